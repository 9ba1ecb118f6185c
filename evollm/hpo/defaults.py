"""Default search ranges: what a population evolves when the user names a model and a task and nothing else.

The ranges are for LoRA members. A LoRA adapter's best learning rate is about ten times that of full
fine-tuning (the adapter starts at zero and its ``B`` matrix sees a small fraction of the gradient), so
the default learning-rate range spans 1e-5 .. 1e-3 on a log scale: full fine-tuning's 1e-6 .. 1e-4, times
ten. A decade of margin above (up to 1e-2) was the default before, and it cost more than it found: on the
HPO benchmark (benchmarks/README.md) the short first rungs of the narrowing schedule favour the member
whose rewards rise fastest, and above 1e-3 that member then collapsed (LLMPPO on the game at 1e-3 and
3e-3, SmolLM2 with GRPO at 3.6e-3: held-out score 0) while the tiny model's best lr, 6e-4, is inside.
A cap at 5e-4 (below every best fixed rate measured but the tiny tasks' 6e-4) was measured too and left
out: level across five small tasks (+0.003, -0.004, -0.012, +0.008, +0.006 against this range) and -0.069 on
SmolLM2, which then kept its default rate on every seed (benchmarks/README.md, "a search range capped at 5e-4").

:data:`DEFAULT_RANGES` gives a sensible range to every hyperparameter a user may evolve by name only
(``hpo.hp_config: {beta: {}}`` in YAML); :data:`DEFAULT_EVOLVED` lists the ones evolved when no
``hp_config`` is given at all: only the policy's learning rate (an actor-critic's critic keeps its
default rate). Why only that:

* the learning rate is the setting whose best value moves most between models and tasks (decades);
* the critic's rate is invisible to the first rungs, which rank members on how the policy plays, and
  a bad one shows only later: on the HPO benchmark's game (LLMPPO, 10 seeds) evolving ``lr_actor`` alone
  ended at 0.660, evolving ``lr_actor`` and ``lr_critic`` at 0.664 and 0.560 in two runs, the lowest
  lineages of those at lr_critic 8.7e-4 (0.062, 0.469) and 1.9e-5 (0.352), none below 0.477 with the
  critic at its default; a critic that followed the actor's evolved rate was level without the anneal (the
  relay, the game, chain_calc) and cost the game 0.038 +- 0.025 with it, which then halved the critic's rate too;
* ``beta > 0`` adds a reference forward to every step (about a third more compute), and the current
  default of the GRPO family is ``beta = 0`` (DAPO, Dr. GRPO, TRL);
* the clip range only binds on the second and later minibatches of a step, and a small population
  covers one dimension far better than four (with ``perturb="one"`` each extra name halves how often
  the learning rate moves).
"""
from __future__ import annotations

from typing import Iterable

from evollm.hpo.parameters import HyperparameterConfig, RLParameter

#: LoRA learning rates: log-uniform over 1e-5 .. 1e-3 (full fine-tuning's best, times ten)
LORA_LR = dict(min=1e-5, max=1e-3, log=True)

#: A sensible range for every hyperparameter that may be named without one.
DEFAULT_RANGES: dict[str, dict] = {
    "lr": LORA_LR, "lr_actor": LORA_LR, "lr_critic": LORA_LR,
    "actor_learning_rate": LORA_LR, "critic_learning_rate": LORA_LR,
    "beta": dict(min=0.0, max=0.05),            # KL coefficient; 0 is the GRPO family's default
    "clip_coef": dict(min=0.1, max=0.3),        # PPO's 0.2 +- 0.1
    "clip_low": dict(min=0.1, max=0.3),
    "clip_high": dict(min=0.1, max=0.4),        # DAPO's clip-higher 0.28 inside
    "temperature": dict(min=0.7, max=1.2),
    "max_grad_norm": dict(min=0.1, max=10.0, log=True),
    "ent_coef": dict(min=0.0, max=0.02),
    "entropy_coef": dict(min=0.0, max=0.02),
    "vf_coef": dict(min=0.25, max=1.0),
    "value_loss_coef": dict(min=0.25, max=1.0),
    "gae_lambda": dict(min=0.9, max=1.0),
    "lora_rank": dict(min=4, max=32, dtype=int),
}

#: The learning-rate names (a roll-back scales these: ``hpo.narrowing.rollback``)
LEARNING_RATES: tuple[str, ...] = tuple(n for n, r in DEFAULT_RANGES.items() if r is LORA_LR)

#: What a population evolves when no hp_config is given: the policy's learning rate (PPO: the actor's;
#: ``lr`` is then an alias of ``lr_actor`` and left out; the critic keeps its default rate).
DEFAULT_EVOLVED: tuple[str, ...] = ("lr_actor", "actor_learning_rate", "lr")


def default_range(name: str) -> RLParameter:
    """The default :class:`RLParameter` of ``name`` (one line error for a name without one)."""
    if name not in DEFAULT_RANGES:
        raise ValueError(f"no default range for hyperparameter {name!r}; give min and max "
                         f"(names with a default: {sorted(DEFAULT_RANGES)})")
    return RLParameter(**DEFAULT_RANGES[name])


def default_hp_config(evolvable: Iterable[str], fixed: Iterable[str] = ()) -> HyperparameterConfig | None:
    """The default search space of an agent that can evolve ``evolvable`` (e.g. ``GRPO.MUTABLE``):
    its policy's learning rate (:data:`DEFAULT_EVOLVED`) with its LoRA range, except the names in ``fixed``
    (values the user set: they are kept for every member). ``None`` when nothing is left."""
    evolvable, fixed = set(evolvable), set(fixed)
    names = [n for n in DEFAULT_EVOLVED if n in evolvable]
    if "lr_actor" in names and "lr" in names:  # PPO: lr is an alias of lr_actor
        names.remove("lr")
    if "lr" in fixed:  # the alias fixes the actor's rate too
        fixed.add("lr_actor")
    names = [n for n in names if n not in fixed]
    return HyperparameterConfig(**{n: default_range(n) for n in names}) if names else None
