"""Peak memory per member of the population learn step: fused (one routed pass), member by member,
and the default (members fuse only while their activations are small against their state, see
``evollm.algorithms.memory_plan.member_chunks``), with the CPU time of the step.

    python benchmarks/memory_learn.py --sizes 1 2 4 8 [--tensors]

Each (path, population size) runs in a fresh subprocess: build a Llama from a config (default
23.0 M parameters: hidden 384, 6 layers, vocabulary 32000), N members with LoRA r=8 on the 7
projections, one learn step on 4 prompts x group 4 (10 prompt + 8 completion tokens) so that Adam
state exists, then reset the peak RSS (``/proc/self/clear_refs``) and take a second learn step.
"Extra peak per member" is ``(peak(N) - peak(1)) / (N - 1)``; the target is at most 1.5x the
member's persistent state (adapter + Adam moments).

RSS also holds what the C allocator keeps after ``free`` (glibc raises its mmap threshold after large
frees and then serves big tensors from a heap it does not give back); run with e.g.
``MALLOC_MMAP_THRESHOLD_=131072`` in the environment to keep large tensors on mmap (the setting is
recorded in the JSON). ``--tensors`` also measures the peak of live tensor bytes with the torch
profiler's memory timeline (by category: parameters, optimizer state, activations, gradients, ...),
which no allocator behaviour affects; the profiler's own memory inflates RSS in that mode.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = Path(__file__).parent / "results"
PATHS = {"default": None, "member_by_member": 1, "fused_all": 0}


def peak_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise RuntimeError("no VmHWM")


def worker(n: int, path: str, args) -> dict:
    from peft import LoraConfig
    from transformers import LlamaConfig, LlamaForCausalLM

    from evollm.algorithms.grpo import GRPO

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                      num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64, num_key_value_heads=args.hidden // 64,
                      tie_word_embeddings=True, pad_token_id=0, eos_token_id=1)
    model = LlamaForCausalLM(cfg)
    chunk = PATHS[path]
    lora = LoraConfig(r=args.rank, lora_alpha=2 * args.rank, task_type="CAUSAL_LM",
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    pop = GRPO.population(n, model, pad_token_id=0, eos_token_id=1, group_size=4, batch_size=16,
                          max_output_tokens=8, lr=1e-4, lora_config=lora,
                          learn_chunk_members=(n if chunk == 0 else chunk))
    gen = torch.Generator().manual_seed(1)

    def experiences():
        out = []
        for _ in pop:
            seqs = torch.randint(2, args.vocab, (16, 18), generator=gen)
            mask = torch.zeros(16, 17, dtype=torch.long)
            mask[:, 9:] = 1
            out.append((seqs, mask, torch.rand(4, 4, generator=gen)))
        return out

    GRPO.learn_population(pop, experiences()) if n > 1 else pop[0].learn(experiences()[0])
    exps = experiences()
    Path(f"/proc/{os.getpid()}/clear_refs").write_text("5")
    before = peak_kib()
    cpu = time.thread_time()
    if args.tensors:  # tensor-level accounting instead of RSS (slower: the profiler records every op)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True,
                                    record_shapes=True, with_stack=True) as prof:
            metrics = GRPO.learn_population(pop, exps) if n > 1 else [pop[0].learn(exps[0])]
    else:
        metrics = GRPO.learn_population(pop, exps) if n > 1 else [pop[0].learn(exps[0])]
    cpu = time.thread_time() - cpu
    tensors = tensor_peak(prof) if args.tensors else {}
    params = pop[0].shared.parameters(pop[0].adapter_name())
    adapter = sum(p.numel() * p.element_size() for p in params)
    return {"members": n, "path": path, "peak_mib": peak_kib() / 1024, "rss_before_mib": before / 1024,
            "learn_cpu_s": cpu, "member_state_mib": 3 * adapter / 2**20,
            "learn_path": metrics[0]["learn_path"], "learn_chunks": metrics[0]["learn_chunks"],
            "base_params": sum(p.numel() for p in pop[0].shared.base_parameters()), **tensors}


def tensor_peak(prof) -> dict:
    """Peak of the bytes held by live CPU tensors during the profiled step (the profiler's memory
    timeline: every allocation and free of the c10 allocator, categorised), with the categories at
    that peak and at the start; allocator caching and fragmentation (which RSS sees) are not in it."""
    from torch.profiler._memory_profiler import _CATEGORY_TO_INDEX, MemoryProfile, MemoryProfileTimeline

    timeline = MemoryProfileTimeline(MemoryProfile(prof.profiler.kineto_results))
    _, sizes = timeline._coalesce_timeline("cpu")
    totals = [sum(s) for s in sizes]
    at = max(range(len(totals)), key=totals.__getitem__)
    names = {i + 1: (c.name.lower() if c is not None else "unknown") for c, i in _CATEGORY_TO_INDEX.items()}
    return {"tensor_peak_mib": totals[at] / 2**20, "tensor_start_mib": totals[0] / 2**20,
            "tensor_at_peak_mib": {names[i]: sizes[at][i] / 2**20 for i in names},
            "tensor_at_start_mib": {names[i]: sizes[0][i] / 2**20 for i in names}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--paths", nargs="+", default=list(PATHS), choices=list(PATHS))
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=384)
    ap.add_argument("--intermediate", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tensors", action="store_true",
                    help="also account live tensor bytes with the torch profiler's memory timeline")
    ap.add_argument("--out", default=str(RESULTS / "memory_learn.json"))
    ap.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(int(args.worker[0]), args.worker[1], args)))
        return
    passthrough = [f"--{k}={getattr(args, k)}" for k in ("layers", "hidden", "intermediate", "vocab", "rank", "threads")]
    passthrough += ["--tensors"] if args.tensors else []
    runs = []
    for _ in range(args.repeats):
        for n in args.sizes:
            for path in args.paths:
                if n == 1 and path != args.paths[0]:
                    continue
                out = subprocess.run([sys.executable, __file__, "--worker", str(n), path, *passthrough],
                                     capture_output=True, text=True, check=True, cwd=ROOT)
                runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    one = statistics.median(r["peak_mib"] for r in runs if r["members"] == 1)
    t_one = 0.0
    one_cpu = statistics.median(r["learn_cpu_s"] for r in runs if r["members"] == 1)
    state = runs[0]["member_state_mib"]
    table = []
    for path in args.paths:
        for n in args.sizes:
            if n == 1:
                continue
            rs = [r for r in runs if r["members"] == n and r["path"] == path]
            peak = statistics.median(r["peak_mib"] for r in rs)
            extra = (peak - one) / (n - 1)
            row = {"path": path, "members": n, "learn_path": rs[0]["learn_path"],
                   "learn_chunks": rs[0]["learn_chunks"], "peak_mib": peak, "extra_per_member_mib": extra,
                   "extra_over_state": extra / state, "learn_cpu_s": statistics.median(r["learn_cpu_s"] for r in rs)}
            if args.tensors:
                t_one = statistics.median(r["tensor_peak_mib"] for r in runs if r["members"] == 1)
                t_extra = (statistics.median(r["tensor_peak_mib"] for r in rs) - t_one) / (n - 1)
                row.update(tensor_peak_mib=statistics.median(r["tensor_peak_mib"] for r in rs),
                           tensor_extra_per_member_mib=t_extra, tensor_extra_over_state=t_extra / state)
            table.append(row)
    result = {"settings": vars(args), "load_average": list(os.getloadavg()),
              "malloc_env": {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")}, "member_state_mib": state,
              "peak_one_member_mib": one, "learn_cpu_one_member_s": one_cpu,
              "base_params": runs[0]["base_params"], "table": table, "runs": runs}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"base {runs[0]['base_params'] / 1e6:.1f} M parameters; member state {state:.2f} MiB; "
          f"1 member: peak {one:.1f} MiB, learn {one_cpu:.3f} CPU s; load {result['load_average']}")
    print("| path | members | learn_path (chunks) | peak RSS (MiB) | extra peak per member (MiB) | "
          "extra / member state | learn CPU s |")
    print("|---|---|---|---|---|---|---|")
    for r in table:
        print(f"| {r['path']} | {r['members']} | {r['learn_path']} ({r['learn_chunks']:.0f}) | {r['peak_mib']:.1f} | "
              f"{r['extra_per_member_mib']:.2f} | **{r['extra_over_state']:.2f}** | {r['learn_cpu_s']:.3f} |")
    if args.tensors:
        print(f"\nlive tensors (profiler), 1 member: peak {t_one:.2f} MiB")
        print("| path | members | tensor peak (MiB) | extra per member (MiB) | extra / member state |")
        print("|---|---|---|---|---|")
        for r in table:
            print(f"| {r['path']} | {r['members']} | {r['tensor_peak_mib']:.2f} | {r['tensor_extra_per_member_mib']:.2f} | "
                  f"**{r['tensor_extra_over_state']:.2f}** |")


if __name__ == "__main__":
    main()
