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


def grouped_experiences(group=4, completion=3, seed=0):
    """Single-turn ``(ids, action_mask, rewards)``: 2 left-padded prompts, ``group`` completions each."""
    from test_ppo_reinforce import PAD

    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(10, 40, (2, 7), generator=g)
    prompts[0, :2] = PAD
    ids = torch.cat([prompts.repeat_interleave(group, 0), torch.randint(10, 40, (2 * group, completion), generator=g)],
                    1)
    mask = torch.zeros(ids.shape[0], ids.shape[1] - 1, dtype=torch.long)
    mask[:, prompts.shape[1] - 1:] = 1
    return ids, mask, torch.rand(2, group, generator=g)


def _all_params(agent):
    return [p.detach().clone() for g in agent.optimizer.param_groups for p in g["params"]]


@pytest.mark.parametrize("algo, members, kw", [
    ("ppo", 1, dict(ent_coef=0.01, beta=0.1)),  # LLMPPO.learn: actor, critic, old and reference forwards
    ("ppo_two_members", 2, dict(ent_coef=0.01, beta=0.1)),  # ppo_update: routed actors and critics
    ("reinforce", 1, dict(beta=0.1)),
])
def test_ppo_and_reinforce_with_shared_prompts_equal_plain(monkeypatch, algo, members, kw):
    from test_ppo_reinforce import LLMPPO, LLMREINFORCE, PAD, TOK

    from evollm.adapters.shared import default_lora_config
    from evollm.algorithms.ppo_update import ppo_update
    from evollm.models.tiny import build_tiny_model

    exps = [grouped_experiences(seed=i) for i in range(members)]
    out = []
    for threshold in (0.0, float("inf")):
        monkeypatch.setattr(prefix, "SHARED_MIN_TOKEN_PARAMS", threshold)
        cls = LLMREINFORCE if algo == "reinforce" else LLMPPO
        torch.manual_seed(0)  # the same LoRA initialisation in both runs
        agents = cls.population(members, build_tiny_model(TOK, seed=0), pad_token_id=PAD, pad_token=TOK.pad_token,
                                lora_config=default_lora_config(r=4), max_output_tokens=3, lr=0.1, update_epochs=2,
                                batch_size=4, **kw)
        for a in agents:
            for group in a.optimizer.param_groups:
                group["eps"] = 1.0  # Adam ~ SGD: a step is linear in the gradient (not its sign)
        _perturb(agents)
        metrics = ppo_update(agents, exps) if algo == "ppo_two_members" else [agents[0].learn(exps[0])]
        assert all(m["shared_prompt"] == (1.0 if threshold == 0 else 0.0) for m in metrics)
        out.append(([_all_params(a) for a in agents], metrics))
    (shared, m_s), (plain, m_p) = out
    for ps, qs in zip(shared, plain):
        for p, q in zip(ps, qs):
            torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-4)
    for a, b in zip(m_s, m_p):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-6)
