"""Populations of IPPO teams on the SAME evolution loop as every other algorithm.

:func:`finetune_ippo` supplies :func:`evollm.training.loop.evolve` with a ``train_step`` (every team
plays the same ``rollout_buffer_size`` training rows -- all agents of all teams in one batched
generate per round -- then every agent learns, agents with equal schedules in shared passes) and an
``evaluate`` (fitness = mean joint return of each team on the task's fixed evaluation rows, greedy).
Tournament selection and mutation act on whole teams. Under ``accelerate launch --num_processes N``
every process plays its ``1/N`` of the training and evaluation rows (both must split evenly) and the
agents' gradients are averaged over processes, so every process takes the same decisions.

:class:`IPPOTrainer` is the CoMLRL-style entry point: ``IPPOTrainer(model=..., tokenizer=...,
reward_func=..., formatters=[...], args=IPPOConfig(...), train_dataset=..., eval_dataset=...).train()``.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Callable, Sequence

from evollm.parallel import distributed as dist
from ..algorithms.ippo import IPPOConfig, IPPOTeam
from ..algorithms.ippo_rollout import evaluate_teams, play_teams
from ..envs.team import TeamTask
from evollm.run.population import Population
from .callbacks import Callback
from .data_parallel import reduce_fitness, seed_sampling
from .quarantine import healthy
from .loop import closing_all, evolve, run_callbacks
from .settings import LoopSettings, loop_settings

#: per-agent training metrics copied into the report (averaged since the previous evaluation)
AGENT_METRICS = ("policy_loss", "value_loss", "entropy", "clip_fraction", "explained_variance")


class TeamReport(Callback):
    """Adds per-team success and per-agent columns to the report rows of each evaluation:
    ``success``, ``hp_agent<i>.<name>`` for every per-agent hyperparameter and ``agent<i>.<metric>``
    for the training metrics of :data:`AGENT_METRICS`, averaged over the steps since the previous
    evaluation (read from the run's metrics record, so a resumed run reports the same)."""

    def __init__(self):
        self.success: dict[int, float] = {}

    def on_evaluation(self, state, fitness) -> None:
        record = state.record
        rows = record.rows[-len(state.agents):]
        since = max((r["step"] for r in record.rows[:-len(state.agents)]), default=-1)
        for row, team in zip(rows, state.agents):
            row["success"] = self.success.get(team.index, math.nan)
            row.update({f"hp_{k}": v for k, v in team.agent_hyperparameters().items()})
            steps = [m for m in record.metric_rows if m["member"] == team.index and since < m["step"] <= row["step"]]
            for i in range(team.num_agents):
                for name in AGENT_METRICS:
                    key = f"agent{i}.{name}"
                    values = [v for v in (s.get(key) for s in steps)
                              if isinstance(v, (int, float)) and math.isfinite(v)]
                    row[key] = sum(values) / len(values) if values else math.nan


def team_metrics(team: IPPOTeam, episodes, agent_metrics: Sequence[dict]) -> dict:
    """One team's step metrics: the joint ``mean_reward`` of its training episodes, the sum of its agents'
    losses (``loss``; non-finite quarantines the team) and each agent's own metrics as ``agent<i>.<name>``."""
    returns = [e.episode_return for e in episodes]
    out = {"mean_reward": sum(returns) / len(returns), "loss": sum(m["loss"] for m in agent_metrics)}
    for i, m in enumerate(agent_metrics):
        out.update({f"agent{i}.{k}": v for k, v in m.items()})
    return out


def finetune_ippo(teams: Sequence[IPPOTeam], task: TeamTask, settings: LoopSettings | None = None, *,
                  tournament=None, mutation=None, population: Population | None = None,
                  callbacks: Sequence[Callback] = (), log: Callable[[str], None] | None = None,
                  **options) -> tuple[list, Population]:
    """Train a population of teams on ``task``; returns ``(teams, population)`` like the other loops.
    ``population.report()`` has one row per team per evaluation, with ``success`` and per-agent columns.
    ``settings`` (:class:`~evollm.training.settings.LoopSettings`, or its fields as keywords) are as in
    :func:`~evollm.training.loop.finetune_llm_reasoning` (the task's position in its training rows is saved
    with the run)."""
    s = loop_settings(settings, options, "finetune_ippo")
    seed = s.seed
    sizes = {t.config.rollout_buffer_size for t in teams}
    if len(sizes) > 1:
        raise ValueError(f"teams disagree on rollout_buffer_size {sorted(sizes)}; every team plays the same rows")
    turns = {t.config.num_turns for t in teams} | {task.num_turns}
    if len(turns) > 1:
        raise ValueError(f"num_turns differ between the teams and the task: {sorted(turns)}")
    buffer = sizes.pop()
    dist.init()
    for name, n in (("rollout_buffer_size", buffer), ("the evaluation rows", len(task.eval_rows))):
        if n % dist.num_processes():
            raise ValueError(f"{name} ({n}) does not split over {dist.num_processes()} processes; use a multiple of "
                             "the number of processes")
    report = TeamReport()

    def train_step(agents, step):
        active = healthy(agents)
        rows = dist.shard(task.next_rows(buffer), "rows (rollout_buffer_size)")  # multi-process: this process's share
        seed_sampling(seed, step)
        rollout = play_teams(active, task, rows, training=True)
        results = IPPOTeam.learn_population(active, [rollout.experiences[t.index] for t in active])
        return {t.index: team_metrics(t, rollout.episodes[t.index], r) for t, r in zip(active, results)}

    def evaluate(agents):
        fitness, success = evaluate_teams_data_parallel(agents, task, record=False)
        report.success = {t.index: s for t, s in zip(agents, success)}
        return fitness

    callbacks = run_callbacks([report, *callbacks], s, env=task, mutation=mutation, selection=tournament)
    with closing_all(callbacks):
        return evolve(teams, train_step, evaluate, s, tournament=tournament, mutation=mutation,
                      population=population, callbacks=callbacks, log=log)


def evaluate_teams_data_parallel(teams: Sequence[IPPOTeam], task: TeamTask, record: bool = True
                                 ) -> tuple[list[float], list[float]]:
    """:func:`~evollm.algorithms.ippo_rollout.evaluate_teams`, the evaluation rows split over processes
    (equal shares) and the means averaged, so every process gets the numbers of one whole evaluation."""
    if not dist.is_distributed():
        return evaluate_teams(teams, task, record=record)
    local = copy.copy(task)
    local.eval_rows = dist.shard(task.eval_rows, "evaluation rows")
    fitness, success = evaluate_teams(teams, local, record=False)
    fitness = reduce_fitness(fitness, len(local.eval_rows), len(task.eval_rows))
    success = dist.all_reduce_mean(success).tolist()
    if record:
        for team, f in zip(teams, fitness):
            team.record_fitness(f)
    return fitness, success


class IPPOTrainer:
    """CoMLRL-style trainer for a population of IPPO teams (one team by default) on ONE base model.

    Args:
        model: a model id / path (loaded ONCE with ``AutoModelForCausalLM.from_pretrained(model,
            **model_config)``) or a loaded causal LM; every agent of every team is a LoRA adapter on it.
        tokenizer: its tokenizer (a chat template is used for the conversations).
        reward_func, reward_processor, formatters: see :class:`~evollm.envs.team.TeamTask`.
        args: :class:`~evollm.algorithms.ippo.IPPOConfig`.
        train_dataset, eval_dataset: rows; the evaluation set is the fixed fitness set.
        model_config: keyword arguments of ``from_pretrained`` when ``model`` is a string.
        population_size, hp_config, mutation, tournament, evo_steps: evolve a population of teams
            (``evo_steps=None``: no evolution).
        lora_config: each agent's LoRA config.
        metrics_callback: optional ``callback(population_report_dataframe)`` after each evaluation.
        task_kwargs: further :class:`TeamTask` settings (``reward_turns``, ``success_threshold``, ...).
    """

    def __init__(self, model, tokenizer, reward_func: Callable, formatters, args: IPPOConfig | None = None,
                 train_dataset=None, eval_dataset=None, reward_processor: Callable | None = None,
                 model_config: dict | None = None, population_size: int = 1, hp_config=None, mutation=None,
                 tournament=None, evo_steps: int | None = None, lora_config=None,
                 metrics_callback: Callable | None = None, **task_kwargs):
        if isinstance(model, str):
            from transformers import AutoModelForCausalLM
            model = AutoModelForCausalLM.from_pretrained(model, **(model_config or {}))
        if train_dataset is None:
            raise ValueError("train_dataset is required")
        self.args = args if args is not None else IPPOConfig()
        self.args.validate()
        self.tokenizer = tokenizer
        self.task = TeamTask(train_dataset, eval_dataset, tokenizer, reward_func, formatters,
                             num_turns=self.args.num_turns, reward_processor=reward_processor,
                             max_new_tokens=self.args.max_new_tokens, max_model_len=self.args.max_model_len,
                             seed=self.args.seed, **task_kwargs)
        self.teams = IPPOTeam.population(population_size, model, hp_config=hp_config, init_sampler=None,
                                         tokenizer=tokenizer, config=self.args, lora_config=lora_config)
        self.mutation, self.tournament, self.evo_steps = mutation, tournament, evo_steps
        self.metrics_callback = metrics_callback
        self.population: Population | None = None

    def evaluate(self) -> dict[str, float]:
        """Joint reward and success of every team on the evaluation set (nothing recorded)."""
        fitness, success = evaluate_teams(self.teams, self.task, record=False)
        return {"eval_joint_reward": max(fitness), "eval_success": max(success)}

    def train(self, max_steps: int | None = None, verbose: bool = True) -> tuple[list, Population]:
        """Train; ``max_steps`` defaults to ``num_train_epochs`` passes over ``train_dataset``."""
        a = self.args
        steps = max_steps or max(1, math.ceil(a.num_train_epochs * len(self.task.train_rows) / a.rollout_buffer_size))
        interval = min(a.eval_interval, steps)
        callbacks = []
        if self.metrics_callback is not None:
            user = self.metrics_callback

            class _User(Callback):
                def on_evaluation(self, state, fitness):
                    user(state.record.report())
            callbacks.append(_User())
        evo = self.evo_steps if self.evo_steps is not None and len(self.teams) > 1 else None
        self.teams, self.population = finetune_ippo(
            self.teams, self.task, max_steps=steps, evaluation_interval=interval, evo_steps=evo,
            tournament=self.tournament if evo else None, mutation=self.mutation if evo else None, verbose=verbose,
            seed=a.seed, callbacks=callbacks)
        return self.teams, self.population

    def save_model(self, output_dir: str | Path | None = None) -> Path:
        """Write the report, lineage and the best team's checkpoint under ``output_dir``."""
        out = Path(output_dir or self.args.output_dir)
        if self.population is not None:
            self.population.write(out, plots=False)
            best = self.population.best()
        else:
            best = self.teams[0]
        return best.save_checkpoint(out / "best_team")
