"""Loss forwards that compute the output head only from the first completion position give the same
log-probs on the completion as the full computation: one member, routed members and the reference."""

import pytest
import torch
from conftest import make_grpo

from evollm.rollout import first_target, forward_logprobs, member_logprobs
from evollm.rollout.logprobs import _takes_logits_to_keep


def _perturb(agents, scale=0.05):
    for i, a in enumerate(agents):
        with torch.no_grad():
            for p in a.shared.parameters(a.adapter_name()):
                p.add_(scale * torch.randn(p.shape, generator=torch.Generator().manual_seed(i)))


def _batch(rows=6, prompt=5, width=11, pad=0):
    """Left-padded prompts of one padded length ``prompt``, then completions (some right-padded)."""
    g = torch.Generator().manual_seed(1)
    seqs = torch.randint(5, 40, (rows, width), generator=g)
    attn = torch.ones_like(seqs)
    seqs[0, :2], attn[0, :2] = pad, 0  # a shorter prompt, left padded
    mask = torch.zeros(rows, width - 1, dtype=torch.long)
    mask[:, prompt - 1:] = 1
    mask[1, -3:] = 0  # a shorter completion
    return seqs, attn, mask


def test_first_target_reads_the_mask():
    mask = torch.zeros(3, 9)
    assert first_target(mask) == 0
    mask[1, 6:] = 1
    mask[2, 4:7] = 1
    assert first_target(mask) == 5
    assert first_target(torch.ones(2, 4)) == 1


def test_completion_only_equals_full_single_member(tiny):
    model, tok = tiny
    a = make_grpo(model, tok)[0]
    _perturb([a])
    assert _takes_logits_to_keep(a.shared.model)
    seqs, attn, mask = _batch()
    start = first_target(mask)
    assert start == 5
    with a.shared.use(a.adapter_name()) as m:
        full, ent_full = forward_logprobs(m, seqs, attn, temperature=0.7, with_entropy=True)
        part, ent_part = forward_logprobs(m, seqs, attn, temperature=0.7, with_entropy=True, start=start)
    assert part.shape == full.shape == mask.shape
    assert torch.all(part[:, :start - 1] == 0) and torch.all(ent_part[:, :start - 1] == 0)
    torch.testing.assert_close(part[:, start - 1:], full[:, start - 1:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent_part[:, start - 1:], ent_full[:, start - 1:], atol=1e-5, rtol=1e-5)
    # gradients of a masked loss are the same too
    params = a.shared.parameters(a.adapter_name())
    grads = []
    for s in (None, start):
        a.optimizer.zero_grad(set_to_none=True)
        with a.shared.use(a.adapter_name(), train=True) as m:
            (forward_logprobs(m, seqs, attn, start=s) * mask).sum().backward()
        grads.append([p.grad.clone() for p in params])
    for g_full, g_part in zip(*grads):
        torch.testing.assert_close(g_part, g_full, atol=1e-5, rtol=1e-4)


def test_completion_only_without_logits_to_keep(tiny, monkeypatch):
    """A model whose forward has no ``logits_to_keep``: the logits are sliced instead, same result."""
    import evollm.rollout.logprobs as lp

    model, tok = tiny
    a = make_grpo(model, tok)[0]
    seqs, attn, mask = _batch()
    with torch.no_grad(), a.shared.use(a.adapter_name()) as m:
        full = forward_logprobs(m, seqs, attn)
        monkeypatch.setattr(lp, "_takes_logits_to_keep", lambda model: False)
        part = forward_logprobs(m, seqs, attn, start=5, chunk_rows=4)
    torch.testing.assert_close(part[:, 4:], full[:, 4:], atol=1e-5, rtol=1e-5)
    assert torch.all(part[:, :4] == 0)


@pytest.mark.parametrize("reference", [False, True])
def test_completion_only_routed_and_reference(tiny, reference):
    model, tok = tiny
    pop = make_grpo(model, tok, n=3)
    _perturb(pop)
    shared, names = pop[0].shared, [a.adapter_name() for a in pop]
    seqs, attn, mask = _batch(rows=6)
    start = first_target(mask)
    for grad in (False, True):
        full = member_logprobs(shared, names, seqs, attn, 2, grad, reference=reference)
        part = member_logprobs(shared, names, seqs, attn, 2, grad, reference=reference, start=start)
        torch.testing.assert_close(part[:, start - 1:], full[:, start - 1:], atol=1e-5, rtol=1e-5)
        assert torch.all(part[:, :start - 1] == 0)
        if grad and not reference:
            assert part.requires_grad


def _learned(agent, experiences, learn):
    learn(experiences)
    return [p.detach().clone() for p in agent.shared.parameters(agent.adapter_name())]


def test_grpo_learn_equals_full_logits(tiny, arithmetic_env, monkeypatch):
    """Old, reference and gradient forwards from the completion on: the update is the full one's."""
    import evollm.algorithms.grpo as grpo
    from evollm.algorithms.grpo import GRPO

    model, tok = tiny
    pop = make_grpo(model, tok, n=2, lr=1e-2, batch_size=8, update_epochs=2, beta=0.1, learn_chunk_members=2)
    _perturb(pop)
    twins = [a.clone() for a in pop]
    prompts = arithmetic_env.reset()
    exps = [(*a.get_action(prompts), torch.rand(4, 4, generator=torch.Generator().manual_seed(i)))
            for i, a in enumerate(pop)]
    assert first_target(torch.cat(exps[0][1])) > 1  # the prompt is skipped
    part = [_learned(pop[0], exps, lambda e: GRPO.learn_population(pop, e))] + \
        [[p.detach().clone() for p in pop[1].shared.parameters(pop[1].adapter_name())]]
    monkeypatch.setattr(grpo, "first_target", lambda mask: 0)
    full = [_learned(twins[0], exps, lambda e: GRPO.learn_population(twins, e))] + \
        [[p.detach().clone() for p in twins[1].shared.parameters(twins[1].adapter_name())]]
    for ps, qs in zip(part, full):
        for p, q in zip(ps, qs):
            torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-4)


def test_reinforce_old_and_reference_from_the_first_action(monkeypatch):
    import evollm.algorithms.reinforce_update as reinforce
    from test_ppo_reinforce import LLMREINFORCE, episodes, make_agent

    batch = episodes()
    out = []
    for patched in (False, True):
        if patched:
            monkeypatch.setattr(reinforce, "first_target", lambda mask: 0)
        torch.manual_seed(0)
        a = make_agent(LLMREINFORCE, beta=0.1, update_epochs=2, batch_size=2, lr=1e-2)
        out.append(_learned(a, batch, a.learn))
    for p, q in zip(*out):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-4)
