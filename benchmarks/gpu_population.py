"""What N members cost on one GPU: an N-member GRPO step (one batched generate, one fused learn over the
shared base) against N x the step of a lone member, and the memory the population holds.

    python benchmarks/gpu_population.py --device cuda --members 1 2 4 8 16
    python benchmarks/gpu_population.py --device cpu --size tiny --members 1 2 --steps 1   # a smoke run

The model has SmolLM2-135M-Instruct's architecture (``--size smollm2``: 30 layers, hidden 576, 9 heads,
3 KV heads, vocab 49152, tied embeddings) with random weights: a step's cost depends on the shapes, not
on the values, and random weights keep every completion at its full length (no early end of sequence).
Every member gets ``prompts`` random prompts of ``prompt-tokens`` tokens, samples ``group-size``
completions of ``new-tokens`` tokens each and learns from random rewards (one update epoch, LoRA r=8
on every projection). Each N is timed over ``steps`` steps after ``warmup`` (CUDA synchronised wall
time). ``cost_per_member_step`` = step time / (N x the 1-member step time): below 1, a population of N
gets more member-steps out of the GPU than N runs one after another (the shared base's weights are
read once per batched forward for all members). ``peak_memory_mb``: ``torch.cuda.max_memory_allocated``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SIZES = {
    "smollm2": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, rms_norm_eps=1e-5, rope_theta=100000.0),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2),
}
PAD, EOS = 0, 2
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_model(size: str, device: str, dtype: str = "float32"):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**SIZES[size], max_position_embeddings=2048, tie_word_embeddings=True, pad_token_id=PAD,
                         eos_token_id=EOS, bos_token_id=1)
    return LlamaForCausalLM(config).to(device=device, dtype=getattr(torch, dtype)).eval()


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_population(n: int, args) -> dict:
    from peft import LoraConfig

    from evollm.algorithms.grpo import GRPO
    from evollm.rollout import generate_population

    if args.device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    model = build_model(args.size, args.device, args.dtype)
    p, g = args.prompts, args.group_size
    pop = GRPO.population(n, model, pad_token_id=PAD, pad_token="<pad>", eos_token_id=EOS, group_size=g,
                          max_output_tokens=args.new_tokens, batch_size=p * g, lr=1e-4, beta=0.0, loss_type="grpo",
                          max_grad_norm=1.0, temperature=1.0,
                          lora_config=LoraConfig(task_type="CAUSAL_LM", r=8, lora_alpha=16, target_modules=TARGETS))
    gen = torch.Generator().manual_seed(0)
    vocab = SIZES[args.size]["vocab_size"]
    prompts = [{"input_ids": torch.randint(3, vocab, (args.prompt_tokens,), generator=gen)} for _ in range(p)]
    times, gens, tokens = [], [], []
    for step in range(args.warmup + args.steps):
        sync(args.device)
        start = time.perf_counter()
        rollouts = generate_population(pop, prompts)
        sync(args.device)
        generated = time.perf_counter()
        exps, new = [], 0
        for m in pop:
            completions, masks = rollouts[m.index].per_prompt()
            new += int(sum(mask.sum() for mask in masks))
            exps.append((completions, masks, torch.rand(len(completions), g, generator=gen)))
        metrics = GRPO.learn_population(pop, exps)
        sync(args.device)
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
            gens.append(generated - start)
            tokens.append(new)
    peak = torch.cuda.max_memory_allocated() / 2**20 if args.device == "cuda" else float("nan")
    loss = [m.get("loss") for m in metrics]
    for m in pop:
        m.release()
    del pop, model
    return {"members": n, "rows_per_member": p * g, "step_s": statistics.median(times),
            "generate_s": statistics.median(gens), "learn_s": statistics.median(t - x for t, x in zip(times, gens)),
            "completion_tokens": statistics.median(tokens), "peak_memory_mb": peak, "loss": loss,
            "step_times_s": times, "generate_times_s": gens}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--size", default="smollm2", choices=sorted(SIZES))
    ap.add_argument("--members", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--prompts", type=int, default=2, help="prompts per member and step")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="the base's weights (the LoRA adapters stay float32)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    rows = [time_population(n, args) for n in sorted(set(args.members) | {1})]
    one = next(r for r in rows if r["members"] == 1)
    for r in rows:
        r["cost_per_member_step"] = r["step_s"] / (r["members"] * one["step_s"])
        r["member_steps_per_s"] = r["members"] / r["step_s"]
    result = {"settings": vars(args), "device_name": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
              "torch": torch.__version__, "rows": rows}
    out = Path(args.out or Path(__file__).parent / "results" / f"gpu_population_{args.size}_{args.device}_{args.dtype}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"{result['device_name']}, {args.size} ({args.dtype}), {args.prompts} prompts x {args.group_size} samples per member, "
          f"{args.prompt_tokens} + {args.new_tokens} tokens")
    for r in rows:
        print(f"  N={r['members']:>2}: step {r['step_s']:.3f} s (generate {r['generate_s']:.3f}, learn {r['learn_s']:.3f}), "
              f"cost per member-step {r['cost_per_member_step']:.2f} of a lone member's, "
              f"{r['member_steps_per_s']:.2f} member-steps/s, peak {r['peak_memory_mb']:.0f} MiB")
    return result


if __name__ == "__main__":
    main()
