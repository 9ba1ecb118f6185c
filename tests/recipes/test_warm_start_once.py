"""The warm start is measured when a run starts and read back on resume, for every kind of env
(single-turn, multi-turn games, IPPO teams): a resume does not evaluate the unchanged base again."""

import json
from types import SimpleNamespace

from evollm.config import RunConfig
from evollm.models.tokenizer import build_tokenizer
from evollm.recipes import runners
from evollm.training.settings import LoopSettings


def test_measured_once_then_read_back(tmp_path):
    cfg = SimpleNamespace(output_dir=str(tmp_path))
    calls = []

    def measure():
        calls.append(1)
        return {"initial_fitness": 0.25, "initial_success": 0.5}

    assert runners.warm_start_once(cfg, LoopSettings(resume=False), measure)["initial_fitness"] == 0.25
    assert json.loads((tmp_path / runners.WARM_START).read_text()) == {"initial_fitness": 0.25, "initial_success": 0.5}
    again = runners.warm_start_once(cfg, LoopSettings(resume=True, checkpoint_dir=str(tmp_path)), lambda: 1 / 0)  # never called
    assert again == {"initial_fitness": 0.25, "initial_success": 0.5} and len(calls) == 1
    (tmp_path / runners.WARM_START).unlink()  # a resume of a run from before the file existed: measured
    assert runners.warm_start_once(cfg, LoopSettings(resume=True, checkpoint_dir=str(tmp_path)), measure)["initial_success"] == 0.5
    assert len(calls) == 2


def test_a_resumed_game_run_does_not_evaluate_the_base_again(tmp_path, monkeypatch, capsys):
    cfg = RunConfig.from_dict({"output_dir": str(tmp_path), "model": {"source": "tiny_multiturn"},
                               "task": {"name": "guess_number"}, "env": {"type": "multiturn", "max_turns": 2},
                               "algorithm": {"name": "LLMPPO"}, "train": {"eval_episodes": 4}})
    member = SimpleNamespace(index=0, fitness=[0.75])
    evaluated = []

    def fake_evaluate(members, pool, seeds, max_turns, record=True):
        evaluated.append(len(seeds))
        return [0.5], {members[0].index: [SimpleNamespace(success=True)] * len(seeds)}

    monkeypatch.setattr(runners, "evaluate_episodes", fake_evaluate)
    monkeypatch.setattr(runners, "success_rate", lambda episodes: 1.0)
    record = SimpleNamespace(best=lambda: member, kept=None)  # the run's record names the best member
    monkeypatch.setattr(runners, "finetune_llm_multiturn", lambda members, *a, **k: (members, record))
    tok = build_tokenizer()
    first = runners.run_multiturn(cfg, [member], tok, LoopSettings(resume=False), None, None, [])
    assert evaluated == [4] and first["initial_fitness"] == 0.5
    resumed = runners.run_multiturn(cfg, [member], tok, LoopSettings(resume=True, checkpoint_dir=str(tmp_path)), None, None, [])
    assert evaluated == [4]  # not again
    assert resumed["initial_fitness"] == 0.5 and resumed["initial_success"] == 1.0
    assert "(measured when the run started)" in capsys.readouterr().out
