"""``evollm train CONFIG.yaml``: build everything from a YAML run config, train the
population, and write the report, lineage, plots and the best member's adapter."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

from evollm.parallel import distributed as dist
from evollm.config import ALGORITHMS, algorithm_class  # noqa: F401  (re-exported)
from evollm.config.schema import ConfigError
from evollm.utils.atomic import write_json


def build_population(cfg, model, tokenizer, hp_config):
    """The members of the population on ONE shared base."""
    from evollm.models.loading import lora_config

    alg = cfg.algorithm
    cls = algorithm_class(alg.name)
    size = alg.population_size
    lora = lora_config(model, **alg.lora.kwargs())
    hps = dict(alg.hyperparameters)
    hps.setdefault("seed", cfg.seed)
    from evollm.hpo.founders import founder_hyperparameters
    # founders drawn from the hp_config (QMC unless algorithm.init_sampler says otherwise); a value
    # set in algorithm.hyperparameters is kept for every founder
    init = founder_hyperparameters(size, hp_config, None, alg.init_sampler, fixed=alg.hyperparameters,
                                   seed=cfg.seed)
    members = []
    for i in range(size):
        agent = cls(model, pad_token_id=tokenizer.pad_token_id, pad_token=tokenizer.pad_token,
                    eos_token_id=tokenizer.eos_token_id, tokenizer=tokenizer, hp_config=hp_config, lora_config=lora,
                    **hps)
        for name, value in (init[i] if init else {}).items():
            agent.set_hyperparameter(name, value)
        members.append(agent)
    return members


RUN_CONFIG = "run_config.json"
_RUN_DIR: Path | None = None  # the run `evollm train` started (for the resume hint after a second Ctrl-C)


def run_callbacks(cfg, out: Path) -> list:
    """The run-directory writer and the live loggers the ``logging:`` section asks for."""
    from evollm.run.files import RunFilesWriter
    from evollm.run.logging import logging_callbacks

    log = cfg.logging
    return [RunFilesWriter(out, plots=log.plots),
            *logging_callbacks(out, log.tensorboard, log.wandb, log.mlflow, run_config=cfg.to_dict())]


def prepare_output_dir(out: Path, overwrite: bool) -> None:
    """A fresh run needs an empty (or new) output_dir; ``overwrite`` clears a previous evollm run there."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"output_dir {str(out)!r} is a file, not a directory")
    if not out.exists() or not any(out.iterdir()):
        return
    is_run = (out / RUN_CONFIG).exists() or (out / "config.json").exists() or (out / "checkpoints").is_dir()
    if not overwrite:
        what = "a previous run" if is_run else "files"
        raise ConfigError(f"output_dir {str(out)!r} already holds {what}; pass --overwrite to replace it, "
                          f"`evollm resume {out}` to continue it, or choose another output_dir")
    if not is_run:
        raise ConfigError(f"output_dir {str(out)!r} is not empty and is not an evollm run directory; "
                          "--overwrite only replaces evollm runs, choose another output_dir")
    shutil.rmtree(out)


def train(config_path: str, overrides: list[str] | None = None, quiet: bool = False,
          overwrite: bool = False) -> dict:
    """``evollm train``: a new run in ``output_dir`` (see :func:`run`)."""
    from evollm.config import RunConfig

    dist.init()  # under `accelerate launch`: one process per device, the population on each
    cfg = RunConfig.from_yaml(config_path, overrides)  # every setting is checked before any model is built
    if cfg.env.type == "reasoning":  # a reward module or file, found from the config's folder or here, remembered
        from evollm.tasks.reward_spec import locate_reward
        cfg.task.reward = locate_reward(cfg.task.reward, [Path(config_path).resolve().parent, Path.cwd()])
    out = Path(cfg.output_dir)
    main = dist.is_main_process()
    global _RUN_DIR
    _RUN_DIR = out
    if main:  # only the main process writes the run directory
        prepare_output_dir(out, overwrite)
        out.mkdir(parents=True, exist_ok=True)
        write_json(out / RUN_CONFIG, cfg.to_dict(explicit=True))
    try:
        return run(cfg, resume=False, quiet=quiet)
    except Exception:
        if main:
            forget_failed_start(out)
        raise


def forget_failed_start(out: Path) -> bool:
    """A run that failed before its first step (a bad reward, dataset or template found while starting)
    leaves no "previous run" behind, so the corrected command runs without --overwrite. Returns whether
    the run directory was removed (it holds no checkpoint and no step's metrics)."""
    if not out.is_dir() or (out / "metrics.csv").exists() or any((out / "checkpoints").glob("step_*")):
        return False
    shutil.rmtree(out, ignore_errors=True)
    return True


def resume(run_dir: str, overrides: list[str] | None = None, quiet: bool = False) -> dict:
    """``evollm resume RUN_DIR``: continue a run from its newest valid checkpoint. Only the budget,
    the evaluation/checkpoint intervals and logging may change (:data:`evollm.config.schema.RESUME_SETTABLE`)."""
    from evollm.config import RunConfig, apply_override
    from evollm.config.schema import check_resume_override

    out = Path(run_dir)
    if not out.is_dir():
        raise ConfigError(f"run directory {run_dir!r} does not exist" if not out.exists()
                          else f"run directory {run_dir!r} is a file")
    if not (out / RUN_CONFIG).is_file():
        raise ConfigError(f"{run_dir!r} is not an evollm run directory (no {RUN_CONFIG}); start it with evollm train")
    try:
        data = json.loads((out / RUN_CONFIG).read_text())
    except ValueError as e:
        raise ConfigError(f"{out / RUN_CONFIG} is not valid JSON ({e})") from e
    for item in overrides or []:
        check_resume_override(item)  # the budget, evaluation/checkpoint intervals and logging may change
        apply_override(data, item)
    data["output_dir"] = str(out)
    cfg = RunConfig.from_dict(data)
    write_json(out / RUN_CONFIG, cfg.to_dict(explicit=True))
    return run(cfg, resume=True, quiet=quiet)


def run(cfg, resume: bool, quiet: bool = False) -> dict:
    """Build the model, task and population of ``cfg``, train (checkpointing into
    ``output_dir/checkpoints``), and write the report, lineage, plots and the best member."""
    import torch

    from evollm.recipes.builders import build_hpo, build_model, build_narrowing, build_task
    from evollm.tasks.user import check_task

    dist.init()
    main = dist.is_main_process()
    run_config = cfg.to_dict(explicit=True)
    cfg.resolve_paths()
    from evollm.models.loading import set_threads

    set_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    out = Path(cfg.output_dir)
    if main:  # only the main process writes the run directory
        write_json(out / "config.json", cfg.to_dict())
    t0 = time.perf_counter()
    task = None
    if cfg.env.type == "reasoning":  # dataset, columns, template and reward: checked before the model loads
        task = build_task(cfg.task, cfg.seed)
        check_task(*task)
    model, tokenizer = build_model(cfg.model, cfg.seed, cfg.task.name)
    if dist.is_distributed():
        model.to(dist.device())
    hp_config, mutation, selection = build_hpo(cfg)
    members = build_population(cfg, model, tokenizer, hp_config)
    evo_steps = cfg.train.evo_steps
    train_cfg = {"max_steps": cfg.train.max_steps, "evaluation_interval": cfg.train.evaluation_interval,
                 "save_elite": cfg.train.save_elite, "elite_path": cfg.train.elite_path or str(out / "elites"),
                 "checkpoint_dir": str(out / "checkpoints"), "checkpoint_every": cfg.train.checkpoint_interval(),
                 "keep_checkpoints": cfg.train.keep_checkpoints, "resume": resume, "run_config": run_config,
                 "max_time": cfg.train.max_time, "max_time_clock": cfg.train.max_time_clock,
                 "narrowing": build_narrowing(cfg)}
    train_cfg["callbacks"] = run_callbacks(cfg, out) if main else []  # only the main process writes
    env_type = cfg.env.type
    if cfg.rollout_backend != "hf":
        if env_type != "reasoning":
            raise ValueError(f"rollout_backend={cfg.rollout_backend!r} supports env.type 'reasoning' only")
        train_cfg.update(rollout_backend=cfg.rollout_backend, vllm=cfg.vllm)
    say = print if main else (lambda *a, **k: None)
    say(f"evollm: {len(members)} x {type(members[0]).__name__} on one shared base "
        f"({sum(p.numel() for p in members[0].shared.base_parameters()):,} base parameters), env={env_type}")
    from evollm.run import RunInterrupted

    try:
        if env_type == "reasoning":
            from evollm.recipes.runners import run_reasoning
            result = run_reasoning(cfg, members, tokenizer, train_cfg, evo_steps, selection, mutation, quiet,
                                   task=task)
        elif env_type == "multiturn":
            from evollm.recipes.runners import run_multiturn
            result = run_multiturn(cfg, members, tokenizer, train_cfg, evo_steps, selection, mutation, quiet)
        elif env_type == "team":
            from evollm.recipes.runners import run_team
            result = run_team(cfg, members, tokenizer, train_cfg, evo_steps, selection, mutation, quiet)
        else:
            raise ValueError(f"env.type={env_type!r} is not valid; choose one of ['reasoning', 'multiturn', 'team']")
    except RunInterrupted:
        if main:  # a stopped segment counts towards the run's wall time
            _record_segment(out, time.perf_counter() - t0, resume)
        raise
    agents, population = result["agents"], result["population"]
    result["num_processes"] = dist.num_processes()
    if not main:
        return {k: v for k, v in result.items() if k not in ("agents", "population")}
    paths = population.write(out, plots=False)  # the plots are already drawn by the run-files writer
    paths.update({p.stem + "_plot": p for p in sorted(out.glob("*.png"))})
    best = population.best()
    best.save_checkpoint(out / "best_member")
    segment = time.perf_counter() - t0
    result["wall_time_s"] = segment + _earlier_segments(out, resume)
    result["wall_time_last_segment_s"] = segment
    _record_segment(out, segment, resume)
    summary = {k: v for k, v in result.items() if k not in ("agents", "population")}
    summary.update(best_member=best.index, outputs={k: str(v) for k, v in paths.items()})
    write_json(out / "summary.json", summary)
    report = population.report()
    print("\nLast rows of the report:")
    cols = [c for c in ("step", "generation", "member", "parent", "fitness", "train_reward", "hp_lr", "hp_beta",
                        "hp_clip_coef", "hp_lora_rank") if c in report.columns]
    print(report[cols].tail(2 * len(agents)).to_string(index=False))
    took = f"{result['wall_time_s']:.0f} s" + (f", {segment:.0f} s since the resume" if resume else "")
    print(f"\nwarm start fitness {result['initial_fitness']:.3f} -> best member {best.index} "
          f"fitness {result['final_fitness']:.3f}   ({took})")
    print(f"outputs in {out}/: report.csv, lineage.csv, metrics.csv, *.png, tensorboard/, best_member/ "
          f"(evollm report {out})")
    return summary


from evollm.envs.reward_call import RewardFunctionError  # noqa: E402  (a user's reward that failed)

SEGMENTS = "segments.json"


def _earlier_segments(out: Path, resume: bool) -> float:
    """Wall seconds of a resumed run's earlier segments (each start or resume until it ended or stopped)."""
    try:
        return float(sum(json.loads((out / SEGMENTS).read_text()))) if resume else 0.0
    except (OSError, ValueError, TypeError):
        return 0.0


def _record_segment(out: Path, seconds: float, resume: bool) -> None:
    earlier = []
    if resume:
        try:
            earlier = list(json.loads((out / SEGMENTS).read_text()))
        except (OSError, ValueError, TypeError):
            earlier = []
    if out.is_dir():
        write_json(out / SEGMENTS, [*earlier, round(seconds, 3)])


USER_ERRORS = (ConfigError, ValueError, TypeError, KeyError, OSError, RewardFunctionError)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="evollm", description="Evolutionary RL fine-tuning of causal LLMs")
    parser.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    sub = parser.add_subparsers(dest="command", required=True)
    p_train = sub.add_parser("train", help="train a population from a YAML config")
    p_train.add_argument("config")
    p_train.add_argument("--overwrite", action="store_true", help="replace a previous run in output_dir")
    p_resume = sub.add_parser("resume", help="continue a run from its newest valid checkpoint")
    p_resume.add_argument("run_dir")
    for p in (p_train, p_resume):
        p.add_argument("--set", dest="overrides", action="append", default=[],
                       help="override a config value, e.g. --set train.max_steps=10; KEY=null removes a section "
                            "(resume: train.max_steps/max_time/evaluation_interval/checkpoint_every/"
                            "keep_checkpoints and logging.*)")
        p.add_argument("--quiet", action="store_true", help="no progress bar")
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help="show the full traceback of an error")
    p_report = sub.add_parser("report", help="summarise a run directory and redraw its plots (finished, running or dead)")
    p_report.add_argument("run_dir")
    p_report.add_argument("--out", default=None, help="write plots and tables here instead of into RUN_DIR")
    p_report.add_argument("--no-plots", dest="plots", action="store_false", help="only print the summary")
    p_report.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                          help="show the full traceback of an error")
    p_export = sub.add_parser("export", help="write the best member merged into its base (+ tokenizer and the "
                              "prompt template) as a model folder you can serve")
    p_export.add_argument("run_dir")
    p_export.add_argument("out")
    p_export.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT")
    p_export.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                          help="show the full traceback of an error")
    args = parser.parse_args(argv)
    from transformers.utils import logging as hf_logging

    from evollm.run import RunInterrupted

    hf_logging.disable_progress_bar()
    import datasets

    datasets.disable_progress_bars()  # "Generating train split" bars of a user's dataset file
    run_dir = getattr(args, "run_dir", None)
    try:
        if args.command == "train":
            train(args.config, args.overrides, args.quiet, args.overwrite)
        elif args.command == "resume":
            resume(args.run_dir, args.overrides, args.quiet)
        elif args.command == "report":
            from evollm.run.report import report_run
            report_run(args.run_dir, args.out, plots=args.plots)
        elif args.command == "export":
            from evollm.recipes.export import PROMPT_FILE, export_run
            path = export_run(args.run_dir, args.out, overwrite=args.overwrite)
            print(f"evollm: best member merged into its base in {path}/ (AutoModelForCausalLM.from_pretrained); "
                  f"the prompt it was trained on: {path / PROMPT_FILE}")
    except RunInterrupted as e:
        target = run_dir or str(e.checkpoint.parent.parent)
        print(f"evollm: stopped after step {e.step}; checkpoint saved in {e.checkpoint}\n"
              f"resume with: evollm resume {target}", file=sys.stderr)
        return 130
    except KeyboardInterrupt:
        if args.debug:
            raise
        target = Path(run_dir) if run_dir else _RUN_DIR
        saved = sorted((target / "checkpoints").glob("step_*/manifest.json"),
                       key=lambda p: int(p.parent.name.split("_")[-1]) if p.parent.name.split("_")[-1].isdigit()
                       else -1) if target is not None else []
        if saved:
            print(f"evollm: interrupted before a new checkpoint could be saved; the newest is {saved[-1].parent}\n"
                  f"resume with: evollm resume {target}", file=sys.stderr)
        else:
            print("evollm: interrupted before a checkpoint could be saved", file=sys.stderr)
        return 130
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
