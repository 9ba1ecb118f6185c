"""Fault injection on a tiny CLI run: concurrent writers, stop signals, killed start-ups, kills inside a
checkpoint write, corrupted and tampered files, a full disk, diverging populations, failing rewards and
edited configs. Each fault ends in one line that says what happened and how to go on, and nothing that
was saved is lost."""

import csv
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from evollm.recipes.cli import main
from evollm.run.checkpoints import list_checkpoints
from evollm.utils.atomic import verify

ROOT = Path(__file__).resolve().parents[2]
CONFIG = """seed: 0
output_dir: {out}
threads: 1
model: {{source: tiny, warm_start: false}}
task: {{name: arithmetic, n_train: 32, n_test: 4, digits: [1, 1], reward: {reward}}}
env: {{type: reasoning, data_batch_size_per_gpu: 2}}
algorithm:
  name: GRPO
  population_size: 2
  hyperparameters: {{lr: {lr}, group_size: 2, batch_size: 4, max_output_tokens: 3}}
train: {{max_steps: {steps}, evaluation_interval: 1, checkpoint_every: 1, keep_checkpoints: 2}}
logging: {{tensorboard: false, plots: false}}
"""


def config(tmp_path, steps=2, lr="3e-3", reward="exact_match", name="run"):
    out = tmp_path / name
    path = tmp_path / f"{name}.yaml"
    path.write_text(CONFIG.format(out=out, steps=steps, lr=lr, reward=reward))
    return path, out


def cli(capsys, *argv):
    code = main([*map(str, argv), "--quiet"])
    return code, capsys.readouterr()


def one_line(err: str) -> str:
    lines = [line for line in err.strip().splitlines() if line.startswith("evollm: error")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def steps(out):
    return [s for s, _ in list_checkpoints(out / "checkpoints")]


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def launch(*args, **kw):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, **kw)


# ----------------------------------------------------------------------------- one writer per run
def test_a_second_writer_is_refused_naming_the_holder_and_a_dead_holder_is_taken_over(tmp_path, capsys):
    cfg, out = config(tmp_path)
    assert cli(capsys, "train", cfg)[0] == 0
    assert not (out / ".lock").exists()  # released at the end
    holder = {"pid": os.getppid(), "host": socket.gethostname(), "since": time.time(), "command": "evollm train x"}
    (out / ".lock").write_text(json.dumps(holder))
    code, io = cli(capsys, "resume", out, "--set", "train.max_steps=3")
    line = one_line(io.err)
    assert code == 2 and f"is in use by pid {os.getppid()} on host {socket.gethostname()}" in line
    code, io = cli(capsys, "train", cfg, "--overwrite")
    assert code == 2 and "is in use by pid" in one_line(io.err) and steps(out) == [1, 2]  # nothing deleted

    (out / ".lock").write_text(json.dumps({**holder, "pid": dead_pid()}))
    code, io = cli(capsys, "resume", out, "--set", "train.max_steps=3")
    assert code == 0 and "taking over the lock" in io.out and "that process is gone" in io.out
    assert steps(out) == [2, 3] and not (out / ".lock").exists()


def test_resume_while_the_run_is_live_is_refused_and_the_live_run_finishes(tmp_path, capsys):
    cfg, out = config(tmp_path, steps=5000)
    proc = launch("-m", "evollm", "train", str(cfg), "--quiet")
    try:
        deadline = time.time() + 300
        while not steps(out) and proc.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        assert proc.poll() is None, proc.stderr.read()
        code, io = cli(capsys, "resume", out)
        assert code == 2 and f"is in use by pid {proc.pid}" in one_line(io.err)
        proc.send_signal(signal.SIGTERM)  # the live run stops cleanly, its checkpoints intact
        assert proc.wait(timeout=300) == 130
    finally:
        proc.kill()
    assert "resume with: evollm resume" in proc.stderr.read()
    verify(list_checkpoints(out / "checkpoints")[-1][1], "population")


# ----------------------------------------------------------------------------- killed while starting
def test_a_run_killed_during_start_up_trains_again_without_overwrite(tmp_path, capsys):
    cfg, out = config(tmp_path)
    proc = launch("-m", "evollm", "train", str(cfg), "--quiet")
    while not (out / "config.json").exists() and proc.poll() is None:
        time.sleep(0.01)
    proc.kill()
    proc.wait()
    assert (out / "run_config.json").exists() and steps(out) == []
    code, io = cli(capsys, "resume", out)
    assert code == 2 and "the run never completed a step; start it again with `evollm train" in one_line(io.err)
    code, io = cli(capsys, "train", cfg)
    assert code == 0 and "never completed a step" in io.out and steps(out) == [1, 2]


# ----------------------------------------------------------------------------- config drift on resume
def test_resume_refuses_a_changed_config_unless_allowed_and_records_it(tmp_path, capsys):
    cfg, out = config(tmp_path)
    assert cli(capsys, "train", cfg)[0] == 0
    code, io = cli(capsys, "resume", out, "--set", "train.max_steps=1")
    assert code == 2 and "train.max_steps=1 is below the 2 steps this run has done" in one_line(io.err)

    data = json.loads((out / "run_config.json").read_text())
    data["algorithm"]["hyperparameters"]["loss_type"] = "dapo"
    (out / "run_config.json").write_text(json.dumps(data))
    code, io = cli(capsys, "resume", out, "--set", "train.max_steps=3")
    line = one_line(io.err)
    assert code == 2 and "would change algorithm.hyperparameters.loss_type from unset to 'dapo'" in line
    assert "--allow-change algorithm.hyperparameters.loss_type" in line and steps(out) == [1, 2]
    code, io = cli(capsys, "resume", out, "--set", "seed=5")
    assert code == 2 and "seed cannot change when resuming" in one_line(io.err)

    code, io = cli(capsys, "resume", out, "--set", "train.max_steps=3", "--allow-change",
                   "algorithm.hyperparameters.loss_type")
    assert code == 0 and steps(out) == [2, 3]
    changes = json.loads((out / "config_changes.json").read_text())
    assert {(c["field"], c["from"], c["to"], c["safe"]) for c in changes} == {
        ("algorithm.hyperparameters.loss_type", None, "dapo", False), ("train.max_steps", 2, 3, True)}
    member = json.loads((out / "checkpoints" / "step_3" / "member_0" / "agent.json").read_text())
    assert member["config"]["loss_type"] == "dapo"  # the members train with what the run says


# ----------------------------------------------------------------------------- diverging populations
@pytest.mark.parametrize("evolve", [False, True])
def test_a_population_that_diverges_stops_with_one_line_naming_the_healthy_checkpoint(tmp_path, capsys, monkeypatch,
                                                                                      evolve):
    (tmp_path / "by_length.py").write_text("def score(completion, answer, question):\n"
                                           "    return float(len(completion) % 3)\n")  # rewards differ: updates
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg, out = config(tmp_path, reward="by_length:score")
    if evolve:
        text = cfg.read_text().replace("evaluation_interval: 1,", "evaluation_interval: 1, evo_steps: 1,")
        cfg.write_text(text + "hpo: {mutation: {no_mutation: 1.0}, selection: {type: tournament, tournament_size: 2},"
                              " narrowing: {revive: false}}\n")  # no reserve to take over (below)
    assert cli(capsys, "train", cfg)[0] == 0
    code, io = cli(capsys, "resume", out, "--set", "train.max_steps=4", "--set", "algorithm.hyperparameters.lr=1e6",
                   "--allow-change", "algorithm.hyperparameters.lr")
    line = one_line(io.err)
    assert code == 3 and "every member of the population diverged by step 3" in line
    assert f"newest healthy checkpoint {out / 'checkpoints' / 'step_2'}" in line and "lower the learning rates" in line
    assert steps(out) == [1, 2]  # nothing of the diverged population was saved
    code, io = cli(capsys, "resume", out, "--set", "train.max_steps=4", "--set", "algorithm.hyperparameters.lr=1e-4",
                   "--allow-change", "algorithm.hyperparameters.lr")
    assert code == 0 and steps(out) == [3, 4]


def test_the_reserve_takes_over_from_a_diverged_lone_member(tmp_path, capsys, monkeypatch):
    """With hpo.narrowing.revive (the default) the runner-up of the cut is parked: when the survivor diverges
    the run goes on with it, and summary.json says so."""
    (tmp_path / "by_length.py").write_text("def score(completion, answer, question):\n"
                                           "    return float(len(completion) % 3)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg, out = config(tmp_path, reward="by_length:score")
    text = cfg.read_text().replace("evaluation_interval: 1,", "evaluation_interval: 1, evo_steps: 1,")
    cfg.write_text(text + "hpo: {mutation: {no_mutation: 1.0}, selection: {type: tournament, tournament_size: 2}}\n")
    assert cli(capsys, "train", cfg)[0] == 0
    code, io = cli(capsys, "resume", out, "--set", "train.max_steps=3", "--set", "algorithm.hyperparameters.lr=1e6",
                   "--allow-change", "algorithm.hyperparameters.lr")
    assert code == 0 and steps(out) == [2, 3]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["reserve"]["rescued_step"] == 3 and summary["best_member"] == summary["reserve"]["rescued"]
    rows = [r for r in csv.DictReader((out / "selections.csv").open()) if r["kind"] == "revival"]
    assert [(r["step"], r["reason"]) for r in rows] == [("3", "quarantine")]
    member = json.loads((out / "checkpoints" / "step_3" / f"member_{summary['best_member']}" / "agent.json").read_text())
    assert member["config"]["lr"] == 1e6  # the allowed change reached the parked member too
    code, io = main(["report", str(out), "--no-plots"]), capsys.readouterr()
    assert code == 0 and (f"every live member was quarantined at step 3: the reserve, member "
                          f"{summary['best_member']}, trained on in their place") in io.out


def test_rotation_keeps_the_newest_healthy_checkpoint(tmp_path, tiny):
    from conftest import make_grpo

    from evollm.run import RunCheckpointer
    from evollm.run.population import Population
    from evollm.training.callbacks import LoopState

    model, tok = tiny
    pop = make_grpo(model, tok, n=2)
    ckpt = RunCheckpointer(tmp_path / "c", every=1, keep=2, handle_signals=False)
    state = LoopState(1, 10, pop, Population(pop))
    ckpt.save(state)
    pop[0].quarantined = True
    state.step = 2
    ckpt.save(state)
    pop[1].quarantined = True  # no healthy member from here on
    for state.step in (3, 4, 5):
        ckpt.save(state)
    assert [s for s, _ in list_checkpoints(tmp_path / "c")] == [2, 4, 5]  # step 2 (member 1 healthy) kept beside the newest two
    ckpt.close()


# ----------------------------------------------------------------------------- failing rewards
REWARDS = {"raises": "raise ZeroDivisionError('division by zero')", "nan": "return float('nan')",
           "inf": "return float('inf')", "list": "return [1.0]", "word": "return 'yes'", "none": "return None"}


@pytest.mark.parametrize("kind", list(REWARDS))
def test_a_failing_reward_is_one_line_with_the_sample_the_checkpoint_and_the_resume_command(
        tmp_path, capsys, monkeypatch, kind):
    cfg, out = config(tmp_path, steps=3, reward=f"flaky_{kind}:score")
    module = tmp_path / f"flaky_{kind}.py"  # fails once the first checkpoint is on disk
    module.write_text(f"import os\n\ndef score(completion, answer, question):\n"
                      f"    if os.path.isdir({str(out / 'checkpoints' / 'step_1')!r}):\n        {REWARDS[kind]}\n"
                      "    return 0.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    code, io = cli(capsys, "train", cfg)
    line = one_line(io.err)
    assert code == 2 and "on sample" in line and "completion=" in line
    assert "ZeroDivisionError" in line if kind == "raises" else "not a finite number" in line
    assert f"last checkpoint {out / 'checkpoints' / 'step_1'}" in line and f"evollm resume {out}" in line
    assert "--debug" in line and steps(out) == [1]


# ----------------------------------------------------------------------------- tampered or foreign state
def _rewrite_manifest(folder):
    from evollm.utils.atomic import write_manifest

    write_manifest(folder, json.loads((folder / "manifest.json").read_text())["kind"])


@pytest.fixture
def trained_run(tmp_path_factory, capsys):
    tmp = tmp_path_factory.mktemp("trained")
    cfg, out = config(tmp)
    assert cli(capsys, "train", cfg)[0] == 0
    return out


def _tamper_and_resume(trained_run, capsys, tamper):
    import shutil

    out = trained_run.parent / f"copy_{tamper.__name__}"
    shutil.copytree(trained_run, out)
    step = out / "checkpoints" / "step_2"
    tamper(step / "member_0")
    _rewrite_manifest(step)
    shutil.rmtree(out / "checkpoints" / "step_1")  # nothing older to fall back on
    code, io = cli(capsys, "resume", out, "--set", "train.max_steps=3")
    return code, one_line(io.err)


def test_a_huge_rank_in_agent_json_is_refused_before_anything_is_allocated(trained_run, capsys):
    def huge_rank(member):
        info = json.loads((member / "agent.json").read_text())
        (member / "agent.json").write_text(json.dumps({**info, "lora_rank": 1000000}))

    code, line = _tamper_and_resume(trained_run, capsys, huge_rank)
    assert code == 2 and "lora_rank 1000000 in agent.json disagrees with its actor adapter" in line


def test_a_safetensors_header_bomb_is_one_line(trained_run, capsys):
    def bomb(member):
        target = member / "optimizer.safetensors"
        target.write_bytes((2 ** 62).to_bytes(8, "little") + target.read_bytes()[8:])

    code, line = _tamper_and_resume(trained_run, capsys, bomb)
    assert code == 2 and "optimizer.safetensors: the safetensors header claims 4611686018427387904 bytes" in line


def test_an_optimizer_lr_that_disagrees_with_the_members_config_is_refused(trained_run, capsys):
    def lr(member):
        meta = json.loads((member / "optimizer.json").read_text())
        meta["param_groups"][0]["lr"] = 1e30
        (member / "optimizer.json").write_text(json.dumps(meta))

    code, line = _tamper_and_resume(trained_run, capsys, lr)
    assert code == 2 and "optimizer.json gives param group 'actor' lr 1e+30, but the member's hyperparameters " \
                          "give 0.003" in line


def test_an_adapter_saved_on_another_base_is_refused(tmp_path):
    from conftest import make_grpo

    from evollm.recipes.warm_start import load_tiny_model
    from evollm.utils.atomic import CheckpointError

    one, tok = load_tiny_model(warm_start=False, seed=0)
    other, _ = load_tiny_model(warm_start=False, seed=1)  # same shapes, other weights
    make_grpo(one, tok)[0].save_checkpoint(tmp_path / "best")
    with pytest.raises(CheckpointError, match="trained on a different base model: the base weights differ"):
        make_grpo(other, tok)[0].load_checkpoint(tmp_path / "best")
    make_grpo(one, tok)[0].load_checkpoint(tmp_path / "best")  # its own base loads it


# ----------------------------------------------------------------------------- stop signals
def test_a_stop_signal_abandons_a_step_still_running_after_stop_grace(tmp_path, tiny):
    import threading

    from conftest import make_grpo

    from evollm.envs.reasoning import ReasoningGym
    from evollm.run import RunInterrupted
    from evollm.tasks import ARITHMETIC_TEMPLATE, arithmetic_dataset
    from evollm.training import Callback
    from evollm.training.loop import finetune_llm_reasoning

    hang = threading.Event()

    def reward(completion, answer, question):
        if hang.is_set():
            time.sleep(3600)  # a reward that never returns
        return 0.0

    class Term(Callback):
        def on_step_end(self, state, metrics):
            if state.step == 2:
                hang.set()
                os.kill(os.getpid(), signal.SIGTERM)

    model, tok = tiny
    train, test = arithmetic_dataset(n_train=16, n_test=4, digits=(1, 1), seed=0)
    env = ReasoningGym(train, test, tok, reward, ARITHMETIC_TEMPLATE, data_batch_size_per_gpu=2)
    started = time.monotonic()
    with pytest.raises(RunInterrupted) as info:
        finetune_llm_reasoning(make_grpo(model, tok, n=2, group_size=2, batch_size=4), env, max_steps=4,
                               evaluation_interval=2, verbose=False, checkpoint_dir=tmp_path / "c",
                               checkpoint_every=1, callbacks=[Term()], stop_grace=0.5)
    assert info.value.abandoned and info.value.step == 1 and info.value.checkpoint == tmp_path / "c" / "step_1"
    assert time.monotonic() - started < 600  # not the reward's hour
    assert [s for s, _ in list_checkpoints(tmp_path / "c")] == [1]
    verify(tmp_path / "c" / "step_1", "population")
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL and not (tmp_path / "c" / ".lock").exists()


# ----------------------------------------------------------------------------- kills, corruption, full disk
KILL_IN_WRITE = """import os, sys
import evollm.utils.atomic as atomic
real, saves = atomic.write_manifest, [0]
def dying(folder, kind, extra=None):
    if kind == "population":
        saves[0] += 1
        if saves[0] == 2:
            os._exit(9)  # killed inside the second checkpoint write: every file written, no manifest yet
    return real(folder, kind, extra)
atomic.write_manifest = dying
from evollm.recipes.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_kill_inside_a_checkpoint_write_resumes_from_the_previous_checkpoint(tmp_path, capsys):
    cfg, out = config(tmp_path, steps=3)
    (tmp_path / "killer.py").write_text(KILL_IN_WRITE)
    proc = launch(str(tmp_path / "killer.py"), "train", str(cfg), "--quiet")
    assert proc.wait(timeout=600) == 9, proc.stderr.read()
    assert steps(out) == [1] and [p.name for p in (out / "checkpoints").glob(".tmp-step_2-*")]
    assert (out / ".lock").exists()  # left by the killed process
    code, io = cli(capsys, "resume", out)
    assert code == 0 and "taking over the lock" in io.out and f"resumed from {out / 'checkpoints' / 'step_1'}" in io.out
    assert steps(out) == [2, 3] and not list((out / "checkpoints").glob(".tmp-*"))


def test_a_corrupted_newest_checkpoint_is_skipped_naming_the_file(tmp_path, capsys):
    cfg, out = config(tmp_path)
    assert cli(capsys, "train", cfg)[0] == 0
    target = out / "checkpoints" / "step_2" / "member_1" / "optimizer.safetensors"
    target.write_bytes(target.read_bytes()[:-100])
    code, io = cli(capsys, "resume", out, "--set", "train.max_steps=3")
    assert code == 0 and "skipping step_2" in io.out and "member_1/optimizer.safetensors does not match" in io.out
    assert f"resumed from {out / 'checkpoints' / 'step_1'}" in io.out and steps(out) == [2, 3]


def test_a_full_disk_stops_with_one_line_and_keeps_the_last_checkpoint(tmp_path, capsys):
    import resource

    cfg, out = config(tmp_path)
    assert cli(capsys, "train", cfg)[0] == 0
    limit = 150_000  # bytes per file: the run's small files fit, a member's optimizer state does not

    def small_disk():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    proc = launch("-m", "evollm", "resume", str(out), "--set", "train.max_steps=4", "--quiet", preexec_fn=small_disk)
    err = proc.communicate(timeout=600)[1]
    assert proc.returncode == 2, err
    assert one_line(err) and "File too large" in one_line(err)
    assert steps(out) == [1, 2] and not list((out / "checkpoints").glob(".tmp-*"))
    verify(out / "checkpoints" / "step_2", "population")
    assert cli(capsys, "resume", out, "--set", "train.max_steps=3")[0] == 0  # with room again it goes on


def test_a_reward_that_hangs_stops_the_run_after_reward_timeout(tmp_path, capsys, monkeypatch):
    cfg, out = config(tmp_path, steps=3, reward="hangs:score")
    cfg.write_text(cfg.read_text().replace("reward: hangs:score", "reward: hangs:score, reward_timeout: 0.5"))
    (tmp_path / "hangs.py").write_text(f"import os, time\n\ndef score(completion, answer, question):\n"
                                       f"    if os.path.isdir({str(out / 'checkpoints' / 'step_1')!r}):\n"
                                       "        time.sleep(3600)\n    return 0.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    code, io = cli(capsys, "train", cfg)
    line = one_line(io.err)
    assert code == 2 and "raised TimeoutError: no result within reward_timeout=0.5 s on sample" in line
    assert f"last checkpoint {out / 'checkpoints' / 'step_1'}" in line and steps(out) == [1]
