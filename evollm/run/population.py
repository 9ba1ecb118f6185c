"""The record of an evolving population: who was born from whom, with which mutation,
which hyperparameters, and every fitness and train-reward measurement.

``report()`` is one row per member per evaluation; ``lineage()`` one row per birth;
``metrics()`` one row per member per training step (learn metrics, timings, throughput, memory);
``selections()`` one row per selection or narrowing (who was kept, who was dropped, and the ranking's
signal-to-noise).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import pandas as pd

from ..utils.atomic import atomic_file, jsonable


def _default_founder(agent) -> bool:
    return bool(getattr(agent, "default_founder", False))


def _hyperparameters(agent) -> dict[str, Any]:
    names = list(agent.hp_config.names()) if getattr(agent, "hp_config", None) is not None else []
    for default in ("lr", "beta", "clip_coef", "lora_rank"):
        if default not in names:
            names.append(default)
    out = {}
    for name in names:
        try:
            value = agent.get_hyperparameter(name)
        except (ValueError, AttributeError, KeyError):
            continue
        out[name] = list(value) if isinstance(value, tuple) else value
    return out


@dataclass
class Birth:
    member: int
    parent: int | None
    generation: int
    step: int
    mutation: str = "none"
    mutation_kind: str = "none"
    old_value: Any = None
    new_value: Any = None
    hyperparameters: dict = field(default_factory=dict)
    default_founder: bool = False  # the founder with the starting hyperparameters, or a clone of its lineage


class Population:
    """History of a population of agents; the agents themselves are in ``members``."""

    def __init__(self, agents: Sequence | None = None, algorithm: str | None = None):
        self.members: list = []
        self.births: list[Birth] = []
        self.rows: list[dict] = []
        self.metric_rows: list[dict] = []  # plain JSON-able dicts, one per member per step
        self.selection_rows: list[dict] = []  # one per selection or narrowing
        self._pair_se: tuple = (None, {})  # (step, paired standard errors by member ids) of the last evaluation
        self.generation = 0
        self.algorithm = algorithm
        #: the best evaluated state of the run (:class:`~evollm.run.best_state.KeptBest`) when the loop
        #: keeps one (``keep_best``), else ``None``
        self.kept = None
        #: the runner-up a narrowing parked for a member that stalls
        #: (:class:`~evollm.run.reserve.Reserve`, ``hpo.narrowing.revive``), else ``None``
        self.reserve = None
        for agent in agents or []:
            self.add_founder(agent)

    # ------------------------------------------------------------------ recording
    def add_founder(self, agent, step: int = 0) -> None:
        self.members.append(agent)
        self.algorithm = self.algorithm or type(agent).__name__
        self.births.append(Birth(agent.index, None, self.generation, step, hyperparameters=_hyperparameters(agent),
                                 default_founder=_default_founder(agent)))

    def record_mutations(self, agents: Sequence, step: int) -> None:
        """Note mutations applied to living members outside selection (the elite under
        ``mutate_elite``, a mutation of founders before training): each is a new lineage row of the
        same member, its parent itself, so the row of its original birth is kept."""
        for agent in agents:
            m = getattr(agent, "last_mutation", None)
            if m is None or m.kind == "none":
                continue
            self.births.append(Birth(agent.index, agent.index, self.generation, step, mutation=m.name or "none",
                                     mutation_kind=m.kind, old_value=_scalar(m.old), new_value=_scalar(m.new),
                                     hyperparameters=_hyperparameters(agent), default_founder=_default_founder(agent)))

    def record_evaluation(self, step: int, agents: Sequence, fitness: Sequence[float],
                          train_rewards: dict[int, float] | None = None, extra: dict[int, dict] | None = None) -> None:
        self._pair_se = (step, dict(getattr(fitness, "pair_se", None) or {}))  # for a ranking at this step
        for agent, f in zip(agents, fitness):
            row = {"step": step, "generation": self.generation, "member": agent.index,
                   "parent": self._birth(agent.index).parent, "fitness": float(f),
                   "train_reward": (train_rewards or {}).get(agent.index, math.nan)}
            row.update({f"hp_{k}": v for k, v in _hyperparameters(agent).items()})
            row.update((extra or {}).get(agent.index, {}))
            self.rows.append(row)

    def record_selection(self, result, step: int, stderr: dict[int, float] | None = None,
                         source: str = "last") -> None:
        """After selection + mutation: register the clones as births of a new generation, and the
        selection itself (scores, who was kept, signal-to-noise; ``stderr``: the standard error of each
        old member's score, by id; ``source``: what the scores are, see :meth:`selections`)."""
        self._selection_row("selection", result, step, stderr, source)
        self.generation += 1
        for agent in result.population:
            if agent.index in result.parents:
                m = getattr(agent, "last_mutation", None)
                self.births.append(Birth(
                    agent.index, result.parents[agent.index], self.generation, step,
                    mutation=(m.name or "none") if m is not None and m.kind != "none" else "none",
                    mutation_kind=m.kind if m is not None else "none",
                    old_value=_scalar(m.old) if m is not None else None,
                    new_value=_scalar(m.new) if m is not None else None,
                    hyperparameters=_hyperparameters(agent), default_founder=_default_founder(agent)))
        self.members = list(result.population)

    def record_narrowing(self, result, step: int, fraction: float, stderr: dict[int, float] | None = None,
                         source: str = "last", tied: bool | None = None, deferred: int = 0, waited: int = 0,
                         demoted: Sequence[int] = (), rates: str | None = None) -> None:
        """A narrowing of the population (``result.dropped`` released for good, ``result.population``
        kept as they are) at ``fraction`` of the budget; ``tied``: the cut fell between equal scores;
        ``deferred``: milestones due that it left for the next evaluation (``hpo.narrowing.on_tie``);
        ``waited``: rankings it waited for a member to learn (``hpo.narrowing.wait_se``); ``demoted``: members
        slower than the starting rate that it ranked last (``hpo.narrowing.slow_se``); ``rates``: the learning
        rates the member kept trains on from here (``"lr 5e-05 -> 7.1e-05"``, ``hpo.narrowing.faster_se``)."""
        self._selection_row("narrowing", result, step, stderr, source, budget_fraction=float(fraction), tied=tied,
                            deferred=int(deferred), waited=int(waited),
                            demoted=" ".join(str(int(i)) for i in demoted), rates=rates)
        self.members = list(result.population)

    def record_revival(self, result, step: int, fraction: float, no_signal: float, reason: str = "stall",
                       rates: str | None = None) -> None:
        """The reserve took over (``hpo.narrowing.revive``): ``reason == "stall"``: ``result.dropped`` (the
        stalled member, parked) gave its place to the reserve in ``result.population``, ``no_signal`` the
        share of its recent steps that had no learning signal; ``"quarantine"``: every member in
        ``result.dropped`` was quarantined (released) and the parked member trains on; ``"anneal"``: the member
        kept trains on at the learning rates ``rates`` describes (``"lr 0.001 -> 0.0005"``)."""
        self._selection_row("revival", result, step, None, "last", budget_fraction=float(fraction),
                            no_signal=float(no_signal), reason=reason, rates=rates)
        self.members = list(result.population)

    def record_rollback(self, result, step: int, fraction: float, copy, parent: int,
                        changed: dict[str, tuple[float, float]]) -> None:
        """A member training alone fell away from the run's best state (``hpo.narrowing.rollback``):
        ``result.dropped`` (released) gave its place to ``copy``, a copy of the best state kept from member
        ``parent`` with its learning rates ``changed`` (``{name: (old, new)}``): a ``revival`` row with
        ``reason == "rollback"`` and a lineage row."""
        self._selection_row("revival", result, step, None, "last", budget_fraction=float(fraction),
                            no_signal=math.nan, reason="rollback",
                            rates=describe_rates(changed))
        old, new = {k: v[0] for k, v in changed.items()} or None, {k: v[1] for k, v in changed.items()} or None
        if len(changed) == 1:  # one rate: plain numbers, as a mutation of one name records them
            (old, new), = changed.values()
        self.births.append(Birth(copy.index, parent, self.generation, step, mutation=",".join(changed) or "none",
                                 mutation_kind="rollback", old_value=old, new_value=new,
                                 hyperparameters=_hyperparameters(copy), default_founder=_default_founder(copy)))
        self.members = list(result.population)

    def revival_events(self) -> dict[str, list[dict]]:
        """What ``summary.json`` lists of the lone member's roll-backs and anneals (``hpo.narrowing``):
        ``{"rollbacks": [{"step", "fell", "copy", "rates"}], "anneals": [{"step", "member", "rates"}]}``, each list
        only when not empty."""
        rows = [r for r in self.selection_rows if r.get("kind") == "revival"]
        out = {"rollbacks": [{"step": int(r["step"]), "fell": int(r["dropped"]), "copy": int(r["kept"]),
                              "rates": r.get("rates") or ""} for r in rows if r.get("reason") == "rollback"],
               "anneals": [{"step": int(r["step"]), "member": int(r["kept"]), "rates": r.get("rates") or ""}
                           for r in rows if r.get("reason") == "anneal"]}
        return {k: v for k, v in out.items() if v}

    def _selection_row(self, kind: str, result, step: int, stderr: dict[int, float] | None, source: str,
                       **extra) -> None:
        from evollm.hpo.selection import selection_signal

        scores = {int(k): float(v) for k, v in (result.scores or {}).items()}
        stderr = {int(k): float(v) for k, v in (stderr or {}).items()}
        signal = selection_signal(list(scores.values()), [stderr.get(k, math.nan) for k in scores],
                                  self._paired(scores, step) if source == "last" else None)
        kept = [int(a.index) for a in result.population]
        row = {"step": int(step), "generation": self.generation, "kind": kind, "source": source,
               "size_before": len(scores), "size_after": len(kept), "best": result.best_index,
               "spread": signal["spread"], "stderr": signal["stderr"], "snr": signal["snr"],
               "paired_stderr": signal["paired_stderr"], "paired_snr": signal["paired_snr"],
               "kept": " ".join(str(i) for i in kept if i in scores),
               "dropped": " ".join(str(int(a.index)) for a in result.dropped
                                   if int(a.index) not in kept),
               "scores": " ".join(f"{k}:{v:.4g}" for k, v in scores.items()),
               "protected": " ".join(str(int(i)) for i in getattr(result, "protected", None) or []),
               "budget_fraction": math.nan, "tied": None}
        row.update(extra)
        self.selection_rows.append(row)

    def _paired(self, scores: dict[int, float], step: int) -> list[float] | None:
        """Paired standard errors between every two ranked members (finite scores) from the evaluation at
        ``step``; ``None`` when it gave none for some pair."""
        at, pair_se = self._pair_se
        ids = [k for k, v in scores.items() if math.isfinite(v)]
        pairs = [pair_se.get((a, b)) for i, a in enumerate(ids) for b in ids[i + 1:]]
        return pairs if at == step and pairs and None not in pairs else None

    def pair_stderrs_at(self, step: int) -> dict[tuple[int, int], float]:
        """The standard errors of the differences between members (by ids), paired over the items both scored,
        of the evaluation at ``step``; ``{}`` when that evaluation gave none."""
        at, pair_se = self._pair_se
        return dict(pair_se) if at == step else {}

    def fitness_stderr(self, index: int) -> list[float]:
        """Standard errors of ``index``'s evaluations, oldest first (NaN where unknown)."""
        return [float(r.get("fitness_se", math.nan)) for r in self.rows if r["member"] == index]

    def record_step(self, step: int, metrics: dict[int, dict]) -> None:
        """One row per member that learnt at ``step`` (``metrics``: member index -> its learn metrics,
        timings, tokens and memory as returned by the loop's ``train_step``)."""
        for index, m in metrics.items():
            row = {"step": int(step), "generation": self.generation, "member": int(index)}
            row.update({k: _scalar(v) for k, v in m.items() if _is_scalar(v) and k not in COST_COLUMNS})
            row.update({k: _scalar(m.get(k, math.nan)) for k in COST_COLUMNS})
            self.metric_rows.append(row)

    def record_evaluation_time(self, step: int, seconds: float) -> None:
        """The wall time of the evaluation run after ``step`` (all members at once), on that step's rows."""
        for row in reversed(self.metric_rows):
            if row["step"] != step:
                break
            row["time_eval_s"] = float(seconds)

    def _birth(self, index: int) -> Birth:
        for b in reversed(self.births):
            if b.member == index:
                return b
        raise KeyError(f"member {index} is not in this population's record")

    # ------------------------------------------------------------------ views
    def report(self) -> pd.DataFrame:
        """One row per member per evaluation: step, generation, member, parent, fitness,
        train_reward, and every hyperparameter as ``hp_<name>``."""
        return typed(pd.DataFrame(self.rows), REPORT_DTYPES)

    def metrics(self) -> pd.DataFrame:
        """One row per member per training step: step, generation, member, every learn metric the
        algorithm returns (loss, kl, clip_fraction, entropy, grad_norm, mean_reward, ...; value_loss
        for PPO), ``time_generate_s``/``time_learn_s``/``time_eval_s``, ``gen_tokens``,
        ``tokens_per_s`` and ``peak_memory_mb`` (README: "What a run directory holds")."""
        return typed(pd.DataFrame(self.metric_rows), METRICS_DTYPES)

    def selections(self) -> pd.DataFrame:
        """One row per selection (``kind == "selection"``), narrowing (``"narrowing"``) or stall swap
        (``"revival"``: the reserve took over, ``reason`` says why: ``stall``: ``dropped`` is the stalled
        member, parked, ``kept`` the reserve that took its place, ``no_signal`` the share of its recent steps
        without a learning signal; ``quarantine``: every member in ``dropped`` was quarantined): step,
        generation, ``source`` of the scores (``last``/``mean``: held-out fitness, ``train``: running
        mean of training rewards), ``size_before``/``size_after``, ``best`` member, ``kept`` and
        ``dropped`` member ids (space-separated; a narrowing's dropped members are released for good),
        ``scores`` (``id:score``, as measured), ``protected`` (the members ranked with the default
        founder's benefit of the doubt, ``hpo.selection.protect_default``), and how well the ranking
        beats noise: ``spread`` (standard deviation of the scores between members), ``stderr`` (root
        mean square of their standard errors) and
        ``snr = spread / stderr`` (below about 1 the ranking is mostly noise), ``paired_stderr`` and
        ``paired_snr`` (the same with the noise of the differences between members paired over the items
        they all scored, which leaves out how hard each item is: the ranking's real signal-to-noise; rankings on
        the last held-out fitness only, NaN otherwise), ``budget_fraction``
        and ``tied`` (narrowings: whether the cut fell between equal scores, so that the tie-break, not the
        measurement, chose which members went on) and ``deferred`` (narrowings: milestones due that the cut
        left for the next evaluation, ``hpo.narrowing.on_tie: one_rung``) and ``waited`` (narrowings: rankings the
        cut waited for a member to learn, ``hpo.narrowing.wait_se``)."""
        return typed(pd.DataFrame(self.selection_rows), SELECTION_DTYPES)

    def lineage(self) -> pd.DataFrame:
        """One row per birth: member, parent, generation, step, mutation (name, kind, old, new) and
        the member's hyperparameters at birth as ``hp_<name>``."""
        rows = []
        for b in self.births:
            d = asdict(b)
            hps = d.pop("hyperparameters")
            d.update({f"hp_{k}": v for k, v in hps.items()})
            rows.append(d)
        return typed(pd.DataFrame(rows), LINEAGE_DTYPES)

    def to_optuna(self, study_name: str, storage: str | None = None, hp_config=None):
        """Export the run as an Optuna study: one trial per member lineage segment, with its
        hyperparameters and fitness, so Optuna's visualisations and importance tools work on it."""
        from evollm.hpo.optuna_utils import population_to_study

        hp_config = hp_config or next((a.hp_config for a in self.members if a.hp_config is not None), None)
        if hp_config is None:
            raise ValueError("to_optuna needs an hp_config (none of the members has one)")
        return population_to_study(self.lineage(), self.report(), hp_config, study_name, storage)

    def best(self, members: Sequence | None = None):
        """The current member (of ``members``, default :attr:`members`) with the highest last fitness,
        among members evaluated since their birth (clones start with an empty fitness history, so an
        unevaluated clone never wins); with a kept best state (``keep_best``) or a member parked by a
        stall swap (``hpo.narrowing.revive``) whose fitness is strictly higher than all of theirs, the
        higher of those."""
        members = list(self.members if members is None else members)
        outside = [e for e in (self.kept, self.reserve) if e is not None and e.beats(members)]
        if outside:
            return max(outside, key=lambda e: e.fitness).member
        scored = [a for a in members if a.fitness]
        return max(scored, key=lambda a: a.fitness[-1]) if scored else members[0]

    def release(self) -> None:
        """Free every member this run still holds on the shared base: the live members, the kept best state
        and a parked reserve (their adapters and optimizer state; the history stays readable). Call it, once
        what you need is saved (``best().save_checkpoint(...)``), before another run on the same model in
        this process: adapters left on the base lengthen its module walks, and each later run is slower.
        Idempotent."""
        for agent in self.members:
            agent.release()
        for held in (self.kept, self.reserve):
            if held is not None and held.member is not None:
                held.member.release()

    # ------------------------------------------------------------------ files
    def write(self, out_dir: str | Path, plots: bool = True) -> dict[str, Path]:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        paths = {"report": out / "report.csv", "lineage": out / "lineage.csv", "metrics": out / "metrics.csv"}
        for key, frame in (("report", self.report()), ("lineage", self.lineage()), ("metrics", self.metrics())):
            write_csv(frame, paths[key])
        if self.selection_rows:
            paths["selections"] = write_csv(self.selections(), out / "selections.csv")
        if plots and self.rows:
            from evollm.run.plots import plot_run
            paths.update(plot_run(self.report(), self.lineage(), self.metrics(), out))
        return paths

    def state_dict(self) -> dict:
        return {"generation": self.generation, "algorithm": self.algorithm,
                "births": [asdict(b) for b in self.births], "rows": self.rows, "metrics": self.metric_rows,
                "selections": self.selection_rows}

    def load_state_dict(self, state: dict) -> None:
        self.generation = state["generation"]
        self.algorithm = state.get("algorithm")
        self.births = [Birth(**b) for b in state["births"]]
        self.rows = list(state["rows"])
        self.metric_rows = list(state.get("metrics", []))
        self.selection_rows = list(state.get("selections", []))

    def save_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.state_dict(), indent=1, default=jsonable))

    def __len__(self) -> int:
        return len(self.members)

    def __iter__(self):
        return iter(self.members)

    def __getitem__(self, i):
        return self.members[i]


#: Column types of the three tables (columns not named here keep pandas' inference). ``parent`` is a
#: nullable integer: founders have none.
REPORT_DTYPES = {"step": "int64", "generation": "int64", "member": "int64", "parent": "Int64",
                 "fitness": "float64", "train_reward": "float64"}
LINEAGE_DTYPES = {"member": "int64", "parent": "Int64", "generation": "int64", "step": "int64",
                  "mutation": "string", "mutation_kind": "string", "default_founder": "boolean"}
#: The cost columns that close every metrics row (see :mod:`evollm.run.measure`).
COST_COLUMNS = ("time_generate_s", "time_learn_s", "time_eval_s", "gen_tokens", "tokens_per_s", "peak_memory_mb")
SELECTION_DTYPES = {"step": "int64", "generation": "int64", "kind": "string", "source": "string",
                    "size_before": "int64", "size_after": "int64", "best": "Int64", "spread": "float64",
                    "stderr": "float64", "snr": "float64", "paired_stderr": "float64",
                    "paired_snr": "float64", "kept": "string", "dropped": "string",
                    "scores": "string", "protected": "string", "budget_fraction": "float64", "tied": "boolean",
                    "deferred": "Int64", "waited": "Int64", "no_signal": "float64", "reason": "string", "rates": "string"}
METRICS_DTYPES = {"step": "int64", "generation": "int64", "member": "int64", "gen_tokens": "Int64"}


def describe_rates(changed: dict[str, tuple[float, float]]) -> str:
    """``{name: (old, new)}`` as one line, e.g. ``"lr 0.001 -> 0.0005"`` ("" when nothing changed).

    >>> describe_rates({"lr_actor": (3e-4, 1.5e-4), "lr_critic": (1e-3, 5e-4)})
    'lr_actor 0.0003 -> 0.00015, lr_critic 0.001 -> 0.0005'
    """
    return ", ".join(f"{n} {old:.3g} -> {new:.3g}" for n, (old, new) in changed.items())


def typed(frame: pd.DataFrame, dtypes: dict[str, str]) -> pd.DataFrame:
    """``frame`` with the given column types (integers stay integers, ``parent`` is ``Int64``) and
    ``hp_lora_rank`` as a nullable integer; unknown columns are left as they are."""
    cols = {c: t for c, t in dtypes.items() if c in frame.columns}
    if "hp_lora_rank" in frame.columns:
        cols["hp_lora_rank"] = "Int64"
    for col, dtype in cols.items():
        if dtype in ("Int64", "int64"):
            values = pd.to_numeric(frame[col], errors="coerce")
            frame[col] = values.astype("Int64" if dtype == "Int64" or values.isna().any() else "int64")
        else:
            frame[col] = frame[col].astype(dtype)
    return frame


def write_csv(frame: pd.DataFrame, path: str | Path) -> Path:
    """Write ``frame`` to ``path`` atomically (a reader or a crash never sees half a file)."""
    with atomic_file(path) as tmp:
        frame.to_csv(tmp, index=False)
    return Path(path)


def _is_scalar(value) -> bool:
    return isinstance(value, (int, float, bool, str)) or (hasattr(value, "item") and getattr(value, "ndim", 0) == 0)


def _scalar(value):
    if isinstance(value, tuple):
        return list(value)
    if hasattr(value, "item"):
        return value.item()
    return value
