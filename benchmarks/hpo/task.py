"""One task of the benchmark, built from a run config: the shared base, the training env, the
validation set the arms rank on, and the held-out report set that scores every arm the same way.

A single-turn task's held-out split (``task.n_test`` rows) is cut in two: the first part is the env's
test set (what the library evaluates members on: the arms' own validation, counted in their budget),
the second part is the report set, scored only by the harness (greedy, one member, off the clock).
A multi-turn game's report set is ``report_size`` fixed seeds far from the training and evaluation
seeds. A team task's (IPPO, ``env.type: team``) fixed evaluation rows are cut like a single-turn task's
held-out split: validation first, report rows last; a team is scored on its joint episode return. The
data and the base model come from the config's seed, so every arm and every benchmark seed sees the
same base, the same validation questions and the same report set; the benchmark seed moves the data
order, the sampling, the founders and the tuners.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable

#: first seed of the report episodes of a multi-turn game (training seeds are seed * 10**6 + ...,
#: the loop's evaluation seeds start at 2**31 + seed * 10**6)
REPORT_SEED_OFFSET = 3 * 2**30


@dataclass
class Task:
    cfg: Any  # evollm.config.RunConfig
    model: Any
    tokenizer: Any
    kind: str  # "reasoning", "multiturn" or "team"
    train: Callable[..., tuple]  # train(members, **loop keywords) -> (agents, population)
    report: Callable[[Any], list[float]]  # per-item held-out scores of one member
    report_size: int
    validation_size: int
    new_run: Callable[[], None] = lambda: None  # a fresh data stream for the next (arm, seed) run


def load_task(cfg, report_size: int | None = None) -> Task:
    """The :class:`Task` of a run config (``env.type`` reasoning or multiturn)."""
    from evollm.recipes.builders import build_model

    data_seed = int(cfg.seed)  # the base and the data are the config's, whatever the benchmark seed
    model, tok = build_model(cfg.model, data_seed, cfg.task.name)
    if cfg.env.type == "reasoning":
        return _reasoning(cfg, model, tok, data_seed, report_size)
    if cfg.env.type == "multiturn":
        return _multiturn(cfg, model, tok, report_size)
    if cfg.env.type == "team":
        return _team(cfg, model, tok, data_seed, report_size)
    raise ValueError(f"env.type={cfg.env.type!r}: the benchmark runs 'reasoning', 'multiturn' and 'team' tasks")


def _reasoning(cfg, model, tok, data_seed: int, report_size: int | None) -> Task:
    from evollm.envs.reasoning import ReasoningGym
    from evollm.recipes.builders import build_task
    from evollm.rollout import generate_population
    from evollm.training.loop import finetune_llm_reasoning

    if cfg.task.seed is None:
        cfg.task.seed = data_seed
    train, test, reward_fn, template = build_task(cfg.task, data_seed)
    n = len(test)
    n_report = n // 2 if report_size is None else int(report_size)
    if not 1 <= n_report < n:
        raise ValueError(f"report_size={n_report} must leave validation rows out of the {n} held-out rows "
                         "(raise task.n_test)")
    validation, held_out = test.select(range(n - n_report)), test.select(range(n - n_report, n))
    common = dict(tokenizer=tok, reward_fn=reward_fn, conversation_template=template,
                  max_context_length=cfg.env.max_context_length, eval_batch_size=cfg.env.eval_batch_size,
                  long_prompts=cfg.env.long_prompts, chat_template_kwargs=cfg.task.chat_template_kwargs)
    report_env = ReasoningGym(train, held_out, data_batch_size_per_gpu=cfg.env.data_batch_size_per_gpu, **common)
    prompts = report_env.test_prompts()

    def report(agent) -> list[float]:
        scores: list[float] = []
        step = report_env.eval_batch_size
        for start in range(0, len(prompts), step):
            batch = prompts[start:start + step]
            completions, _ = generate_population([agent], batch, training=False)[agent.index].per_prompt()
            scores += report_env.score(completions, batch).reshape(len(batch), -1).mean(1).tolist()
        return scores

    def make_env(seed: int):
        return ReasoningGym(train, validation, seed=seed, data_batch_size_per_gpu=cfg.env.data_batch_size_per_gpu,
                            **common)

    envs: dict[str, Any] = {}

    def run(members, seed: int, **loop):
        if "env" not in envs:  # one data stream per run (its trials continue it)
            envs["env"] = make_env(seed)
        env = envs["env"]
        return finetune_llm_reasoning(members, env, seed=seed, verbose=False, **loop)

    return Task(cfg, model, tok, "reasoning", run, report, len(prompts), n - n_report, envs.clear)


def _multiturn(cfg, model, tok, report_size: int | None) -> Task:
    from evollm.recipes.runners import env_factory_from_config
    from evollm.rollout import EnvPool
    from evollm.training.multiturn import evaluate_episodes, finetune_llm_multiturn

    env = {k: v for k, v in cfg.env.to_dict().items() if v is not None}
    factory, max_turns = env_factory_from_config({"name": cfg.task.name, **cfg.task.game}, env, tok)
    pool = EnvPool(factory)
    n_report = int(report_size or cfg.train.eval_episodes)
    seeds = [REPORT_SEED_OFFSET + i for i in range(n_report)]

    def report(agent) -> list[float]:
        _, episodes = evaluate_episodes([agent], pool, seeds, max_turns, record=False)
        return [float(e.episode_return) for e in episodes[agent.index]]

    def run(members, seed: int, **loop):
        return finetune_llm_multiturn(members, max_turns=max_turns, env_factory=factory, seed=seed, verbose=False,
                                      episodes_per_step=cfg.train.episodes_per_step,
                                      eval_episodes=cfg.train.eval_episodes, **loop)

    return Task(cfg, model, tok, "multiturn", run, report, n_report, cfg.train.eval_episodes)


def _team(cfg, model, tok, data_seed: int, report_size: int | None) -> Task:
    from evollm.algorithms.ippo_rollout import play_teams
    from evollm.envs.team import TeamTask
    from evollm.recipes.runners import team_task_from_config
    from evollm.training.ippo import finetune_ippo

    # team_task_from_config reads the teams' reply and conversation lengths from their config only
    template = team_task_from_config(cfg.task, cfg.env, tok, data_seed, [SimpleNamespace(config=_team_config(cfg))])
    rows = template.eval_rows
    n_report = len(rows) // 2 if report_size is None else int(report_size)
    if not 1 <= n_report < len(rows):
        raise ValueError(f"report_size={n_report} must leave validation rows out of the {len(rows)} evaluation rows")
    validation, held_out = rows[:len(rows) - n_report], rows[len(rows) - n_report:]

    def make_task(eval_rows, seed: int) -> TeamTask:  # the template's task on other rows, its own row order
        t = template
        return TeamTask(t.train_rows, eval_rows, tok, t.reward_func, t.formatters, num_turns=t.num_turns,
                        reward_processor=t.reward_processor, reward_turns=t.reward_turns,
                        max_new_tokens=t.max_new_tokens, max_model_len=t.max_model_len,
                        success_threshold=t.success_threshold, system_prompt=t.system_prompt,
                        eval_batch_size=t.eval_batch_size, seed=seed)

    report_task = make_task(held_out, data_seed)

    def report(team) -> list[float]:
        scores: list[float] = []
        step = report_task.eval_batch_size
        for start in range(0, len(held_out), step):
            out = play_teams([team], report_task, held_out[start:start + step], training=False)
            scores += [float(e.episode_return) for e in out.episodes[team.index]]
        return scores

    tasks: dict[str, Any] = {}

    def run(members, seed: int, **loop):
        if "task" not in tasks:  # one stream of training rows per run (its trials continue it)
            tasks["task"] = make_task(validation, seed)
        return finetune_ippo(members, tasks["task"], seed=seed, verbose=False, **loop)

    return Task(cfg, model, tok, "team", run, report, len(held_out), len(validation), tasks.clear)


def _team_config(cfg):
    """The teams' :class:`~evollm.algorithms.ippo.IPPOConfig` as the config sets it."""
    from evollm.algorithms.ippo import IPPOConfig
    from evollm.algorithms.base import build_config
    return build_config(IPPOConfig, None, dict(cfg.algorithm.hyperparameters or {}))


def mean_se(scores: list[float]) -> tuple[float, float]:
    """Mean of per-item scores and its standard error (sd / sqrt(n); the binomial one for 0/1 scores)."""
    n = len(scores)
    m = sum(scores) / n
    var = sum((s - m) ** 2 for s in scores) / (n - 1) if n > 1 else math.nan
    return m, math.sqrt(var / n)
