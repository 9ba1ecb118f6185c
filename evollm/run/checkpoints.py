"""The run directory's checkpoints: ``<dir>/step_N/`` every ``every`` steps, after every selection, on
SIGINT/SIGTERM and at the end, the newest ``keep`` kept (and always the newest one in which some member
was healthy); each one atomic and manifest-verified (:mod:`evollm.utils.atomic`) and complete enough to
continue the run bit for bit (:mod:`evollm.run.state`). One process writes a checkpoint directory at a
time (:mod:`evollm.run.lock`).

A stop signal (SIGINT/SIGTERM) lets the current step finish and saves it, unless the step is still
running ``stop_grace`` seconds later: then the step is abandoned and the last checkpoint is the one to
resume from. A stop therefore takes at most ``stop_grace`` seconds plus one checkpoint write.

:class:`RunCheckpointer` is a loop :class:`~evollm.training.callbacks.Callback`; with ``resume=True`` it
restores the newest valid checkpoint in ``on_train_begin``.
"""

from __future__ import annotations

import json
import re
import signal
import threading
import time
from pathlib import Path
from typing import Callable

from evollm.utils.atomic import MANIFEST, CheckpointError, clean_temporaries, remove_folder, verify
from evollm.algorithms.checkpoint import check_fingerprint, check_recorded_rank, member_ids
from evollm.run.population_checkpoint import save_population
from .lock import RunLock
from .state import RUN_STATE, read_run_state, restore_components, restore_rng, since_eval_from, write_run_state

STEP_DIR = re.compile(r"^step_(\d+)$")


STOP_GRACE = 20.0  # seconds a stop signal waits for the current step before abandoning it


class RunInterrupted(KeyboardInterrupt):
    """The run stopped on SIGINT/SIGTERM after saving a checkpoint (``.checkpoint``, ``.step``)."""

    def __init__(self, checkpoint: Path | None, step: int | None, signum: int, abandoned: bool = False):
        what = "abandoned its unfinished step" if abandoned else "saved"
        super().__init__(f"interrupted by {signal.Signals(signum).name} ({what}); last checkpoint {checkpoint} "
                         f"(step {step})")
        self.checkpoint, self.step, self.signum, self.abandoned = checkpoint, step, signum, abandoned


def list_checkpoints(directory: str | Path) -> list[tuple[int, Path]]:
    """``(step, folder)`` of every ``step_N`` folder, oldest first (valid or not)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if p.is_dir() and (m := STEP_DIR.match(p.name))]
    return sorted(found)


def newest_valid(directory: str | Path, log: Callable[[str], None] = print, clean: bool = True) -> Path:
    """The newest checkpoint whose manifest verifies; invalid newer ones are reported and skipped.
    ``clean`` removes what killed saves left behind (only the process that holds the run's lock may)."""
    directory = Path(directory)
    if clean:
        clean_temporaries(directory)
    problems = []
    for _, folder in reversed(list_checkpoints(directory)):
        try:
            verify(folder, "population")
            return folder
        except CheckpointError as e:
            problems.append(str(e))
            log(f"evollm: skipping {folder.name}: {e}")
    detail = f" ({len(problems)} invalid: {problems[0]})" if problems else ""
    raise CheckpointError(f"no valid checkpoint in {directory}{detail}")


def healthy_members(folder: Path) -> int | None:
    """How many members of checkpoint ``folder`` were healthy (not quarantined); ``None`` if unknown.
    An incomplete checkpoint (no manifest) counts as 0: nothing can resume from it."""
    if not (folder / MANIFEST).is_file():
        return 0
    try:
        run = json.loads((folder / RUN_STATE).read_text())
    except (OSError, ValueError):
        return None
    count = run.get("healthy_members") if isinstance(run, dict) else None
    return count if isinstance(count, int) else None


def newest_healthy(directory: str | Path) -> Path | None:
    """The newest valid checkpoint in which some member was healthy (or whose health is unknown)."""
    for _, folder in reversed(list_checkpoints(directory)):
        if healthy_members(folder) != 0:
            try:
                verify(folder, "population")
            except CheckpointError:
                continue
            return folder
    return None


class RunCheckpointer:
    """Checkpoint a run into ``directory`` and (with ``resume``) continue it from there.

    Args:
        directory: where ``step_N/`` folders go (``output_dir/checkpoints`` for ``evollm train``).
        every: steps between periodic checkpoints (0: none; selections, signals and the end still save).
        keep: newest checkpoints kept (``None``: all).
        env, mutation, selection, narrowing: objects whose ``state_dict()`` is saved and restored.
        seed: the run seed (recorded). config: the run config as plain data (recorded).
        resume: restore the newest valid checkpoint before the first step.
        handle_signals: on SIGINT/SIGTERM finish the current step, save, and raise :class:`RunInterrupted`;
            a step still running ``stop_grace`` seconds after the signal is abandoned (default
            :data:`STOP_GRACE`, 20 s; ``None``: wait for it).
        lock: hold ``directory/.lock`` while the run goes (:class:`~evollm.run.lock.RunLock`).
    """

    def __init__(self, directory: str | Path, every: int = 0, keep: int | None = 3, *, env=None, mutation=None,
                 selection=None, narrowing=None, seed: int = 0, config: dict | None = None, resume: bool = False,
                 handle_signals: bool = True, log: Callable[[str], None] = print,
                 stop_grace: float | None = STOP_GRACE, lock: bool = True):
        if every < 0 or (keep is not None and keep < 1):
            raise ValueError(f"checkpoint every={every} must be >= 0 and keep={keep} >= 1 or None")
        if stop_grace is not None and not stop_grace > 0:
            raise ValueError(f"stop_grace must be > 0 seconds or None, got {stop_grace}")
        self.stop_grace = stop_grace
        self._lock = RunLock(directory, log=log) if lock else None
        self._alarm = None
        self._saving = False
        self.directory, self.every, self.keep = Path(directory), int(every), keep
        self.env, self.mutation, self.selection, self.narrowing = env, mutation, selection, narrowing
        self.seed, self.config, self.resume = seed, config, resume
        self.handle_signals, self.log = handle_signals, log
        self.last_saved: int | None = None
        self.selected = False
        self.signum: int | None = None
        self._previous: dict[int, object] = {}
        self.timings: list[float] = []

    # ------------------------------------------------------------------ callback events
    def on_train_begin(self, state) -> None:
        if self._lock is not None:
            self._lock.acquire()
        if self.resume:
            self.restore(state)
        self._install_signals()

    def on_step_end(self, state, metrics) -> None:
        pass

    def on_evaluation(self, state, fitness) -> None:
        pass

    def on_selection(self, state, result) -> None:
        self.selected = True

    def saves_after(self, state) -> bool:
        """Whether :meth:`on_step_complete` will write a checkpoint for ``state.step``."""
        due = (self.every and state.step % self.every == 0) or self.selected or state.step == state.max_steps
        return bool(due or self.signum is not None)

    def on_step_complete(self, state) -> None:
        due = self.saves_after(state)
        self.selected = False
        if due:
            path = self.save(state)
            if self.signum is not None:
                self._restore_signals()
                raise RunInterrupted(path, state.step, self.signum)

    def on_train_end(self, state) -> None:
        if self.last_saved != state.step:
            self.save(state)
        self._restore_signals()
        self._disarm()

    # ------------------------------------------------------------------ save / restore
    def save(self, state) -> Path:
        """Checkpoint the run as it is after ``state.step`` completed steps."""
        self._disarm()  # a stop signal's deadline does not cut a checkpoint write short
        self._saving = True
        try:
            return self._save(state)
        finally:
            self._saving = False

    def _save(self, state) -> Path:
        t0 = time.perf_counter()
        folder = self.directory / f"step_{state.step}"
        healthy = sum(not a.quarantined for a in state.agents)

        def run_files(tmp: Path) -> None:
            write_run_state(tmp, step=state.step, max_steps=state.max_steps, seed=self.seed,
                            since_eval=state.since_eval, env=self.env, mutation=self.mutation,
                            selection=self.selection, config=self.config, healthy_members=healthy,
                            narrowing=self.narrowing)

        save_population(list(state.agents), state.record, folder, extra_files=run_files)
        self.last_saved = state.step
        self._rotate()
        self.timings.append(time.perf_counter() - t0)
        return folder

    def _rotate(self) -> None:
        """Keep the newest ``keep`` checkpoints, and the newest healthy one when none of those is."""
        if self.keep is None:
            return
        found = [folder for _, folder in list_checkpoints(self.directory)]
        kept = found[-self.keep:]
        if all(healthy_members(f) == 0 for f in kept):
            kept += [f for f in reversed(found[:-self.keep]) if healthy_members(f) != 0][:1]
        for folder in found:
            if folder not in kept:
                remove_folder(folder)

    def restore(self, state) -> Path:
        """Load the newest valid checkpoint into the live run (members, record, generators, step)."""
        folder = newest_valid(self.directory, self.log)
        population = json.loads((folder / "population.json").read_text())
        run, rng_tensors = read_run_state(folder)
        agents = list(state.agents)
        if not agents:
            raise CheckpointError("cannot resume an empty population")
        check_fingerprint(population.get("base_fingerprint"), agents[0].shared.model, folder)
        restored = restore_members(agents, folder, member_ids(population["members"], folder))
        shared = restored[0].shared
        shared.mark_used(population.get("used_ids", []))
        state.record.load_state_dict({k: v for k, v in population.items()
                                      if k not in ("members", "used_ids", "base_fingerprint")})
        state.record.members = list(restored)
        if getattr(state.record, "kept", None) is not None:  # keep_best: the run's best state comes back too
            state.record.kept.load(folder, restored)
        if getattr(state.record, "reserve", None) is not None:  # hpo.narrowing.revive: the parked runner-up
            state.record.reserve.load(folder, restored)
        restore_components(run, self.env, self.mutation, self.selection, folder, narrowing=self.narrowing)
        restore_rng(run["rng"], rng_tensors)
        state.step, state.agents = run["step"], restored
        state.since_eval = since_eval_from(run)
        self.last_saved = run["step"]
        self.log(f"evollm: resumed from {folder} (step {run['step']})")
        return folder

    def close(self) -> None:
        """Give the signal handlers and the run directory's lock back (called however the run ends)."""
        self._restore_signals()
        self._disarm()
        if self._lock is not None:
            self._lock.release()

    # ------------------------------------------------------------------ signals
    def _install_signals(self) -> None:
        if not self.handle_signals or threading.current_thread() is not threading.main_thread():
            return
        for signum in (signal.SIGINT, signal.SIGTERM):
            self._previous[signum] = signal.signal(signum, self._on_signal)

    def _restore_signals(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _on_signal(self, signum, frame) -> None:
        self.signum = signum
        self._restore_signals()  # a second signal acts at once (the last complete checkpoint stays)
        grace = ""
        if self.stop_grace is not None and hasattr(signal, "setitimer") and not self._saving:
            self._alarm = signal.signal(signal.SIGALRM, self._on_deadline)
            signal.setitimer(signal.ITIMER_REAL, self.stop_grace)
            last = f"step_{self.last_saved}" if self.last_saved is not None else "none yet"
            grace = f" if it ends within {self.stop_grace:g} s (else it is abandoned; last checkpoint: {last})"
        self.log(f"\nevollm: {signal.Signals(signum).name} received: finishing this step{grace}, then saving a "
                 "checkpoint (press Ctrl-C again to stop at once)")

    def _on_deadline(self, signum, frame) -> None:
        self._disarm()
        checkpoint = self.directory / f"step_{self.last_saved}" if self.last_saved is not None else None
        self.log(f"evollm: the step did not end within stop_grace={self.stop_grace:g} s: abandoned")
        raise RunInterrupted(checkpoint, self.last_saved, self.signum or signal.SIGTERM, abandoned=True)

    def _disarm(self) -> None:
        if self._alarm is not None:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self._alarm)
            self._alarm = None


def restore_members(live: list, folder: Path, ids: list[int]) -> list:
    """The checkpoint's members on the live base: a live member with the same id is loaded in place,
    others are cloned from a live member of the same algorithm (keeping its hooks), resized to the saved
    rank and loaded."""
    by_index = {a.index: a for a in live}
    out = [load_member(live, folder / f"member_{index}", index, by_index.get(index)) for index in ids]
    keep = {id(a) for a in out}
    for agent in live:
        if id(agent) not in keep:
            agent.release()
    return out


def load_member(live: list, member_dir: Path, index: int, agent=None):
    """The member saved in ``member_dir`` with id ``index``: loaded into ``agent`` when given, else cloned
    from a live member of the saved algorithm (keeping its hooks) with that id, resized to the saved rank."""
    info_file = member_dir / "agent.json"
    info = json.loads((info_file if info_file.is_file() else member_dir / "team.json").read_text())
    if agent is None:  # cloned from a live member of the saved kind (a population may mix algorithms)
        kind = info.get("algorithm")
        template = next((a for a in live if type(a).__name__ == kind), None)
        if template is None:
            raise CheckpointError(f"checkpoint {member_dir.parent}: member {index} is a {kind}, and the resumed "
                                  f"population has none ({sorted({type(a).__name__ for a in live})}); resume with "
                                  "the population the run was started with")
        template.shared.return_index(index, template.ID_SPACE)  # the same member returns; no other gets its id
        agent = template.clone(index=index)
    rank = info.get("lora_rank")
    if rank is not None and (member_dir / "adapter").is_dir():  # checked against the adapter files
        rank = check_recorded_rank(member_dir, rank)                # before a member of that rank exists
    if rank is not None and rank != agent.lora_rank:
        agent.set_lora_rank(rank)
    agent.load_checkpoint(member_dir, verify_manifest=False)
    return agent
