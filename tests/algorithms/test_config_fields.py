"""Every field of every algorithm config is documented in one style (``metadata["help"]``, inherited by a
subclass that only changes the default), and ``describe_config()`` lists each with its default and
whether it can evolve."""

import dataclasses

import pytest

from evollm.algorithms.base import AgentConfig
from evollm.algorithms.ippo import IPPOAgentConfig, IPPOConfig
from evollm.config import ALGORITHMS, algorithm_class, describe_config
from evollm.utils.fields import documented, field_help


def _config_classes():
    found, todo = {IPPOConfig, IPPOAgentConfig}, [AgentConfig]
    while todo:
        cls = todo.pop()
        found.add(cls)
        todo += cls.__subclasses__()
    found |= {algorithm_class(name).config_cls for name in ALGORITHMS}
    return sorted(found, key=lambda c: c.__name__)


@pytest.mark.parametrize("config_cls", _config_classes(), ids=lambda c: c.__name__)
def test_every_algorithm_config_field_has_help_text(config_cls):
    helps = field_help(config_cls)
    missing = [name for name, text in helps.items() if len(text.strip()) < 8]
    assert not missing, f"{config_cls.__name__}: fields without help text: {missing}"


def test_a_subclass_that_changes_a_default_inherits_the_help():
    @dataclasses.dataclass
    class Base:
        lr: float = documented(1e-3, "The learning rate.")

    @dataclasses.dataclass
    class Child(Base):
        lr: float = 1e-4
        extra: int = 3

    assert field_help(Child) == {"lr": "The learning rate.", "extra": ""}
    assert Child().lr == 1e-4


def test_describe_config_lists_every_algorithm_field_with_default_and_evolvability():
    lines = describe_config().splitlines()
    for name in ALGORITHMS:
        cls = algorithm_class(name)
        evolvable = set(cls.evolvable_names(cls.config_cls()))
        for f in dataclasses.fields(cls.config_cls):
            kind = "evolvable" if f.name in evolvable else "fixed"
            prefix = f"algorithm.hyperparameters.{f.name} [{name}, {kind}] = "
            line = next((line for line in lines if line.startswith(prefix)), None)
            assert line is not None, prefix
            assert line.split(": ", 1)[1].strip()
    text = "\n".join(lines)
    # the hyperparameters users tune most, with their defaults
    assert "algorithm.hyperparameters.lr [GRPO, evolvable] = 5e-05: " in text
    assert "algorithm.hyperparameters.group_size [GRPO, evolvable] = 8: " in text
    assert "algorithm.hyperparameters.clip_coef [LLMPPO, evolvable] = 0.2: " in text
    assert "algorithm.hyperparameters.actor_learning_rate [IPPO, evolvable] = 0.0001: " in text
    assert "algorithm.hyperparameters.num_agents [IPPO, fixed] = 2: " in text
