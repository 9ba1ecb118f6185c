"""The fast LoRA forward, the cheap reference pass, the fused optimizer and the chunked fused learn
give exactly what PEFT's own forward and member-by-member learning give."""

import pytest
import torch
from conftest import make_grpo
from peft import LoraConfig, PeftModel

from evollm.adapters import fastlora
from evollm.algorithms.grpo import GRPO


def _perturb(agents, scale=0.05):
    for i, a in enumerate(agents):
        with torch.no_grad():
            for p in a.shared.parameters(a.adapter_name()):
                p.add_(scale * torch.randn(p.shape, generator=torch.Generator().manual_seed(i)))


def _peft_logits(shared, name, x, train=False):
    """The member's logits through PEFT's own forward (fast path switched off)."""
    model = shared.model
    model.set_adapter(name)
    model.train(train)
    with torch.set_grad_enabled(train):
        return model(x).logits


def test_fast_forward_equals_peft_forward_bitwise(tiny):
    model, tok = tiny
    pop = make_grpo(model, tok, n=3)
    _perturb(pop)
    shared = pop[0].shared
    x = torch.randint(5, 40, (3, 9))
    for a in pop:
        name = a.adapter_name()
        assert shared.fast_path(name)
        expected = _peft_logits(shared, name, x)
        with torch.no_grad(), shared.use(name) as m:
            assert shared._fast.mode == name
            got = m(x).logits
        assert torch.equal(got, expected)
    assert shared._fast.mode is None  # outside the context PEFT's forward is back


def test_fast_forward_gradients_equal_peft(tiny):
    model, tok = tiny
    a = make_grpo(model, tok, n=2)[1]
    _perturb([a])
    shared, name = a.shared, a.adapter_name()
    x = torch.randint(5, 40, (2, 7))
    params = shared.parameters(name)
    shared.model.set_adapter(name)
    _peft_logits(shared, name, x, train=True).logsumexp(-1).sum().backward()
    expected = [p.grad.clone() for p in params]
    a.optimizer.zero_grad(set_to_none=True)
    with shared.use(name, train=True) as m:
        m(x).logits.logsumexp(-1).sum().backward()
    for p, g in zip(params, expected):
        assert torch.equal(p.grad, g)


def test_reference_equals_peft_disable_adapter_and_leaves_flags(tiny):
    model, tok = tiny
    pop = make_grpo(model, tok, n=2)
    _perturb(pop)
    shared = pop[0].shared
    x = torch.randint(5, 40, (2, 8))
    with torch.no_grad(), shared.model.disable_adapter():
        expected = shared.model(x).logits
    with torch.no_grad(), shared.reference() as m:
        got = m(x).logits
    assert torch.equal(got, expected)
    assert not any(layer._disable_adapters for _, layer in shared.lora_layers())
    with torch.no_grad(), shared.use(pop[1].adapter_name()) as m:
        assert not torch.equal(m(x).logits, expected)


def test_mode_is_switched_only_on_change(tiny, monkeypatch):
    model, tok = tiny
    a = make_grpo(model, tok)[0]
    a.shared.model.eval()
    calls = []
    original = torch.nn.Module.train
    monkeypatch.setattr(torch.nn.Module, "train", lambda self, mode=True: calls.append(mode) or original(self, mode))
    with a.shared.use(a.adapter_name()):
        pass
    with a.shared.reference():
        pass
    assert calls == []


def test_unsupported_adapter_falls_back_to_peft(tiny):
    """DoRA is not plain LoRA: it runs on PEFT's forward and still matches it."""
    model, tok = tiny
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], use_dora=True, task_type="CAUSAL_LM")
    a = make_grpo(model, tok, lora_config=cfg)[0]
    _perturb([a])
    name = a.adapter_name()
    assert not a.shared.fast_path(name)
    x = torch.randint(5, 40, (2, 6))
    expected = _peft_logits(a.shared, name, x)
    with torch.no_grad(), a.shared.use(name) as m:
        assert a.shared._fast.mode is None
        assert torch.equal(m(x).logits, expected)


def test_lora_dropout_takes_fast_path_only_in_eval(tiny):
    model, tok = tiny
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.1, task_type="CAUSAL_LM")
    a = make_grpo(model, tok, lora_config=cfg)[0]
    name = a.adapter_name()
    with a.shared.use(name, train=False):
        assert a.shared._fast.mode == name
    with a.shared.use(name, train=True):
        assert a.shared._fast.mode is None


def test_fast_trained_adapter_loads_with_peft(tiny, tmp_path):
    from evollm.recipes.warm_start import load_tiny_model

    model, tok = tiny
    pop = make_grpo(model, tok, n=2, lr=1e-2)
    _perturb(pop)
    a = pop[1]
    x = torch.randint(5, 40, (2, 8))
    a.save_checkpoint(tmp_path / "ckpt")
    fresh, _ = load_tiny_model(warm_start=False, seed=0)
    peft_model = PeftModel.from_pretrained(fresh, str(tmp_path / "ckpt" / "adapter"))
    with torch.no_grad(), a.shared.use(a.adapter_name()) as m:
        ours = m(x).logits
        assert torch.equal(peft_model(x).logits, ours)


def test_optimizer_is_fused_or_foreach(tiny):
    model, tok = tiny
    opt = make_grpo(model, tok)[0].optimizer
    assert opt.defaults.get("fused") or opt.defaults.get("foreach")


@pytest.mark.parametrize("chunk", [1, 2])
def test_chunked_fused_learn_equals_member_by_member(tiny, arithmetic_env, chunk):
    model, tok = tiny
    pop = make_grpo(model, tok, n=4, lr=1e-2, batch_size=8, update_epochs=2, learn_chunk_members=chunk)
    pop[1].set_hyperparameter("beta", 0.1)
    _perturb(pop)
    twins = [a.clone() for a in pop]
    prompts = arithmetic_env.reset()
    experiences = []
    for i, a in enumerate(pop):
        ids, masks = a.get_action(prompts)
        experiences.append((ids, masks, torch.rand(4, 4, generator=torch.Generator().manual_seed(i))))
    fused = GRPO.learn_population(pop, experiences)
    alone = [t.learn(e) for t, e in zip(twins, experiences)]
    for a, t, mf, ma in zip(pop, twins, fused, alone):
        for p, q in zip(a.shared.parameters(a.adapter_name()), t.shared.parameters(t.adapter_name())):
            torch.testing.assert_close(p, q, atol=5e-4, rtol=0)
        assert mf["loss"] == pytest.approx(ma["loss"], rel=1e-4, abs=1e-6)
        assert mf["learn_chunks"] == 4 // chunk
        assert mf["learn_path"] == ("member_by_member" if chunk == 1 else "fused_chunked")
        assert ma["learn_path"] == "single"


def test_prefill_only_where_it_pays(tiny):
    from evollm.rollout.sampling import PREFILL_MIN_TOKEN_PARAMS, prefill_pays

    model, _ = tiny
    n = sum(p.numel() for p in model.parameters())
    saved = int(PREFILL_MIN_TOKEN_PARAMS // n) + 1  # (reps - 1) * rows * (prompt_len - 1) tokens saved
    assert prefill_pays(model, rows=saved, prompt_len=2, reps=2)
    assert not prefill_pays(model, rows=max(1, saved // 4), prompt_len=2, reps=2)
    assert not prefill_pays(model, rows=10**6, prompt_len=30, reps=1)


def test_checkpointing_check_follows_enable_and_disable(tiny):
    """The flagged layers are found once; turning checkpointing on or off later is still seen."""
    from evollm.adapters.shared import checkpointing

    model, tok = tiny
    base = make_grpo(model, tok, n=2)[0].shared.model
    assert not checkpointing(base) and not checkpointing(base.get_base_model())
    base.get_base_model().gradient_checkpointing_enable()
    assert checkpointing(base) and checkpointing(base.get_base_model())
    inner = base.get_base_model()  # transformers' flag (called is_gradient_checkpointing before 5.2x)
    assert checkpointing(base) == getattr(inner, "is_activation_checkpointing", inner.is_gradient_checkpointing)
    base.get_base_model().gradient_checkpointing_disable()
    assert not checkpointing(base)
