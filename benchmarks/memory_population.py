"""Memory of a population on ONE shared base: what each extra GRPO member costs.

Every population size is measured in a FRESH subprocess (so peak RSS does not carry over):
build a Llama whose base dominates (~40M parameters by default), build N GRPO members with
LoRA r=8 on the 7 projections, run ONE learn step per member (so AdamW's exp_avg/exp_avg_sq
exist), ``gc.collect()`` + ``malloc_trim(0)``, then read the process RSS (psutil) and the peak
RSS (``getrusage(RUSAGE_SELF).ru_maxrss``).

"member bytes" = adapter tensors + optimizer state tensors of one member. The requirement is
``(RSS(N) - RSS(1)) / (N - 1) <= 1.5 x member bytes``. For comparison, ``--deepcopy-sizes``
also measures a population that gives every member its own ``copy.deepcopy(model)``.

Usage: ``python benchmarks/memory_population.py [--sizes 1 2 4 8] [--layers 12] [--repeats 2]``
Writes ``benchmarks/results/memory_population.json``.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
MB = 2**20


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def rss_now() -> int:
    import psutil
    gc.collect()
    try:  # hand freed heap pages back to the OS so RSS reflects live data
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    return psutil.Process().memory_info().rss


def worker(args) -> dict:
    """Runs in the subprocess: one population size, one mode ('shared' or 'deepcopy')."""
    import copy

    import torch

    from evollm.adapters.shared import default_lora_config
    from evollm.algorithms.grpo import GRPO
    from evollm.envs.reasoning import ReasoningGym
    from evollm.models import build_tiny_model, build_tokenizer
    from evollm.tasks import ARITHMETIC_TEMPLATE, arithmetic_dataset, exact_match_reward

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rss_start = rss_now()
    tok = build_tokenizer()
    model = build_tiny_model(tok, hidden_size=args.hidden, intermediate_size=args.intermediate,
                             num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=8)
    unique = {id(p): p for p in model.parameters()}
    base_bytes = tensor_bytes(unique.values()) + tensor_bytes(model.buffers())
    base_params = sum(p.numel() for p in unique.values())
    rss_model = rss_now()

    n = args.worker
    bases = [model] + ([copy.deepcopy(model) for _ in range(n - 1)] if args.mode == "deepcopy" else [model] * (n - 1))
    lora = default_lora_config(r=args.rank, lora_alpha=2 * args.rank)
    hp = dict(pad_token_id=tok.pad_token_id, pad_token=tok.pad_token, eos_token_id=tok.eos_token_id,
              lora_config=lora, lr=1e-3, group_size=2, batch_size=2, max_output_tokens=4, seed=0)
    if args.mode == "shared":
        members = GRPO.population(n, actor_network=model, **hp)
    else:
        members = [GRPO(b, **hp) for b in bases]
    rss_population = rss_now()

    train, test = arithmetic_dataset(n_train=8, n_test=1, seed=0)
    env = ReasoningGym(train, test, tok, exact_match_reward, ARITHMETIC_TEMPLATE, data_batch_size_per_gpu=1)
    prompts = env.reset()  # 1 prompt x group 2 x 4 new tokens: activations stay tiny and equal across N
    for agent in members:
        completions, masks = agent.get_action(prompts)
        agent.learn((completions, masks, torch.tensor([[1.0, 0.0]])))
    rss_learned = rss_now()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB

    m = members[0]
    params = m.shared.parameters(m.adapter_name())
    adapter = tensor_bytes(params)
    optim = tensor_bytes(t for s in m.optimizer.state.values() for t in s.values() if torch.is_tensor(t))
    grads = tensor_bytes(p.grad for p in params if p.grad is not None)
    for agent in members:  # what-if: the .grad tensors learn() leaves behind, dropped
        agent.optimizer.zero_grad(set_to_none=True)
    rss_no_grads = rss_now()
    return {"n": n, "mode": args.mode, "base_params": base_params, "base_bytes": base_bytes,
            "adapter_params": sum(p.numel() for p in params), "adapter_bytes": adapter, "optimizer_bytes": optim,
            "grad_bytes_left_after_learn": grads, "member_bytes": adapter + optim,
            "rss_start": rss_start, "rss_model": rss_model, "rss_population": rss_population,
            "rss": rss_learned, "peak_rss": peak, "rss_no_grads": rss_no_grads}


def run_worker(n: int, mode: str, args) -> dict:
    cmd = [sys.executable, __file__, "--worker", str(n), "--mode", mode, "--layers", str(args.layers),
           "--hidden", str(args.hidden), "--intermediate", str(args.intermediate), "--rank", str(args.rank),
           "--threads", str(args.threads)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def summarise(runs: list[dict]) -> dict:
    """Median of the repeats of one (mode, N)."""
    keys = ("rss", "peak_rss", "rss_population", "rss_model", "rss_no_grads")
    out = dict(runs[0])
    out.update({k: statistics.median(r[k] for r in runs) for k in keys})
    out["repeats"] = {k: [r[k] for r in runs] for k in keys}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--deepcopy-sizes", type=int, nargs="*", default=[2], help="sizes also run with one deep copy "
                    "of the base per member (for comparison); none to skip")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--intermediate", type=int, default=1536)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2, help="fresh subprocesses per size (median taken)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(RESULTS / "memory_population.json"))
    ap.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="shared", choices=["shared", "deepcopy"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return
    if 1 not in args.sizes:
        args.sizes.insert(0, 1)

    shared = {}
    for n in args.sizes:
        shared[n] = summarise([run_worker(n, "shared", args) for _ in range(args.repeats)])
        print(f"shared   N={n}: RSS {shared[n]['rss'] / MB:.1f} MiB, peak {shared[n]['peak_rss'] / MB:.1f} MiB", flush=True)
    deep = {}
    for n in args.deepcopy_sizes:
        deep[n] = summarise([run_worker(n, "deepcopy", args) for _ in range(args.repeats)])
        print(f"deepcopy N={n}: RSS {deep[n]['rss'] / MB:.1f} MiB, peak {deep[n]['peak_rss'] / MB:.1f} MiB", flush=True)

    one = shared[1]
    member, base = one["member_bytes"], one["base_bytes"]
    rows = []
    for n, r in shared.items():
        row = {"n": n, "rss": r["rss"], "peak_rss": r["peak_rss"], "rss_population": r["rss_population"],
               "rss_no_grads": r["rss_no_grads"],
               "full_copy_estimate": one["rss"] + (n - 1) * base, "deepcopy_rss": deep.get(n, {}).get("rss")}
        if n > 1:
            row["extra_per_member"] = (r["rss"] - one["rss"]) / (n - 1)
            row["extra_per_member_peak"] = (r["peak_rss"] - one["peak_rss"]) / (n - 1)
            row["ratio"] = row["extra_per_member"] / member
            row["ratio_peak"] = row["extra_per_member_peak"] / member
            row["ratio_no_grads"] = (r["rss_no_grads"] - one["rss_no_grads"]) / (n - 1) / member
            row["ratio_before_learn"] = (r["rss_population"] - one["rss_population"]) / (n - 1) / one["adapter_bytes"]
        rows.append(row)

    la = os.getloadavg()
    print(f"\nBase: {one['base_params'] / 1e6:.1f}M params = {base / MB:.1f} MiB. One member: adapter "
          f"{one['adapter_bytes'] / MB:.2f} MiB + AdamW state {one['optimizer_bytes'] / MB:.2f} MiB = member bytes "
          f"{member / MB:.2f} MiB (grads left after learn: {one['grad_bytes_left_after_learn'] / MB:.2f} MiB)\n")
    print("| N | RSS (MiB) | peak RSS (MiB) | extra RSS / member (MiB) | ratio to member bytes | ratio (peak) "
          "| ratio, grads freed | before learn: extra / adapter bytes | full copy per member, est. (MiB) "
          "| deepcopy measured (MiB) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        cell = (lambda key, fmt=".3f", scale=1: format(r[key] / scale, fmt) if r.get(key) else "-")
        print(f"| {r['n']} | {r['rss'] / MB:.1f} | {r['peak_rss'] / MB:.1f} | {cell('extra_per_member', '.2f', MB)} | "
              f"{cell('ratio')} | {cell('ratio_peak')} | {cell('ratio_no_grads')} | {cell('ratio_before_learn')} | "
              f"{r['full_copy_estimate'] / MB:.1f} | {cell('deepcopy_rss', '.1f', MB)} |")
    print(f"\nrequirement: extra RSS per member <= 1.5 x member bytes; load average {la}")

    result = {"benchmark": "memory_population", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "loadavg": la},
              "settings": {k: v for k, v in vars(args).items() if k not in ("worker", "mode")},
              "base_bytes": base, "base_params": one["base_params"], "member_bytes": member,
              "adapter_bytes": one["adapter_bytes"], "optimizer_bytes": one["optimizer_bytes"],
              "grad_bytes_left_after_learn": one["grad_bytes_left_after_learn"], "rows": rows,
              "runs": {"shared": shared, "deepcopy": deep}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
