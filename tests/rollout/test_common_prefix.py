"""Greedy evaluation runs the prompts' common prefix once per member and answers exactly as the plain
left-padded generate does."""

import pytest
import torch
from conftest import make_grpo

import evollm.rollout.common_prefix as cp
from evollm.rollout.common_prefix import common_prefix_length, prefix_layout
from evollm.rollout.population import evaluate_population, generate_population


def test_common_prefix_and_its_layout():
    pad = 0
    ids = torch.tensor([[0, 0, 5, 6, 7, 8], [5, 6, 7, 9, 9, 1], [0, 5, 6, 7, 2, 3]])
    mask = (ids != 0).long()
    mask[1] = 1
    assert common_prefix_length(ids, mask) == 3
    laid, laid_mask = prefix_layout(ids, mask, 3, pad)
    assert laid.tolist() == [[5, 6, 7, 0, 0, 8], [5, 6, 7, 9, 9, 1], [5, 6, 7, 0, 2, 3]]
    assert laid_mask.tolist() == [[1, 1, 1, 0, 0, 1], [1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 1, 1]]
    assert common_prefix_length(ids[:, -1:], mask[:, -1:]) == 0


@pytest.mark.parametrize("n_members", [1, 3])
def test_greedy_answers_are_the_plain_generates(tiny, monkeypatch, n_members):
    from evollm.envs.reasoning import ReasoningGym, conversation_template
    from evollm.tasks import arithmetic_dataset, exact_match_reward

    model, tok = tiny
    train, test = arithmetic_dataset(n_train=16, n_test=12, digits=(1, 2), seed=0)
    arithmetic_env = ReasoningGym(train, test, tok, exact_match_reward,
                                  conversation_template("{question}", system_prompt="12+34=46"), eval_batch_size=8)
    pop = make_grpo(model, tok, n=n_members, max_output_tokens=6)
    torch.manual_seed(1)
    for agent in pop:  # members that differ: each member's prefix keys and values are its own
        for p in agent.shared.parameters(agent.adapter_name("actor")):
            p.data.normal_(0, 0.3)
    prompts = arithmetic_env.test_prompts()
    calls = []
    real = cp.generate_with_common_prefix
    monkeypatch.setattr(cp, "generate_with_common_prefix", lambda *a, **k: calls.append(a[5]) or real(*a, **k))
    monkeypatch.setattr(cp, "PREFILL_MIN_TOKEN_PARAMS", 0)
    shared = generate_population(pop, prompts, training=False)
    fit_shared = evaluate_population(pop, arithmetic_env, record=False)
    assert calls and calls[0] >= 2  # the prefix path ran, with a real common prefix
    monkeypatch.setattr(cp, "PREFILL_MIN_TOKEN_PARAMS", float("inf"))
    plain = generate_population(pop, prompts, training=False)
    assert evaluate_population(pop, arithmetic_env, record=False) == fit_shared
    for agent in pop:
        assert torch.equal(shared[agent.index].sequences, plain[agent.index].sequences)
    completions = {tuple(r.sequences[:, -6:].flatten().tolist()) for r in plain.values()}
    assert n_members == 1 or len(completions) > 1  # the members really answer differently
