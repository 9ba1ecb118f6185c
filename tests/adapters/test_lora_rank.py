"""LoRA rank as an evolvable hyperparameter: function-preserving grow, SVD shrink,
optimizer state, mixed-rank populations, checkpoints across ranks."""

import pytest
import torch
from conftest import make_grpo

from evollm.adapters.resize import lora_factors
from evollm.hpo import HyperparameterConfig, Mutations, RLParameter
from evollm.rollout import generate_population


def _randomise(agent, seed=0, scale=0.2):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in agent.shared.parameters(agent.adapter_name()):
            p.copy_(torch.randn(p.shape, generator=g) * scale)


@pytest.fixture
def trained(tiny, arithmetic_env):
    model, tok = tiny
    agent = make_grpo(model, tok, lr=1e-2)[0]
    _randomise(agent)
    ids, masks = agent.get_action(arithmetic_env.reset())
    agent.learn((ids, masks, torch.rand(4, 4)))
    return agent, torch.cat(ids), (ids, masks)


def test_grow_preserves_logprobs_and_scale(trained):
    agent, seqs, _ = trained
    before = agent.get_logprobs(seqs)
    scales = {s for _, _, s in lora_factors(agent.shared, agent.adapter_name()).values()}
    agent.set_lora_rank(16)
    assert agent.lora_rank == 16
    factors = lora_factors(agent.shared, agent.adapter_name())
    assert {s for _, _, s in factors.values()} == scales  # alpha / r kept
    assert all(A.shape[0] == 16 and B.shape[1] == 16 for A, B, _ in factors.values())
    torch.testing.assert_close(agent.get_logprobs(seqs), before, atol=1e-5, rtol=1e-5)


def test_shrink_equals_truncated_svd(trained):
    agent, _, _ = trained
    before = lora_factors(agent.shared, agent.adapter_name())
    agent.set_lora_rank(3)
    after = lora_factors(agent.shared, agent.adapter_name())
    for name, (A, B, s) in before.items():
        U, S, Vh = torch.linalg.svd(s * B.double() @ A.double(), full_matrices=False)
        best = (U[:, :3] * S[:3]) @ Vh[:3]
        A2, B2, s2 = after[name]
        assert s2 == pytest.approx(s)
        torch.testing.assert_close((s2 * B2.double() @ A2.double()), best, atol=1e-5, rtol=1e-4)


def test_optimizer_state_after_resize(trained):
    agent, _, batch = trained
    old = {n: agent.optimizer.state[p]["exp_avg"].clone() for n, p in agent.shared.named_parameters(
        agent.adapter_name())}
    lr = agent.optimizer.param_groups[0]["lr"]
    agent.set_lora_rank(12)  # grow: moments zero-padded, step kept
    for n, p in agent.shared.named_parameters(agent.adapter_name()):
        st = agent.optimizer.state[p]
        m = st["exp_avg"]
        assert m.shape == p.shape
        small = old[n]
        if "lora_A" in n:  # lora_A [r, in]
            assert torch.equal(m[:8], small) and m[8:].abs().sum() == 0
        else:  # lora_B [out, r]
            assert torch.equal(m[:, :8], small) and m[:, 8:].abs().sum() == 0
        assert int(st["step"]) == 1
    assert agent.optimizer.param_groups[0]["lr"] == lr
    agent.learn(batch[:2] + (torch.rand(4, 4),))  # training continues
    agent.set_lora_rank(4)  # shrink: moments reset, lr kept
    assert all(p not in agent.optimizer.state for p in agent.shared.parameters(agent.adapter_name()))
    assert agent.optimizer.param_groups[0]["lr"] == lr
    metrics = agent.learn(batch[:2] + (torch.rand(4, 4),))
    assert metrics["grad_norm"] > 0


def test_mixed_rank_population_trains_and_generates(tiny, arithmetic_env):
    model, tok = tiny
    hp = HyperparameterConfig(lora_rank=RLParameter(min=2, max=32, dtype=int))
    pop = make_grpo(model, tok, n=3, hp_config=hp)
    for i, a in enumerate(pop):
        _randomise(a, i)
    Mutations(no_mutation=0.0, rl_hp=0.0, lora_rank=1.0, rand_seed=0).mutation(pop)
    ranks = [a.lora_rank for a in pop]
    assert all(m.last_mutation.kind == "lora_rank" for m in pop) and ranks != [8, 8, 8]
    pop[2].set_lora_rank(5)
    prompts = arithmetic_env.reset()
    rollouts = generate_population(pop, prompts)
    for a in pop:  # each member's rows equal what it samples alone (greedy for a deterministic check)
        r = rollouts[a.index]
        assert r.sequences.shape[0] == len(prompts) * a.group_size
        a.learn((*r.per_prompt(), torch.rand(len(prompts), a.group_size)))
    greedy = generate_population(pop, prompts, training=False)
    for a in pop:
        alone, _ = a.get_action(prompts, training=False)
        assert torch.equal(torch.cat(alone), greedy[a.index].sequences)


def test_checkpoint_across_ranks(tiny, tmp_path, trained):
    agent, seqs, _ = trained
    expected = agent.get_logprobs(seqs)
    agent.save_checkpoint(tmp_path / "r8")
    bigger = agent.clone()
    bigger.set_lora_rank(16)
    _randomise(bigger, 5)
    with pytest.raises(ValueError, match=r"r=8.*r=16"):
        bigger.load_checkpoint(tmp_path / "r8")
    bigger.load_checkpoint(tmp_path / "r8", merge_lora_configs=True)  # larger (live) rank wins
    assert bigger.lora_rank == 16
    torch.testing.assert_close(bigger.get_logprobs(seqs), expected, atol=1e-5, rtol=1e-5)
    smaller = agent.clone()
    smaller.set_lora_rank(4)
    smaller.load_checkpoint(tmp_path / "r8", merge_lora_configs=True)  # checkpoint rank wins
    assert smaller.lora_rank == 8
    torch.testing.assert_close(smaller.get_logprobs(seqs), expected, atol=1e-5, rtol=1e-5)


def test_population_checkpoint_round_trip(tiny, tmp_path, arithmetic_env):
    from evollm.algorithms.grpo import GRPO
    from evollm.run.population_checkpoint import load_population, save_population
    from evollm.recipes.warm_start import load_tiny_model
    from evollm.run.population import Population

    model, tok = tiny
    pop = make_grpo(model, tok, n=2, lr=1e-2)
    pop[1].set_lora_rank(4)
    pop[1].set_hyperparameter("beta", 0.03)
    for i, a in enumerate(pop):
        _randomise(a, i)
        a.fitness.append(0.1 * i)
    record = Population(pop)
    record.record_evaluation(1, pop, [0.0, 0.1])
    seqs = torch.cat(pop[0].get_action(arithmetic_env.reset())[0])
    expected = [a.get_logprobs(seqs) for a in pop]
    save_population(pop, record, tmp_path / "pop")
    fresh, _ = load_tiny_model(warm_start=False, seed=0)
    agents, population = load_population(tmp_path / "pop", GRPO, fresh, pad_token_id=tok.pad_token_id,
                                         pad_token=tok.pad_token, eos_token_id=tok.eos_token_id)
    assert [a.index for a in agents] == [a.index for a in pop]
    assert [a.lora_rank for a in agents] == [8, 4] and agents[1].beta == 0.03
    for a, exp in zip(agents, expected):
        torch.testing.assert_close(a.get_logprobs(seqs), exp, atol=1e-5, rtol=1e-5)
    assert population.report().equals(record.report()) and len(population.lineage()) == 2


def _adam_reference(values, state, grads, group):
    """Plain torch AdamW over a copy of ``values`` started from ``state`` (None: fresh)."""
    p = torch.nn.Parameter(values.clone())
    opt = torch.optim.AdamW([p], lr=group["lr"], betas=group["betas"], eps=group["eps"],
                            weight_decay=group["weight_decay"])
    if state is not None:
        opt.state[p] = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in state.items()}
    out = []
    for g in grads:
        p.grad = g.clone()
        opt.step()
        out.append(p.detach().clone())
    return out


@pytest.mark.parametrize("clone_first", [False, True, "checkpoint"])
def test_grown_directions_step_like_a_fresh_adam(trained, clone_first, tmp_path):
    """After a rank growth the new LoRA columns take the steps a fresh Adam would take, the old ones
    the steps their kept moments give; checked for three steps against torch's own AdamW."""
    agent, _, _ = trained
    for _ in range(5):  # a step count well past 1, where a kept count would distort the new entries
        for p in agent.shared.parameters(agent.adapter_name()):
            p.grad = torch.randn_like(p) * 1e-3
        agent.optimizer.step()
    name, B = next((n, p) for n, p in agent.shared.named_parameters(agent.adapter_name()) if "lora_B" in n)
    state_before = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in agent.optimizer.state[B].items()}
    old_values, r = B.detach().clone(), agent.lora_rank
    agent.set_lora_rank(r + 4)
    position = [n for n, _ in agent.shared.named_parameters(agent.adapter_name())].index(name)
    if clone_first == "checkpoint":  # a save + load (e.g. a resumed run) keeps the tracking
        agent.save_checkpoint(tmp_path / "grown")
        agent.load_checkpoint(tmp_path / "grown")
    elif clone_first:  # the clone carries the tracking over to its own optimizer
        agent = agent.clone()
    B = list(agent.shared.parameters(agent.adapter_name()))[position]
    group = agent.optimizer.param_groups[0]
    torch.manual_seed(0)
    grads = [torch.randn_like(B) * 1e-3 for _ in range(3)]
    seen = []
    for g in grads:
        for p in agent.shared.parameters(agent.adapter_name()):
            p.grad = torch.zeros_like(p)
        B.grad = g.clone()
        agent.optimizer.step()
        seen.append(B.detach().clone())
    fresh = _adam_reference(torch.zeros(B.shape[0], 4), None, [g[:, r:] for g in grads], group)
    kept = _adam_reference(old_values, state_before, [g[:, :r] for g in grads], group)
    for got, want_new, want_old in zip(seen, fresh, kept):
        torch.testing.assert_close(got[:, r:], want_new, rtol=1e-5, atol=1e-9)
        torch.testing.assert_close(got[:, :r], want_old, rtol=1e-5, atol=1e-9)
    # the first step of a new direction is about lr in size (a fresh Adam), not 3x as with a kept count
    assert fresh[0].abs().max() == pytest.approx(group["lr"], rel=1e-3)
