"""One clip encoding: ``clip_low`` / ``clip_high`` offsets; ``clip_coef`` a float or a tuple of the two
offsets; PPO's value clip its own field that the policy clip never moves."""
import pytest
import torch

from evollm import functional as F
from evollm.algorithms import ppo_update
from evollm.algorithms.grpo import GRPOConfig
from evollm.algorithms.ppo import LLMPPOConfig
from evollm.algorithms.reinforce import LLMREINFORCEConfig
from test_ppo_reinforce import episodes, make_agent


@pytest.mark.parametrize("cls", [GRPOConfig, LLMPPOConfig, LLMREINFORCEConfig])
def test_clip_coef_float_and_tuple_set_the_two_offsets(cls):
    assert cls(clip_coef=0.3).clip_range() == (0.3, 0.3)
    assert cls(clip_coef=(0.2, 0.28)).clip_range() == (0.2, 0.28)  # offsets, as TRL's epsilon / epsilon_high
    assert cls(clip_coef=[0.1, 0.5]).clip_range() == (0.1, 0.5)
    assert cls(clip_coef=0.3, clip_high=0.4).clip_range() == (0.3, 0.4)  # an offset set itself wins
    assert cls(clip_low=0.1, clip_high=0.3).clip_range() == (0.1, 0.3)


def test_defaults_ppo_and_grpo_presets():
    assert LLMPPOConfig().clip_range() == (0.2, 0.2) and LLMREINFORCEConfig().clip_range() == (0.2, 0.2)
    assert GRPOConfig().clip_range() == (0.2, 0.2)
    assert GRPOConfig(loss_type="dapo").clip_range() == (0.2, 0.28)
    assert GRPOConfig(loss_type="dapo", clip_coef=0.1).clip_range() == (0.1, 0.1)


@pytest.mark.parametrize("value", ["0.2", None, (0.2, "x"), {"low": 0.2}])
def test_non_numeric_clip_coef_is_a_type_error(value):
    cfg = LLMPPOConfig()
    cfg.clip_coef = value
    if value is None:  # None: the default offsets
        cfg.validate()
        return
    with pytest.raises(TypeError, match="clip_coef must be a float or a tuple") as err:
        cfg.validate()
    assert "\n" not in str(err.value)


def test_invalid_offsets_name_the_field_they_came_from():
    with pytest.raises(ValueError, match="^clip_coef=1.5 gives clip_low=1.5") as err:
        GRPOConfig(clip_coef=1.5).validate()
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="^clip_high=-0.1 gives clip_high=-0.1"):
        GRPOConfig(clip_high=-0.1).validate()
    with pytest.raises(ValueError, match="exactly two values"):
        GRPOConfig(clip_coef=(0.1, 0.2, 0.3)).validate()


def test_loss_takes_offsets():
    logp, old = torch.log(torch.tensor([[0.5, 0.5]])), torch.log(torch.tensor([[0.25, 0.25]]))  # ratio 2
    adv, mask = torch.tensor([1.0]), torch.ones(1, 2)
    # ratio 2 clipped to 1 + clip_high; A > 0 takes the min: -(1 + clip_high)
    assert float(F.policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28)) == pytest.approx(-1.28)
    assert float(F.policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=float("inf"))) == pytest.approx(-2.0)
    with pytest.raises(ValueError, match="clip offsets"):
        F.policy_loss(logp, old, adv, mask, clip_low=1.5)


def test_value_clip_is_its_own_field_and_the_policy_clip_never_moves_it(monkeypatch):
    agent = make_agent(update_epochs=2, batch_size=2)
    assert agent.config.value_clip == 0.2
    agent.set_hyperparameter("clip_high", 0.5)
    agent.set_hyperparameter("clip_coef", 0.05)
    assert agent.config.clip_range() != (0.2, 0.2) and agent.config.value_clip == 0.2
    seen = []
    value_loss = ppo_update.F.value_loss
    monkeypatch.setattr(ppo_update.F, "value_loss", lambda *a, **k: seen.append(k["clip"]) or value_loss(*a, **k))
    agent.learn(episodes())
    assert seen and set(seen) == {0.2}
    agent.set_hyperparameter("value_clip", 0.7)
    seen.clear()
    agent.learn(episodes())
    assert set(seen) == {0.7}
    agent.config.value_clip = None  # off: the unclipped value loss
    seen.clear()
    agent.learn(episodes())
    assert set(seen) == {None}
