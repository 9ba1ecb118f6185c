"""The reserve of a narrowing population: the best member a cut released, parked for a member that stalls
(``hpo.narrowing.revive``).

A narrowed population trains its survivor alone. When that member stops learning (a GRPO policy whose
samples all score alike has no gradient: :func:`evollm.hpo.lone.stalled`), nothing is left to replace
it. The reserve is the runner-up of the latest cut, kept on the shared base (its adapters and optimizer
state: memory, no compute). On a stall the loop swaps them once: the reserve trains on in the stalled
member's place and the stalled member is parked with its last fitness. :meth:`Population.best` then
returns the parked member when its last fitness is strictly above every live member's, so a swap never
hands back less than the stalled member measured.

When every live member is quarantined (a lone survivor whose learning rate blows its adapter up), the
parked member is healthy and takes over (:meth:`rescue`): the run goes on instead of stopping with
:class:`~evollm.training.quarantine.PopulationDiverged`. That is the reserve's last use: after it
nothing is parked.

The reserve is saved with every run checkpoint (``reserve/``, the member file format plus
``reserve.json``; ``reserve.json`` alone once the reserve is used up) and restored on resume.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

from .best_state import beats_members, read_parked, write_parked

RESERVE_DIR = "reserve"
RESERVE_FILE = "reserve.json"


class Reserve:
    """The parked member (``member``; ``None`` before a cut) and whether the once-per-run swap happened."""

    def __init__(self) -> None:
        self.member = None
        self.swapped_step: int | None = None  # completed steps at the swap; None: not yet
        self.revived: int | None = None  # id of the member the swap brought back
        self.rescued_step: int | None = None  # completed steps when it replaced a quarantined population
        self.rescued: int | None = None  # id of the member that did

    @property
    def swapped(self) -> bool:
        return self.swapped_step is not None

    def park(self, member) -> None:
        """Keep ``member`` (released from the population by a cut) as the reserve, releasing the one
        parked before; after the swap or a rescue nothing more is parked (``member`` is released)."""
        if self.swapped or self.used_up:
            member.release()
            return
        if self.member is not None:
            self.member.release()
        self.member = member

    def swap(self, stalled, step: int):
        """Park ``stalled`` and return the reserve, which trains on in its place (once per run)."""
        if self.member is None or self.swapped:
            raise RuntimeError("the reserve has no member to swap in")
        revived, self.member = self.member, stalled
        self.swapped_step, self.revived = int(step), int(revived.index)
        return revived

    def rescue(self, step: int):
        """Return the parked member to train in place of a population whose every member is quarantined;
        the reserve is then used up (nothing parked, no further swap)."""
        if self.member is None:
            raise RuntimeError("the reserve has no member to bring back")
        member, self.member = self.member, None
        self.rescued_step, self.rescued = int(step), int(member.index)
        return member

    @property
    def used_up(self) -> bool:
        """Whether the reserve can no longer change the run (rescued; nothing left to park or swap)."""
        return self.rescued_step is not None

    @property
    def fitness(self) -> float:
        """The parked member's last fitness (``-inf`` when it has none)."""
        if self.member is None or not self.member.fitness:
            return -math.inf
        value = float(self.member.fitness[-1])
        return -math.inf if math.isnan(value) else value

    def beats(self, members: Sequence) -> bool:
        """After the swap: whether the parked (stalled) member's last fitness is strictly above every
        evaluated live member's."""
        return self.swapped and self.member is not None and beats_members(self.fitness, members)

    def info(self) -> dict:
        """``{member, swapped_step, revived, rescued_step, rescued}`` (JSON; ``member`` is ``None`` once the
        reserve is used up)."""
        return {"member": None if self.member is None else int(self.member.index), "swapped_step": self.swapped_step,
                "revived": self.revived, "rescued_step": self.rescued_step, "rescued": self.rescued}

    # ------------------------------------------------------------------ checkpoints
    def save(self, folder: Path) -> None:
        """Write the parked member into ``folder/reserve/`` (part of a run checkpoint)."""
        if self.member is not None or self.used_up:  # used up: that alone, so a resumed run does not park again
            write_parked(self.member, folder, RESERVE_DIR, RESERVE_FILE, self.info())

    def load(self, folder: Path, live: Sequence) -> None:
        """Restore the reserve of checkpoint ``folder`` onto the base of ``live``; a checkpoint without one
        leaves the reserve empty."""
        if self.member is not None:
            self.member.release()
        self.member, self.swapped_step, self.revived, self.rescued_step, self.rescued = None, None, None, None, None
        found = read_parked(folder, RESERVE_DIR, RESERVE_FILE, live)
        if found is None:
            return
        self.member, info = found
        self.swapped_step, self.revived = info.get("swapped_step"), info.get("revived")
        self.rescued_step, self.rescued = info.get("rescued_step"), info.get("rescued")
