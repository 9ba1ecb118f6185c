"""What watching a run costs: the evolution loop with no callbacks, with the run-files writer and
TensorBoard (CSV + event files every step), and with the plots redrawn at every evaluation too.

The tiny model (random init), 8 GRPO members, ``--steps`` steps, an evaluation every
``--eval-every`` steps, selection at every evaluation. The modes run interleaved (paired) for
``--repeats`` rounds, each on a fresh population and run directory; CPU time (``time.process_time``,
1 torch thread) and wall time are recorded. ``plot_budget`` is set to 1.0 so that the "plots" mode
really redraws at every evaluation. Also times each PNG of the finished run once (``plot_run``).

Usage: ``python benchmarks/logging_overhead.py [--steps 10] [--eval-every 5] [--repeats 3]``
Writes ``benchmarks/results/logging_overhead.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RESULTS = Path(__file__).resolve().parent / "results"
MODES = ("none", "files+tensorboard", "files+tensorboard+plots")


def run_once(mode: str, steps: int, eval_every: int, out: Path) -> tuple[float, float]:
    from evollm.algorithms.grpo import GRPO
    from evollm.envs.reasoning import ReasoningGym
    from evollm.hpo import Mutations, TournamentSelection
    from evollm.recipes.warm_start import load_tiny_model
    from evollm.run.files import RunFilesWriter
    from evollm.run.logging import TensorBoardLogger
    from evollm.tasks import ARITHMETIC_TEMPLATE, arithmetic_dataset, exact_match_reward
    from evollm.training.loop import finetune_llm_reasoning

    torch.manual_seed(0)
    model, tok = load_tiny_model(warm_start=False, seed=0)
    train, test = arithmetic_dataset(n_train=64, n_test=16, digits=(1, 1), seed=0)
    env = ReasoningGym(train, test, tok, exact_match_reward, ARITHMETIC_TEMPLATE, data_batch_size_per_gpu=4)
    pop = GRPO.population(8, actor_network=model, pad_token_id=tok.pad_token_id, pad_token=tok.pad_token,
                          eos_token_id=tok.eos_token_id, group_size=4, max_output_tokens=4, batch_size=16)
    callbacks = []
    if mode != "none":
        callbacks = [RunFilesWriter(out, plots=mode.endswith("plots"), plot_budget=1.0),
                     TensorBoardLogger(out / "tensorboard")]
    wall, cpu = time.perf_counter(), time.process_time()
    finetune_llm_reasoning(pop, env, max_steps=steps, evaluation_interval=eval_every, evo_steps=eval_every,
                           tournament=TournamentSelection(2, True, 8),
                           mutation=Mutations(no_mutation=0.3, rl_hp=0.7, rand_seed=0), verbose=False,
                           callbacks=callbacks)
    return time.process_time() - cpu, time.perf_counter() - wall


def time_plots(run_dir: Path) -> dict[str, float]:
    """CPU seconds of each plot of a finished run."""
    from evollm.run import plots
    from evollm.run.plots_lineage import lineage_figure
    from evollm.run.report import read_run

    run = read_run(run_dir)
    out = run_dir / "timed"
    member = int(run.metrics["member"].iloc[-1])
    jobs = {
        "fitness.png": lambda: plots.plot_fitness(run.report, run.lineage, out / "fitness.png"),
        "hyperparameters.png": lambda: plots.plot_hyperparameters(run.report, run.lineage, out / "hp.png"),
        "lineage.png": lambda: plots.save(lineage_figure(run.report, run.lineage), out / "lineage.png"),
        "diagnostics.png": lambda: plots.plot_diagnostics_overview(run.metrics, out / "diagnostics.png"),
        "diagnostics/member_<id>.png": lambda: plots.plot_member_diagnostics(
            run.metrics, run.report, member, out / "member.png", run.lineage),
    }
    result = {}
    for name, job in jobs.items():
        cpu = time.process_time()
        job()
        result[name] = time.process_time() - cpu
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    samples: dict[str, list[tuple[float, float]]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        run_once("none", 2, 2, Path(tmp) / "warmup")
        last = None
        for r in range(args.repeats):
            for mode in MODES:
                out = Path(tmp) / f"{mode}_{r}"
                samples[mode].append(run_once(mode, args.steps, args.eval_every, out))
                last = out if mode != "none" else last
        plot_seconds = time_plots(last)
    base_cpu = [c for c, _ in samples["none"]]
    table = {}
    for mode in MODES:
        cpu = [c for c, _ in samples[mode]]
        table[mode] = {"cpu_s_per_step": statistics.median(cpu) / args.steps,
                       "wall_s_per_step": statistics.median(w for _, w in samples[mode]) / args.steps,
                       "cpu_ratio_to_none_paired": statistics.median(c / b for c, b in zip(cpu, base_cpu))}
    result = {"date": datetime.now(timezone.utc).isoformat(), "machine": platform.platform(),
              "torch_threads": torch.get_num_threads(), "args": vars(args), "modes": table,
              "plot_cpu_s": plot_seconds, "samples": samples}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "logging_overhead.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({"modes": table, "plot_cpu_s": plot_seconds}, indent=1))


if __name__ == "__main__":
    main()
