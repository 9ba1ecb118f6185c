"""``evollm train CONFIG.yaml``: build everything from a YAML run config, train the
population, and write the report, lineage, plots and the best member's adapter."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from .config import ALGORITHMS, algorithm_class  # noqa: F401  (re-exported)
from .schema import ConfigError


def build_population(cfg, model, tokenizer, hp_config):
    """The members of the population on ONE shared base."""
    from .adapters.shared import default_lora_config

    alg = cfg.algorithm
    cls = algorithm_class(alg.name)
    size = alg.population_size
    lora = default_lora_config(**alg.lora.kwargs())
    hps = dict(alg.hyperparameters)
    hps.setdefault("seed", cfg.seed)
    init = None
    if alg.init_sampler and hp_config is not None:
        from .hpo import initial_population_hyperparameters
        init = initial_population_hyperparameters(hp_config, size, sampler=alg.init_sampler, seed=cfg.seed)
    members = []
    for i in range(size):
        agent = cls(model, pad_token_id=tokenizer.pad_token_id, pad_token=tokenizer.pad_token,
                    eos_token_id=tokenizer.eos_token_id, tokenizer=tokenizer, hp_config=hp_config, lora_config=lora,
                    **hps)
        for name, value in (init[i] if init else {}).items():
            agent.set_hyperparameter(name, value)
        members.append(agent)
    return members


def run_callbacks(cfg, out: Path) -> list:
    """The run-directory writer and the live loggers the ``logging:`` section asks for."""
    from .run.files import RunFilesWriter
    from .run.logging import logging_callbacks

    log = cfg.logging
    return [RunFilesWriter(out, plots=log.plots),
            *logging_callbacks(out, log.tensorboard, log.wandb, log.mlflow, run_config=cfg.to_dict())]


def train(config_path: str, overrides: list[str] | None = None, quiet: bool = False) -> dict:
    import torch

    from .config import RunConfig, build_hpo, build_model

    cfg = RunConfig.from_yaml(config_path, overrides)  # every setting is checked before any model is built
    cfg.resolve_paths()
    if cfg.threads:
        torch.set_num_threads(int(cfg.threads))
    torch.manual_seed(cfg.seed)
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=1))
    t0 = time.perf_counter()
    model, tokenizer = build_model(cfg.model, cfg.seed, cfg.task.name)
    hp_config, mutation, selection = build_hpo(cfg)
    members = build_population(cfg, model, tokenizer, hp_config)
    evo_steps = cfg.train.evo_steps
    train_cfg = {"max_steps": cfg.train.max_steps, "evaluation_interval": cfg.train.evaluation_interval,
                 "save_elite": cfg.train.save_elite, "elite_path": cfg.train.elite_path}
    train_cfg["callbacks"] = run_callbacks(cfg, out)
    env_type = cfg.env.type
    print(f"evollm: {len(members)} x {type(members[0]).__name__} on one shared base "
          f"({sum(p.numel() for p in members[0].shared.base_parameters()):,} base parameters), env={env_type}")
    if env_type == "reasoning":
        from .runners import run_reasoning
        result = run_reasoning(cfg, members, tokenizer, train_cfg, evo_steps, selection, mutation, quiet)
    elif env_type == "multiturn":
        from .runners import run_multiturn
        result = run_multiturn(cfg, members, tokenizer, train_cfg, evo_steps, selection, mutation, quiet)
    elif env_type == "team":
        from .runners import run_team
        result = run_team(cfg, members, tokenizer, train_cfg, evo_steps, selection, mutation, quiet)
    else:
        raise ValueError(f"env.type={env_type!r} is not valid; choose one of ['reasoning', 'multiturn', 'team']")
    agents, population = result["agents"], result["population"]
    paths = population.write(out, plots=False)  # the plots are already drawn by the run-files writer
    paths.update({p.stem + "_plot": p for p in sorted(out.glob("*.png"))})
    best = population.best()
    best.save_checkpoint(out / "best_member")
    result["wall_time_s"] = time.perf_counter() - t0
    summary = {k: v for k, v in result.items() if k not in ("agents", "population")}
    summary.update(best_member=best.index, outputs={k: str(v) for k, v in paths.items()})
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    report = population.report()
    print("\nLast rows of the report:")
    cols = [c for c in ("step", "generation", "member", "parent", "fitness", "train_reward", "hp_lr", "hp_beta",
                        "hp_clip_coef", "hp_lora_rank") if c in report.columns]
    print(report[cols].tail(2 * len(agents)).to_string(index=False))
    print(f"\nwarm start fitness {result['initial_fitness']:.3f} -> best member {best.index} "
          f"fitness {result['final_fitness']:.3f}   ({result['wall_time_s']:.0f} s)")
    print(f"outputs in {out}/: report.csv, lineage.csv, metrics.csv, *.png, tensorboard/, best_member/ "
          f"(evollm report {out})")
    return summary


USER_ERRORS = (ConfigError, ValueError, TypeError, KeyError, OSError)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="evollm", description="Evolutionary RL fine-tuning of causal LLMs")
    parser.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    sub = parser.add_subparsers(dest="command", required=True)
    p_train = sub.add_parser("train", help="train a population from a YAML config")
    p_train.add_argument("config")
    p_train.add_argument("--set", dest="overrides", action="append", default=[],
                         help="override a config value, e.g. --set train.max_steps=10")
    p_train.add_argument("--quiet", action="store_true", help="no progress bar")
    p_train.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                         help="show the full traceback of an error")
    p_report = sub.add_parser("report", help="summarise a run directory and redraw its plots (finished, running or dead)")
    p_report.add_argument("run_dir")
    p_report.add_argument("--out", default=None, help="write plots and tables here instead of into RUN_DIR")
    p_report.add_argument("--no-plots", dest="plots", action="store_false", help="only print the summary")
    p_report.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                          help="show the full traceback of an error")
    args = parser.parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        if args.command == "train":
            train(args.config, args.overrides, args.quiet)
        elif args.command == "report":
            from .run.report import report_run
            report_run(args.run_dir, args.out, plots=args.plots)
    except USER_ERRORS as e:
        if args.debug:
            raise
        print(f"evollm: error: {one_line(e)}", file=sys.stderr)
        return 2
    return 0


def one_line(error: BaseException) -> str:
    """An exception as one line (KeyError's quotes dropped)."""
    text = error.args[0] if isinstance(error, KeyError) and error.args else str(error)
    text = " ".join(str(text).split())
    return text or type(error).__name__


if __name__ == "__main__":
    sys.exit(main())
