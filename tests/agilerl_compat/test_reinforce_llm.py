"""AgileRL's tests/test_algorithms/test_llms/test_reinforce_llm.py, ported (AgileRL's ``REINFORCE`` is
evollm's ``LLMREINFORCE``).

Changed: imports; model construction (evollm's tiny Llama, pad id and vocabulary from its tokenizer,
LoRA on its projections); AgileRL's ``"actor"`` adapter is ``agent.adapter_name("actor")`` here.

Left out (AgileRL internals): vLLM routing and sleep mode, accelerate mocks
(``test_test_method_waits_for_everyone``), Liger loss and its dispatch, sequence packing, the private
advantage helpers (``_compute_token_rewards``, ``_compute_rebn_advantages*``,
``_resolve_advantage_granularity``), the ``clone=True`` actor-protocol assertion, get_action on an
actor without parameters, vLLM importance-sampling metrics.
"""

import pytest
import torch
from unittest.mock import patch

from evollm import LLMREINFORCE as REINFORCE
from evollm import TokenObservationWrapper
from evollm.algorithms.grpo import ActionResult

from .helpers import assert_vllm_get_action_contract, lora_config, tiny_model
from .test_ppo_llm import (GRANULARITY_NAME, THREE_TUPLE, VOCAB, ConstantTargetEnv, _DummyMultiTurnContinueEnv,
                           _DummyMultiTurnEpisodeEnv, _turn_ids, run_test_method_cases)


def _cpu_llmreinforce(**kwargs):
    model, tok = tiny_model()
    max_tokens, input_size = 8, 10
    defaults = {"actor_network": model, "pad_token_id": tok.pad_token_id, "pad_token": "<pad>",
                "lora_config": lora_config(r=4, alpha=16), "batch_size": 4, "micro_batch_size_per_gpu": 2,
                "max_output_tokens": max_tokens, "max_model_len": input_size + max_tokens + 4, "accelerator": None,
                "wrap": False, "gradient_checkpointing": False, "use_vllm": False, "lr": 1e-3, "update_epochs": 1,
                "beta": 0.01, "seed": 0, "device": "cpu", "use_liger_loss": False}
    defaults.update(kwargs)
    return REINFORCE(**defaults)


def _rf(**kwargs):
    model, tok = tiny_model()
    return REINFORCE(actor_network=model, pad_token_id=tok.pad_token_id, pad_token="<pad>",
                     lora_config=lora_config(r=4, alpha=16), wrap=False, gradient_checkpointing=False, **kwargs)


class TestREINFORCEInit:
    def test_init_rejects_output_tokens_not_less_than_model_len(self):
        with pytest.raises(ValueError, match="must be less than"):
            _rf(max_output_tokens=32, max_model_len=16)

    def test_init_clip_coef_non_negative(self):
        with pytest.raises(AssertionError):
            _rf(clip_coef=-0.1)

    def test_init_update_epochs_at_least_one(self):
        with pytest.raises(AssertionError):
            _rf(update_epochs=0)

    def test_init_advantage_granularity_must_be_valid(self):
        with pytest.raises(ValueError, match="advantage_granularity"):
            _rf(advantage_granularity="bad")

    def test_init_chunk_rows_must_be_positive(self):
        with pytest.raises(ValueError, match="chunk_rows must be a positive int"):
            _rf(chunk_rows=0)

    def test_init_stores_chunk_rows(self):
        assert _cpu_llmreinforce(chunk_rows=256).chunk_rows == 256

    def test_init_turn_ratio_pooling_must_be_valid(self):
        with pytest.raises(ValueError, match="turn_ratio_pooling"):
            _rf(turn_ratio_pooling="median")

    def test_init_default_turn_ratio_pooling_is_sum(self):
        assert _cpu_llmreinforce().turn_ratio_pooling == "sum"

    def test_init_clone_requires_pretrained_like_actor(self):
        with pytest.raises(AssertionError, match="PeftModelProtocol"):
            REINFORCE(model_name="tiny", actor_network=object(), pad_token_id=99, pad_token="<pad>", clone=True,
                  wrap=False, gradient_checkpointing=False)

    @pytest.mark.xfail(strict=True, reason=GRANULARITY_NAME)
    def test_init_action_granularity_deprecated_warns_and_overrides(self):
        with pytest.warns(DeprecationWarning, match="action_granularity is deprecated"):
            rf = _cpu_llmreinforce(action_granularity="turn")
        assert rf.advantage_granularity == "turn"


class TestREINFORCEGetAction:
    @pytest.mark.xfail(strict=True, reason=THREE_TUPLE)
    def test_llmreinforce_get_action_hf_path_contract(self):
        rf = _cpu_llmreinforce(use_vllm=False, hf_generate_chunk_size=2, max_model_len=128, max_output_tokens=8)
        prompts = [{"input_ids": torch.randint(1, VOCAB, (1, 10)), "attention_mask": torch.ones(1, 10)}
                   for _ in range(4)]
        for training in (True, False):
            completion_ids, action_masks, _ = rf.get_action(prompts, training=training)
            assert_vllm_get_action_contract(completion_ids=completion_ids, action_masks=action_masks, batch_size=4,
                                            prompt_len=10, pad_token_id=rf.pad_token_id)
        rf.clean_up()


class TestREINFORCELearn:
    def test_learn_multi_turn_explicit_turn_ids(self):
        rf = _cpu_llmreinforce(lr=0.05, update_epochs=2)
        completions = [torch.randint(1, VOCAB, (1, 18))]
        action_masks = [torch.ones(1, 17, dtype=torch.bool)]
        rewards = torch.tensor([[0.5, -0.5]], dtype=torch.float32)
        rf.learn((completions, action_masks, rewards), turn_ids=_turn_ids(10, 8))

    def test_llmreinforce_learns_multiturn(self):
        torch.manual_seed(0)
        rf = _cpu_llmreinforce(lr=0.05, update_epochs=2, use_vllm=False)
        batch_size = 2
        completions = [torch.randint(1, VOCAB, (1, 18)) for _ in range(batch_size)]
        action_masks = [torch.ones(1, 17, dtype=torch.bool) for _ in range(batch_size)]
        turn_ids = _turn_ids(10, 8, batch_size)
        rewards = torch.tensor([[1.0, -0.5], [-0.25, 0.75]], dtype=torch.float32)
        rf.learn((completions, action_masks, rewards), turn_ids=turn_ids)
        pre = {name: param.clone().detach() for name, param in rf.actor.named_parameters()}
        metrics = rf.learn((completions, action_masks, rewards), turn_ids=turn_ids)
        for key in ("loss", "kl", "entropy"):
            assert key in metrics
            assert isinstance(metrics[key], float)
            assert torch.isfinite(torch.tensor(metrics[key]))
        actor = f".{rf.adapter_name('actor')}."
        assert any(actor in n and "lora" in n and not torch.equal(p, pre[n]) for n, p in rf.actor.named_parameters()), \
            "Expected at least one actor LoRA parameter to update"

    def test_learn_token_granularity(self):
        rf = _cpu_llmreinforce(advantage_granularity="token", lr=0.05)
        completions = [torch.randint(1, VOCAB, (1, 18)) for _ in range(2)]
        action_masks = [torch.ones(1, 17, dtype=torch.bool) for _ in range(2)]
        rf.learn((completions, action_masks, torch.tensor([1.0, -1.0]).unsqueeze(-1)))

    def test_learn_with_turn_ids_and_1d_reward_vector(self):
        rf = _cpu_llmreinforce(lr=0.05)
        completions = [torch.randint(1, VOCAB, (1, 18)) for _ in range(2)]
        masks = [torch.ones(1, 17, dtype=torch.bool) for _ in range(2)]
        rf.learn((completions, masks, torch.tensor([0.25, -0.25])), turn_ids=torch.zeros(2, 17, dtype=torch.long))

    def test_llmreinforce_wrap_true_runs_learn(self):
        rf = _rf(batch_size=2, micro_batch_size_per_gpu=2, max_output_tokens=8, max_model_len=32, accelerator=None,
                 use_vllm=False, lr=0.05, update_epochs=1, device="cpu", seed=0)
        completions = [torch.randint(1, VOCAB, (1, 18)) for _ in range(2)]
        masks = [torch.ones(1, 17, dtype=torch.bool) for _ in range(2)]
        rf.learn((completions, masks, torch.tensor([[1.0], [-1.0]])))


class TestREINFORCETest:
    def test_test_method_reasoning_gym_branch(self):
        run_test_method_cases(_cpu_llmreinforce)

    def test_test_method_multiturn_episode_env_branch(self):
        rf = _cpu_llmreinforce()
        env = _DummyMultiTurnEpisodeEnv()
        completion = torch.ones(1, 6, dtype=torch.long)
        with patch.object(rf, "get_action", return_value=ActionResult([completion], [torch.ones(1, 5).bool()])) as ga:
            out = rf.test(env, loop=2)
        assert out.shape == ()
        assert out.item() == pytest.approx(1.0)
        assert ga.call_count == 2
        for call in ga.call_args_list:
            assert call.args[0][0] is env.valid_prompt
        assert rf.fitness[-1] == pytest.approx(1.0)

    def test_test_method_multiturn_continues_when_not_done(self):
        rf = _cpu_llmreinforce()
        with patch.object(rf, "get_action", return_value=ActionResult([torch.ones(1, 6, dtype=torch.long)], None)) as ga:
            out = rf.test(_DummyMultiTurnContinueEnv(), loop=1)
        assert out.shape == ()
        assert ga.call_count == 2
        assert ga.call_args_list[0].args[0][0]["input_ids"].shape[-1] == 4
        assert ga.call_args_list[1].args[0][0]["input_ids"].shape[-1] == 5

    def test_test_method_unknown_env_typeerror(self):
        with pytest.raises(TypeError, match="env must be a ReasoningGym"):
            _cpu_llmreinforce().test(object(), loop=1)

    def test_test_method_token_observation_wrapper_branch(self, tiny):
        _, tok = tiny
        env = TokenObservationWrapper(ConstantTargetEnv(target_digit="1", prompt="1"), tok, max_turns=1,
                                      pad_id=tok.pad_token_id, apply_chat_template=False, max_model_len=128,
                                      max_output_tokens=8)
        rf = _cpu_llmreinforce(max_model_len=128, max_output_tokens=8)
        out = rf.test(env, loop=1)
        assert out.shape == ()
        assert rf.fitness[-1] == pytest.approx(float(out))
