"""keep_best: the run's best evaluated state is kept (a clone that takes no further step), returned by
Population.best() when no live member reaches it, and saved/restored with run checkpoints.

The loop runs on a scripted train step (each member's first LoRA tensor moved by a planned amount) and an
evaluation that reads the weights (fitness = the sum of the member's adapter tensors), so every kept
state can be checked against the exact weights it was measured on."""

import math

import pytest
import torch
from conftest import StopAt, make_grpo

from evollm.run import RunCheckpointer
from evollm.run.best_state import KeptBest, best_of_evaluation
from evollm.training.loop import evolve

# fitness change of each member at each step (3 members, 6 steps): member 1 peaks after step 2, then falls
PLAN = [(0.1, 0.5, 0.0), (0.1, 0.5, 0.0), (0.1, -0.3, 0.0), (0.1, -0.3, 0.0), (0.1, -0.3, 0.0), (0.0, -0.3, 0.0)]


class _Fake:
    def __init__(self, index, quarantined=False):
        self.index, self.quarantined = index, quarantined


def test_best_of_evaluation_by_hand():
    a, b, c = _Fake(5), _Fake(2), _Fake(9, quarantined=True)
    assert best_of_evaluation([a, b, c], [0.3, 0.1, 0.9]) == (0, 0.3)  # the quarantined member never counts
    assert best_of_evaluation([a, b], [0.3, 0.3]) == (1, 0.3)  # a tie goes to the lower id
    assert best_of_evaluation([a, b], [math.nan, -math.inf]) is None
    assert best_of_evaluation([a, b], [math.nan, 0.2]) == (1, 0.2)


def _weights_fitness(agent) -> float:
    return float(sum(p.detach().double().sum() for p in agent.shared.parameters(agent.adapter_name())))


def _run(tmp_path=None, keep_best=True, callbacks=(), resume=False):
    from evollm.recipes.warm_start import load_tiny_model

    torch.manual_seed(0)
    model, tok = load_tiny_model(warm_start=False, seed=0)
    pop = make_grpo(model, tok, n=3)
    start = {a.index: _weights_fitness(a) for a in pop}  # fitness: how far each member's weights moved

    def train_step(agents, step):
        with torch.no_grad():
            for i, agent in enumerate(agents):
                first = agent.shared.parameters(agent.adapter_name())[0]
                first.add_(PLAN[step][i] / first.numel())
        return {a.index: {"mean_reward": 0.0} for a in agents}

    def evaluate(agents):
        return [_weights_fitness(a) - start[a.index] for a in agents]

    cbs = list(callbacks)
    if tmp_path is not None:
        cbs.insert(0, RunCheckpointer(tmp_path, every=1, keep=None, resume=resume, handle_signals=False,
                                      log=lambda m: None))
    agents, record = evolve(pop, train_step, evaluate, max_steps=len(PLAN), evaluation_interval=2, verbose=False,
                            keep_best=keep_best, callbacks=cbs)
    return agents, record, start


def test_the_best_state_is_kept_and_returned_after_a_collapse():
    agents, record, start = _run()
    kept = record.kept
    peak = agents[1]
    # member 1 was best after step 2 (+1.0), then fell; member 0 reaches +0.5 at the end
    assert (kept.source, kept.step) == (peak.index, 2)
    assert kept.fitness == pytest.approx(1.0, abs=1e-4)
    # the weights it was measured on
    assert _weights_fitness(kept.member) - start[kept.source] == pytest.approx(kept.fitness, abs=1e-4)
    assert kept.member.index not in {a.index for a in agents}  # a clone: it took no further step
    assert kept.member.fitness == [kept.fitness]
    assert record.best() is kept.member  # better than every live member's last fitness
    assert all(a.fitness[-1] < kept.fitness for a in agents)


def test_without_keep_best_the_last_state_is_returned():
    agents, record, _ = _run(keep_best=False)
    assert record.kept is None
    assert record.best() in agents


def test_a_live_member_that_reaches_the_kept_fitness_is_preferred():
    from evollm.recipes.warm_start import load_tiny_model

    model, tok = load_tiny_model(warm_start=False, seed=0)
    a, b = make_grpo(model, tok, n=2)
    kept = KeptBest()
    assert kept.offer([a, b], [0.2, 0.5], step=2)
    assert not kept.offer([a, b], [0.4, 0.3], step=4)
    assert (kept.source, kept.step, kept.fitness) == (b.index, 2, 0.5)
    assert kept.offer([a, b], [0.5, 0.4], step=6)  # a tie: the later state (same measure, trained longer)
    assert (kept.source, kept.step, kept.fitness) == (a.index, 6, 0.5)
    a.record_fitness(0.5)
    b.record_fitness(0.4)
    assert not kept.beats([a, b])
    a.fitness[-1] = 0.49
    assert kept.beats([a, b])
    first = kept.member
    assert kept.offer([a, b], [0.1, 0.7], step=8)
    assert first.released and kept.source == b.index  # the older kept state is given back


def test_the_kept_state_is_discounted_by_the_luck_of_being_the_best_of_many_evaluations(tmp_path):
    """With standard errors recorded, the kept state must beat the live members by more than its luck:
    expected_max_normal(draws) of its standard error, draws counting every evaluation offered (not only those
    it won). A collapse is still caught. The count and the error survive a checkpoint."""
    from evollm.hpo.lone import expected_max_normal
    from evollm.recipes.warm_start import load_tiny_model
    from evollm.rollout.population import Fitness

    model, tok = load_tiny_model(warm_start=False, seed=0)
    a, b = make_grpo(model, tok, n=2)
    kept = KeptBest()
    assert kept.offer([a, b], Fitness([0.30, 0.55], stderr=[0.06, 0.05]), step=10)
    assert (kept.se, kept.draws) == (0.05, 2)
    assert kept.luck() == pytest.approx(expected_max_normal(2) * 0.05)  # 0.028
    for step in range(20, 110, 10):  # nine flat evaluations of the one member left
        assert not kept.offer([b], Fitness([0.45], stderr=[0.06]), step=step)
    assert kept.draws == 11 and kept.luck() == pytest.approx(expected_max_normal(11) * 0.05)  # 1.586 se = 0.079
    b.record_fitness(0.48)
    assert kept.fitness > 0.48 and not kept.beats([b])  # 0.55 - 0.079 = 0.471: within its luck, the last state
    b.fitness[-1] = 0.46
    assert kept.beats([b])  # 0.471 > 0.46
    b.fitness[-1] = 0.20
    assert kept.beats([b])  # a collapse
    kept.save(tmp_path)
    again = KeptBest()
    again.load(tmp_path, [a, b])
    assert (again.se, again.draws, again.fitness, again.step) == (0.05, 11, 0.55, 10)
    assert again.beats([b]) and again.luck() == pytest.approx(kept.luck())
    plain = KeptBest()  # no standard error recorded (a custom evaluate): no discount, as before
    assert plain.offer([a], [0.5], step=1) and plain.draws == 1 and math.isnan(plain.se) and plain.luck() == 0.0


def test_the_kept_state_survives_an_interrupted_run_exactly(tmp_path):
    _, whole, _ = _run(tmp_path / "whole")
    with pytest.raises(KeyboardInterrupt):
        _run(tmp_path / "cut", callbacks=[StopAt(3)])
    _, resumed, _ = _run(tmp_path / "cut", resume=True)
    a, b = whole.kept, resumed.kept
    assert (a.source, a.step, a.member.index) == (b.source, b.step, b.member.index)
    assert a.fitness == b.fitness
    for p, q in zip(a.member.trainable_parameters(), b.member.trainable_parameters()):
        assert torch.equal(p, q)
    assert resumed.best() is b.member


def test_evollm_train_returns_the_best_evaluated_state(tmp_path, capsys):
    """`train.keep_best: true` and a reward that collapses after its 60th call (every later evaluation
    scores 0): best_member/, the final fitness and summary.json are the state of the best evaluation."""
    import json

    import pandas as pd

    from evollm.recipes.cli import main

    (tmp_path / "fading.py").write_text(
        "CALLS = [0]\n\n\ndef score(completion, answer, question):\n    CALLS[0] += 1\n"
        "    return float(len(completion)) if CALLS[0] <= 60 else 0.0\n")
    config = tmp_path / "c.yaml"
    config.write_text(f"""
output_dir: {tmp_path / 'run'}
model: {{source: tiny, warm_start: false}}
task: {{name: arithmetic, n_train: 64, n_test: 4, digits: [1, 1], reward: fading.py:score}}
env: {{data_batch_size_per_gpu: 2}}
algorithm: {{name: GRPO, population_size: 2, hyperparameters: {{lr: 0.05, group_size: 4, batch_size: 8,
             max_output_tokens: 3}}}}
train: {{max_steps: 6, evaluation_interval: 1, keep_best: true}}
logging: {{tensorboard: false, plots: false}}
""")
    assert main(["train", str(config), "--quiet"]) == 0
    run = tmp_path / "run"
    report = pd.read_csv(run / "report.csv")
    summary = json.loads((run / "summary.json").read_text())
    best = report["fitness"].max()
    assert best > 0 and (report[report["step"] == 6]["fitness"] == 0).all()  # the live members collapsed
    # the latest evaluation that reached the best fitness (a tie keeps the later state), its lowest id
    row = report[report["fitness"] == best].sort_values(["step", "member"], ascending=[False, True]).iloc[0]
    assert summary["final_fitness"] == pytest.approx(best)
    assert (summary["best_state"]["source"], summary["best_state"]["step"]) == (row["member"], row["step"])
    assert summary["best_member"] == summary["best_state"]["member"] not in set(report["member"])
    saved = json.loads((run / "best_member" / "agent.json").read_text())
    assert saved["index"] == summary["best_member"] and saved["fitness"] == [best]
    assert "kept as the run's best" in capsys.readouterr().out
