"""`evollm export RUN_DIR OUT`: the best member merged into its base, loadable as a plain model,
with the prompt it was trained on."""

import json

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from evollm.recipes.cli import main


def test_export_writes_a_merged_model_that_answers_like_the_best_member(tmp_path, capsys):
    from peft import PeftModel

    from evollm.config import RunConfig
    from evollm.recipes.builders import build_model

    (tmp_path / "lengthy.py").write_text("def score(completion, answer, question):\n    return float(len(completion))\n")
    config = tmp_path / "c.yaml"
    config.write_text(f"""
output_dir: {tmp_path / 'run'}
model: {{source: tiny, warm_start: false}}
task: {{name: arithmetic, n_train: 64, n_test: 4, digits: [1, 1], reward: lengthy.py:score}}
env: {{data_batch_size_per_gpu: 2}}
algorithm: {{name: GRPO, population_size: 2, hyperparameters: {{lr: 0.05, group_size: 4, batch_size: 8,
             max_output_tokens: 3}}}}
train: {{max_steps: 2, evaluation_interval: 2}}
logging: {{tensorboard: false, plots: false}}
""")
    assert main(["train", str(config), "--quiet"]) == 0
    out = tmp_path / "served"
    assert main(["export", str(tmp_path / "run"), str(out)]) == 0
    assert "merged into its base" in capsys.readouterr().out
    merged = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    spec = json.loads((out / "evollm_prompt.json").read_text())
    assert spec["generation"] == {"max_new_tokens": 3, "do_sample": False}
    assert "{" in json.dumps(spec["messages"]) and spec["example"]["prompt_text"]
    cfg = RunConfig.from_dict(json.loads((tmp_path / "run" / "run_config.json").read_text()))
    base, _ = build_model(cfg.model, cfg.seed, cfg.task.name)
    base_logits_model = AutoModelForCausalLM.from_config(base.config)
    base_logits_model.load_state_dict(base.state_dict())
    peft = PeftModel.from_pretrained(base, str(tmp_path / "run" / "best_member" / "adapter"))
    ids = tok(spec["example"]["prompt_text"], add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        want, got, plain = peft(ids).logits, merged(ids).logits, base_logits_model(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(got, plain, atol=1e-6)  # the adapter learnt something, and it is in the weights
    assert main(["export", str(tmp_path / "run"), str(out)]) == 2  # not empty: refused without --overwrite
    assert "pass --overwrite" in capsys.readouterr().err
