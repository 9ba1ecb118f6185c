"""A mutation hook that raises stops the run with an error naming the hook and the member."""

import pytest
from conftest import make_grpo

from evollm.algorithms.base import MutationHookError
from evollm.hpo import HyperparameterConfig, Mutations, RLParameter


def test_a_raising_hook_is_named_with_its_member(tiny):
    model, tok = tiny
    pop = make_grpo(model, tok, n=2, hp_config=HyperparameterConfig(lr=RLParameter(min=1e-4, max=1e-2, log=True)))

    def my_hook(agent):
        raise KeyError("beta_max")

    pop[1].register_mutation_hook(my_hook)
    pop[0].run_mutation_hooks()  # no hook: nothing happens
    with pytest.raises(MutationHookError, match=r"mutation hook .*my_hook raised KeyError: 'beta_max' on member 1") as e:
        Mutations(no_mutation=0.0, rl_hp=1.0, rand_seed=0).mutation([pop[1]])
    assert isinstance(e.value.__cause__, KeyError) and isinstance(e.value, ValueError)  # the CLI's one-line errors
