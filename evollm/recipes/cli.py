"""``evollm train CONFIG.yaml``: build everything from a YAML run config, train the
population, and write the report, lineage, plots and the best member's adapter."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path

from evollm.parallel import distributed as dist
from evollm.config import ALGORITHMS, algorithm_class  # noqa: F401  (re-exported)
from evollm.config.schema import ConfigError
from evollm.run.lock import RunLock
from evollm.run.search import describe, search_cost
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
    # founders drawn from the hp_config (stratified unless algorithm.init_sampler says otherwise); a value
    # set in algorithm.hyperparameters is kept for every founder
    return cls.population(size, model, hp_config=hp_config, init_sampler=alg.init_sampler, fixed=alg.hyperparameters,
                          default_founder=alg.default_founder,
                          pad_token_id=tokenizer.pad_token_id, pad_token=tokenizer.pad_token,
                          eos_token_id=tokenizer.eos_token_id, tokenizer=tokenizer, lora_config=lora, **hps)


from evollm.recipes.rundir import RUN_CONFIG, prepare_output_dir  # noqa: E402,F401  (re-exported)
_RUN_DIR: Path | None = None  # the run `evollm train` started (for the resume hint after a second Ctrl-C)


def run_callbacks(cfg, out: Path) -> list:
    """The run-directory writer and the live loggers the ``logging:`` section asks for."""
    from evollm.run.files import RunFilesWriter
    from evollm.run.logging import logging_callbacks

    log = cfg.logging
    return [RunFilesWriter(out, plots=log.plots),
            *logging_callbacks(out, log.tensorboard, log.wandb, log.mlflow, run_config=cfg.to_dict())]


def train(config_path: str, overrides: list[str] | None = None, quiet: bool = False,
          overwrite: bool = False) -> dict:
    """``evollm train``: a new run in ``output_dir`` (see :func:`run`)."""
    from evollm.config import RunConfig

    dist.init()  # under `accelerate launch`: one process per device, the population on each
    cfg = RunConfig.from_yaml(config_path, overrides)  # every setting is checked before any model is built
    if cfg.env.type == "reasoning":  # a reward and data files, found from the config's folder or here, remembered
        from evollm.tasks.reward_spec import locate_reward
        folders = [Path(config_path).resolve().parent, Path.cwd()]
        cfg.task.reward = locate_reward(cfg.task.reward, folders)
        for name in ("dataset", "test_dataset"):
            value = getattr(cfg.task, name)
            if isinstance(value, str) and value and not Path(value).expanduser().is_absolute():
                found = next((f / value for f in folders if (f / value).exists()), None)
                if found is not None:
                    setattr(cfg.task, name, str(found.resolve()))
    out = Path(cfg.output_dir)
    main = dist.is_main_process()
    global _RUN_DIR
    _RUN_DIR = out
    if not main:
        return run(cfg, resume=False, quiet=quiet)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"output_dir {str(out)!r} is a file, not a directory")
    forgotten = False
    try:
        with RunLock(out):  # only the main process writes the run directory, one writer at a time
            prepare_output_dir(out, overwrite)
            write_json(out / RUN_CONFIG, cfg.to_dict(explicit=True))
            try:
                return run(cfg, resume=False, quiet=quiet)
            except Exception:
                forgotten = forget_failed_start(out)
                raise
    finally:
        if forgotten:  # emptied but for the lock, now released
            try:
                out.rmdir()
            except OSError:
                pass


def forget_failed_start(out: Path) -> bool:
    """A run that failed before its first step (a bad reward, dataset or template found while starting)
    leaves no "previous run" behind, so the corrected command runs without --overwrite. Returns whether
    the run directory was removed (it holds no checkpoint and no step's metrics)."""
    from evollm.recipes.rundir import clear

    if not out.is_dir() or (out / "metrics.csv").exists() or any((out / "checkpoints").glob("step_*")):
        return False
    clear(out)  # all but the lock, which its holder releases
    return True


def resume(run_dir: str, overrides: list[str] | None = None, quiet: bool = False,
           allow_changes: list[str] | None = None) -> dict:
    """``evollm resume RUN_DIR``: continue a run from its newest valid checkpoint. The resumed config is
    compared with the checkpoint's record field by field: only the budget, the evaluation/checkpoint
    intervals and logging may change (:data:`evollm.config.schema.RESUME_SETTABLE`), other fields only when
    named in ``allow_changes`` (``--allow-change FIELD``; recorded in ``config_changes.json``)."""
    out = Path(run_dir)
    if not out.is_dir():
        raise ConfigError(f"run directory {run_dir!r} does not exist" if not out.exists()
                          else f"run directory {run_dir!r} is a file")
    if not (out / RUN_CONFIG).is_file():
        raise ConfigError(f"{run_dir!r} is not an evollm run directory (no {RUN_CONFIG}); start it with evollm train")
    if not dist.is_main_process():
        return _resume(out, overrides, quiet, allow_changes or [], main=False)
    with RunLock(out):  # a second writer is refused before anything in the directory changes
        return _resume(out, overrides, quiet, allow_changes or [], main=True)


def _resume(out: Path, overrides, quiet: bool, allowed: list[str], main: bool) -> dict:
    from evollm.config import RunConfig, apply_override
    from evollm.config.schema import check_resume_override
    from evollm.recipes.rundir import check_resumed_config, member_overrides
    from evollm.run.resume_check import covers

    try:
        data = json.loads((out / RUN_CONFIG).read_text())
    except ValueError as e:
        raise ConfigError(f"{out / RUN_CONFIG} is not valid JSON ({e})") from e
    for item in overrides or []:
        if not covers(item.split("=", 1)[0].strip(), allowed):
            check_resume_override(item)  # the budget, evaluation/checkpoint intervals and logging may change
        apply_override(data, item)
    data["output_dir"] = str(out)
    cfg = RunConfig.from_dict(data)
    changes = check_resumed_config(out, cfg, allowed, RunConfig, record=main)  # what the checkpoint recorded
    if main:
        write_json(out / RUN_CONFIG, cfg.to_dict(explicit=True))
        for field, old, new in changes:
            print(f"evollm: resuming with {field} changed from {old!r} to {new!r}")
    return run(cfg, resume=True, quiet=quiet, member_values=member_overrides(changes))


def run(cfg, resume: bool, quiet: bool = False, member_values: dict | None = None) -> dict:
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
    settings = cfg.train.loop_settings(out, cfg.seed, resume=resume, run_config=run_config, verbose=not quiet)
    settings = settings.replace(narrowing=build_narrowing(cfg), max_time_clock=cfg.train.max_time_clock)
    callbacks = run_callbacks(cfg, out) if main else []  # only the main process writes
    if member_values:  # allowed changes of algorithm.hyperparameters, set on the members once restored
        from evollm.recipes.rundir import apply_on_resume
        callbacks.insert(0, apply_on_resume(member_values, print if main else lambda msg: None))
    env_type = cfg.env.type
    if cfg.rollout_backend != "hf" and env_type != "reasoning":
        raise ValueError(f"rollout_backend={cfg.rollout_backend!r} supports env.type 'reasoning' only")
    say = print if main else (lambda *a, **k: None)
    say(f"evollm: {len(members)} x {type(members[0]).__name__} on one shared base "
        f"({sum(p.numel() for p in members[0].shared.base_parameters()):,} base parameters), env={env_type}")
    from evollm.recipes import runners
    from evollm.run import RunInterrupted

    runner = {"reasoning": "run_reasoning", "multiturn": "run_multiturn", "team": "run_team"}.get(env_type)
    if runner is None:
        raise ValueError(f"env.type={env_type!r} is not valid; choose one of ['reasoning', 'multiturn', 'team']")
    extra = {"task": task} if env_type == "reasoning" else {}
    try:
        result = getattr(runners, runner)(cfg, members, tokenizer, settings, selection, mutation, callbacks, **extra)
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
    if population.kept is not None and best is population.kept.member:  # train.keep_best returned an earlier state
        summary["best_state"] = population.kept.info()
    reserve = population.reserve  # hpo.narrowing.revive: it replaced a stalled or quarantined member
    if reserve is not None and (reserve.swapped or reserve.used_up):
        summary["reserve"] = reserve.info()
    summary.update(population.revival_events())  # hpo.narrowing.rollback and .anneal
    report = population.report()
    kept = summary.get("best_state")  # the kept state descends from its source member
    search = search_cost(population.lineage(), population.metrics(), kept["source"] if kept else best.index,
                         kept["step"] if kept else int(report["step"].max()))
    if search is not None:  # what the population's search cost and found (evollm.run.search)
        summary["search"] = search
    write_json(out / "summary.json", summary)
    print("\nLast rows of the report:")
    cols = [c for c in ("step", "generation", "member", "parent", "fitness", "train_reward", "hp_lr", "hp_beta",
                        "hp_clip_coef", "hp_lora_rank") if c in report.columns]
    print(report[cols].tail(2 * len(agents)).to_string(index=False))
    took = f"{result['wall_time_s']:.0f} s" + (f", {segment:.0f} s since the resume" if resume else "")
    origin = (f" (the state of member {summary['best_state']['source']} at step {summary['best_state']['step']}, "
              "kept as the run's best)") if "best_state" in summary else ""
    print(f"\nwarm start fitness {result['initial_fitness']:.3f} -> best member {best.index}{origin} "
          f"fitness {result['final_fitness']:.3f}   ({took})")
    if search is not None:
        print("\n".join(describe(search)))
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
    p_resume.add_argument("--allow-change", dest="allow_changes", action="append", default=[], metavar="FIELD",
                          help="resume although FIELD (e.g. algorithm.hyperparameters.lr, or a whole section) "
                               "differs from the checkpoint's config; recorded in config_changes.json")
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

    from evollm.envs import RewardFunctionError
    from evollm.run import RunInterrupted
    from evollm.training.quarantine import PopulationDiverged

    global _RUN_DIR
    _RUN_DIR = None
    hf_logging.disable_progress_bar()
    import datasets

    datasets.disable_progress_bars()  # "Generating train split" bars of a user's dataset file
    if hasattr(signal, "SIGXFSZ"):  # a file-size limit is an OSError (one line), not a core dump
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    run_dir = getattr(args, "run_dir", None)
    try:
        if args.command == "train":
            train(args.config, args.overrides, args.quiet, args.overwrite)
        elif args.command == "resume":
            resume(args.run_dir, args.overrides, args.quiet, args.allow_changes)
        elif args.command == "report":
            from evollm.run.report import report_run
            report_run(args.run_dir, args.out, plots=args.plots)
        elif args.command == "export":
            from evollm.recipes.export import PROMPT_FILE, export_run
            path = export_run(args.run_dir, args.out, overwrite=args.overwrite)
            print(f"evollm: best member merged into its base in {path}/ (AutoModelForCausalLM.from_pretrained); "
                  f"the prompt it was trained on: {path / PROMPT_FILE}")
    except RunInterrupted as e:
        run_dir = run_dir or (str(_RUN_DIR) if _RUN_DIR is not None else None)
        if e.checkpoint is None:
            print(f"evollm: stopped by {signal.Signals(e.signum).name} before a checkpoint was saved; "
                  f"{_restart_hint(run_dir)}", file=sys.stderr)
        else:
            what = "its unfinished step abandoned" if e.abandoned else "checkpoint saved"
            print(f"evollm: stopped by {signal.Signals(e.signum).name} after step {e.step} ({what}); last checkpoint "
                  f"{e.checkpoint}\nresume with: evollm resume {run_dir or e.checkpoint.parent.parent}",
                  file=sys.stderr)
        return 130
    except PopulationDiverged as e:
        if args.debug:
            raise
        run_dir = run_dir or (str(_RUN_DIR) if _RUN_DIR is not None else None)
        print(f"evollm: error: {one_line(e)}; {_diverged_hint(run_dir)}", file=sys.stderr)
        return 3
    except RewardFunctionError as e:
        if args.debug:
            raise
        run_dir = run_dir or (str(_RUN_DIR) if _RUN_DIR is not None else None)
        print(f"evollm: error: {one_line(e)}; {_restart_hint(run_dir, 'fix the reward, then ')} "
              "(--debug shows the traceback)", file=sys.stderr)
        return 2
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


def console(argv: list[str] | None = None) -> int:
    """The ``evollm`` command (and ``python -m evollm``): :func:`main`, then, after a success under a
    multi-process launch, every process waits for the others and the process group is closed
    (:func:`evollm.parallel.distributed.shutdown`). :func:`main` itself leaves the group open, for programs
    that call it more than once in one process."""
    code = main(argv)
    if code == 0:
        dist.shutdown()
    return code


def _restart_hint(run_dir: str | None, prefix: str = "") -> str:
    """How to go on: resume from the newest valid checkpoint, or start again when there is none."""
    from evollm.run.checkpoints import newest_valid

    if run_dir is None:
        return f"{prefix}run it again"
    try:
        folder = newest_valid(Path(run_dir) / "checkpoints", log=lambda msg: None, clean=False)
    except ValueError:
        return f"no checkpoint yet: {prefix}run the same `evollm train` again (no --overwrite needed)"
    return f"last checkpoint {folder}; {prefix}resume with: evollm resume {run_dir}"


def _diverged_hint(run_dir: str | None) -> str:
    from evollm.run.checkpoints import newest_healthy

    change = "lower the learning rates (algorithm.hyperparameters.lr, hpo.hp_config.lr)"
    folder = newest_healthy(Path(run_dir) / "checkpoints") if run_dir else None
    if folder is None:
        return f"{change} and train again (no healthy checkpoint to resume from)"
    return (f"newest healthy checkpoint {folder}; {change}, e.g. resume from it with: evollm resume {run_dir} "
            "--set algorithm.hyperparameters.lr=1e-4 --allow-change algorithm.hyperparameters.lr")


def one_line(error: BaseException) -> str:
    """An exception as one line (KeyError's quotes dropped)."""
    text = error.args[0] if isinstance(error, KeyError) and error.args else str(error)
    text = " ".join(str(text).split())
    return text or type(error).__name__


if __name__ == "__main__":
    sys.exit(console())
