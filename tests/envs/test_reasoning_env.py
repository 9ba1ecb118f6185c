"""ReasoningGym contract: batches, rewards shape, fixed test set, clear errors."""

import math

import pytest
import torch
from conftest import make_grpo

from evollm.envs.reasoning import ReasoningGym, RewardFunctionError
from evollm.tasks import ARITHMETIC_TEMPLATE, arithmetic_dataset


@pytest.fixture
def data():
    return arithmetic_dataset(n_train=40, n_test=6, digits=(1, 1), seed=1)


def test_reset_step_shapes_and_rewards(tiny, data):
    model, tok = tiny
    train, test = data
    env = ReasoningGym(train, test, tok, lambda c, a, q: float(len(c)), ARITHMETIC_TEMPLATE,
                       data_batch_size_per_gpu=3)
    prompts = env.reset()
    assert len(prompts) == 3 and all(p["input_ids"].shape[0] == 1 for p in prompts)
    with pytest.warns(UserWarning, match="called more than once sequentially"):
        assert env.reset() is prompts  # reset does not advance (and warns, as AgileRL's does)
    agent = make_grpo(model, tok, n=1, group_size=5)[0]
    ids, masks = agent.get_action(prompts)
    assert len(ids) == 3 and ids[0].shape[0] == 5
    nxt, rewards = env.step(ids)
    assert rewards.shape == (3, 5)
    # the reward is the decoded completion's length: at most max_output_tokens characters
    assert float(rewards.max()) <= agent.max_output_tokens
    assert nxt is not prompts and env.reset() is nxt


def test_completion_strings_and_decoding(tiny, data):
    _, tok = tiny
    train, test = data
    seen = []
    env = ReasoningGym(train, test, tok, lambda c, a, q: seen.append((c, a, q)) or 1.0, ARITHMETIC_TEMPLATE,
                       data_batch_size_per_gpu=2)
    prompts = env.reset()
    width = max(p["input_ids"].shape[1] for p in prompts)
    rows = []
    for p in prompts:
        pad = torch.full((1, width - p["input_ids"].shape[1]), tok.pad_token_id)
        body = torch.tensor([tok.encode("42", add_special_tokens=False) + [tok.eos_token_id, tok.pad_token_id]])
        rows.append(torch.cat([pad, p["input_ids"], body], dim=1))
    rewards = env.score(rows)
    assert rewards.shape == (2, 1)
    assert [c for c, _, _ in seen] == ["42", "42"]  # cut at eos, specials dropped
    assert seen[0][1] == prompts[0]["answer"] and seen[0][2] == prompts[0]["question"]


def test_test_set_is_fixed(tiny, data):
    _, tok = tiny
    env = ReasoningGym(*data, tok, lambda c, a, q: 0.0, ARITHMETIC_TEMPLATE, data_batch_size_per_gpu=2)
    first = [p["question"] for p in env.test_prompts()]
    env.step([["1", "2"], ["3", "4"]])
    assert [p["question"] for p in env.test_prompts()] == first == list(data[1]["question"])


def test_too_long_prompt_is_rejected_on_request(tiny, data):
    _, tok = tiny
    with pytest.raises(ValueError, match="max_context_length=5"):
        ReasoningGym(*data, tok, lambda c, a, q: 0.0, ARITHMETIC_TEMPLATE, max_context_length=5,
                     long_prompts="raise")


@pytest.mark.parametrize("bad, match", [(lambda c, a, q: 1 / 0, "ZeroDivisionError"),
                                        (lambda c, a, q: math.nan, "not a finite number"),
                                        (lambda c, a, q: "high", "not a finite number")])
def test_reward_errors_name_the_sample(tiny, data, bad, match):
    _, tok = tiny
    env = ReasoningGym(*data, tok, bad, ARITHMETIC_TEMPLATE, data_batch_size_per_gpu=2)
    with pytest.raises(RewardFunctionError, match=match) as err:
        env.step([["7"], ["8"]])
    assert "sample 0" in str(err.value) and "question=" in str(err.value)


def test_missing_columns(tiny):
    _, tok = tiny
    with pytest.raises(ValueError, match="train row 0: needs a 'question' column"):
        ReasoningGym([{"q": 1}], [{"q": 2}], tok, lambda c, a, q: 0.0, ARITHMETIC_TEMPLATE, data_batch_size_per_gpu=1)
