"""Tests for evollm.functional against hand-computed values."""
import math

import pytest
import torch

import evollm.functional as F

LN = math.log


def close(a, b, tol=1e-5):
    b = torch.as_tensor(b, dtype=torch.float32)
    assert torch.allclose(a.float(), b, atol=tol, rtol=0), f"{a} != {b}"


# --------------------------------------------------------------------------- #
# group_advantages
# --------------------------------------------------------------------------- #
REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])


def test_group_advantages_group_scale():
    # group 1: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = 0.577350
    # -> +-0.5 / (0.577350 + 1e-4) = +-0.865875 ; group 2 is constant: std 0 -> 0
    a = 0.865875
    close(F.group_advantages(REWARDS, 4), [a, -a, -a, a, 0, 0, 0, 0])


def test_group_advantages_batch_scale():
    # batch mean 0.75; squared deviations 6 * 0.0625 + 2 * 0.5625 = 1.5; std sqrt(1.5/7) = 0.462910
    # -> +-0.5 / (0.462910 + 1e-4) = +-1.079890
    a = 1.079890
    close(F.group_advantages(REWARDS, 4, scale="batch"), [a, -a, -a, a, 0, 0, 0, 0])


def test_group_advantages_none_scale():
    close(F.group_advantages(torch.tensor([3.0, 1.0, 2.0, 6.0]), 2, scale="none"), [1, -1, -2, 2])


def test_group_advantages_group_size_one_is_zero_not_nan():
    out = F.group_advantages(torch.tensor([1.0, 5.0, -2.0]), 1)
    close(out, [0, 0, 0])
    assert not torch.isnan(F.group_advantages(torch.tensor([2.0]), 1, scale="batch")).any()


def test_group_advantages_errors():
    with pytest.raises(ValueError, match="group.*batch.*none"):
        F.group_advantages(REWARDS, 4, scale="bogus")
    with pytest.raises(ValueError, match="divisible"):
        F.group_advantages(REWARDS, 3)


# --------------------------------------------------------------------------- #
# k3
# --------------------------------------------------------------------------- #
def test_k3_kl_values():
    close(F.k3_kl(torch.tensor([-0.3, -2.0]), torch.tensor([-0.3, -2.0])), [0, 0])
    # d = ln2: 2 - ln2 - 1 = 0.306853 ; d = -ln2: 0.5 + ln2 - 1 = 0.193147
    close(F.k3_kl(torch.tensor([0.0, LN(2)]), torch.tensor([LN(2), 0.0])), [0.306853, 0.193147])


# --------------------------------------------------------------------------- #
# policy_loss: 2x3 example
#   ratios  row0 [1.5, 0.5, (1.0 masked)]  A = +1
#           row1 [1.1, 0.7, 1.3]           A = -2
#   old_logp = -1 everywhere, logp = ln(ratio) - 1, clip (0.8, 1.2)
# min-clipped per-token losses:
#   row0: 1.5 -> -min(1.5, 1.2) = -1.2 (clipped);  0.5 -> -min(0.5, 0.8) = -0.5
#   row1: 1.1 -> 2.2;  0.7 -> -min(-1.4, -1.6) = 1.6 (clipped);  1.3 -> -min(-2.6, -2.4) = 2.6
# token sum 4.7 over 5 tokens
# --------------------------------------------------------------------------- #
RATIOS = torch.tensor([[1.5, 0.5, 1.0], [1.1, 0.7, 1.3]])
MASK = torch.tensor([[1, 1, 0], [1, 1, 1]])
ADV = torch.tensor([1.0, -2.0])


def inputs(requires_grad=False):
    old = torch.full((2, 3), -1.0)
    logp = (RATIOS.log() + old).clone().requires_grad_(requires_grad)
    return logp, old


def test_policy_loss_grpo_reduction_and_stats():
    logp, old = inputs()
    loss, stats = F.policy_loss_with_stats(logp, old, ADV, MASK, "grpo")
    # row means: -1.7/2 = -0.85 and 6.4/3 = 2.133333 -> (-0.85 + 2.133333) / 2
    close(loss, 0.641667)
    assert stats["clip_fraction"] == pytest.approx(0.4)  # 2 of 5 tokens
    assert stats["ratio_mean"] == pytest.approx(5.1 / 5)
    assert stats["kl"] == 0.0
    assert F.policy_loss(logp, old, ADV, MASK, "grpo").item() == pytest.approx(loss.item())


@pytest.mark.parametrize("loss_type", ["dapo"])
def test_policy_loss_token_mean_reduction(loss_type):
    logp, old = inputs()
    close(F.policy_loss(logp, old, ADV, MASK, loss_type), 4.7 / 5)


def test_token_count_replaces_the_token_divisor_of_token_means_only():
    """Row 0 (2 tokens, sum -1.7) on one process and row 1 (3 tokens, sum 6.4) on another: each divides by the
    mean count 2.5, and the mean of the two losses is the token mean of the whole batch, 4.7 / 5."""
    logp, old = inputs()
    halves = [F.policy_loss_with_stats(logp[i:i + 1], old[i:i + 1], ADV[i:i + 1], MASK[i:i + 1], "dapo",
                                       token_count=2.5)[0] for i in (0, 1)]
    close(halves[0], -1.7 / 2.5)
    close((halves[0] + halves[1]) / 2, 4.7 / 5)
    close(F.policy_loss_with_stats(logp, old, ADV, MASK, "grpo", token_count=99.0)[0], 0.641667)  # sequence means
    v, ret, m = torch.tensor([[1.0, 2.0, 3.0]]), torch.tensor([[2.0, 0.0, 0.0]]), torch.tensor([[1, 1, 0]])
    close(F.value_loss(v, v, ret, m, count=4.0), 0.5 * (1 + 4) / 4)  # 0.5 * [1, 4] summed over the count 4


def test_policy_loss_dr_grpo_divisor():
    logp, old = inputs()
    close(F.policy_loss(logp, old, ADV, MASK, "dr_grpo", max_completion_length=4), 4.7 / 8)
    close(F.policy_loss(logp, old, ADV, MASK, "dr_grpo", max_completion_length=10), 4.7 / 20)
    with pytest.raises(ValueError, match="max_completion_length"):
        F.policy_loss(logp, old, ADV, MASK, "dr_grpo")


def test_policy_loss_clipped_tokens_have_zero_gradient():
    logp, old = inputs(requires_grad=True)
    F.policy_loss(logp, old, ADV, MASK, "dapo").backward()
    # d/dlogp of -rho*A is -rho*A; divided by 5 tokens. Clipped tokens and masked token: 0.
    close(logp.grad, [[0.0, -0.5 / 5, 0.0], [2.2 / 5, 0.0, 2.6 / 5]])


def test_policy_loss_clip_float_equals_tuple():
    logp, old = inputs()
    a = F.policy_loss(logp, old, ADV, MASK, clip_low=0.2, clip_high=0.2)
    b = F.policy_loss(logp, old, ADV, MASK)  # the default offsets: 0.2 / 0.2
    close(a, b.item())
    # wider clip: nothing clipped -> row0 -(1.5+0.5)/2 = -1, row1 2*(3.1)/3 = 2.066667
    close(F.policy_loss(logp, old, ADV, MASK, clip_low=0.6, clip_high=0.6), (-1 + 2.066667) / 2)


def test_policy_loss_per_token_advantages_match_broadcast():
    logp, old = inputs()
    a = F.policy_loss(logp, old, ADV, MASK)
    b = F.policy_loss(logp, old, ADV[:, None].expand(2, 3).clone(), MASK)
    close(a, b.item())
    # per-token advantages that differ within a row: row0 A=[1, -1], row1 A=0
    adv = torch.tensor([[1.0, -1.0, 5.0], [0.0, 0.0, 0.0]])
    # row0: 1.5 -> -1.2 ; 0.5 with A=-1 -> -min(-0.5, -0.8) = 0.8 -> mean -0.2 ; row1 0
    close(F.policy_loss(logp, old, adv, MASK, "grpo"), -0.1)


def test_policy_loss_gspo_sequence_ratio():
    logp, old = inputs()
    loss, stats = F.policy_loss_with_stats(logp, old, ADV, MASK, "gspo")
    # row0: exp((ln1.5 + ln0.5)/2) = sqrt(0.75) = 0.866025 (inside clip) -> -0.866025
    # row1: exp(ln(1.1*0.7*1.3)/3) = 1.001^(1/3) = 1.000333 -> 2.000666
    close(loss, (-0.866025 + 2.000666) / 2)
    assert stats["ratio_mean"] == pytest.approx((2 * 0.866025 + 3 * 1.000333) / 5, abs=1e-5)
    assert stats["clip_fraction"] == 0.0


def test_policy_loss_gspo_sequence_clipping():
    # row ratios [2, 2] -> sequence ratio 2 > 1.2 with A=+1: clipped, loss -1.2, zero gradient
    old = torch.zeros(1, 3)
    logp = torch.tensor([[LN(2), LN(2), 7.0]], requires_grad=True)
    loss, stats = F.policy_loss_with_stats(logp, old, torch.tensor([1.0]), torch.tensor([[1, 1, 0]]), "gspo")
    close(loss, -1.2)
    assert stats["clip_fraction"] == 1.0
    loss.backward()
    close(logp.grad, [[0, 0, 0]])


def test_policy_loss_cispo_value_and_gradient():
    logp, old = inputs(requires_grad=True)
    loss, stats = F.policy_loss_with_stats(logp, old, ADV, MASK, "cispo")
    # -min(rho,1.2)*A*logp: 1.2*0.594535=0.713442, 0.5*1.693147=0.846574,
    # -2.2*0.904690=-1.990318, -1.4*1.356675=-1.899345, -2.4*0.737636=-1.770326 ; sum/5
    close(loss, -0.819995)
    assert stats["clip_fraction"] == pytest.approx(0.4)  # rho 1.5 and 1.3 exceed hi
    loss.backward()
    # gradient is -min(rho, hi) * A / 5 on valid tokens (the weight is stop-gradient)
    close(logp.grad, [[-1.2 / 5, -0.5 / 5, 0.0], [2.2 / 5, 1.4 / 5, 2.4 / 5]])


def test_policy_loss_beta_kl_term():
    logp, old = inputs()
    ref = logp + LN(2)  # k3 = 2 - ln2 - 1 = 0.306853 on every token
    loss, stats = F.policy_loss_with_stats(logp, old, ADV, MASK, "grpo", ref_logp=ref, beta=0.1)
    close(loss, 0.641667 + 0.0306853)
    assert stats["kl"] == pytest.approx(0.306853, abs=1e-6)
    # ref given but beta 0: loss unchanged, kl still reported
    loss0, stats0 = F.policy_loss_with_stats(logp, old, ADV, MASK, "grpo", ref_logp=ref)
    close(loss0, 0.641667)
    assert stats0["kl"] == pytest.approx(0.306853, abs=1e-6)
    with pytest.raises(ValueError, match="ref_logp"):
        F.policy_loss(logp, old, ADV, MASK, beta=0.1)


def test_policy_loss_empty_sequence_no_nan():
    old = torch.zeros(2, 2)
    logp = torch.tensor([[0.0, 0.0], [float("-inf"), float("nan")]], requires_grad=True)
    mask = torch.tensor([[1, 1], [0, 0]])
    loss = F.policy_loss(logp, old, torch.tensor([1.0, 3.0]), mask, "grpo")
    # row0: -1 each -> mean -1 ; row1 contributes 0 ; divided by B=2
    close(loss, -0.5)
    loss.backward()
    assert torch.isfinite(logp.grad).all()
    close(F.policy_loss(logp, old, torch.ones(2), torch.zeros(2, 2), "dapo"), 0.0)


def test_policy_loss_bad_loss_type():
    logp, old = inputs()
    with pytest.raises(ValueError, match="grpo.*dr_grpo.*dapo.*gspo.*cispo"):
        F.policy_loss(logp, old, ADV, MASK, "ppo2")
    assert set(F.LOSS_TYPES) == {"grpo", "gspo", "dr_grpo", "dapo", "cispo"}


# --------------------------------------------------------------------------- #
# gae / rebn
# --------------------------------------------------------------------------- #
GAE_R = torch.tensor([[1.0, 0.0, 2.0], [0.0, 1.0, 9.0]])
GAE_V = torch.tensor([[0.5, 1.0, 1.5], [2.0, 1.0, 7.0]])
GAE_M = torch.tensor([[1, 1, 1], [1, 1, 0]])


def test_gae_terminal():
    adv, ret = F.gae(GAE_R, GAE_V, GAE_M, gamma=0.9, lam=0.5)
    # row0: d2 = 2 - 1.5 = 0.5 ; d1 = 0.9*1.5 - 1 = 0.35 -> 0.35 + 0.45*0.5 = 0.575
    #       d0 = 1 + 0.9 - 0.5 = 1.4 -> 1.4 + 0.45*0.575 = 1.65875
    # row1: d1 = 1 - 1 = 0 ; d0 = 0.9*1 - 2 = -1.1
    close(adv, [[1.65875, 0.575, 0.5], [-1.1, 0.0, 0.0]])
    close(ret, [[2.15875, 1.575, 2.0], [0.9, 1.0, 0.0]])


def test_gae_bootstrap_last_values():
    adv, ret = F.gae(GAE_R, GAE_V, GAE_M, gamma=0.9, lam=0.5, last_values=torch.tensor([1.0, 2.0]))
    # row0: d2 = 2 + 0.9 - 1.5 = 1.4 ; A1 = 0.35 + 0.45*1.4 = 0.98 ; A0 = 1.4 + 0.45*0.98 = 1.841
    # row1: d1 = 1 + 1.8 - 1 = 1.8 ; A0 = -1.1 + 0.45*1.8 = -0.29
    close(adv, [[1.841, 0.98, 1.4], [-0.29, 1.8, 0.0]])
    close(ret, [[2.341, 1.98, 2.9], [1.71, 2.8, 0.0]])


def test_gae_lambda_one_gamma_one_is_monte_carlo():
    adv, ret = F.gae(GAE_R, torch.zeros(2, 3), GAE_M, gamma=1.0, lam=1.0)
    close(ret, [[3.0, 2.0, 2.0], [1.0, 1.0, 0.0]])


def test_rebn_ragged():
    r = torch.tensor([[1.0, 0.0, 2.0], [0.0, 4.0, 99.0]])
    out = F.rebn(r, GAE_M, gamma=0.5)
    # G row0 = [1.5, 1, 2], row1 = [2, 4]; mean 2.1; unbiased var 5.2/4 = 1.3; std 1.140175
    close(out, [[-0.526235, -0.964764, -0.087706], [-0.087706, 1.666410, 0.0]])


def test_rebn_single_cell_no_nan():
    out = F.rebn(torch.tensor([[3.0, 1.0]]), torch.tensor([[1, 0]]), gamma=0.9)
    close(out, [[0.0, 0.0]])


# --------------------------------------------------------------------------- #
# masked helpers / value loss
# --------------------------------------------------------------------------- #
def test_masked_reductions():
    x = torch.tensor([[1.0, 2.0, float("nan")], [4.0, 5.0, 6.0]])
    m = torch.tensor([[1, 1, 0], [0, 1, 1]])
    close(F.masked_sum(x, m), 14.0)
    close(F.masked_mean(x, m), 3.5)
    close(F.masked_mean(x, m, dim=1), [1.5, 5.5])
    close(F.masked_sum(x, m, dim=0), [1.0, 7.0, 6.0])
    close(F.masked_mean(x, torch.zeros(2, 3)), 0.0)


def test_masked_whiten():
    x = torch.tensor([1.0, 2.0, 3.0, 100.0])
    m = torch.tensor([1, 1, 1, 0])
    close(F.masked_whiten(x, m), [-1.0, 0.0, 1.0, 0.0])  # mean 2, unbiased std 1
    close(F.masked_whiten(x, m, shift_mean=False), [1.0, 2.0, 3.0, 0.0])


def test_value_loss_clipped_vs_unclipped():
    v = torch.tensor([[1.0, 2.0, 3.0]])
    old = torch.tensor([[0.5, 2.5, 2.0]])
    ret = torch.tensor([[2.0, 0.0, 0.0]])
    m = torch.ones(1, 3)
    # unclipped: 0.5*[1, 4, 9] -> mean 7/3
    close(F.value_loss(v, old, ret, m), 7 / 3)
    # clip 0.2: clipped V = [0.7, 2.3, 2.2] -> sq [1.69, 5.29, 4.84]; max with [1, 4, 9]
    # -> 0.5*[1.69, 5.29, 9] -> mean 7.99/3
    close(F.value_loss(v, old, ret, m, clip=0.2), 7.99 / 3)
    close(F.value_loss(v, old, ret, torch.tensor([[1, 1, 0]]), clip=0.2), (0.845 + 2.645) / 2)


# --------------------------------------------------------------------------- #
# logits helpers
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("chunk_size", [1, 2, 3, 8])
def test_token_logprobs_matches_log_softmax(chunk_size):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 4, 11, generator=g)
    labels = torch.randint(0, 11, (5, 4), generator=g)
    expected = torch.log_softmax(logits, -1).gather(-1, labels[..., None]).squeeze(-1)
    close(F.token_logprobs(logits, labels, chunk_size=chunk_size), expected)


def test_token_logprobs_uniform_low_precision_and_grad():
    logits = torch.zeros(2, 3, 8, dtype=torch.bfloat16, requires_grad=True)
    out = F.token_logprobs(logits, torch.tensor([[0, 3, 7], [1, 1, -100]]))
    assert out.dtype == torch.float32
    close(out, [[-LN(8)] * 3, [-LN(8), -LN(8), 0.0]])
    out.sum().backward()
    assert logits.grad is not None and logits.grad.dtype == torch.bfloat16


def test_entropy_from_logits():
    close(F.entropy_from_logits(torch.zeros(3, 2, 16), chunk_size=2), torch.full((3, 2), LN(16)))
    # p = [0.25, 0.75]: H = 0.25 ln4 + 0.75 ln(4/3) = 0.562335 ; near one-hot -> ~0
    logits = torch.tensor([[[0.0, LN(3)], [0.0, 100.0]]])
    close(F.entropy_from_logits(logits), [[0.562335, 0.0]])


# --------------------------------------------------------------------------- #
# multi-turn helpers
# --------------------------------------------------------------------------- #
TURN_IDS = torch.tensor([[-1, 0, 0, -1, 1, 1], [-1, 0, -1, -1, -1, -1]])


def test_broadcast_turn_values():
    tv = torch.tensor([[10.0, 20.0, 30.0], [7.0, 8.0, 9.0]])
    close(F.broadcast_turn_values(tv, TURN_IDS), [[0, 10, 10, 0, 20, 20], [0, 7, 0, 0, 0, 0]])


def test_turn_values_from_tokens():
    tok = torch.tensor([[9.0, 1.0, 3.0, 9.0, 4.0, 8.0], [9.0, 5.0, 9.0, 9.0, 9.0, 9.0]])
    close(F.turn_values_from_tokens(tok, TURN_IDS, 3), [[3, 8, 0], [5, 0, 0]])
    close(F.turn_values_from_tokens(tok, TURN_IDS, 3, reduce="mean"), [[2, 6, 0], [5, 0, 0]])
    with pytest.raises(ValueError):
        F.turn_values_from_tokens(tok, TURN_IDS, 3, reduce="max")


# --------------------------------------------------------------------------- #
# statistics over a batch split between processes (``reduce``)
# --------------------------------------------------------------------------- #
def on_two_shares(fn, share_a: tuple, share_b: tuple):
    """``fn(*share, reduce=...)`` on two shares of a batch at once (two threads standing for two processes),
    with a ``reduce`` that sums its argument over both, as an all-reduce does."""
    import threading

    barrier, slots, out = threading.Barrier(2), [None, None], [None, None]

    def reduce_for(i):
        def reduce(t):
            slots[i] = t.clone()
            barrier.wait()
            total = slots[0] + slots[1]
            barrier.wait()  # both have read the slots before either writes the next statistic
            return total
        return reduce

    def run(i, share):
        out[i] = fn(*share, reduce=reduce_for(i))

    threads = [threading.Thread(target=run, args=(i, s)) for i, s in enumerate((share_a, share_b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_masked_whiten_over_two_shares_uses_the_whole_batch():
    # the batch [1, 2, 3, (100 masked)]: mean 2, unbiased std 1; share A [1, 2], share B [3, (100)]
    a, b = on_two_shares(F.masked_whiten, (torch.tensor([1.0, 2.0]), torch.tensor([1, 1])),
                         (torch.tensor([3.0, 100.0]), torch.tensor([1, 0])))
    close(a, [-1.0, 0.0])
    close(b, [1.0, 0.0])
    close(F.masked_whiten(torch.tensor([1.0, 2.0]), torch.tensor([1, 1])), [-0.707107, 0.707107])  # alone: its own


def test_rebn_over_two_shares_equals_rebn_of_the_whole_batch():
    r = torch.tensor([[1.0, 0.0, 2.0], [0.0, 4.0, 99.0]])
    a, b = on_two_shares(lambda r, m, reduce: F.rebn(r, m, 0.5, reduce=reduce), (r[:1], GAE_M[:1]), (r[1:], GAE_M[1:]))
    close(torch.cat([a, b]), [[-0.526235, -0.964764, -0.087706], [-0.087706, 1.666410, 0.0]])  # test_rebn_ragged's


def test_group_advantages_batch_scale_over_two_shares():
    a, b = on_two_shares(lambda r, reduce: F.group_advantages(r, 4, scale="batch", reduce=reduce),
                         (REWARDS[:4],), (REWARDS[4:],))
    x = 1.079890  # test_group_advantages_batch_scale's: the std of all 8 rewards
    close(torch.cat([a, b]), [x, -x, -x, x, 0, 0, 0, 0])
