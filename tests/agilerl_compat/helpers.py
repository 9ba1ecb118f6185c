"""Model construction for the AgileRL port: AgileRL's ``create_module``/``model_factory`` -> evollm's tiny
Llama (same seed each time, so two agents built apart share base weights, as two loads of one
checkpoint do); AgileRL's ``assert_vllm_get_action_contract`` from its tests/utils.py."""

import torch
from peft import LoraConfig

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj", "gate_proj"]


def tiny_model():
    from evollm.recipes.warm_start import load_tiny_model

    return load_tiny_model(warm_start=False, seed=0)


def lora_config(r: int = 16, alpha: int = 64) -> LoraConfig:
    return LoraConfig(r=r, lora_alpha=alpha, target_modules=TARGETS, task_type="CAUSAL_LM", lora_dropout=0.05)


def assert_vllm_get_action_contract(completion_ids, action_masks, batch_size, prompt_len, pad_token_id) -> None:
    assert len(completion_ids) == batch_size
    assert len(action_masks) == batch_size
    for completion_id, action_mask in zip(completion_ids, action_masks, strict=True):
        assert completion_id.dim() == 2
        assert action_mask.dim() == 2
        assert completion_id.shape[1] > prompt_len
        assert action_mask.shape[1] == completion_id.shape[1] - 1
        assert action_mask.dtype == torch.bool
        pad_positions = completion_id[:, 1:] == pad_token_id
        assert not action_mask[pad_positions].any()
