"""A run killed with SIGKILL at random moments and resumed each time ends bit-identical to the same run
uninterrupted (adapters, optimizer state and report)."""

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]
CONFIG = """seed: 0
output_dir: {out}
threads: 1
model: {{source: tiny, warm_start: false}}
task: {{name: arithmetic, n_train: 64, n_test: 8, digits: [1, 1]}}
env: {{type: reasoning, data_batch_size_per_gpu: 4}}
algorithm:
  name: GRPO
  population_size: 3
  hyperparameters: {{lr: 3e-3, group_size: 4, batch_size: 16, max_output_tokens: 4}}
hpo:
  hp_config: {{lr: {{min: 1e-4, max: 1e-2, log: true}}}}
  mutation: {{no_mutation: 0.0, rl_hp: 1.0}}
  selection: {{type: tournament, tournament_size: 2}}
  narrowing: {{at: []}}  # three members evolve to the end: steps long enough to be killed in
train: {{max_steps: 8, evaluation_interval: 2, evo_steps: 4, checkpoint_every: 1, keep_checkpoints: 2}}
"""


def launch(*args):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "evollm", *args, "--quiet"], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def steps_saved(out: Path) -> int:
    folders = [p.name for p in (out / "checkpoints").glob("step_*")] if (out / "checkpoints").is_dir() else []
    return max((int(n.split("_")[1]) for n in folders), default=-1)


def final_state(out: Path) -> dict:
    ckpt = out / "checkpoints" / "step_8"
    tensors = {}
    for f in sorted(ckpt.rglob("*.safetensors")):
        if f.name != "rng_torch.safetensors":
            tensors.update({f"{f.relative_to(ckpt)}:{k}": v for k, v in load_file(str(f)).items()})
    return tensors


def test_sigkill_at_random_moments_then_resume_is_bit_identical(tmp_path):
    ref_out, out = tmp_path / "ref", tmp_path / "killed"
    for name, target in (("ref.yaml", ref_out), ("run.yaml", out)):
        (tmp_path / name).write_text(CONFIG.format(out=target))
    reference = launch("train", str(tmp_path / "ref.yaml"))
    rng = random.Random(0)
    kills, proc = 0, launch("train", str(tmp_path / "run.yaml"))
    while True:
        seen = steps_saved(out)
        while proc.poll() is None and steps_saved(out) <= seen:
            time.sleep(0.05)
        if proc.poll() is not None:
            break
        if kills < 3:
            time.sleep(rng.uniform(0.0, 0.3))  # somewhere in the next step (a checkpoint write included)
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                kills += 1
                proc = launch("resume", str(out))
    assert proc.returncode == 0, proc.stderr.read().decode()[-2000:]
    assert reference.wait() == 0, reference.stderr.read().decode()[-2000:]
    assert kills >= 3
    a, b = final_state(ref_out), final_state(out)
    assert a.keys() == b.keys() and len(a) > 0
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])][:3]
    assert (ref_out / "report.csv").read_text() == (out / "report.csv").read_text()
    assert (ref_out / "lineage.csv").read_text() == (out / "lineage.csv").read_text()
