"""The reserve of a narrowing population: the best member a cut released, parked for a member that stalls
(``hpo.narrowing.revive``).

A narrowed population trains its survivor alone. When that member stops learning (a GRPO policy whose
samples all score alike has no gradient: :func:`evollm.hpo.narrowing.stalled`), nothing is left to replace
it. The reserve is the runner-up of the latest cut, kept on the shared base (its adapters and optimizer
state: memory, no compute). On a stall the loop swaps them once: the reserve trains on in the stalled
member's place and the stalled member is parked with its last fitness. :meth:`Population.best` then
returns the parked member when its last fitness is strictly above every live member's, so a swap never
hands back less than the stalled member measured.

The reserve is saved with every run checkpoint (``reserve/``, the member file format plus
``reserve.json``) and restored on resume.
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

    @property
    def swapped(self) -> bool:
        return self.swapped_step is not None

    def park(self, member) -> None:
        """Keep ``member`` (released from the population by a cut) as the reserve, releasing the one
        parked before; after the swap nothing more is parked (``member`` is released)."""
        if self.swapped:
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
        return {"member": int(self.member.index), "swapped_step": self.swapped_step, "revived": self.revived}

    # ------------------------------------------------------------------ checkpoints
    def save(self, folder: Path) -> None:
        """Write the parked member into ``folder/reserve/`` (part of a run checkpoint)."""
        if self.member is not None:
            write_parked(self.member, folder, RESERVE_DIR, RESERVE_FILE, self.info())

    def load(self, folder: Path, live: Sequence) -> None:
        """Restore the reserve of checkpoint ``folder`` onto the base of ``live``; a checkpoint without one
        leaves the reserve empty."""
        if self.member is not None:
            self.member.release()
        self.member, self.swapped_step, self.revived = None, None, None
        found = read_parked(folder, RESERVE_DIR, RESERVE_FILE, live)
        if found is not None:
            self.member, info = found
            self.swapped_step, self.revived = info.get("swapped_step"), info.get("revived")
