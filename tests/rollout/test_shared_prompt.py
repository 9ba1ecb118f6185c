"""Shared-prompt loss forwards: each group's prompt computed once, its completions run against the prompt's
keys and values. Log-probs and gradients equal the unshared forward, for plain LoRA, mixed ranks (routed),
DoRA (member by member), the reference, gradient checkpointing, tiny Llama and tiny Qwen2; a model that
cannot take it falls back to the plain forward and says so."""

import pytest
import torch
from test_policy_contract import EOS, PAD, VOCAB, lora, members_for, tiny_base

import evollm.rollout.prefix as prefix
from evollm.rollout import attention_from_sequences, collate_prompts, first_target, member_logprobs
from evollm.rollout.logprobs import forward_logits
from evollm.rollout.prefix import prefix_plan

CONFIGS = {"plain": [lora(4)], "mixed_ranks": [lora(2), lora(8)], "dora": [lora(4, use_dora=True)] * 2}


def groups(n_prompts=3, group=3, completion=5, seed=0, shuffle=True):
    """Left-padded prompts of different lengths, ``group`` completions each (one right-padded), rows shuffled
    as in a minibatch. Returns ``(seqs, attn, action_mask)``."""
    g = torch.Generator().manual_seed(seed)
    prompts = [{"input_ids": torch.randint(10, VOCAB, (n,), generator=g)} for n in (4, 7, 5)[:n_prompts]]
    ids, _ = collate_prompts(prompts, PAD)
    rows = ids.repeat_interleave(group, 0)
    tail = torch.randint(10, VOCAB, (rows.shape[0], completion), generator=g)
    tail[1, -2:] = PAD  # a completion that ended early
    seqs = torch.cat([rows, tail], 1)
    mask = torch.zeros(seqs.shape[0], seqs.shape[1] - 1, dtype=torch.long)
    mask[:, ids.shape[1] - 1:] = 1
    mask[1, -2:] = 0
    if shuffle:
        order = torch.randperm(seqs.shape[0], generator=g)
        seqs, mask = seqs[order], mask[order]
    return seqs, attention_from_sequences(seqs, PAD), mask


def _grads(members):
    out = []
    for m in members:
        for p in m.shared.parameters(m.adapter_name("actor")):
            out.append(p.grad.clone() if p.grad is not None else torch.zeros_like(p))
            p.grad = None
    return out


def _both(members, seqs, attn, mask, grad, reference=False, shares=True, **kw):
    """``(shared, plain)`` log-probs (and gradients of a masked weighted sum) of ``members`` on the rows."""
    shared, names = members[0].shared, [m.adapter_name("actor") for m in members]
    k = seqs.shape[0] // len(names)
    weights = torch.linspace(-1, 1, mask.shape[1])
    out = []
    for share in (True, False):
        info = {}
        lp = member_logprobs(shared, names, seqs, attn, k, grad, reference, [m.config.temperature for m in members],
                             start=first_target(mask), info=info, shared_prompt=share, **kw)
        assert info["shared_prompt"] == float(share and shares)
        if grad:
            (lp * mask * weights).sum().backward()
        out.append((lp.detach(), _grads(members) if grad else None))
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_shared_prompt_equals_plain_forward(arch, config):
    members = members_for(tiny_base(arch), CONFIGS[config])
    seqs, attn, mask = groups()
    rows = torch.cat([seqs] * len(members)), torch.cat([attn] * len(members)), torch.cat([mask] * len(members))
    for grad in (False, True):
        (lp_s, g_s), (lp_p, g_p) = _both(members, *rows, grad)
        m = rows[2].bool()
        torch.testing.assert_close(lp_s[m], lp_p[m], atol=1e-5, rtol=1e-5)
        if grad:
            assert any(g.abs().sum() > 0 for g in g_p)
            for a, b in zip(g_s, g_p):
                torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("arch", ["qwen3", "mistral"])
def test_other_supported_architectures(arch):
    from transformers import MistralConfig, MistralForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, pad_token_id=PAD, eos_token_id=EOS)
    model = (Qwen3ForCausalLM(Qwen3Config(**common)) if arch == "qwen3"
             else MistralForCausalLM(MistralConfig(**common, sliding_window=None)))
    members = members_for(model, [lora(4)])
    seqs, attn, mask = groups()
    (lp_s, g_s), (lp_p, g_p) = _both(members, seqs, attn, mask, True)
    torch.testing.assert_close(lp_s[mask.bool()], lp_p[mask.bool()], atol=1e-5, rtol=1e-5)
    for a, b in zip(g_s, g_p):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_sliding_window_models_take_the_plain_forward():
    from transformers import MistralConfig, MistralForCausalLM

    from evollm.rollout.prefix import shared_prompt_support

    model = MistralForCausalLM(MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=4, num_key_value_heads=2, sliding_window=16))
    assert shared_prompt_support(model) == "sliding-window attention"
    assert shared_prompt_support(tiny_base("qwen2")) is None  # sliding_window set but use_sliding_window off


def test_reference_shares_prompts_across_members():
    members = members_for(tiny_base(), [lora(4), lora(4)])
    seqs, attn, mask = groups()
    rows = torch.cat([seqs, seqs]), torch.cat([attn, attn]), torch.cat([mask, mask])
    (lp_s, _), (lp_p, _) = _both(members, *rows, False, reference=True)
    torch.testing.assert_close(lp_s[rows[2].bool()], lp_p[rows[2].bool()], atol=1e-5, rtol=1e-5)
    plan = prefix_plan(rows[0], rows[1], first_target(rows[2]) - 1)
    assert plan.sources.numel() == 3  # the base alone: one prefix per prompt, whichever member sampled it


@pytest.mark.parametrize("reentrant", [False, True])
def test_shared_prompt_under_gradient_checkpointing(reentrant):
    """Non-reentrant checkpointing (evollm's) shares; reentrant would drop the prefix's gradients: plain forward."""
    model = tiny_base("qwen2")
    members = members_for(model, [lora(4)])
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    seqs, attn, mask = groups()
    calls = []
    mlp = members[0].shared.model.get_base_model().model.layers[0].mlp
    handle = mlp.register_forward_pre_hook(lambda *a: calls.append(1))  # runs in a recompute too
    (lp_s, g_s), (lp_p, g_p) = _both(members, seqs, attn, mask, True, shares=not reentrant)
    handle.remove()
    assert len(calls) == (6 if not reentrant else 4)  # recomputed in backward: prefix + suffix, then the plain pass
    torch.testing.assert_close(lp_s[mask.bool()], lp_p[mask.bool()], atol=1e-5, rtol=1e-5)
    for a, b in zip(g_s, g_p):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_forward_logits_hidden_and_logits_from_the_prompt_end():
    """What PPO's actor and critic read: logits and last hidden states from the last prompt position on."""
    members = members_for(tiny_base(), [lora(4)])
    seqs, attn, mask = groups()
    first = first_target(mask) - 1
    with members[0].shared.use(members[0].adapter_name("actor")) as model:
        s_logits, s_hidden, used = forward_logits(model, seqs, attn, first, hidden=True, shared_prompt=True)
        p_logits, p_hidden, plain = forward_logits(model, seqs, attn, first, hidden=True, shared_prompt=False)
    assert used and not plain
    assert s_logits.shape == p_logits.shape == (seqs.shape[0], seqs.shape[1] - 1 - first, VOCAB)
    torch.testing.assert_close(s_logits, p_logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s_hidden, p_hidden, atol=1e-5, rtol=1e-5)


def test_plan_groups_rows_by_prompt_and_block():
    seqs, attn, mask = groups(shuffle=False)
    first = first_target(mask) - 1
    plan = prefix_plan(seqs, attn, first)
    assert plan.sources.numel() == 3
    assert torch.equal(seqs[plan.sources[plan.index], :first], seqs[:, :first])
    two = prefix_plan(torch.cat([seqs, seqs]), torch.cat([attn, attn]), first, blocks=2)
    assert two.sources.numel() == 6 and torch.all(two.sources[3:] >= 9)  # each block its own prefixes
    assert prefix_plan(seqs[::3], attn[::3], first) is None  # nothing shared


def test_unsupported_model_falls_back_and_says_so(monkeypatch):
    members = members_for(tiny_base(), [lora(4)])
    seqs, attn, mask = groups()
    monkeypatch.setattr(prefix, "SHARED_PROMPT_MODEL_TYPES", ("gpt2",))
    info = {}
    shared, name = members[0].shared, members[0].adapter_name("actor")
    lp = member_logprobs(shared, [name], seqs, attn, seqs.shape[0], False, start=first_target(mask), info=info,
                         shared_prompt=True)
    assert info["shared_prompt"] == 0.0
    plain = member_logprobs(shared, [name], seqs, attn, seqs.shape[0], False, start=first_target(mask),
                            shared_prompt=False)
    torch.testing.assert_close(lp, plain)
