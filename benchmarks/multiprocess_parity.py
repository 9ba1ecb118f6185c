"""How far a 2-process update is from the 1-process update on the same global batch: whitened PPO, a fused
LLMREINFORCE population (ReBN) and GRPO with the token-mean loss (``dapo``), two steps at lr 1e-2 on the tiny
model, each process its half of a fixed batch of completions of 1-6 tokens (the scenarios of
``tests/zero_script.py``). ``--without`` measures the update as it was before the batch statistics were
taken over all processes: ``token`` (each process divides its token means by its own tokens) or ``whiten``
(each process whitens / z-scores its own share; with ``--equal`` lengths, as first measured).

    python benchmarks/multiprocess_parity.py [--without token|whiten] [--equal]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("ppo-whitened", "reinforce", "grpo-dapo")


def worker(out: Path, without: str | None, ragged: bool) -> None:
    """One process of the 2-process launch."""
    sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]
    torch.set_num_threads(1)
    from safetensors.torch import save_file

    import evollm.algorithms.grpo  # noqa: F401 - every module that holds the two names, imported before patching
    import evollm.algorithms.ppo  # noqa: F401
    import evollm.algorithms.reinforce  # noqa: F401
    from evollm.parallel import distributed as dist

    if without:  # the name in every evollm module that holds it (some import it by name)
        name, off = ("token_divisors", lambda masks: None) if without == "token" else ("batch_reduce", lambda: None)
        for module in [m for n, m in sys.modules.items() if n.startswith("evollm") and hasattr(m, name)]:
            setattr(module, name, off)
    import data_parallel_script
    import zero_script

    if not ragged:
        equal_lengths(data_parallel_script)
    dist.init()
    rank = dist.process_index()
    for part, tensors in zip(PARTS, scenarios(zero_script, dist.shard)):
        save_file(tensors, str(out / f"{part}-rank{rank}.safetensors"))
    dist.barrier()


def equal_lengths(data_parallel_script) -> None:
    """Every scenario's fixed batch with completions of equal length (the tests' scenarios ask for ragged ones)."""
    batch = data_parallel_script.fixed_batch
    data_parallel_script.fixed_batch = lambda tok, **kw: batch(tok, **{**kw, "ragged": False})


def scenarios(zero_script, shard=lambda rows: rows):
    yield zero_script.member_tensors(zero_script.ppo_scenario(shard, adv_whitening=True, ragged=True)[0])
    yield zero_script.adapters(zero_script.reinforce_scenario(shard))
    yield zero_script.adapters(zero_script.grpo_scenario(shard))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--without", choices=["token", "whiten"], default=None)
    p.add_argument("--equal", action="store_true", help="completions of equal length")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(Path(args.worker), args.without, not args.equal)
    from safetensors.torch import load_file

    out = Path(tempfile.mkdtemp(prefix="parity_"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    cmd = ["accelerate", "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision",
           "no", "--dynamo_backend", "no", "--main_process_port", "29541", __file__, "--worker", str(out)]
    cmd += (["--without", args.without] if args.without else []) + (["--equal"] if args.equal else [])
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True)
    sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]
    import data_parallel_script
    import zero_script

    if args.equal:
        equal_lengths(data_parallel_script)
    print(f"2 processes against 1 ({'equal' if args.equal else 'ragged'} lengths; without: {args.without or 'nothing'})")
    for part, ref in zip(PARTS, scenarios(zero_script)):
        got = load_file(str(out / f"{part}-rank0.safetensors"))
        diff = torch.cat([(got[k] - ref[k]).abs().flatten() for k in ref])
        print(f"{part:>13}: mean |dw| {diff.mean():.2e}  max {diff.max():.2e}  share > 1e-3 {(diff > 1e-3).float().mean():.1%}")


if __name__ == "__main__":
    main()
