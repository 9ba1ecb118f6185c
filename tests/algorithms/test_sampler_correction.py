"""Sampler/trainer mismatch correction (truncated importance sampling), against hand-computed values."""

import math

import pytest
import torch

from evollm import functional as F

LN2, LN3 = math.log(2.0), math.log(3.0)
# two sequences, three positions; row 0: diffs (ln 3, -ln 2, 0); row 1: (ln 2, <pad>, <pad>)
TRAINER = torch.tensor([[LN3, -LN2, 0.5], [LN2, 7.0, 7.0]])
SAMPLER = torch.tensor([[0.0, 0.0, 0.5], [0.0, -9.0, float("nan")]])
MASK = torch.tensor([[1, 1, 1], [1, 0, 0]])


def test_token_truncate_caps_each_ratio():
    w, st = F.sampler_importance_weights(TRAINER, SAMPLER, MASK, "token_truncate", cap=2.0)
    # ratios 3, 1/2, 1 | 2 ; 3 is truncated to the cap; padding gets weight 0
    torch.testing.assert_close(w, torch.tensor([[2.0, 0.5, 1.0], [2.0, 0.0, 0.0]]))
    assert st["is_ratio_max"] == pytest.approx(2.0)
    assert st["is_ratio_min"] == pytest.approx(0.5)
    assert st["is_ratio_mean"] == pytest.approx((2 + 0.5 + 1 + 2) / 4)
    assert st["is_corrected_fraction"] == pytest.approx(1 / 4)
    assert st["logp_diff_mean"] == pytest.approx((LN3 + LN2 + 0 + LN2) / 4)
    assert st["logp_diff_max"] == pytest.approx(LN3)


def test_token_mask_drops_tokens_out_of_bounds():
    w, st = F.sampler_importance_weights(TRAINER, SAMPLER, MASK, "token_mask", cap=2.5, floor=0.6)
    torch.testing.assert_close(w, torch.tensor([[0.0, 0.0, 1.0], [2.0, 0.0, 0.0]]))
    assert st["is_corrected_fraction"] == pytest.approx(2 / 4)


def test_sequence_modes_use_the_summed_log_ratio():
    # row 0: ln3 - ln2 + 0 -> 1.5 ; row 1: ln 2 -> 2
    w, st = F.sampler_importance_weights(TRAINER, SAMPLER, MASK, "sequence_truncate", cap=1.8)
    torch.testing.assert_close(w, torch.tensor([[1.5, 1.5, 1.5], [1.8, 0.0, 0.0]]))
    assert st["is_ratio_mean"] == pytest.approx((1.5 + 1.8) / 2)
    w, _ = F.sampler_importance_weights(TRAINER, SAMPLER, MASK, "sequence_mask", cap=1.8)
    torch.testing.assert_close(w, torch.tensor([[1.5, 1.5, 1.5], [0.0, 0.0, 0.0]]))


def test_no_mismatch_gives_unit_weights_and_bad_mode_is_refused():
    w, st = F.sampler_importance_weights(TRAINER, TRAINER.clone(), MASK)
    torch.testing.assert_close(w, MASK.float())
    assert st["logp_diff_max"] == 0.0 and st["is_corrected_fraction"] == 0.0
    with pytest.raises(ValueError, match="token_truncate"):
        F.sampler_importance_weights(TRAINER, SAMPLER, MASK, "tokens")


def test_policy_loss_multiplies_each_token_term_by_its_weight():
    """grpo reduction with old = logp (ratio 1): token term = -A * w. Row 0 (A=1): -(2 + 0.5 + 1)/3;
    row 1 (A=-2): +2 * 2 / 1. Loss = mean of the two rows."""
    logp = torch.zeros(2, 3, requires_grad=True)
    w = torch.tensor([[2.0, 0.5, 1.0], [2.0, 0.0, 0.0]])
    loss = F.policy_loss(logp, logp.detach(), torch.tensor([1.0, -2.0]), MASK, "grpo", is_weights=w)
    assert loss.item() == pytest.approx((-(3.5 / 3) + 4.0) / 2)
    loss.backward()
    # d/dlogp of -rho*A*w at rho=1 is -A*w / n_tokens / B
    torch.testing.assert_close(logp.grad, torch.tensor([[-2 / 6, -0.5 / 6, -1 / 6], [2.0, 0.0, 0.0]]))


def test_stats_are_the_documented_columns():
    _, st = F.sampler_importance_weights(TRAINER, SAMPLER, MASK)
    assert tuple(st) == F.SAMPLER_STATS
