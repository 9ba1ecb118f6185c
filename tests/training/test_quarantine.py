"""Divergence detection: a member is quarantined for non-finite values AND for finite blow-ups (which
of the two a huge learning rate produces depends on the CPU's arithmetic)."""

import math

import pytest
import torch

from conftest import make_grpo
from evollm.training.quarantine import DivergenceLimits, check_members, nonfinite_reason


@pytest.fixture
def member(tiny):
    model, tok = tiny
    return make_grpo(model, tok, n=1)[0]


def _set_weight(agent, value):
    with torch.no_grad():
        agent.trainable_parameters()[0].view(-1)[0] = value


def test_healthy_member_passes(member):
    assert nonfinite_reason(member, {"loss": 0.1, "kl": 0.02}) is None


def test_finite_blow_up_of_a_weight_is_divergence(member):
    _set_weight(member, 2e3)
    reason = nonfinite_reason(member, {"loss": 0.0})
    assert reason is not None and "max_adapter_abs=1000" in reason and "2e+03" in reason
    assert nonfinite_reason(member, {"loss": 0.0}, DivergenceLimits(max_adapter_abs=1e4)) is None
    assert nonfinite_reason(member, {"loss": 0.0}, DivergenceLimits(max_adapter_abs=None)) is None


def test_kl_and_loss_limits(member):
    assert "max_kl=50" in nonfinite_reason(member, {"loss": 0.0, "kl": 51.0})
    assert nonfinite_reason(member, {"loss": 1e9, "kl": 0.0}) is None  # loss limit is off by default
    assert "max_loss_abs=100" in nonfinite_reason(member, {"loss": -101.0}, DivergenceLimits(max_loss_abs=100))


def test_non_finite_values_still_caught(member):
    assert "non-finite loss" in nonfinite_reason(member, {"loss": math.nan})
    _set_weight(member, math.inf)
    assert "non-finite" in nonfinite_reason(member, {"loss": 0.0})


def test_check_members_quarantines_and_logs(member):
    _set_weight(member, -5e5)
    lines = []
    newly = check_members([member], {member.index: {"loss": 0.0}}, step=3, log=lines.append)
    assert newly == [member] and member.quarantined and "step 3" in member.quarantine_reason
    assert len(lines) == 1 and "blew up" in lines[0]


@pytest.mark.parametrize("bad", [0, -1.0, "big"])
def test_limits_are_validated(bad):
    with pytest.raises(ValueError, match="DivergenceLimits.max_kl"):
        DivergenceLimits(max_kl=bad)
