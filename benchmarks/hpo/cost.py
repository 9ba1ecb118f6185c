"""What a population step would cost on a GPU, from a measurement of one (``benchmarks/gpu_population.py``).

On CPU an N-member step costs about N lone-member steps (every row is paid for). On a GPU the members'
completions are generated in one batch, so generation costs about the same for any N, and only the learn
step grows with N. ``--cost-model gpu`` charges every CPU second the population spends with N live members
at ``factor(N) = step(N) / (N * step(1))``, with ``step(N) = G + L * N`` fitted to the measurement: G the
mean generation time over the measured N, L the mean learn time per member. A lone member (the default
run, the tuners' trials, a grid point) is charged 1: its accounting is the CPU budget's, unchanged.

This is a model: the runs are made on CPU, and the GPU measurement had SmolLM2-135M's shapes (16 rows
per member, 64 + 64 tokens, fp32, one H200). The fit charges the population more than the measured ratios
themselves (8 members: 0.21 against 0.17 of 8 lone steps).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MEASUREMENT = Path(__file__).resolve().parents[1] / "results" / "gpu_population_smollm2_cuda_float32.json"


@dataclass(frozen=True)
class StepCost:
    """``step(N) = generate_s + learn_s_per_member * N`` seconds; :meth:`factor` is the charge per CPU second."""

    generate_s: float
    learn_s_per_member: float
    source: str = ""

    def factor(self, members: int) -> float:
        """What a CPU second spent with ``members`` live members is charged: 1 for a lone member."""
        n = max(int(members), 1)
        return (self.generate_s + self.learn_s_per_member * n) / (n * (self.generate_s + self.learn_s_per_member))

    def to_dict(self) -> dict:
        return {"generate_s": self.generate_s, "learn_s_per_member": self.learn_s_per_member, "source": self.source,
                "factor": {n: round(self.factor(n), 4) for n in (1, 2, 4, 8, 16)}}


def fit_step_cost(rows: list[dict], source: str = "") -> StepCost:
    """Fit ``step(N) = G + L * N`` to ``gpu_population.py`` rows (``members``, ``generate_s``, ``learn_s``)."""
    if not rows:
        raise ValueError("the GPU measurement has no rows")
    g = sum(r["generate_s"] for r in rows) / len(rows)
    per_member = sum(r["learn_s"] / r["members"] for r in rows) / len(rows)
    return StepCost(g, per_member, source)


def load_step_cost(path: str | Path = DEFAULT_MEASUREMENT) -> StepCost:
    doc = json.loads(Path(path).read_text())
    return fit_step_cost(doc["rows"], f"{Path(path).name} ({doc.get('device_name', '?')})")


class ChargedClock:
    """This process's CPU seconds, each charged at ``cost.factor(members)`` for the members live while it
    was spent (``cost`` None: charged 1, the CPU clock itself). :meth:`set_members` is told when the
    population's size changes; the seconds before it are charged at the old size. ``timer`` is the raw
    clock: ``time.process_time`` (CPU seconds), or ``time.perf_counter`` for a run on a GPU (``--device
    cuda``: wall seconds, the GPU's time being what the arms share)."""

    def __init__(self, cost: StepCost | None = None, timer=None):
        self.cost = cost
        self.timer = timer or time.process_time
        self.members = 1
        self._raw0 = self._raw_last = self.timer()
        self._charged = 0.0
        self.raw_by_members: dict[int, float] = {}  # CPU seconds spent at each population size

    def raw(self) -> float:
        """Raw seconds (CPU, or wall on a GPU) since the clock started."""
        return self.timer() - self._raw0

    def __call__(self) -> float:
        """Charged seconds since the clock started."""
        now = self.timer()
        spent, self._raw_last = now - self._raw_last, now
        self.raw_by_members[self.members] = self.raw_by_members.get(self.members, 0.0) + spent
        self._charged += spent * (self.cost.factor(self.members) if self.cost else 1.0)
        return self._charged

    def set_members(self, members: int) -> None:
        self()
        self.members = max(int(members), 1)
