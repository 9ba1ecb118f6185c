"""What a population costs beyond its rows: an N-member GRPO step vs ONE agent doing the same N x rows.

    python benchmarks/population_overhead.py --model tiny --members 8 --steps 5
    python benchmarks/population_overhead.py --model smollm2 --members 4 --prompts 1 --steps 3 --warmup 1

Both arms run in one process, interleaved step by step (pairs; the order alternates), on the same
prompts: the population samples ``group_size`` completions of ``prompts`` prompts per member (one
batched generate, ``generate_population``) and learns (``GRPO.learn_population``); the single agent
samples N x prompts distinct prompts (its first ``prompts`` are the population's; N x the rows, and no
prompt repeated, which its shared-prompt forward would compute once) and learns once from all of them.
Each step is timed with the main thread's CPU time (``time.thread_time``, 1 torch thread) and wall time;
the ratio population / single is taken per pair and the median reported (whole step, its generation and
its learn). Target: ratio <= 1. Models: the 1.2M-parameter Llama of ``vs_trl.py``
(arithmetic prompts, 4 new tokens) or SmolLM2-135M-Instruct (the chat shape of ``vs_trl.py --prompt chat``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", choices=["tiny", "smollm2"])
    ap.add_argument("--members", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=4, help="prompts per member and step")
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=None, help="default: 4 (tiny), 16 (smollm2)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from peft import LoraConfig

    from evollm.algorithms.grpo import GRPO
    from evollm.rollout import generate_population
    from vs_trl import LORA, PROMPTS, QUESTIONS, Clock, _ids, chat, digit_share, model_factory

    new_tokens = args.new_tokens or (4 if args.model == "tiny" else 16)
    tok, make_model = model_factory(argparse.Namespace(model=args.model))
    if args.model == "smollm2":
        prompts = [{"input_ids": _ids(tok.apply_chat_template(chat(q), add_generation_prompt=True, tokenize=True))}
                   for q in QUESTIONS]
    else:
        prompts = [{"input_ids": tok(p, add_special_tokens=False)["input_ids"]} for p in PROMPTS]
    n, p, g = args.members, args.prompts, args.group_size
    kw = dict(pad_token_id=tok.pad_token_id, pad_token=tok.pad_token, eos_token_id=tok.eos_token_id, group_size=g,
              max_output_tokens=new_tokens, lr=1e-4, beta=0.001, clip_coef=0.2, loss_type="grpo", max_grad_norm=1.0,
              temperature=1.0, lora_config=LoraConfig(task_type="CAUSAL_LM", **LORA))
    model = make_model()
    pop = GRPO.population(n, model, batch_size=p * g, **kw)
    single = GRPO.population(1, make_model(), batch_size=n * p * g, **kw)[0]

    def score(completions, prompt_len):
        return torch.tensor([[digit_share(tok.decode(row[prompt_len:], skip_special_tokens=True)) for row in c]
                             for c in completions])

    def step_population(batch):
        clock = Clock()
        rollouts = generate_population(pop, batch)
        exps = []
        for m in pop:
            completions, masks = rollouts[m.index].per_prompt()
            exps.append((completions, masks, score(completions, rollouts[m.index].prompt_len)))
        gen = clock.stop()
        metrics = GRPO.learn_population(pop, exps)
        return clock.stop(), gen, metrics[0]

    def step_single(batch):
        clock = Clock()
        rollout = single.rollout(batch)
        completions, masks = rollout.per_prompt()
        rewards = score(completions, rollout.prompt_len)
        gen = clock.stop()
        metrics = single.learn((completions, masks, rewards))
        return clock.stop(), gen, metrics

    rows = {"population": [], "single": []}
    info = {}
    for step in range(args.warmup + args.steps):
        batch = [prompts[(step * n * p + i) % len(prompts)] for i in range(n * p)]
        order = [("population", step_population), ("single", step_single)]
        for name, fn in (order if step % 2 else order[::-1]):
            total, gen, metrics = fn(batch[:p] if name == "population" else batch)
            info[name] = {k: metrics.get(k) for k in ("learn_path", "learn_chunks", "shared_prompt")}
            if step >= args.warmup:
                rows[name].append({"step": total, "generation": gen})

    def part(r, key, clock):
        if key == "learn":
            return r["step"][clock] - r["generation"][clock]
        return r[key][clock]

    result = {"settings": vars(args) | {"new_tokens": new_tokens, "rows_per_member": p * g,
                                        "base_params": sum(q.numel() for q in model.parameters())},
              "load_average": list(os.getloadavg()), "paths": info}
    for key in ("step", "generation", "learn"):
        for clock, name in ((0, "cpu"), (1, "wall")):
            ratios = [part(a, key, clock) / part(b, key, clock) for a, b in zip(rows["population"], rows["single"])]
            result[f"{key}_{name}"] = {
                "population_s": statistics.median(part(r, key, clock) for r in rows["population"]),
                "single_s": statistics.median(part(r, key, clock) for r in rows["single"]),
                "ratio_median": statistics.median(ratios), "pairs": ratios}
    out = Path(args.out or Path(__file__).parent / "results" / f"population_overhead_{args.model}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"{args.model}: {n} members x {p * g} rows vs 1 agent x {n * p * g} rows, {new_tokens} new tokens; "
          f"load {result['load_average']}; paths {info}")
    print("| part | population CPU s | single CPU s | **CPU ratio (median of pairs)** | wall ratio |")
    print("|---|---|---|---|---|")
    for key in ("step", "generation", "learn"):
        c, w = result[f"{key}_cpu"], result[f"{key}_wall"]
        print(f"| {key} | {c['population_s']:.3f} | {c['single_s']:.3f} | **{c['ratio_median']:.2f}** | "
              f"{w['ratio_median']:.2f} |")
    return result


if __name__ == "__main__":
    main()
