"""Greedy evaluation of the SmolLM2 demo (configs/smollm2_arithmetic.yaml) with the test prompts'
common prefix run once per member (``evollm.rollout.common_prefix``) against the plain left-padded
generate, on the same members (their LoRA B matrices perturbed, so they differ).

Records wall and process CPU time (``time.process_time``) of each evaluation, checks that both give
the same completions, and the load average (the machine is shared: compare CPU times).

Usage: ``python benchmarks/eval_common_prefix.py --members 4 --n-test 64 [--repeats 1]``
Writes ``benchmarks/results/eval_common_prefix.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
CONFIG = Path(__file__).resolve().parent.parent / "configs" / "smollm2_arithmetic.yaml"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--members", type=int, default=4)
    parser.add_argument("--n-test", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(1)

    import evollm.rollout.common_prefix as cp
    from evollm.config import RunConfig
    from evollm.envs.reasoning import ReasoningGym
    from evollm.recipes.builders import build_hpo, build_model, build_task
    from evollm.recipes.cli import build_population
    from evollm.rollout import generate_population

    cfg = RunConfig.from_yaml(CONFIG, [f"algorithm.population_size={args.members}", f"task.n_test={args.n_test}"])
    torch.manual_seed(cfg.seed)
    model, tok = build_model(cfg.model, cfg.seed)
    members = build_population(cfg, model, tok, build_hpo(cfg)[0])
    for m in members:  # members that differ (fresh LoRA B is zero)
        for p in m.shared.parameters(m.adapter_name("actor")):
            p.data.add_(torch.randn_like(p) * 0.01)
    train, test, reward, template = build_task(cfg.task, cfg.seed)
    env = ReasoningGym(train, test, tok, reward, template, data_batch_size_per_gpu=2,
                       eval_batch_size=cfg.env.eval_batch_size)
    prompts = env.test_prompts()
    k = cp.common_prefix_length(*_collated(prompts, tok.pad_token_id))
    rows, seqs = [], {}
    for rep in range(args.repeats):
        for mode, threshold in (("common_prefix", 0), ("plain", float("inf"))):
            cp.PREFILL_MIN_TOKEN_PARAMS = threshold
            w, c = time.perf_counter(), time.process_time()
            out = generate_population(members, prompts, training=False)
            rows.append({"mode": mode, "repeat": rep, "wall_s": time.perf_counter() - w,
                         "cpu_s": time.process_time() - c, "load": os.getloadavg()[0]})
            seqs[mode] = {i: r.sequences for i, r in out.items()}
            print(rows[-1], flush=True)
    same = all(torch.equal(seqs["plain"][i], seqs["common_prefix"][i]) for i in seqs["plain"])
    result = {"members": args.members, "n_test": len(prompts), "prompt_tokens": int(prompts[0]["input_ids"].shape[1]),
              "common_prefix_tokens": k, "identical_completions": same, "runs": rows}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "eval_common_prefix.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}))


def _collated(prompts, pad_id):
    from evollm.rollout.tokens import collate_prompts
    return collate_prompts(prompts, pad_id)


if __name__ == "__main__":
    main()
