"""Checkpoint size and time for the demo population (configs/demo.yaml: 4 GRPO members, r=8, on the
tiny warm-started model): save (atomic write + fsync + manifest), verify, and restore.

    EVOLLM_CACHE=/work/cache python benchmarks/checkpoint_demo.py --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from evollm.utils.atomic import verify
from evollm.recipes.cli import build_population
from evollm.config import RunConfig
from evollm.recipes.builders import build_hpo, build_model
from evollm.run import RunCheckpointer
from evollm.training.callbacks import LoopState
from evollm.training.loop import finetune_llm_reasoning


def timed(fn):
    w, c = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - w, time.process_time() - c


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    cfg = RunConfig.from_yaml("configs/demo.yaml")
    cfg.resolve_paths()
    model, tok = build_model(cfg.model, cfg.seed, cfg.task.name)
    hp_config, mutation, selection = build_hpo(cfg)
    members = build_population(cfg, model, tok, hp_config)
    from evollm.recipes.builders import build_task
    from evollm.envs.reasoning import ReasoningGym

    train, test, reward, template = build_task(cfg.task, cfg.seed)
    env = ReasoningGym(train, test.select(range(16)), tok, reward, template, data_batch_size_per_gpu=8, seed=0)
    agents, record = finetune_llm_reasoning(members, env, max_steps=2, evaluation_interval=2, verbose=False)
    rows = {"save": [], "verify": [], "restore": []}
    with tempfile.TemporaryDirectory() as tmp:
        ck = RunCheckpointer(Path(tmp) / "checkpoints", every=1, keep=2, env=env, mutation=mutation,
                             selection=selection, config=cfg.to_dict(explicit=True), handle_signals=False,
                             log=lambda m: None)
        state = LoopState(2, 2, agents, record)
        for i in range(args.repeats):
            state.step = 2 + i
            folder, w, c = timed(lambda: ck.save(state))
            rows["save"].append((w, c))
            _, w, c = timed(lambda: verify(folder, "population"))
            rows["verify"].append((w, c))
            ck.resume = True
            restore_state = LoopState(0, 10, list(agents), record)
            _, w, c = timed(lambda: ck.restore(restore_state))
            agents = restore_state.agents
            rows["restore"].append((w, c))
        files = [p for p in folder.rglob("*") if p.is_file()]
        size = sum(p.stat().st_size for p in files)
        per_member = sum(p.stat().st_size for p in (folder / f"member_{agents[0].index}").rglob("*") if p.is_file())
    result = {"members": len(agents), "lora_r": agents[0].lora_rank, "files": len(files), "bytes": size,
              "bytes_per_member": per_member, "repeats": args.repeats, "load_avg": os.getloadavg()[0]}
    for k, v in rows.items():
        result[f"{k}_wall_s_median"] = statistics.median(x for x, _ in v)
        result[f"{k}_cpu_s_median"] = statistics.median(y for _, y in v)
    Path("benchmarks/results").mkdir(parents=True, exist_ok=True)
    Path("benchmarks/results/checkpoint_demo.json").write_text(json.dumps(result, indent=1))
    print("| members | checkpoint | per member | files | save wall / CPU | verify wall / CPU | restore wall / CPU |")
    print("|---|---|---|---|---|---|---|")
    print(f"| {len(agents)} | {size / 2**20:.2f} MiB | {per_member / 2**20:.2f} MiB | {len(files)} | "
          + " | ".join(f"{result[f'{k}_wall_s_median']:.3f} s / {result[f'{k}_cpu_s_median']:.3f} s"
                       for k in ("save", "verify", "restore")) + " |")
    print(f"load average {result['load_avg']:.1f}")


if __name__ == "__main__":
    main()
