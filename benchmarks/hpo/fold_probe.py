"""Can the search's compute become the survivor's progress? Eight founders train ``k`` steps each, side by
side on the same prompts; then the other members' LoRA updates are added to one member's (exactly, by
stacking the factors: rank 8r) and the held-out score of the sum is compared with single runs at that
member's rate after k, 2k, 4k and 8k steps (8k: the population's compute).

Ways to add the other members' updates ``dW_j`` to the survivor's ``dW_s``:

- ``sum_scaled``: ``dW_s + sum_j (lr_s / lr_j) dW_j``. Early Adam steps move about ``lr`` per step
  whatever the gradient's size, so each member's k steps count as k steps at the survivor's rate: to first
  order, 8k steps.
- ``sum_capped``: the same with the factor capped at 1 (a faster member's steps shrunk to the survivor's rate,
  a slower member's added as they are).
- ``mean``: the mean of the eight updates (a model soup).

    python -m benchmarks.hpo.fold_probe --config benchmarks/hpo/configs/tiny_arithmetic.yaml --steps 10 --seeds 0 1 2

Single-turn (GRPO, REINFORCE) tasks only: one adapter per member.
"""

from __future__ import annotations

import argparse
import json
from statistics import mean

FOLDS = ("sum_scaled", "sum_capped", "mean")


def fold_factors(shared, names: list[str], rates: list[float], s: int, how: str) -> dict:
    """``{layer: (A, B)}`` of the survivor ``names[s]`` plus the other adapters' updates, combined ``how``."""
    import torch

    from evollm.adapters.resize import lora_factors

    factors = [lora_factors(shared, n) for n in names]
    out = {}
    for layer, (A_s, B_s, scale_s) in factors[s].items():
        As, Bs = [A_s], [B_s]
        for j, f in enumerate(factors):
            if j == s:
                continue
            A, B, scale = f[layer]
            c = {"sum_scaled": rates[s] / rates[j], "sum_capped": min(1.0, rates[s] / rates[j]), "mean": 1.0}[how]
            As.append(A)
            Bs.append(B * c * scale / scale_s)
        if how == "mean":
            Bs = [b / len(names) for b in Bs]
        out[layer] = (torch.cat(As), torch.cat(Bs, dim=1))
    return out


def probe(task, cfg, seed: int, k: int) -> dict:
    from evollm.adapters.resize import lora_factors, set_adapter_factors
    from evollm.adapters.shared import SharedBase

    from .arms import evolution_overrides, hps, members_of, search_space, with_overrides

    pcfg = with_overrides(cfg, evolution_overrides(cfg) + [f"seed={seed}"])
    hp = search_space(pcfg)
    lr_name = next(n for n in hp.names() if n.startswith("lr"))
    members = members_of(pcfg, task, hp)
    rates = [float(hps(m)[lr_name]) for m in members]
    task.new_run()
    task.train(members, seed=seed, max_steps=k, evaluation_interval=k, evo_steps=None)
    own = [mean(task.report(m)) for m in members]
    shared = SharedBase.find(task.model)
    names = [m.adapter_name("actor") for m in members]
    best = max(range(len(members)), key=lambda i: own[i])
    out = {"seed": seed, "steps": k, "rates": rates, "own": own, "survivors": {}}
    for label, s in (("best", best), ("default founder", 0)):
        name, config = names[s], shared.config(names[s])
        saved, r0, alpha0 = lora_factors(shared, name), int(config.r), float(config.lora_alpha)
        row = {"lr": rates[s], "own": own[s]}
        for how in FOLDS:
            new = fold_factors(shared, names, rates, s, how)
            rank = next(iter(new.values()))[0].shape[0]
            scale = next(iter(saved.values()))[2]
            set_adapter_factors(shared, name, rank, scale * rank, new)
            row[how] = mean(task.report(members[s]))
            set_adapter_factors(shared, name, r0, alpha0, {n: (A, B) for n, (A, B, _) in saved.items()})
        single = with_overrides(cfg, ["algorithm.population_size=1", "hpo={}", f"seed={seed}",
                                      f"algorithm.hyperparameters.{lr_name}={rates[s]:.6e}"])
        agent = members_of(single, task, None)[0]
        task.new_run()
        done = 0
        for n in (k, 2 * k, 4 * k, 8 * k):
            task.train([agent], seed=seed, max_steps=n - done, evaluation_interval=n - done)
            done = n
            row[f"single_{n}"] = mean(task.report(agent))
        agent.release()
        out["survivors"][label] = row
        print(seed, label, json.dumps({key: round(v, 4) for key, v in row.items()}), flush=True)
    for m in members:
        m.release()
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="a single-turn benchmark task config (benchmarks/hpo/configs/)")
    parser.add_argument("--steps", type=int, default=10, help="steps of each founder before the fold")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--out", help="write every row as JSON")
    args = parser.parse_args(argv)

    import torch

    from evollm.config import RunConfig

    from .task import load_task

    cfg = RunConfig.from_yaml(args.config, [])
    torch.set_num_threads(int(cfg.threads or 1))
    task = load_task(cfg)
    if task.kind != "reasoning":
        raise SystemExit(f"fold_probe: {args.config} is a {task.kind} task; the probe folds one adapter per member "
                         "(single-turn tasks)")
    rows = [probe(task, cfg, seed, args.steps) for seed in args.seeds]
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"config": args.config, "steps": args.steps, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
