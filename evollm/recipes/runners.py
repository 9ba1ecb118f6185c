"""What ``evollm train`` runs for each kind of environment: build the env, measure the
warm start, train, measure again."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable

from tqdm.auto import tqdm

from ..algorithms.ippo_rollout import evaluate_teams
from ..envs.reasoning import ReasoningGym
from ..envs.team import TeamTask
from ..parallel import distributed as dist
from ..rollout import EnvPool, evaluate_population
from ..tasks.coop import relay_task
from ..tasks.games import game_env_factory, task_settings
from ..training.callbacks import Callback
from ..training.data_parallel import evaluate_data_parallel
from ..training.ippo import finetune_ippo
from ..training.loop import finetune_llm_reasoning
from ..training.settings import LoopSettings
from ..training.multiturn import EVAL_SEED_OFFSET, evaluate_episodes, finetune_llm_multiturn, success_rate
from ..utils.atomic import write_json
from .builders import build_task

#: the base's held-out fitness, measured once when a run starts (``evollm resume`` reads it back)
WARM_START = "warm_start.json"


def run_reasoning(cfg, members, tokenizer, settings: LoopSettings, selection, mutation, callbacks,
                  task=None) -> dict:
    """What ``evollm train`` runs for ``env.type: reasoning``: measure the warm start on the fixed test
    questions, train, and return ``{agents, population, initial_fitness, final_fitness}``. ``task``: the
    task's parts when the recipe built them already."""
    train_ds, test_ds, reward_fn, template = task if task is not None else build_task(cfg.task, cfg.seed)
    # data_batch_size_per_gpu is per process: the env yields the global batch, each process its share
    env = ReasoningGym(train_ds, test_ds, tokenizer, reward_fn, template, seed=cfg.seed,
                       data_batch_size_per_gpu=cfg.env.data_batch_size_per_gpu * dist.num_processes(),
                       max_context_length=cfg.env.max_context_length, eval_batch_size=cfg.env.eval_batch_size,
                       long_prompts=cfg.env.long_prompts, chat_template_kwargs=cfg.task.chat_template_kwargs,
                       reward_timeout=cfg.task.reward_timeout)
    def measure() -> dict:
        capture = _ScoreCapture(env)
        initial = evaluate_data_parallel(members[:1], capture, evaluate_population, record=False)[0]
        return {"initial_fitness": initial,
                "standard_error": capture.standard_error() if not dist.is_distributed() else None}

    measured = warm_start_once(cfg, settings, measure)
    initial, se = float(measured["initial_fitness"]), measured.get("standard_error")
    if dist.is_main_process():
        noise = f" ± {se:.3f} (standard error)" if se is not None else ""
        print(f"warm start: held-out fitness {initial:.3f}{noise}, the mean reward of greedy answers to "
              f"{len(env.test_prompts())} fixed test questions"
              + (" (measured when the run started)" if settings.resume else ""))
    agents, population = finetune_llm_reasoning(
        members, env, settings, tournament=selection, mutation=mutation, callbacks=callbacks,
        rollout_backend=cfg.rollout_backend, vllm=cfg.vllm)
    final = population.best().fitness[-1]  # the kept best state's, when train.keep_best kept a better one
    return {"agents": agents, "population": population, "initial_fitness": initial, "final_fitness": final}


def warm_start_once(cfg, settings: LoopSettings, measure: Callable[[], dict]) -> dict:
    """The warm start's scores: ``measure()`` when the run starts, kept in ``OUTPUT_DIR/warm_start.json``
    and read back on every resume (the base does not change, so it is not evaluated again)."""
    saved = Path(cfg.output_dir) / WARM_START
    if settings.resume and saved.is_file():
        return json.loads(saved.read_text())
    values = measure()
    if dist.is_main_process():
        write_json(saved, values)
    return values


class _ScoreCapture:
    """The env, with every reward it scores kept: the evaluation's standard error, from which
    ``task.n_test`` can be chosen (it shrinks as one over the square root of the question count)."""

    def __init__(self, env):
        self._env, self.rewards = env, []

    def __getattr__(self, name):
        return getattr(self._env, name)

    def score(self, completions, prompts=None):
        rewards = self._env.score(completions, prompts)
        self.rewards += rewards.flatten().tolist()
        return rewards

    def standard_error(self) -> float | None:
        n = len(self.rewards)
        if n < 2:
            return None
        mean = sum(self.rewards) / n
        return math.sqrt(sum((r - mean) ** 2 for r in self.rewards) / (n - 1) / n)


# --------------------------------------------------------------------------- multi-turn games
def env_factory_from_config(task_cfg: dict, env_cfg: dict, tokenizer) -> tuple[Callable[[], object], int]:
    """``(env_factory, max_turns)`` for a game task: ``task: {name: guess_number | chain_calc, <game
    settings>}``, ``env: {type: multiturn, max_turns, max_model_len, max_output_tokens}``; game settings
    default to those the tiny model was warm-started on."""
    task_cfg = dict(task_cfg or {})
    name = task_cfg.pop("name", "guess_number")
    spec = task_settings(name)
    game = {**spec["game"], **task_cfg}
    probe = game_env_factory(name, tokenizer, game=game)()
    max_turns = int(env_cfg.get("max_turns") or probe.max_turns)
    factory = game_env_factory(name, tokenizer, game=game, max_turns=max_turns,
                               max_model_len=env_cfg.get("max_model_len", 256),
                               max_output_tokens=int(env_cfg.get("max_output_tokens", spec["max_output_tokens"])))
    return factory, max_turns


def run_multiturn(cfg, members, tokenizer, settings: LoopSettings, selection, mutation, callbacks) -> dict:
    """What ``evollm train`` runs for ``env.type: multiturn``: measure the warm start on the fixed evaluation
    episodes, train, and return ``{agents, population, initial_fitness, final_fitness, initial_success,
    final_success}`` (fitness = mean return; success = fraction of episodes won, best member)."""
    task = {"name": cfg.task.name, **cfg.task.game}
    env = {k: v for k, v in cfg.env.to_dict().items() if v is not None}
    factory, max_turns = env_factory_from_config(task, env, tokenizer)
    eval_n = cfg.train.eval_episodes
    seed = settings.seed
    pool = EnvPool(factory)
    seeds = [EVAL_SEED_OFFSET + seed * 10**6 + i for i in range(eval_n)]  # the loop's own evaluation seeds
    def measure() -> dict:
        fit, eps = evaluate_episodes(members[:1], pool, seeds, max_turns, record=False)
        return {"initial_fitness": fit[0], "initial_success": success_rate(eps[members[0].index])}

    measured = warm_start_once(cfg, settings, measure)
    initial, initial_success = float(measured["initial_fitness"]), float(measured["initial_success"])
    if dist.is_main_process():
        print(f"warm start: success {initial_success:.3f}, mean return {initial:.3f} on {eval_n} fixed greedy "
              "episodes" + (" (measured when the run started)" if settings.resume else ""))
    successes: dict[int, float] = {}  # each member's latest success rate
    successes_at: dict[tuple[int, int], float] = {}  # by (step, member): the kept best state's (train.keep_best)

    def log(step, agents, episodes):  # multi-process: equal shares of the seeds, so the mean of the rates
        rates = [success_rate(episodes[a.index]) for a in agents]
        if dist.is_distributed():
            rates = dist.all_reduce_mean(rates).tolist()
        successes.update({a.index: r for a, r in zip(agents, rates)})
        successes_at.update({(step, a.index): r for a, r in zip(agents, rates)})
        if settings.verbose and dist.is_main_process():
            tqdm.write(f"step {step:>5}  success " + " ".join(f"{successes[a.index]:.3f}" for a in agents))

    agents, population = finetune_llm_multiturn(
        members, max_turns, factory, settings, tournament=selection, mutation=mutation,
        episodes_per_step=cfg.train.episodes_per_step, eval_episodes=eval_n, on_evaluation=log, callbacks=callbacks)
    best, measured = best_and_origin(population)
    return {"agents": agents, "population": population, "initial_fitness": initial,
            "final_fitness": best.fitness[-1], "initial_success": initial_success,
            "final_success": successes_at.get(measured, math.nan) if measured else successes.get(best.index, math.nan)}


# --------------------------------------------------------------------------- IPPO teams
TEAM_TASKS = ("relay_sum",)


def team_task_from_config(task_cfg, env_cfg, tokenizer, seed: int, teams) -> TeamTask:
    """The :class:`TeamTask` of the config's ``task`` (``name: relay_sum``) and ``env`` (``type: team``,
    ``success_threshold``) sections; replies as long as the teams' ``max_new_tokens``."""
    name = getattr(task_cfg, "name", "relay_sum")
    if name not in TEAM_TASKS:
        raise ValueError(f"task.name={name!r} is not a team task; valid: {list(TEAM_TASKS)}")
    team = teams[0].config
    return relay_task(tokenizer, seed=seed, max_new_tokens=team.max_new_tokens, max_model_len=team.max_model_len,
                      success_threshold=float(getattr(env_cfg, "success_threshold", 1.0)))


def run_team(cfg, teams, tokenizer, settings: LoopSettings, selection, mutation, callbacks) -> dict:
    """What ``evollm train`` runs for ``env.type: team`` (IPPO teams on a cooperative task): measure the warm
    start (one untrained team) on the fixed evaluation rows, train, and return ``{agents, population,
    initial_fitness, final_fitness, initial_success, final_success}`` (fitness = mean joint reward; success =
    fraction of episodes every agent got right)."""
    task = team_task_from_config(cfg.task, cfg.env, tokenizer, int(cfg.seed), teams)
    def measure() -> dict:
        fit, succ = evaluate_teams(teams[:1], task, record=False)
        return {"initial_fitness": fit[0], "initial_success": succ[0]}

    measured = warm_start_once(cfg, settings, measure)
    initial, initial_success = float(measured["initial_fitness"]), float(measured["initial_success"])
    say = print if dist.is_main_process() else (lambda *a, **k: None)
    say(f"warm start: joint reward {initial:.3f}, joint success {initial_success:.3f} on {len(task.eval_rows)} "
        "fixed greedy episodes" + (" (measured when the run started)" if settings.resume else ""))
    report, report_at = {}, {}  # each team's latest joint success; by (step, team) for a kept best state

    class _Success(Callback):
        def on_evaluation(self, state, fitness):
            rows = state.record.rows[-len(state.agents):]
            report.update({r["member"]: r.get("success", math.nan) for r in rows})
            report_at.update({(r["step"], r["member"]): r.get("success", math.nan) for r in rows})
            if settings.verbose:
                say(f"step {state.step:>5}  joint success " + " ".join(f"{report[t.index]:.3f}" for t in state.agents))

    agents, population = finetune_ippo(teams, task, settings, tournament=selection, mutation=mutation,
                                       callbacks=[_Success(), *callbacks])
    best, measured = best_and_origin(population)
    return {"agents": agents, "population": population, "initial_fitness": initial, "final_fitness": best.fitness[-1],
            "initial_success": initial_success,
            "final_success": report_at.get(measured, math.nan) if measured else report.get(best.index, math.nan)}


def best_and_origin(population) -> tuple:
    """``(best member, (step, source id))`` when it is the kept best state (train.keep_best: its success was
    measured on ``source`` at ``step``), else ``(best member, None)``."""
    best, kept = population.best(), population.kept
    if kept is not None and best is kept.member:
        return best, (kept.step, kept.source)
    return best, None
