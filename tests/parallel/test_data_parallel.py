"""Multi-process data parallel (accelerate launch, 2 CPU processes, gloo): the population stays
identical on every process (single-turn and multi-turn runs), and an update equals the 1-process
update on the same global batch (GRPO, LLMPPO, IPPO agents, LLMREINFORCE), advantage whitening and
ReBN included."""

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from data_parallel_script import fixed_batch

ROOT = Path(__file__).resolve().parents[2]


def _members(path):
    with safe_open(str(path), "pt") as f:
        return json.loads(f.metadata()["members"]), load_file(str(path))


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory, cache_dir):
    if shutil.which("accelerate") is None:
        pytest.fail("accelerate's launcher is not on PATH")
    from evollm.recipes.warm_start import load_tiny_model

    from evollm.recipes.coop_warm_start import load_tiny_coop_model
    from evollm.recipes.multiturn_warm_start import load_tiny_multiturn_model

    load_tiny_model(warm_start=True, cache_dir=cache_dir)  # build the caches once, before two processes race
    load_tiny_multiturn_model("guess_number", warm_start=True, cache_dir=cache_dir)
    load_tiny_coop_model(warm_start=True, cache_dir=cache_dir)
    out = tmp_path_factory.mktemp("dp")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
           "CUDA_VISIBLE_DEVICES": ""}  # CPU processes (gloo) also on a machine with fewer GPUs than processes
    cmd = ["accelerate", "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision",
           "no", "--dynamo_backend", "no", "--main_process_port", "29517", str(ROOT / "tests" / "data_parallel_script.py"),
           str(out), cache_dir]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return out, proc.stdout


def test_population_is_identical_on_every_process(two_process_run):
    out, stdout = two_process_run
    (ids0, t0), (ids1, t1) = _members(out / "run-rank0.safetensors"), _members(out / "run-rank1.safetensors")
    assert ids0 == ids1  # same members, ranks and learning rates after selection and mutation
    assert t0.keys() == t1.keys()
    for k in t0:
        assert torch.equal(t0[k], t1[k]), k
    assert json.loads((out / "run-rank0.json").read_text()) == json.loads((out / "run-rank1.json").read_text())
    summary = json.loads((out / "run" / "summary.json").read_text())
    assert summary["num_processes"] == 2
    assert stdout.count("warm start: held-out") == 1  # only the main process prints
    for rank in (0, 1):  # dist.shutdown, as `evollm train` ends: the process group is closed on every process
        assert json.loads((out / f"shutdown-rank{rank}.json").read_text()) == {"initialized": False}


def test_two_process_update_equals_one_process_update_on_the_same_global_batch(two_process_run):
    from conftest import make_grpo
    from evollm.recipes.warm_start import load_tiny_model
    from evollm.training.loop import learn_all

    out, _ = two_process_run
    model, tok = load_tiny_model(warm_start=False, seed=0)
    torch.manual_seed(0)
    pop = make_grpo(model, tok, n=2, lr=1e-2, batch_size=64)
    pop[1].set_hyperparameter("lr", 3e-3)
    seqs, masks, rewards = fixed_batch(tok)
    exp = (seqs.reshape(-1, seqs.shape[2]), masks.reshape(-1, masks.shape[2]), rewards)
    before = {a.index: a.shared.state_dict(a.adapter_name()) for a in pop}
    for _ in range(2):
        learn_all(pop, [exp, exp])
    (_, r0), (_, r1) = _members(out / "fixed-rank0.safetensors"), _members(out / "fixed-rank1.safetensors")
    for a in pop:
        for k, v in a.shared.state_dict(a.adapter_name()).items():
            assert torch.equal(r0[f"{a.index}/{k}"], r1[f"{a.index}/{k}"])
            torch.testing.assert_close(r0[f"{a.index}/{k}"], v, atol=5e-5, rtol=1e-3)  # Adam amplifies float rounding on tiny grads
        moved = max((a.shared.state_dict(a.adapter_name())[k] - before[a.index][k]).abs().max() for k in before[a.index])
        assert moved > 1e-4  # the update did something


@pytest.mark.parametrize("part,warm_start", [("multiturn", "warm start: success"), ("team", "warm start: joint reward")])
def test_multiturn_and_team_populations_are_identical_on_every_process(two_process_run, part, warm_start):
    """A multi-turn game (LLMPPO) and IPPO teams: each process plays its half of the episodes / rows."""
    out, stdout = two_process_run
    t0, t1 = (load_file(str(out / f"{part}-rank{r}.safetensors")) for r in (0, 1))
    assert t0.keys() == t1.keys() and any("/critic/" in k for k in t0)
    for k in t0:
        assert torch.equal(t0[k], t1[k]), k
    f0, f1 = (json.loads((out / f"{part}-rank{r}.json").read_text()) for r in (0, 1))
    assert f0 == f1 and any(len(f) >= 2 for f in f0)  # the same fitness (returns reduced over processes)
    assert stdout.count(warm_start) == 1  # only the main process prints
    assert json.loads((out / part / "summary.json").read_text())["num_processes"] == 2
    import pandas as pd

    report = pd.read_csv(out / part / "report.csv")  # each mean's standard error, over both processes' episodes
    assert len(report) > 0 and report["fitness_se"].notna().all() and (report["fitness_se"] >= 0).all()


def test_actor_critic_update_equals_one_process_update_on_the_same_global_batch(two_process_run):
    import zero_script

    out, _ = two_process_run
    t0, t1 = (load_file(str(out / f"ppo-rank{r}.safetensors")) for r in (0, 1))
    pop, norms = zero_script.ppo_scenario()
    ref = zero_script.member_tensors(pop)
    assert ref.keys() == t0.keys()
    for k in ref:
        assert torch.equal(t0[k], t1[k]), k
        torch.testing.assert_close(t0[k], ref[k], atol=5e-4, rtol=1e-3)  # as in tests/parallel/test_zero.py
    dp_norms = json.loads((out / "ppo-rank0.json").read_text())
    torch.testing.assert_close(torch.tensor(sum(dp_norms, [])), torch.tensor(sum(norms, [])), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("part", ["ppo-whitened", "reinforce", "grpo-dapo"])
def test_batch_statistics_over_the_global_batch_give_the_one_process_update(two_process_run, part):
    """Completions of different lengths, each process its half of the rows: PPO's advantage whitening and
    REINFORCE's ReBN take the mean and std of the whole global batch, and every token-mean loss (PPO's policy,
    entropy and value terms, REINFORCE's and GRPO dapo's policy loss) divides by the tokens of the whole
    minibatch, not each half's own: the 2-process update equals the 1-process update on the global batch."""
    import zero_script

    out, _ = two_process_run
    t0, t1 = (load_file(str(out / f"{part}-rank{r}.safetensors")) for r in (0, 1))
    if part == "ppo-whitened":
        ref = zero_script.member_tensors(zero_script.ppo_scenario(adv_whitening=True, ragged=True)[0])
    else:
        ref = zero_script.adapters(zero_script.reinforce_scenario() if part == "reinforce" else zero_script.grpo_scenario())
    assert ref.keys() == t0.keys()
    for k in ref:
        assert torch.equal(t0[k], t1[k]), k
    diff = torch.cat([(t0[k] - ref[k]).abs().flatten() for k in ref])
    # measured: mean ~1e-8, at most ~4e-5 (Adam at lr 1e-2 can turn float rounding on a near-zero gradient into up
    # to ~2e-3); each half's own mean and std, or its own token count: mean 5e-4-9e-3, 6-65 % of the elements off
    # by more than 1e-3
    assert diff.mean() < 1e-5 and (diff > 1e-3).float().mean() < 0.005, (diff.mean(), (diff > 1e-3).float().mean())


def test_more_processes_than_gpus_is_one_line(monkeypatch):
    """Two processes launched on a machine with one visible GPU: process 1 has no GPU of its own. The
    error says so and what to do, instead of CUDA's 'invalid device ordinal'."""
    import types

    import accelerate

    from evollm.parallel import distributed

    monkeypatch.setattr(distributed, "_STATE", None)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(accelerate, "PartialState", lambda cpu: types.SimpleNamespace(local_process_index=1,
                                                                                      num_processes=2))
    with pytest.raises(ValueError, match=r"^process 1 of this machine has no GPU of its own: 1 visible for 2 "
                                           r"processes; .*CUDA_VISIBLE_DEVICES= to run them on CPU \(gloo\)$"):
        distributed.init()


def test_the_fitness_of_shares_is_the_fitness_of_the_whole_evaluation(monkeypatch):
    """reduce_fitness adds each process's sums and sums of squares: two shares of [1, 0, 1] and [1, 0, 0, 0]
    (means 2/3 and 1/4), reduced, are the mean and standard error of all seven items; one process's own share
    comes back unchanged. (The sum over processes is stood in for by adding the two shares' lists.)"""
    from evollm.rollout.population import Fitness, mean_stderr
    from evollm.training import data_parallel

    a, b = [1.0, 0.0, 1.0], [1.0, 0.0, 0.0, 0.0]
    share = lambda x: Fitness([sum(x) / len(x)], [mean_stderr(sum(x), sum(v * v for v in x), len(x))],
                              [sum(v * v for v in x)])
    alone = data_parallel.reduce_fitness(share(a), 3, 3)  # one process: the share is the whole
    assert alone == pytest.approx(share(a)) and alone.stderr == pytest.approx(share(a).stderr)
    other = {"sums": [sum(b)], "squares": [sum(v * v for v in b)]}
    calls = []

    def add_other(values):  # this process's values plus the other process's, in the order reduce_fitness asks
        extra = other["sums"] if not calls else other["squares"]
        calls.append(values)
        return torch.tensor([v + e for v, e in zip(values, extra)], dtype=torch.float64)

    monkeypatch.setattr(data_parallel.dist, "all_reduce_sum", add_other)
    whole = data_parallel.reduce_fitness(share(a), 3, 7)
    both = a + b
    assert whole == pytest.approx([3 / 7])
    assert whole.stderr == pytest.approx([torch.tensor(both, dtype=torch.float64).std().item() / 7 ** 0.5])
    assert whole.sum_sq == pytest.approx([3.0])


def test_shares_add_up_to_the_paired_standard_errors_of_the_whole_evaluation(monkeypatch):
    """Two members scored on two shares of the same items: the reduced ``cross`` (sums of products) is the
    sum of the shares', and the paired standard error from it is numpy's over all items of the difference.
    A process whose share has no products makes the whole evaluation report none (every process agrees)."""
    from evollm.rollout.population import Fitness, item_products, mean_stderr
    from evollm.training import data_parallel

    x = torch.tensor([[1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0], [1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0]], dtype=torch.float64)
    mine, theirs = x[:, :3], x[:, 3:]

    def share(s, cross=True):
        return Fitness((s.sum(1) / s.shape[1]).tolist(), [mean_stderr(float(r.sum()), float((r * r).sum()), s.shape[1])
                                                          for r in s], (s * s).sum(1).tolist(),
                       item_products(s).tolist() if cross else None, s.shape[1] if cross else None)

    def fake_sum(other):
        queue = [other.sum(1).tolist(), (other * other).sum(1).tolist(), [0.0], item_products(other).flatten().tolist()]

        def add(values):
            extra = queue.pop(0)
            return torch.tensor([float(v) + e for v, e in zip(values, extra)], dtype=torch.float64)
        return add

    monkeypatch.setattr(data_parallel.dist, "all_reduce_sum", fake_sum(theirs))
    whole = data_parallel.reduce_fitness(share(mine), 3, 7)
    assert torch.allclose(torch.tensor(whole.cross, dtype=torch.float64), item_products(x)) and whole.count == 7
    d = x[0] - x[1]
    assert whole.pair_stderrs()[0][1] == pytest.approx(d.std().item() / 7 ** 0.5)
    assert whole.pair_stderrs()[0][0] == 0.0

    monkeypatch.setattr(data_parallel.dist, "all_reduce_sum", fake_sum(theirs))
    assert data_parallel.reduce_fitness(share(mine, cross=False), 3, 7).pair_stderrs() is None
