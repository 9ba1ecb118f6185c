"""One frozen base, many adapters: sharing, routing, cloning, release."""

import pytest
import torch
from conftest import make_grpo

from evollm.adapters.routing import routed
from evollm.adapters.shared import default_lora_config


def _base_storage(model):
    return {n: p.data_ptr() for n, p in model.named_parameters() if "lora_" not in n}


def test_members_share_every_base_tensor(tiny):
    model, tok = tiny
    before = {n: p.data_ptr() for n, p in model.named_parameters()}
    pop = make_grpo(model, tok, n=4)
    shared = pop[0].shared
    assert all(a.shared is shared for a in pop)
    storage = _base_storage(shared.model)
    assert len(storage) == len(before)
    # every base tensor of the population is the very storage of the user's model
    assert sorted(storage.values()) == sorted(before.values())
    assert all(not p.requires_grad for p in shared.base_parameters())
    clone = pop[1].clone()
    assert _base_storage(clone.shared.model) == storage
    assert len({a.index for a in pop + [clone]}) == 5


def test_ids_are_never_reused(tiny):
    model, tok = tiny
    pop = make_grpo(model, tok, n=2)
    gone = pop[1].index
    pop[1].release()
    assert not pop[0].shared.has_adapter(f"m{gone}")
    fresh = pop[0].clone()
    assert fresh.index not in (pop[0].index, gone)
    with pytest.raises(ValueError, match="never reused"):
        pop[0].clone(index=gone)


def test_release_frees_adapter_and_optimizer(tiny):
    model, tok = tiny
    pop = make_grpo(model, tok, n=3)
    n_params = sum(p.numel() for p in pop[0].shared.model.parameters())
    per_member = sum(p.numel() for p in pop[2].shared.parameters(pop[2].adapter_name()))
    pop[2].release()
    assert sum(p.numel() for p in pop[0].shared.model.parameters()) == n_params - per_member
    assert pop[2].optimizer is None


def _randomise(agent, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in agent.shared.parameters(agent.adapter_name()):
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)


@pytest.mark.parametrize("counts", [[3, 3, 3], [1, 4, 2]])
def test_routed_batch_equals_each_member_alone(tiny, counts):
    model, tok = tiny
    pop = make_grpo(model, tok, n=2)
    pop.append(make_grpo(model, tok, n=1, lora_config=default_lora_config(r=4))[0])  # mixed ranks
    for i, a in enumerate(pop):
        _randomise(a, i)
    x = torch.randint(5, 40, (sum(counts), 7))
    expected, start = [], 0
    for a, c in zip(pop, counts):
        with torch.no_grad(), a.shared.use(a.adapter_name()) as m:
            expected.append(m(x[start:start + c]).logits)
        start += c
    with torch.no_grad(), routed(pop[0].shared, [a.adapter_name() for a in pop], counts) as m:
        got = m(x).logits
    torch.testing.assert_close(got, torch.cat(expected), atol=1e-5, rtol=1e-5)


def test_routed_gradients_reach_only_own_adapter(tiny):
    model, tok = tiny
    pop = make_grpo(model, tok, n=2)
    for i, a in enumerate(pop):
        _randomise(a, i)
    x = torch.randint(5, 40, (4, 6))
    with routed(pop[0].shared, [a.adapter_name() for a in pop], [2, 2], differentiable=True) as m:
        m(x).logits[:2].sum().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in pop[0].shared.parameters("m%d" % pop[0].index))
    assert all(p.grad is None or p.grad.abs().sum() == 0 for p in pop[1].shared.parameters(pop[1].adapter_name()))


def test_clone_is_independent(tiny, arithmetic_env):
    model, tok = tiny
    parent = make_grpo(model, tok, n=1, lr=1e-2)[0]
    _randomise(parent, 0)
    prompts = arithmetic_env.reset()
    ids, masks = parent.get_action(prompts)
    rewards = torch.rand(len(prompts), 4)
    parent.learn((ids, masks, rewards))  # parent has optimizer state now
    child = parent.clone()
    assert child.index != parent.index and child.adapter_name() != parent.adapter_name()
    p_before = [p.detach().clone() for p in parent.shared.parameters(parent.adapter_name())]
    c_before = [p.detach().clone() for p in child.shared.parameters(child.adapter_name())]
    for a, b in zip(p_before, c_before):
        assert torch.equal(a, b)
    # optimizer moments are copies, not aliases
    ps = parent.optimizer.state_dict()["state"]
    cs = child.optimizer.state_dict()["state"]
    assert ps.keys() == cs.keys()
    k = next(iter(ps))
    assert torch.equal(ps[k]["exp_avg"], cs[k]["exp_avg"])
    assert ps[k]["exp_avg"].data_ptr() != cs[k]["exp_avg"].data_ptr()
    child.learn((ids, masks, rewards))
    assert all(torch.equal(a, p) for a, p in zip(p_before, parent.shared.parameters(parent.adapter_name())))
    assert any(not torch.equal(a, p) for a, p in zip(c_before, child.shared.parameters(child.adapter_name())))
    parent.learn((ids, masks, rewards * 0 + torch.tensor([1.0, 0, 0, 0])))
    after_child = [p.detach().clone() for p in child.shared.parameters(child.adapter_name())]
    parent.learn((ids, masks, rewards))
    assert all(torch.equal(a, p) for a, p in zip(after_child, child.shared.parameters(child.adapter_name())))


def test_a_member_trains_to_the_same_bits_whatever_the_adapters_parked_beside_it():
    """Members share one base, and nothing of the others reaches a member's numbers: with two adapters of
    other values parked beside it (or none), its samples and its trained weights are the same to the bit."""
    from evollm.envs.reasoning import ReasoningGym
    from evollm.recipes.warm_start import load_tiny_model
    from evollm.tasks import ARITHMETIC_TEMPLATE, arithmetic_dataset, exact_match_reward

    def train(others: int, seed: int) -> list:
        torch.manual_seed(0)
        model, tok = load_tiny_model(warm_start=False, seed=0)
        train_set, test_set = arithmetic_dataset(n_train=64, n_test=8, digits=(1, 1), seed=0)
        env = ReasoningGym(train_set, test_set, tok, exact_match_reward, ARITHMETIC_TEMPLATE, data_batch_size_per_gpu=4)
        pop = make_grpo(model, tok, n=1 + others, lr=1e-2)
        for i, a in enumerate(pop[1:]):
            _randomise(a, seed + i)
        member = pop[0]
        _randomise(member, 0)
        before = [p.detach().clone() for p in member.shared.parameters(member.adapter_name())]
        for step in range(2):
            torch.manual_seed(step)
            prompts = env.reset()
            ids, masks = member.get_action(prompts)
            member.learn((ids, masks, torch.rand(len(prompts), 4)))
        after = [p.detach().clone() for p in member.shared.parameters(member.adapter_name())]
        assert any(not torch.equal(a, b) for a, b in zip(before, after))  # it did learn
        return after

    alone = train(0, 0)
    for others, seed in ((2, 1), (2, 7)):
        assert all(torch.equal(a, b) for a, b in zip(alone, train(others, seed)))


def test_clone_copies_hyperparameters_and_hooks(tiny):
    model, tok = tiny
    parent = make_grpo(model, tok, n=1, lr=3e-4, beta=0.02)[0]
    calls = []
    parent.register_mutation_hook(lambda a: calls.append(a.index))
    parent.fitness.append(0.5)
    child = parent.clone()
    assert child.lr == 3e-4 and child.beta == 0.02
    assert child.fitness == [] and child.parent_index == parent.index and parent.fitness == [0.5]
    child.set_hyperparameter("lr", 1e-3)
    assert parent.lr == 3e-4 and parent.optimizer.param_groups[0]["lr"] == 3e-4
    child.run_mutation_hooks()
    assert calls == [child.index]


def test_shared_prompt_prefix_matches_plain_generation(tiny, arithmetic_env):
    """Prefilling each prompt once and repeating its KV cache gives the same tokens."""
    from evollm.rollout import SamplingConfig, collate_prompts, generate

    model, tok = tiny
    pop = make_grpo(model, tok, n=2)
    for i, a in enumerate(pop):
        _randomise(a, i)
    ids, mask = collate_prompts(arithmetic_env.reset(), tok.pad_token_id)
    names = [a.adapter_name() for a in pop]
    greedy = dict(max_new_tokens=5, do_sample=False)
    with routed(pop[0].shared, names, [ids.shape[0]] * 2) as m:
        shared_prefix = generate(m, ids.repeat(2, 1), mask.repeat(2, 1), SamplingConfig(num_return_sequences=3, **greedy),
                                 tok.pad_token_id, tok.eos_token_id, share_prefix=True)
        plain = generate(m, ids.repeat(2, 1).repeat_interleave(3, 0), mask.repeat(2, 1).repeat_interleave(3, 0),
                         SamplingConfig(num_return_sequences=1, **greedy), tok.pad_token_id, tok.eos_token_id)
    assert torch.equal(shared_prefix, plain)
