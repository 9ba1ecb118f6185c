"""Tests of the char tokenizer, the tiny model and the cached warm start."""

from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoTokenizer, LlamaForCausalLM

from evollm.models import ALPHABET, SPECIAL_TOKENS, build_tiny_model, build_tokenizer, tiny_config
from evollm.recipes import (
    evaluate_accuracy, generate_completions, load_tiny_model, sft_warm_start, teacher_forced_accuracy,
    well_formed_rate,
)
from evollm.recipes import warm_start as ws
from evollm.tasks import ARITHMETIC_TEMPLATE, arithmetic_dataset, exact_match_reward

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """The tiny model gains little from a second thread and loses a lot when the cores are busy."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def _same_weights(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


# --------------------------------------------------------------------------- tokenizer

@pytest.mark.parametrize("text", [
    "12+34=46",
    "Hello,  world!\n\nTwo  spaces and\ttab ",
    "  leading and trailing  ",
    "\n",
    ALPHABET,
    "(a*b) - c/d >= 'e' \"f\" _#?:;.",
])
def test_tokenizer_round_trip(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) == len(text)  # one token per character
    assert tok.decode(ids) == text


def test_special_tokens_are_single_ids(tok):
    assert tok.pad_token == "<pad>" and tok.pad_token_id == 0
    assert tok.eos_token == "<eos>" and tok.unk_token == "<unk>"
    ids = [tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS]
    assert len(set(ids)) == len(SPECIAL_TOKENS)
    for t, i in zip(SPECIAL_TOKENS, ids):
        assert tok.encode(t, add_special_tokens=False) == [i]
    assert tok.encode("<|user|>7<eos>", add_special_tokens=False) == [
        tok.convert_tokens_to_ids("<|user|>"), tok.convert_tokens_to_ids("7"), tok.eos_token_id]
    assert tok.decode(tok.encode("<|user|>7<eos>", add_special_tokens=False), skip_special_tokens=True) == "7"
    assert tok.padding_side == "left"


def test_chat_template(tok):
    user = [{"role": "user", "content": "12+34="}]
    assert tok.apply_chat_template(user, add_generation_prompt=True, tokenize=False) == "<|user|>12+34=<|assistant|>"
    assert tok.apply_chat_template(user, tokenize=False) == "<|user|>12+34="
    conv = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "1+1="},
        {"role": "assistant", "content": "2"},
        {"role": "user", "content": "2+2="},
    ]
    assert (tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=False)
            == "<|system|>Be brief.<|user|>1+1=<|assistant|>2<eos><|user|>2+2=<|assistant|>")


def test_left_padding(tok):
    batch = tok(["1+2=", "11+22="], padding=True, add_special_tokens=False, return_tensors="pt")
    assert batch["input_ids"][0, :2].tolist() == [0, 0]
    assert batch["attention_mask"][0].tolist() == [0, 0, 1, 1, 1, 1]


def test_tokenizer_save_and_autotokenizer_reload(tok, tmp_path):
    # Saved next to a (Llama) model config, exactly as the warm-start cache does.
    build_tiny_model(tok).save_pretrained(tmp_path, safe_serialization=True)
    tok.save_pretrained(tmp_path)
    tok2 = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    text = "Hello,  world!\n 12 + 34 = 46 "
    assert tok2.encode(text, add_special_tokens=False) == tok.encode(text, add_special_tokens=False)
    assert tok2.decode(tok2.encode(text, add_special_tokens=False)) == text
    assert tok2.get_vocab() == tok.get_vocab()
    assert [tok2.pad_token_id, tok2.eos_token_id, tok2.unk_token_id] == [tok.pad_token_id, tok.eos_token_id,
                                                                         tok.unk_token_id]
    assert tok2.padding_side == "left"
    conv = [{"role": "user", "content": "12+34="}, {"role": "assistant", "content": "46"}]
    assert tok2.apply_chat_template(conv, tokenize=False) == "<|user|>12+34=<|assistant|>46<eos>"


# --------------------------------------------------------------------------- tiny model

def test_tiny_config_overrides(tok):
    cfg = tiny_config(len(tok), hidden_size=64, num_hidden_layers=1)
    assert cfg.model_type == "llama" and cfg.hidden_size == 64 and cfg.num_hidden_layers == 1
    assert cfg.vocab_size == len(tok) and cfg.pad_token_id == 0


def test_tiny_model_generates_greedy_and_sampled(tok):
    model = build_tiny_model(tok, seed=0)
    assert model.generation_config.pad_token_id == tok.pad_token_id
    assert model.generation_config.eos_token_id == tok.eos_token_id
    batch = tok(["<|user|>1+2=<|assistant|>", "<|user|>11+22=<|assistant|>"], padding=True,
                add_special_tokens=False, return_tensors="pt")
    greedy = model.generate(**batch, max_new_tokens=5, do_sample=False)
    assert greedy.shape[0] == 2 and greedy.shape[1] <= batch["input_ids"].shape[1] + 5
    torch.manual_seed(0)
    sampled = model.generate(**batch, max_new_tokens=5, do_sample=True, temperature=1.0)
    assert sampled.shape[0] == 2
    assert torch.equal(model.generate(**batch, max_new_tokens=5, do_sample=False), greedy)


def test_tiny_model_accepts_lora(tok):
    model = build_tiny_model(tok, seed=0)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS))
    trainable = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert {t for t in LORA_TARGETS if any(f".{t}.lora_A" in n for n in trainable)} == set(LORA_TARGETS)
    ids = torch.tensor([tok.encode("<|user|>1+2=<|assistant|>3<eos>", add_special_tokens=False)])
    out = peft_model(input_ids=ids, labels=ids)
    out.loss.backward()
    assert peft_model.generate(input_ids=ids, max_new_tokens=3, do_sample=True).shape[0] == 1


def test_random_init_is_deterministic(tmp_path, monkeypatch):
    monkeypatch.setenv("EVOLLM_CACHE", str(tmp_path))
    m1, t1 = load_tiny_model(warm_start=False, seed=0)
    torch.manual_seed(123)  # global RNG state must not matter
    m2, _ = load_tiny_model(warm_start=False, seed=0)
    m3, _ = load_tiny_model(warm_start=False, seed=1)
    assert _same_weights(m1, m2)
    assert not _same_weights(m1, m3)
    assert list(tmp_path.iterdir()) == []  # nothing written without a warm start
    assert t1.pad_token_id == 0


# --------------------------------------------------------------------------- SFT and evaluation

def test_sft_learns_and_evaluations_agree(tok):
    train, test = arithmetic_dataset(n_train=64, n_test=32, digits=(1, 1), seed=0)
    model = build_tiny_model(tok, seed=0)
    ids = torch.tensor([tok.encode("<|user|>3+4=<|assistant|>7<eos>", add_special_tokens=False)])
    before = model(input_ids=ids, labels=ids).loss.item()
    calls = []
    sft_warm_start(model, tok, train, ARITHMETIC_TEMPLATE, steps=40, lr=3e-3, batch_size=32, seed=0,
                   callback=lambda step, m: calls.append(step) or step >= 30, callback_every=10)
    assert calls == [10, 20, 30]  # stopped early by the callback
    assert model(input_ids=ids, labels=ids).loss.item() < before
    greedy = generate_completions(model, tok, test)
    assert well_formed_rate(greedy) > 0.9  # digits then <eos> already after a few steps
    assert evaluate_accuracy(model, tok, test) == pytest.approx(teacher_forced_accuracy(model, tok, test), abs=0.04)
    sampled = evaluate_accuracy(model, tok, test, do_sample=True, seed=0)
    assert sampled == evaluate_accuracy(model, tok, test, do_sample=True, seed=0)


# --------------------------------------------------------------------------- cache

def test_warm_start_cache_round_trip(tmp_path, monkeypatch):
    m1, t1 = load_tiny_model(warm_start=True, cache_dir=tmp_path, _sft_steps=10)
    entries = list(tmp_path.iterdir())
    assert len(entries) == 1 and entries[0].name.startswith("tiny-arith-")  # no leftover temp dirs
    files = {p.name for p in entries[0].iterdir()}
    assert "model.safetensors" in files and "tokenizer.json" in files
    assert not [f for f in files if f.endswith((".bin", ".pt", ".pth"))]

    def no_build(*args, **kwargs):
        raise AssertionError("the second call must load from disk")

    monkeypatch.setattr(ws, "build_warm_start", no_build)
    m2, t2 = load_tiny_model(warm_start=True, cache_dir=tmp_path, _sft_steps=10)
    assert isinstance(m2, LlamaForCausalLM)
    assert _same_weights(m1, m2)
    assert t2.get_vocab() == t1.get_vocab() and t2.padding_side == "left"
    assert t2.decode(t2.encode(" a b\n", add_special_tokens=False)) == " a b\n"
    assert m2.generation_config.eos_token_id == t2.eos_token_id

    monkeypatch.setenv("EVOLLM_CACHE", str(tmp_path / "env"))
    assert ws.default_cache_dir() == Path(tmp_path / "env")


def test_default_warm_start_is_partial(warm):
    """The default recipe: well-formed answers, partly right (greedy and sampled)."""
    model, tok = warm
    _, test = arithmetic_dataset(ops=("+",), digits=(1, 2))
    assert 0.25 <= teacher_forced_accuracy(model, tok, test) <= 0.6
    rows = list(test)[:128]
    sampled = generate_completions(model, tok, rows, batch_size=128, do_sample=True, seed=0)
    assert well_formed_rate(sampled) >= 0.9
    assert sum(exact_match_reward(c, r["answer"]) for c, r in zip(sampled, rows)) / len(rows) >= 0.12
