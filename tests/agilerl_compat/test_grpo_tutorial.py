"""AgileRL's GRPO HPO tutorial, imports changed to evollm, runs end to end at a tiny size."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_agilerl_grpo_hpo_tutorial_runs_with_imports_changed(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp_path)}
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "agilerl_grpo_tutorial.py"), "--tiny"],
                         capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    steps = [line for line in (out.stdout + out.stderr).splitlines() if "train reward" in line and "fitness" in line]
    assert steps, out.stdout[-2000:]
    elites = [p for p in tmp_path.iterdir() if p.name.startswith("elite-")]
    assert elites and any(elites[0].rglob("*.safetensors")), "the elite was not saved"
