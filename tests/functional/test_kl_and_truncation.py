"""KL estimators (k3 to the reference, approx_kl to the sampling policy), the bootstrap of truncated
episodes and the explained variance, against hand-computed values."""
import math

import pytest
import torch

import evollm.functional as F

LN2 = math.log(2)


def test_approx_kl_hand_computed():
    r = torch.tensor([LN2, 0.0, -LN2])
    # exp(r) - 1 - r: 2 - 1 - ln 2; 0; 0.5 - 1 + ln 2
    assert F.approx_kl(r).tolist() == pytest.approx([1 - LN2, 0.0, LN2 - 0.5])


def test_policy_loss_reports_approx_kl_over_valid_tokens():
    logp = torch.log(torch.tensor([[0.5, 0.25, 0.9]]))
    old = torch.log(torch.tensor([[0.25, 0.5, 0.1]]))
    _, stats = F.policy_loss_with_stats(logp, old, torch.tensor([1.0]), torch.tensor([[1, 1, 0]]))
    assert stats["approx_kl"] == pytest.approx(((1 - LN2) + (LN2 - 0.5)) / 2)
    _, stats = F.policy_loss_with_stats(old, old, torch.tensor([1.0]), torch.tensor([[1, 1, 1]]))
    assert stats["approx_kl"] == 0.0


PI = torch.tensor([0.5, 0.25, 0.25])
REF = torch.tensor([0.25, 0.25, 0.5])


def test_k3_value_estimates_the_reverse_kl():
    # E_{y ~ pi}[k3(y)] exactly: sum_y pi(y) k3(log pi(y), log ref(y)) = KL(pi || ref) = 0.5 ln 2 - 0.25 ln 2
    expected = F.k3_kl(PI.log(), REF.log())
    assert float((PI * expected).sum()) == pytest.approx(0.25 * LN2)
    assert float((PI * (PI / REF).log()).sum()) == pytest.approx(0.25 * LN2)


def test_k3_gradient_is_the_forward_kl_gradient():
    # pi = softmax(theta); the loss adds k3 on tokens sampled from pi: its expected gradient is
    # sum_y pi(y) grad k3(y) with pi(y) the sampling weight (not differentiated)
    theta = PI.log().clone().requires_grad_(True)
    logp = torch.log_softmax(theta, 0)
    (PI * F.k3_kl(logp, REF.log())).sum().backward()
    # grad KL(ref || pi) w.r.t. softmax logits = pi - ref
    assert theta.grad.tolist() == pytest.approx([0.25, 0.0, -0.25], abs=1e-6)
    # ... not grad KL(pi || ref) = pi * (log(pi / ref) - KL(pi || ref))
    reverse = PI * ((PI / REF).log() - 0.25 * LN2)
    assert not torch.allclose(theta.grad, reverse, atol=1e-3)


def test_truncation_bootstrap_reads_the_value_after_the_last_action():
    values = torch.tensor([[0.0, 1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0, 9.0], [1.0, 1.0, 1.0, 1.0, 1.0]])
    mask = torch.tensor([[0, 1, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 0, 0, 0]])
    # last action at t = 2 (row 0), 3 (row 1): the prefix through that token is position t + 1
    out = F.truncation_bootstrap(values, mask, torch.tensor([True, True, True]))
    assert out.tolist() == [3.0, 9.0, 0.0]  # a row without actions: nothing to bootstrap
    assert F.truncation_bootstrap(values, mask, torch.tensor([False, True, False])).tolist() == [0.0, 9.0, 0.0]
    assert F.truncation_bootstrap(values, mask, None).tolist() == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="one column after it"):  # no column after row 1's last action
        F.truncation_bootstrap(values[:, :4], mask[:, :4], torch.tensor([False, True, False]))


def test_gae_bootstraps_truncated_episodes_only():
    rewards, values, mask = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.5, 0.5]]), torch.tensor([[1, 1]])
    adv, _ = F.gae(rewards, values, mask, 1.0, 1.0, last_values=torch.tensor([2.0]))
    # delta1 = 0 + 2 - 0.5 = 1.5; delta0 = 1 + 0.5 - 0.5 = 1; A0 = 1 + 1.5
    assert adv.tolist() == [[2.5, 1.5]]
    adv, _ = F.gae(rewards, values, mask, 1.0, 1.0, last_values=torch.tensor([0.0]))
    assert adv.tolist() == [[0.5, -0.5]]


def test_explained_variance_hand_computed():
    r, m = torch.tensor([[1.0, 2.0, 3.0, 99.0]]), torch.tensor([[1, 1, 1, 0]])
    assert F.explained_variance(r, r, m) == pytest.approx(1.0)
    assert F.explained_variance(torch.full((1, 4), 2.0), r, m) == pytest.approx(0.0)  # var(r - 2) = var(r)
    # V = [1, 1, 1]: R - V = [0, 1, 2], var 1 = var(R): 0; V = [3, 2, 1]: R - V = [-2, 0, 2], var 4: 1 - 4
    assert F.explained_variance(torch.tensor([[3.0, 2.0, 1.0, 0.0]]), r, m) == pytest.approx(-3.0)
    assert math.isnan(F.explained_variance(r, torch.ones(1, 4), m))
