"""``evollm export RUN_DIR OUT``: the best member as a plain model a user can serve.

``OUT`` gets the base model with the best member's LoRA adapter merged in (PEFT
``merge_and_unload``, safetensors), its tokenizer, and ``evollm_prompt.json``: how the run built each
prompt (the messages with their ``{column}`` placeholders, the chat-template options, the greedy
generation settings the member was evaluated with, and one rendered example), so the model is asked
exactly as it was trained. The folder loads with ``AutoModelForCausalLM.from_pretrained(OUT)``; vLLM,
TGI or llama.cpp's converter take it as any Hugging Face model folder.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from evollm.config.schema import ConfigError
from evollm.utils.atomic import write_atomically, write_json

PROMPT_FILE = "evollm_prompt.json"


def _read_run(run_dir: Path):
    from evollm.config import RunConfig

    config = run_dir / "run_config.json"
    if not config.is_file():
        raise ConfigError(f"{str(run_dir)!r} is not an evollm run directory (no run_config.json)")
    try:
        return RunConfig.from_dict(json.loads(config.read_text()))
    except ValueError as e:
        raise ConfigError(f"{config}: {e}") from e


def prompt_spec(cfg, tokenizer, agent_info: dict) -> dict:
    """What ``evollm_prompt.json`` holds (see the module docstring)."""
    from evollm.envs.reasoning import prompt_messages, render_messages
    from evollm.recipes.builders import build_task

    hps = agent_info.get("config", {})
    spec = {"generation": {"max_new_tokens": hps.get("max_output_tokens"), "do_sample": False},
            "chat_template_kwargs": dict(cfg.task.chat_template_kwargs)}
    if cfg.env.type != "reasoning":
        spec["note"] = f"env.type={cfg.env.type!r}: prompts are the game's own turns (task {cfg.task.name!r})"
        return spec
    _, test, _, template = build_task(cfg.task, cfg.seed)
    row = dict(test[0])
    messages, _ = prompt_messages(row, template)
    if template is None and "question" in row:
        template = [{"role": "user", "content": "{question}"}]
    spec.update(
        messages=template,
        how=("fill every {column} of messages from a row of your data (str.format), then "
             "tokenizer.apply_chat_template(messages, add_generation_prompt=True, **chat_template_kwargs); "
             "a final assistant message is a prefill: use continue_final_message=True instead"
             if template is not None else
             "one user message holding the question (a TRL text prompt as it is; a conversational prompt's own "
             "messages), then tokenizer.apply_chat_template(messages, add_generation_prompt=True)"),
        example={"row": {k: v for k, v in row.items() if isinstance(v, (str, int, float, bool, list, dict))},
                 "prompt_text": render_messages(tokenizer, messages, cfg.task.chat_template_kwargs)})
    return spec


def export_run(run_dir: str, out: str, overwrite: bool = False) -> Path:
    """Write the best member of ``run_dir`` merged into its base, the tokenizer and the prompt to ``out``."""
    from peft import PeftModel

    from evollm.recipes.builders import build_model

    run, target = Path(run_dir), Path(out)
    if not run.is_dir():
        raise ConfigError(f"run directory {run_dir!r} does not exist")
    cfg = _read_run(run)
    member = run / "best_member"
    if not (member / "adapter" / "adapter_config.json").is_file():
        raise ConfigError(f"{run_dir!r} has no best_member/adapter yet (written when the run ends); finish it "
                          f"with `evollm resume {run_dir}` first")
    if target.exists() and any(target.iterdir()):
        if not overwrite:
            raise ConfigError(f"{out!r} is not empty; pass --overwrite to replace it or choose another folder")
        shutil.rmtree(target)
    info = json.loads((member / "agent.json").read_text()) if (member / "agent.json").is_file() else {}
    model, tokenizer = build_model(cfg.model, cfg.seed, cfg.task.name)
    merged = PeftModel.from_pretrained(model, str(member / "adapter")).merge_and_unload()
    spec = prompt_spec(cfg, tokenizer, info)
    spec.update(run_dir=str(run.resolve()), member=info.get("index"), fitness=(info.get("fitness") or [None])[-1])

    def write(tmp: Path) -> None:  # a reader never sees half an export: the folder appears whole
        merged.save_pretrained(str(tmp), safe_serialization=True)
        tokenizer.save_pretrained(str(tmp))
        write_json(tmp / PROMPT_FILE, spec)

    shutil.rmtree(target, ignore_errors=True)
    return write_atomically(target, write)
