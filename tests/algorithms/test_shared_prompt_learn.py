"""Every loss forward of a learn step (old, reference and gradient passes; fused or member by member) computes
each group's prompt once: the update equals the one with the plain forward, and the step says which ran."""

import pytest
import torch
from conftest import make_grpo

import evollm.rollout.prefix as prefix


def _perturb(agents, scale=0.05):
    for i, a in enumerate(agents):
        with torch.no_grad():
            for p in a.shared.parameters(a.adapter_name()):
                p.add_(scale * torch.randn(p.shape, generator=torch.Generator().manual_seed(i)))


def _params(agents):
    return [[p.detach().clone() for p in a.shared.parameters(a.adapter_name())] for a in agents]


@pytest.mark.parametrize("chunk", [2, 1])  # fused (routed) and member by member
def test_grpo_update_with_shared_prompts_equals_plain(tiny, arithmetic_env, monkeypatch, chunk):
    from evollm.algorithms.grpo import GRPO

    model, tok = tiny
    pop = make_grpo(model, tok, n=2, lr=1e-2, batch_size=8, update_epochs=2, beta=0.1, learn_chunk_members=chunk)
    _perturb(pop)
    twins = [a.clone() for a in pop]
    prompts = arithmetic_env.reset()
    exps = [(*a.get_action(prompts), torch.rand(4, 4, generator=torch.Generator().manual_seed(i)))
            for i, a in enumerate(pop)]
    out = []
    for agents, threshold in ((pop, 0.0), (twins, float("inf"))):
        monkeypatch.setattr(prefix, "SHARED_MIN_TOKEN_PARAMS", threshold)
        metrics = GRPO.learn_population(agents, exps)
        assert all(m["shared_prompt"] == (1.0 if threshold == 0 else 0.0) for m in metrics)
        out.append((_params(agents), metrics))
    (shared, m_s), (plain, m_p) = out
    for ps, qs in zip(shared, plain):
        for p, q in zip(ps, qs):
            torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-4)
    for a, b in zip(m_s, m_p):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-6)
