"""A population that narrows as its budget is spent: successive halving into population-based training.

On one shared base a step costs about what its rows cost, so a population of 8 spends 8x a single
run's compute per step. :class:`Narrowing` drops the worst members at fixed fractions of the budget
(``at``), keeping ``keep`` of them each time (never fewer than ``min_size``), so that the later, longer
part of the run trains only the best members, and each of their steps is cheaper. Between the
milestones the population evolves as usual (selection, mutation).

The budget is the run's step budget (``max_steps``) and, when the run has one, its time budget
(``max_time``, on the loop's clock): the fraction spent is the larger of the two. Members with equal
scores at a cut are ordered by :func:`tie_rank`. The training loop drives the schedule
(:meth:`Narrowing.due`, :meth:`Narrowing.narrow`); the dropped members are released (their adapters and
optimizer state freed on the shared base).
"""
from __future__ import annotations

import math
from typing import Any, Callable, Optional, Sequence

from evollm.hpo.lone import (ANNEAL_LR, ANNEAL_SHARE, DECAYS, DECLINE, DECLINE_SE, MAX_ANNEALS, MAX_ROLLBACKS, ROLLBACK_LR,
                             STALL_NO_SIGNAL, STALL_PATIENCE)


def narrowed_size(size: int, keep: float, min_size: int) -> int:
    """Members left after one narrowing of ``size``: ``ceil(keep * size)``, at least ``min_size``
    (and never more than ``size``). E.g. 8 -> 4 -> 2 with ``keep=0.5``."""
    return min(size, max(min_size, int(math.ceil(keep * size - 1e-9))))


#: what a ranking does when its deepest due cut falls between equal scores (``Narrowing.on_tie``)
ON_TIE = ("cut", "one_rung")
#: what orders equal scores at a cut (``Narrowing.tiebreak``)
TIEBREAKS = ("default_first", "reward")
#: the learning rates a stall swap's reserve trains on (``Narrowing.revive_rate``)
REVIVE_RATES = ("own", "between")
#: how low an anneal may take a learning rate (``Narrowing.anneal_floor``)
ANNEAL_FLOORS = ("range", "start")
#: training steps whose rewards break a narrowing's ties (:func:`recent_reward`)
TIE_WINDOW = 10


def budget_fraction(step: int, max_steps: int, elapsed: Optional[float] = None,
                    max_time: Optional[float] = None) -> float:
    """Share of the budget spent: the larger of ``step / max_steps`` and ``elapsed / max_time``."""
    fraction = step / max_steps
    if max_time is not None and elapsed is not None:
        fraction = max(fraction, elapsed / max_time)
    return fraction


class Narrowing:
    """Drop the worst members at fixed fractions of the budget.

    Args:
        at: fractions of the budget (strictly increasing, in ``(0, 1)``) at which the population
            narrows; default ``(0.05, 0.1, 0.2)``: a population of 8 trains as 8 until the first ranking
            past 5 % of the budget, as 4 until the first past 10 %, as 2 until the first past 20 %, and
            its best member trains alone after that. With rankings on held-out fitness a rung lasts at
            least one evaluation interval, so the cuts come later than the fractions where evaluations
            are sparse. On the HPO benchmark (benchmarks/README.md) the cuts came at 8 %, ~14 % and 21 %
            of the budget on the tiny task and at 15 % (8 -> 2) and 22 % on the game, and the member
            returned had 0.91 and 0.77 of a single run's steps (0.81 and 0.71 with 0.10/0.20/0.35, the
            default until 2026-11-26, which ended at the same scores and was further behind at half
            the budget).
        keep: share of the members kept at each milestone (rounded up), in ``(0, 1)``.
        min_size: never narrow below this many members (at least 1; default 1). Once fewer members
            are left than the selection needs, selection and mutation stop and the rest train on.
        evaluate: with rankings on held-out fitness, a milestone reached between two evaluations
            brings the next evaluation forward to that step (that interval's regular evaluation is not
            repeated), so that the cut falls at its fraction of the budget and the run evaluates as often
            as without. Default ``False``: the cut waits for the next regular evaluation, so each rung
            lasts at least ``evaluation_interval`` steps. Measured on the HPO benchmark
            (benchmarks/README.md, 2026-11-26): alone, the game's and the relay's first cuts came at
            5-7 % of the budget instead of 15-19 % and the final scores did not move; on the arithmetic
            tasks, cut on scores one or two questions apart, they ended 0.03-0.05 lower.
        incumbent: the default founder's lineage is the incumbent: at a cut, a member outside it stays only
            when it is among the best :meth:`target` *and* scores strictly above the best member of that
            lineage; the others are released, so the population may narrow faster than ``keep`` says
            (never below ``min_size``). With nothing better than the starting values on the evidence,
            the compute goes to them. No effect once the lineage is gone. Default ``False``. With
            ``evaluate`` it is the setting for starting values known to be good: the first cut comes at
            5 % of the budget, where greedy scores are often all equal, and the population is then the
            default run with 0.9-1.0 of its steps (measured: level with it on the game, where the
            library's defaults lose 0.05; 0.03-0.04 lower than the defaults where the default lr is far
            off; on SmolLM2, whose better rates show after 25 steps per member, the default run).
        revive: keep the best member each cut releases as a *reserve* (parked on the shared base: memory,
            no compute), and when a member training alone (the schedule finished, selection stopped) has
            :func:`~evollm.hpo.lone.stalled` (``patience`` evaluations without a new best, at least ``no_signal`` of its
            steps without a learning signal, not counting steps whose samples all got the run's best reward:
            :func:`~evollm.hpo.lone.failing_alike`), swap them: the stalled member is parked with its last fitness and the reserve
            trains on in its place, once per run. At the end the run returns the better of the two by
            their last held-out fitness, so a swap never hands back less than the stalled member scored.
            Default ``True``. Why: a lone GRPO member can collapse onto samples that all score alike and
            then has no gradient for the rest of the run (measured on SmolLM2: half the seeds sat on a
            plateau for 450 steps, benchmarks/README.md); keeping two members to the end instead
            (``min_size=2``) halves the survivor's steps and cost 0.02-0.07 on each of the five other tasks.
            With the swap, evollm on SmolLM2 rose by 0.053 +- 0.043 (10 seeds), to 0.021 +- 0.053 below
            the default run.
        revive_rate: the learning rates the reserve trains on after a stall swap: ``"between"`` (the default:
            :func:`~evollm.hpo.lone.rate_between` its own and the stalled member's, the log-midpoint of a rate that
            stalled and one that lost the cut) or ``"own"`` (its founder's). Why: the reserve comes back with a half
            to two thirds of the budget left, and its own rate was chosen for a whole one; on SmolLM2 the stalled
            member is the fast founder that won the first cut (5e-4 to 1e-3) and the reserve often the default
            founder (5e-5), which then ends where a single run at 5e-5 stands two thirds of the way through. Measured
            on SmolLM2 (10 seeds, benchmarks/README.md, "A reserve between two rates"): +0.073 +- 0.049 against
            the reserve at its own rate (5 ahead, 3 behind, 2 level); evollm against the default run +0.039 +-
            0.034 instead of -0.033 +- 0.043. The swap never fires on the other benchmark tasks.
        patience: evaluations without a new best before a member without signal has stalled (default 3).
        no_signal: share of the member's steps over those evaluations that must have had no learning signal
            (default 0.5); for the stall swap a step whose every sample got the run's best reward is solved, not
            without signal.
        rollback: when a member training alone (the schedule finished, selection stopped) has
            :func:`~evollm.hpo.lone.declined` (the mean of its last ``patience`` evaluations since the run's best evaluated
            state more than ``decline`` below it; only a best state measured at or after the last cut or stall swap,
            so a lucky evaluation among several members, or the plateau a swap left, is no member's bar), put a copy of that state (adapters, optimizer state,
            hyperparameters) in its place with ``rollback_lr`` times the lower of its and the fallen
            member's learning rates (a second roll-back lowers the rate again), at most
            ``max_rollbacks`` times per run: exploit and explore, as a population-based step does, against
            the run's own history once no other member is left. It keeps the run's best state as
            ``train.keep_best`` does (and returns it when it measured best). Default ``True``. Why: the first
            cuts favour the member whose play improves fastest, which is often a learning rate that then
            falls back alone (the game: lone survivors at lr 6e-4 to 9e-4 peaked at 0.55-0.70 and ended at
            0.40-0.52; benchmarks/README.md).
        anneal: when a member training alone (the schedule finished, selection stopped) has :func:`~evollm.hpo.lone.plateaued`
            (``patience`` evaluations without a new best since it was last chosen or changed), multiply its learning
            rates by ``anneal_lr`` in place (not below ``anneal_floor``; only once its best is above the run's
            first evaluation, the median over the members, and not while at least ``no_signal`` of its steps since
            had no learning signal: that plateau is the stall swap's, a want of signal, not a rate too coarse), at
            most ``max_anneals`` times per run: PBT's explore step downwards, on the one member left, as a
            learning-rate schedule reduces on a plateau. Default ``True`` (since 2026-11-29, night). Why: the first
            cuts keep the member whose score rises fastest, often a rate above the starting one that then sits on a
            plateau below what a lower rate reaches (the relay's lone members at 3.3e-4 to 9.7e-4: 0.936, the
            default run's 1e-4: 0.949). Measured side by side against the library without it (benchmarks/README.md,
            2026-11-29): the relay +0.011 +- 0.003 (20 seeds; level with the default run after it), chain_calc
            +0.019 +- 0.010, the game +0.004 +- 0.010, and with the signal rule REINFORCE +0.015 +- 0.006 and tiny
            GRPO +0.011 +- 0.009. Before the signal rule it was off by default: on SmolLM2, whose starting rate
            (5e-5) is ten times below its best, it halved the stall swap's reserve on plateaus where most steps had
            no signal, toward that rate (two seeds fell by 0.25 and 0.29); with the rule neither seed anneals.
            Without the floor (``range``) it
            cost the game 0.044 +- 0.029 in runs of 400-700 steps: the game's greedy score is flat for tens of
            steps between jumps, and the anneal halved rates still to jump, the default founder's 1e-4 among them.
        anneal_floor: how low an anneal takes a rate: ``"start"`` (default) not below the rate the run started
            from (the default founder's: the value set in the config, else the algorithm's default), and a member
            at or below it is not annealed, so the starting rate's own lineage trains as a single run would;
            ``"range"`` down to the search range's lower end. With no default founder, ``start`` is the range.
        anneal_share: the share of the budget a plateau must last, in evaluations at the rate the member has been
            evaluated since it was chosen (:func:`~evollm.hpo.lone.plateau_patience`; at least ``patience``; default 0.1, 0:
            ``patience`` alone). Why: with a
            time budget a faster machine makes more evaluations, and three without a new best then come by
            chance during a slow rise: on a machine three times as fast as the one the anneal was measured on
            (about 690 single-run steps in 40 CPU-s instead of 220), REINFORCE members annealed twice from
            2.6e-4 in the first half of the budget, at scores of 0.50-0.60 that the same rate left for 0.8.
            Replayed on the runs the anneal was measured on (20-30 lone evaluations per budget), a tenth fires
            at the same evaluation on 24 of 35 anneals and one to six evaluations later on the other 11 (all 8 of chain_calc's).
        anneal_lr: the factor of an anneal (default 0.5).
        max_anneals: anneals per run at most (default 2).
        decline: the fall, as a share of the best state's fitness, that counts (default 0.1).
        decline_se: the fall must also exceed this many standard errors of the best state's evaluation
            (default 1.5; 0: the share alone). Why: on chain_calc (scores about 0.2, a tenth of which is
            0.02, within one standard error) the share alone rolled back on 7 of 8 seeds, twice on three,
            each time halving the rate; replayed on the runs without roll-backs, 1.5 standard errors leave
            chain_calc's falls alone and keep 8 of the game's 10 (benchmarks/README.md). Beyond those, the
            fall must exceed the best state's own luck: it is the best of every evaluation since the last cut,
            about :func:`~evollm.hpo.lone.expected_max_normal` of their number standard errors above its true
            score on a flat curve (2.0 after 30 evaluations). Without that term, in runs of 40-50 evaluations,
            the rule rolled back the default run's own trajectory on the game on 8 seeds of 20 (a run that
            ends best at that rate), with it on 0 (benchmarks/README.md, "The best of many evaluations is a
            lucky one").
        rollback_lr: factor on the learning rates of a roll-back's copy (default 0.5), not below the
            lower end of their search range.
        max_rollbacks: roll-backs per run at most (default 2).
        on_tie: what a ranking does when several milestones are due at once and the deepest cut would fall
            between equal scores (:meth:`tied_at_cut`: the measurement cannot tell the last member kept from
            the first released). ``"cut"`` acts on every milestone due, the tie-break choosing;
            ``"one_rung"`` acts on one (8 -> 4, not 8 -> 1) and leaves the others due at the next regular
            ranking (with ``evaluate``, too: they do not bring an evaluation forward), so the members kept on
            the tie-break are measured again before the next cut. A cut that is not
            tied, or one whose single rung goes as deep (2 -> 1 either way), is unaffected. Default ``"cut"``.
        tie_se: with ``on_tie="one_rung"``, scores closer than this many standard errors of their difference
            count as tied too (:meth:`tied_at_cut`; default 0: equal scores only). On a small validation set
            (SmolLM2's 40 questions: a standard error of 0.05) the scores of the first ranking are mostly
            within one standard error of each other, and a cut of several rungs on them keeps one member
            on what is mostly noise.
        tiebreak: what orders equal scores at a cut: ``"default_first"`` (:func:`tie_rank`: the default
            founder's lineage, then the recent training rewards) or ``"reward"`` (:func:`recent_reward`
            alone). Default ``"default_first"``.
        wait_se: a cut waits until a member has learnt something the evaluation can see (:func:`~evollm.hpo.horizon.learnt`: a
            held-out score above the run's starting level, the median of its first evaluation, by at least
            ``wait_se`` of that member's standard error), or until ``wait_until`` of the budget; until then
            every member trains on, the tournament waits too (no selection on a ranking that is noise), and
            each ranking looks again. Default 0 (off: cuts act when due); 2 is the value measured. Why it is
            there: on the arithmetic tasks the cuts at 5 % and 10 % came after 10-20 steps per member, on scores
            within about one standard error of the start (signal-to-noise 0.3-0.6); on REINFORCE 4 seeds of 16
            kept rates of 4.7e-5-1.2e-4 that way and ended 0.12-0.25 below the others. With ``wait_se=2``, against
            the same population without it (16-20 seeds, 3 on SmolLM2; benchmarks/README.md, "Cuts that wait for
            a member to learn"): tiny GRPO +0.025 +- 0.020, REINFORCE +0.019 +- 0.021 (both then above the default
            run on 16 seeds of 16), chain_calc +0.004 +- 0.009, the game -0.016 +- 0.021, SmolLM2 -0.100 +- 0.067;
            the relay, whose first ranking already separates the members, never waits. Why it is off: taken
            together that is no gain, so the measured default stays.
        wait_until: the fraction of the budget after which a due cut acts whether or not a member has learnt
            (default ``None``: the last fraction of ``at``), so the search costs at most that share of it.
        pair_cut: a selection among the last two members, where the schedule goes on to one, is that last cut:
            the loser is released and the winner trains alone from there, instead of racing a mutated clone of
            itself to the next milestone. Every selection among two keeps the winner and fills the other place
            with its clone (tournament or truncation), so the pair that reaches the last cut is a member and
            its own copy at another rate, a ranking whose paired signal-to-noise was below 1 on most seeds
            (REINFORCE: 8 of 8; benchmarks/README.md, "the ranking's paired noise"), while the pair halves the
            lineage's steps until that cut (9-10 % of the budget). Default ``True`` (since 2026-12-07; benchmarks/
            README.md, "The last pair" and "The last pair again"): first measured at tiny GRPO +0.012, REINFORCE
            +0.026, the game +0.017 and chain_calc -0.020 +- 0.008 (32 seeds, whose races drifted the rate where it
            paid); with the decay for actor-critic members, on seeds not used before, level or ahead on the six
            tasks where it acts (chain_calc -0.000 +- 0.005 on 16 seeds, REINFORCE +0.016 +- 0.012, tiny GRPO -0.013).
        decay: ``"cosine"``: once every milestone has been acted on, the members left (the lone member, and
            whoever takes its place after a stall swap or roll-back) train at their learning rates times
            :func:`~evollm.hpo.lone.decay_factor`, which falls along a half cosine from 1 where the last cut
            was acted on (``lone_since``) to the run's starting rate (the default founder's) over the member's
            own at the end of the budget (without a default founder: the search range's lower end); a member
            at or below that rate keeps its rate. The factor
            scales the optimizer's groups (critic too), as ``train.lr_cooldown`` does, so the hyperparameters
            keep the rate the cuts found. It replaces the ``anneal``, which does not act while it is on (both
            halved the falling rates again on the plateaus the fall made). ``"auto"`` (the default): the decay
            for members that learn a critic (LLMPPO, IPPO teams; :func:`~evollm.hpo.lone.decays`), the anneal for
            the others: side by side with the anneal, the decay lifted chain_calc, the game with LLMPPO and the
            relay, and cost the GRPO and REINFORCE arithmetic tasks (benchmarks/README.md, "The decay for
            actor-critic members"). ``"none"``: the anneal for every member.
        slow_se: at a cut, a member whose learning rate is below the run's starting one (the default founder's)
            ranks below every faster member unless it scores above the best of them by this many standard errors
            of their difference, paired over the same items (:func:`~evollm.hpo.horizon.demote_slow`): the first
            rankings, a few steps per member, favour slow rates that keep the warm start's answers (short-horizon
            bias). Default 2 (since 2026-12-07; benchmarks/README.md, "Slow rates keep their place only on evidence").
        faster_se: at a cut that leaves one member, when the best member it releases with a learning rate above
            the kept member's scored within this many standard errors of their difference of it (paired over the
            same items; :func:`~evollm.hpo.horizon.within_noise`), the member kept trains on at the rate between the
            two (their geometric mean, :func:`~evollm.hpo.lone.rate_between`): the ranking could not tell them
            apart, and early rankings favour slow rates (short-horizon bias). Only upward. Default 2 (since
            2026-12-07; benchmarks/README.md, "A faster member within noise, at 2 standard errors"). 0: off.
        lift: a lone member the cuts left at or below the run's starting rate (the search found nothing faster to
            keep) trains at ``lift`` times its rates from the last cut, falling along a half cosine to its own rates
            at the end of the budget (:func:`~evollm.hpo.lone.lifted`, :func:`~evollm.hpo.lone.decay_factor`). Default 1
            (off): with 3, the game with REINFORCE +0.029 +- 0.012 over 36 seeds (benchmarks/README.md, "A lift").

    A milestone is acted on at the first step that has a fresh ranking (an evaluation, or any step
    when the selection ranks on training rewards) at or after it. Several milestones crossed at once
    narrow several times. The state (milestones passed, budget time spent) is saved with run
    checkpoints, so a resumed run narrows where the original would have.
    """

    def __init__(self, at: Sequence[float] = (0.05, 0.1, 0.2), keep: float = 0.5, min_size: int = 1,
                 evaluate: bool = False, incumbent: bool = False, revive: bool = True,
                 patience: int = STALL_PATIENCE, no_signal: float = STALL_NO_SIGNAL, rollback: bool = True,
                 decline: float = DECLINE, rollback_lr: float = ROLLBACK_LR, max_rollbacks: int = MAX_ROLLBACKS,
                 decline_se: float = DECLINE_SE, on_tie: str = "cut", tiebreak: str = "default_first",
                 tie_se: float = 0.0, anneal: bool = True, anneal_lr: float = ANNEAL_LR,
                 max_anneals: int = MAX_ANNEALS, anneal_share: float = ANNEAL_SHARE, wait_se: float = 0.0,
                 wait_until: Optional[float] = None, revive_rate: str = "between", pair_cut: bool = True,
                 anneal_floor: str = "start", decay: str = "auto", slow_se: float = 2.0,
                 faster_se: float = 2.0, lift: float = 1.0) -> None:
        at = [float(a) for a in at]
        if not at:
            raise ValueError("Narrowing.at must name at least one fraction of the budget")
        if any(not 0.0 < a < 1.0 for a in at) or any(b <= a for a, b in zip(at, at[1:])):
            raise ValueError(f"Narrowing.at must be strictly increasing fractions in (0, 1), got {at}")
        if not 0.0 < keep < 1.0:
            raise ValueError(f"Narrowing.keep must be in (0, 1), got {keep!r}")
        if int(min_size) < 1:
            raise ValueError(f"Narrowing.min_size must be >= 1, got {min_size!r}")
        if int(patience) < 1:
            raise ValueError(f"Narrowing.patience must be >= 1 evaluation, got {patience!r}")
        if not 0.0 <= float(no_signal) <= 1.0:
            raise ValueError(f"Narrowing.no_signal must be a share in [0, 1], got {no_signal!r}")
        if not 0.0 < float(decline) < 1.0:
            raise ValueError(f"Narrowing.decline must be a share in (0, 1), got {decline!r}")
        if not float(decline_se) >= 0.0:
            raise ValueError(f"Narrowing.decline_se must be >= 0 standard errors, got {decline_se!r}")
        if not 0.0 < float(rollback_lr) <= 1.0:
            raise ValueError(f"Narrowing.rollback_lr must be a factor in (0, 1], got {rollback_lr!r}")
        if int(max_rollbacks) < 0:
            raise ValueError(f"Narrowing.max_rollbacks must be >= 0, got {max_rollbacks!r}")
        if on_tie not in ON_TIE:
            raise ValueError(f"Narrowing.on_tie must be one of {list(ON_TIE)}, got {on_tie!r}")
        if revive_rate not in REVIVE_RATES:
            raise ValueError(f"Narrowing.revive_rate must be one of {list(REVIVE_RATES)}, got {revive_rate!r}")
        if tiebreak not in TIEBREAKS:
            raise ValueError(f"Narrowing.tiebreak must be one of {list(TIEBREAKS)}, got {tiebreak!r}")
        if not 0.0 < float(anneal_lr) <= 1.0:
            raise ValueError(f"Narrowing.anneal_lr must be a factor in (0, 1], got {anneal_lr!r}")
        if int(max_anneals) < 0:
            raise ValueError(f"Narrowing.max_anneals must be >= 0, got {max_anneals!r}")
        if anneal_floor not in ANNEAL_FLOORS:
            raise ValueError(f"Narrowing.anneal_floor must be one of {list(ANNEAL_FLOORS)}, got {anneal_floor!r}")
        if decay not in DECAYS:
            raise ValueError(f"Narrowing.decay must be one of {list(DECAYS)}, got {decay!r}")
        if not 0.0 <= float(anneal_share) < 1.0:
            raise ValueError(f"Narrowing.anneal_share must be a share of the budget in [0, 1), got {anneal_share!r}")
        if not float(tie_se) >= 0.0:
            raise ValueError(f"Narrowing.tie_se must be >= 0 standard errors, got {tie_se!r}")
        if not float(wait_se) >= 0.0:
            raise ValueError(f"Narrowing.wait_se must be >= 0 standard errors, got {wait_se!r}")
        if not float(slow_se) >= 0.0:
            raise ValueError(f"Narrowing.slow_se must be >= 0 standard errors, got {slow_se!r}")
        if not float(faster_se) >= 0.0:
            raise ValueError(f"Narrowing.faster_se must be >= 0 standard errors, got {faster_se!r}")
        if not float(lift) >= 1.0:
            raise ValueError(f"Narrowing.lift must be a factor >= 1 (1: off), got {lift!r}")
        if wait_until is not None and not 0.0 < float(wait_until) <= 1.0:
            raise ValueError(f"Narrowing.wait_until must be a fraction of the budget in (0, 1], got {wait_until!r}")
        self.at = tuple(at)
        self.keep = float(keep)
        self.min_size = int(min_size)
        self.evaluate = bool(evaluate)
        self.incumbent = bool(incumbent)
        self.revive, self.revive_rate = bool(revive), revive_rate
        self.patience = int(patience)
        self.no_signal = float(no_signal)
        self.rollback, self.decline, self.decline_se = bool(rollback), float(decline), float(decline_se)
        self.rollback_lr, self.max_rollbacks = float(rollback_lr), int(max_rollbacks)
        self.on_tie, self.tiebreak, self.tie_se = on_tie, tiebreak, float(tie_se)
        self.anneal, self.anneal_lr, self.max_anneals = bool(anneal), float(anneal_lr), int(max_anneals)
        self.anneal_share, self.anneal_floor = float(anneal_share), anneal_floor
        self.wait_se = float(wait_se)
        self.wait_until = float(wait_until) if wait_until is not None else self.at[-1]
        self.pair_cut = bool(pair_cut)
        self.decay = decay
        self.slow_se = float(slow_se)
        self.faster_se = float(faster_se)
        self.lift = float(lift)
        self.lone_since: Optional[float] = None  # budget fraction at which the last cut was acted on (decay, lift)
        self.passed = 0  # milestones acted on
        self.deferred = 0  # milestones due that the last cut left for the next regular ranking (on_tie)
        self.elapsed_s = 0.0  # budget-clock seconds spent before this process started (resume)
        self.waited = 0  # rankings the due cut has waited for a member to learn (wait_se)

    def due(self, fraction: float) -> int:
        """How many milestones not yet acted on ``fraction`` has reached."""
        return sum(1 for a in self.at[self.passed:] if fraction >= a - 1e-12)

    def waits(self, fraction: float, has_learnt: bool) -> bool:
        """Whether a cut due at ``fraction`` of the budget waits (``wait_se``): no member has learnt yet
        (``has_learnt``, :func:`~evollm.hpo.horizon.learnt`) and ``wait_until`` is not reached."""
        return self.wait_se > 0.0 and not has_learnt and fraction < self.wait_until - 1e-12

    def cuts_pair(self, size: int) -> bool:
        """Whether a selection among ``size`` members is the last cut instead (``pair_cut``): two members
        are left and the milestones not yet acted on narrow them to one."""
        return self.pair_cut and size == 2 and self.target(size, self.remaining) == 1

    @property
    def remaining(self) -> int:
        """Milestones not yet acted on."""
        return len(self.at) - self.passed

    def target(self, size: int, milestones: int) -> int:
        """Population size after acting on ``milestones`` milestones from ``size``."""
        for _ in range(milestones):
            size = narrowed_size(size, self.keep, self.min_size)
        return size

    def sizes(self, size: int) -> list[int]:
        """The population size in each stage of the schedule, from ``size`` (e.g. ``[8, 4, 2]``)."""
        out = [size]
        for _ in self.at:
            out.append(narrowed_size(out[-1], self.keep, self.min_size))
        return out

    def narrow(self, population: Sequence[Any], score: Callable[[Any], float],
               milestones: int, tiebreak: Optional[Callable[[Any], float]] = None,
               stderr: Optional[Callable[[Any], float]] = None) -> tuple[list, list]:
        """``(kept, dropped)`` after acting on ``milestones`` milestones (one, with ``on_tie="one_rung"``,
        when the deeper cut would fall between scores the measurement cannot tell apart: :meth:`is_tied`,
        with ``stderr`` giving each member's standard error): members ranked by ``score`` (higher is
        better; NaN last), equal scores by ``tiebreak`` (the training loop's: :meth:`tie_key`; higher is
        better, NaN last), then by the lower id; the best :meth:`target` kept in their original order.
        Marks the milestones acted on as passed."""
        population = list(population)

        def higher_first(value: float) -> float:
            value = float(value)
            return -(value if not math.isnan(value) else -math.inf)

        def key(agent):
            second = higher_first(tiebreak(agent)) if tiebreak is not None else 0.0
            return (higher_first(score(agent)), second, int(agent.index))

        ranked = sorted(population, key=key)
        size = self.target(len(population), milestones)
        self.deferred = 0
        if self.on_tie == "one_rung" and self.target(len(population), 1) > size > 0 and self.is_tied(
                ranked[:size], ranked[size:], score, stderr):
            self.deferred = milestones - 1  # no evidence for the deeper cut: one rung now, the rest at the next ranking
            milestones, size = 1, self.target(len(population), 1)
        self.passed = min(len(self.at), self.passed + milestones)
        chosen = ranked[:size]
        defaults = [a for a in population if getattr(a, "default_founder", False)]
        if self.incumbent and defaults:
            bar = max(_finite_or(score(a), -math.inf) for a in defaults)
            better = [a for a in chosen if getattr(a, "default_founder", False) or _finite_or(score(a), -math.inf) > bar]
            chosen = better if len(better) >= self.min_size else ranked[:max(self.min_size, 1)]
        best = {id(a) for a in chosen}
        return [a for a in population if id(a) in best], [a for a in population if id(a) not in best]

    def tie_key(self) -> Callable[[Any], float]:
        """The tie-break ``tiebreak`` names: :func:`tie_rank` or :func:`recent_reward`."""
        return tie_rank if self.tiebreak == "default_first" else recent_reward

    def is_tied(self, kept: Sequence[Any], dropped: Sequence[Any], score: Callable[[Any], float],
                stderr: Optional[Callable[[Any], float]] = None) -> bool:
        """Whether a cut between members ``kept`` and ``dropped`` falls within the measurement's reach:
        :meth:`tied_at_cut` on their scores, with ``tie_se`` standard errors of tolerance (``stderr``: each
        member's; without them, equal scores only)."""
        def errors(members):
            return [stderr(a) for a in members] if stderr is not None else None
        return self.tied_at_cut([score(a) for a in kept], [score(a) for a in dropped], errors(kept), errors(dropped),
                                self.tie_se)

    @staticmethod
    def tied_at_cut(kept_scores: Sequence[float], dropped_scores: Sequence[float],
                    kept_se: Optional[Sequence[float]] = None, dropped_se: Optional[Sequence[float]] = None,
                    z: float = 0.0) -> bool:
        """Whether a cut fell between equal scores: the worst kept member scored exactly what the best
        dropped one did, so the tie-break (the default founder's lineage, the recent training rewards,
        the lower id), not the measurement, chose between them.

        >>> Narrowing.tied_at_cut([0.25, 0.25], [0.25, 0.25])  # every member alike: no information
        True
        >>> Narrowing.tied_at_cut([0.44, 0.25], [0.25, 0.20])
        True
        >>> Narrowing.tied_at_cut([0.44, 0.30], [0.25, 0.25])
        False

        With ``z`` > 0 and the standard errors of the scores (``kept_se``, ``dropped_se``, in the same order), a
        cut also counts as tied when the worst kept member is less than ``z`` standard errors of the difference
        above the best dropped one (``sqrt(se_kept**2 + se_dropped**2)``; unknown errors: equal scores only):

        >>> Narrowing.tied_at_cut([0.15, 0.10], [0.075, 0.05], [0.057, 0.048], [0.042, 0.035], z=1.0)  # 0.025 < 0.064
        True
        >>> Narrowing.tied_at_cut([0.62, 0.61], [0.52, 0.51], [0.034, 0.034], [0.035, 0.035], z=1.0)  # 0.09 > 0.049
        False
        """
        kept = [(s, e) for s, e in zip(kept_scores, kept_se or [math.nan] * len(kept_scores)) if not math.isnan(s)]
        dropped = [(s, e) for s, e in zip(dropped_scores, dropped_se or [math.nan] * len(dropped_scores))
                   if not math.isnan(s)]
        if not (kept and dropped):
            return False
        (worst, worst_se), (best, best_se) = min(kept), max(dropped)
        margin = float(z) * math.sqrt(float(worst_se) ** 2 + float(best_se) ** 2) if z > 0 else math.nan
        return worst == best or (math.isfinite(margin) and worst - best < margin)

    def state_dict(self) -> dict:
        """Milestones passed, budget seconds spent, the milestones the last cut deferred, the rankings the
        due cut has waited and the budget fraction at which the last cut left the members alone (JSON)."""
        return {"passed": self.passed, "elapsed_s": self.elapsed_s, "deferred": self.deferred, "waited": self.waited,
                "lone_since": self.lone_since}

    def load_state_dict(self, state: dict) -> None:
        self.passed = int(state["passed"])
        self.deferred = int(state.get("deferred", 0))
        self.elapsed_s = float(state.get("elapsed_s", 0.0))
        self.waited = int(state.get("waited", 0))
        since = state.get("lone_since")
        self.lone_since = float(since) if since is not None else None

    def __repr__(self) -> str:
        return (f"Narrowing(at={list(self.at)}, keep={self.keep}, min_size={self.min_size}, evaluate={self.evaluate}, "
                f"incumbent={self.incumbent}, revive={self.revive}, revive_rate={self.revive_rate!r}, "
                f"patience={self.patience}, no_signal={self.no_signal}, "
                f"rollback={self.rollback}, decline={self.decline}, rollback_lr={self.rollback_lr}, "
                f"max_rollbacks={self.max_rollbacks}, on_tie={self.on_tie!r}, tiebreak={self.tiebreak!r}, "
                f"tie_se={self.tie_se}, anneal={self.anneal}, anneal_lr={self.anneal_lr}, max_anneals={self.max_anneals}, "
                f"anneal_share={self.anneal_share}, anneal_floor={self.anneal_floor!r}, wait_se={self.wait_se}, wait_until={self.wait_until}, "
                f"pair_cut={self.pair_cut}, decay={self.decay!r}, slow_se={self.slow_se}, faster_se={self.faster_se}, lift={self.lift})")

    @property
    def finished(self) -> bool:
        """Whether every milestone has been acted on (the population is at its final size)."""
        return self.passed >= len(self.at)


def _finite_or(value: float, default: float) -> float:
    value = float(value)
    return default if math.isnan(value) else value


def tie_rank(agent) -> float:
    """What orders members with equal held-out scores at a narrowing (higher first): the default founder's
    lineage (``algorithm.default_founder``: the founder with the starting values, and its clones) before
    every other member, then :func:`recent_reward`. Greedy evaluation is coarse (a game's greedy play may
    not change for dozens of steps, so every member scores the base model's fitness): with nothing to
    tell them apart the run a user would get without a search stays, and among the others the rewards
    already collected, not the order the founders were drawn in, choose."""
    return math.inf if getattr(agent, "default_founder", False) else recent_reward(agent)


def recent_reward(agent, window: int = TIE_WINDOW) -> float:
    """Mean training reward of ``agent``'s last ``window`` steps, NaN when it has none."""
    values = [v for v in (getattr(agent, "scores", None) or [])[-window:] if not math.isnan(v)]
    return sum(values) / len(values) if values else math.nan
