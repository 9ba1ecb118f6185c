"""AgileRL's tests/test_wrappers/test_llm_envs.py (ReasoningGym part), ported.

Changed: imports, the tokenizer (evollm's tiny one instead of AgileRL's tiny checkpoint; random
completion ids drawn from its vocabulary), and asserts on AgileRL's DataLoader objects
(``train_dataloader``, ``dataloader``) dropped. Left out: PreferenceGym and SFTGym (evollm has no
DPO/SFT), ``apply_chat_template``/``create_collate_fn`` (AgileRL's DataLoader collation), the
accelerator parametrizations, and the tests that drive private methods (``_get_next_batch``,
``_reset_dataloaders``, ``_filter_dataset_by_max_context_length``); ``TokenObservationWrapper``'s step
guard is checked through the public ``step`` (AgileRL's calls ``_step``).
"""

import pytest
import torch
from datasets import Dataset as HFDataset

from evollm import ReasoningGym, TokenObservationWrapper

from .conftest import DUMMY_CONVERSATION_TEMPLATE, dummy_reward_fn

PROMPT_KEYS = "evollm's prompts carry their question, answer and text, so any batch can be scored on its own"


class TestReasoningGymInit:
    @pytest.mark.parametrize("num_samples", [200])
    def test_reasoning_gym_init(self, reasoning_dataset, tokenizer, num_samples):
        train_dataset, test_dataset = reasoning_dataset
        data_batch_size = 8
        env = ReasoningGym(train_dataset=train_dataset, test_dataset=test_dataset, tokenizer=tokenizer,
                           reward_fn=dummy_reward_fn, conversation_template=DUMMY_CONVERSATION_TEMPLATE,
                           data_batch_size_per_gpu=data_batch_size, accelerator=None)
        assert env.name == "dummy_dataset"
        assert callable(env.reward_fn)
        assert hasattr(env, "tokenizer")
        assert env.tokenizer is not None
        assert not env.reset_called
        assert not env.evaluation_mode
        assert env.data_batch_size_per_gpu == data_batch_size

    def test_reasoning_gym_max_context_length_warning(self, tokenizer):
        train_dataset = HFDataset.from_dict({
            "question": ["This is a prompt that is longer than the max context length. This prompt really is a lot "
                         "longer than the other one.", "This is a prompt that is shorter."],
            "answer": ["This is an answer.", "This is an answer."]})
        test_dataset = HFDataset.from_dict({"question": ["This is a normal length prompt"],
                                            "answer": ["This is an answer."]})
        with pytest.warns(UserWarning, match=r"1 samples were filtered out of the train dataset due to the max "
                                             r"context length constraint."):
            env = ReasoningGym(train_dataset=train_dataset, test_dataset=test_dataset, tokenizer=tokenizer,
                               reward_fn=dummy_reward_fn, conversation_template=DUMMY_CONVERSATION_TEMPLATE,
                               data_batch_size_per_gpu=8, max_context_length=130)
        assert len(env) == 1
        with env.eval_mode():
            assert len(env) == 1

    def test_reasoning_gym_init_missing_features(self, tokenizer):
        good_dataset = HFDataset.from_dict({"question": ["q"], "answer": ["a"]})
        bad_dataset = HFDataset.from_dict({"text": ["t"]})
        with pytest.raises(AssertionError, match="'question' and 'answer'"):
            ReasoningGym(train_dataset=bad_dataset, test_dataset=good_dataset, tokenizer=tokenizer,
                         reward_fn=dummy_reward_fn, conversation_template=DUMMY_CONVERSATION_TEMPLATE)
        with pytest.raises(AssertionError, match="'question' and 'answer'"):
            ReasoningGym(train_dataset=good_dataset, test_dataset=bad_dataset, tokenizer=tokenizer,
                         reward_fn=dummy_reward_fn, conversation_template=DUMMY_CONVERSATION_TEMPLATE)


def _check_prompts(tokenized_prompts, return_raw_completions):
    assert isinstance(tokenized_prompts, list)
    for prompts in tokenized_prompts:
        assert sorted(prompts.keys()) == ["attention_mask", "input_ids", "text"]
        for key, val in prompts.items():
            if key in ("attention_mask", "input_ids"):
                assert isinstance(val, torch.Tensor)
            elif return_raw_completions:
                assert isinstance(val, str)
            else:
                assert val is None


class TestReasoningGymStep:
    @pytest.mark.xfail(strict=True, reason=PROMPT_KEYS)
    @pytest.mark.parametrize("num_samples", [200])
    @pytest.mark.parametrize("eval_mode", [False])
    @pytest.mark.parametrize("return_raw_completions", [True, False])
    def test_reasoning_gym_step(self, reasoning_dataset, tokenizer, num_samples, eval_mode, return_raw_completions):
        train_dataset, test_dataset = reasoning_dataset
        data_batch_size = 8
        env = ReasoningGym(train_dataset=train_dataset, test_dataset=test_dataset, tokenizer=tokenizer,
                           reward_fn=dummy_reward_fn, conversation_template=DUMMY_CONVERSATION_TEMPLATE,
                           data_batch_size_per_gpu=data_batch_size, return_raw_completions=return_raw_completions)
        env.evaluation_mode = eval_mode
        env.reset()
        completions = [torch.randint(0, len(tokenizer), (10, 356)) for _ in range(data_batch_size)]
        tokenized_prompts, rewards = env.step(completions)
        assert isinstance(rewards, torch.Tensor)
        _check_prompts(tokenized_prompts, return_raw_completions)


class TestReasoningGymReset:
    @pytest.mark.xfail(strict=True, reason=PROMPT_KEYS)
    @pytest.mark.parametrize("num_samples", [200])
    @pytest.mark.parametrize("reset_dataloaders", [True])
    @pytest.mark.parametrize("return_raw_completions", [True, False])
    def test_reasoning_gym_reset(self, reasoning_dataset, tokenizer, num_samples, reset_dataloaders,
                                 return_raw_completions):
        train_dataset, test_dataset = reasoning_dataset
        env = ReasoningGym(train_dataset=train_dataset, test_dataset=test_dataset, tokenizer=tokenizer,
                           reward_fn=dummy_reward_fn, conversation_template=DUMMY_CONVERSATION_TEMPLATE,
                           data_batch_size_per_gpu=8, return_raw_completions=return_raw_completions)
        _check_prompts(env.reset(reset_dataloaders), return_raw_completions)

    @pytest.mark.parametrize("num_samples", [200])
    def test_reasoning_gym_reset_warning(self, reasoning_dataset, tokenizer, num_samples):
        train_dataset, test_dataset = reasoning_dataset
        env = ReasoningGym(train_dataset=train_dataset, test_dataset=test_dataset, tokenizer=tokenizer,
                           reward_fn=dummy_reward_fn, conversation_template=DUMMY_CONVERSATION_TEMPLATE,
                           data_batch_size_per_gpu=8)
        env.reset()
        with pytest.warns(UserWarning, match=r"env\.reset\(\) called more than once sequentially"):
            env.reset()


class TestReasoningGymLen:
    @pytest.mark.parametrize("num_samples", [200])
    def test_reasoning_gym_len(self, reasoning_dataset, tokenizer, num_samples):
        train_dataset, test_dataset = reasoning_dataset
        env = ReasoningGym(train_dataset=train_dataset, test_dataset=test_dataset, tokenizer=tokenizer,
                           reward_fn=dummy_reward_fn, conversation_template=DUMMY_CONVERSATION_TEMPLATE,
                           data_batch_size_per_gpu=8)
        env.reset()
        assert len(env) == 200 * 0.8  # Length returns the training length
        with env.eval_mode():
            assert len(env) == 200 * 0.2


class TestReasoningGymEpochs:
    @pytest.mark.parametrize("num_samples", [20])
    @pytest.mark.parametrize("data_batch_size", [8, pytest.param(10, marks=pytest.mark.xfail(
        strict=True, reason="evollm's batches are all full: an epoch's last partial batch is dropped (the rows "
                            "are reshuffled), so 16 rows in batches of 10 take one batch per epoch"))])
    def test_reasoning_gym_counts_epochs_when_train_data_exhausted(self, reasoning_dataset, tokenizer, num_samples,
                                                                    data_batch_size):
        """AgileRL's test_reasoning_gym_reset_dataloaders_when_train_dataloader_exhausted through the
        public API (AgileRL's calls the private ``_get_next_batch``): three batches of 16 rows -> epoch 1."""
        train_dataset, test_dataset = reasoning_dataset
        env = ReasoningGym(train_dataset=train_dataset, test_dataset=test_dataset, tokenizer=tokenizer,
                           reward_fn=dummy_reward_fn, conversation_template=DUMMY_CONVERSATION_TEMPLATE,
                           data_batch_size_per_gpu=data_batch_size)
        prompts = env.reset()
        for _ in range(2):
            prompts, _ = env.step([p["input_ids"].repeat(2, 1) for p in prompts])
        assert env.num_epochs == 1

    @pytest.mark.parametrize("num_samples", [20])
    def test_reasoning_gym_eval_batches_do_not_count_epochs(self, reasoning_dataset, tokenizer, num_samples):
        train_dataset, test_dataset = reasoning_dataset
        env = ReasoningGym(train_dataset=train_dataset, test_dataset=test_dataset, tokenizer=tokenizer,
                           reward_fn=dummy_reward_fn, conversation_template=DUMMY_CONVERSATION_TEMPLATE,
                           data_batch_size_per_gpu=8)
        env.reset()
        for _ in range(10):
            with env.eval_mode():
                prompts = env.reset()
                env.step([p["input_ids"].repeat(2, 1) for p in prompts])
        assert env.num_epochs == 0


class TestReasoningGymEvalMode:
    @pytest.mark.parametrize("num_samples", [20])
    def test_eval_mode_preserves_last_tokenized_prompts(self, reasoning_dataset, tokenizer, num_samples):
        train_dataset, test_dataset = reasoning_dataset
        env = ReasoningGym(train_dataset=train_dataset, test_dataset=test_dataset, tokenizer=tokenizer,
                           reward_fn=dummy_reward_fn, conversation_template=DUMMY_CONVERSATION_TEMPLATE,
                           data_batch_size_per_gpu=4)
        env.reset()
        saved_ids = [p["input_ids"].clone() for p in env.last_tokenized_prompts]
        with env.eval_mode():
            env.reset()
            assert env.evaluation_mode
        assert not env.evaluation_mode
        for original, restored in zip(saved_ids, env.last_tokenized_prompts, strict=False):
            assert torch.equal(original, restored["input_ids"])

    def _eval_mode_restores(self, tokenizer, completions_for):
        train_dataset = HFDataset.from_dict({"question": [f"train question {i}?" for i in range(8)],
                                             "answer": [f"train answer {i}" for i in range(8)]})
        test_dataset = HFDataset.from_dict({"question": [f"test question {i}?" for i in range(6)],
                                            "answer": [f"test answer {i}" for i in range(6)]})
        seen_answers = []

        def recording_reward_fn(completion, answer, question):
            seen_answers.append(answer)
            return 1.0

        env = ReasoningGym(train_dataset=train_dataset, test_dataset=test_dataset, tokenizer=tokenizer,
                           reward_fn=recording_reward_fn, conversation_template=DUMMY_CONVERSATION_TEMPLATE,
                           data_batch_size_per_gpu=4)
        group_size = 8
        prompts = env.reset()
        prompts, _ = env.step(completions_for(prompts, group_size))
        train_answers = list(env.answers)
        train_questions = list(env.questions)
        with env.eval_mode():
            eval_prompts = env.reset()
            _, eval_rewards = env.step(completions_for(eval_prompts, group_size))
            assert eval_rewards.shape == (4, group_size)
            assert len(env.answers) == 2
        assert env.answers == train_answers
        assert env.questions == train_questions
        seen_answers.clear()
        _, rewards = env.step(completions_for(prompts, group_size))
        assert rewards.shape == (len(prompts), group_size)
        assert set(seen_answers) == set(train_answers)

    def test_eval_mode_restores_train_questions_and_answers(self, tokenizer):
        self._eval_mode_restores(tokenizer, lambda batch, g: [torch.randint(0, len(tokenizer), (g, 356))
                                                              for _ in batch])


class TestTokenObservationWrapperStepGuard:
    def test_step_before_reset_raises(self, tokenizer):
        """Stepping before reset() raises (AgileRL calls the private ``_step``; here the public ``step``)."""
        wrapper = TokenObservationWrapper(env=None, tokenizer=tokenizer, max_turns=1, apply_chat_template=False)
        assert wrapper.full_ids is None
        with pytest.raises(RuntimeError, match="reset\\(\\) was never called"):
            wrapper.step(torch.ones(1, 2, dtype=torch.long))
