"""DeepSpeed ZeRO-2 for a population (2 CPU processes, gloo, launched with configs/deepspeed/zero2.yaml):
every member's optimizer state is partitioned (each process holds its half), the adapters are identical
on both processes and equal to a 1-process run, and checkpoints hold the full state (safetensors).
Skipped when DeepSpeed is not installed (``pip install -e .[deepspeed]``)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]


def test_zero3_and_offload_are_refused_in_one_line(monkeypatch):
    from evollm import zero

    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3")
    with pytest.raises(ValueError, match="zero_stage=3 is not supported.*use zero_stage 1 or 2"):
        zero.stage()
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2")
    assert zero.stage() == 2 and not zero.active()  # one process: nothing to partition
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", "cpu")
    with pytest.raises(ValueError, match="offload_optimizer_device='cpu' is not supported"):
        zero.stage()


def test_members_with_several_adapters_refuse_zero(monkeypatch, tiny):
    from evollm.algorithms.ppo import LLMPPO

    model, tok = tiny
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2")
    with pytest.raises(ValueError, match="LLMPPO does not support DeepSpeed ZeRO"):
        LLMPPO(model, pad_token_id=tok.pad_token_id)


@pytest.fixture(scope="module")
def zero_run(tmp_path_factory, cache_dir):
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install -e .[deepspeed])")
    out = tmp_path_factory.mktemp("zero")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}",
           "EVOLLM_CACHE": cache_dir}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ROOT / "configs/deepspeed/zero2.yaml"),
           "--num_processes", "2", "--main_process_port", "29527", str(ROOT / "tests" / "zero_script.py"), str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return out


def test_each_process_holds_only_its_shard_of_every_members_optimizer_state(zero_run):
    infos = [json.loads((zero_run / f"info-rank{r}.json").read_text()) for r in (0, 1)]
    assert infos[0]["sizes"].keys() == {"0", "1", "2"}  # two members and a clone
    for member, (local0, full, kind, stage) in infos[0]["sizes"].items():
        local1 = infos[1]["sizes"][member][0]
        assert kind == "ZeroOptimizer" and stage == 2
        assert local0 + local1 >= full  # together the processes hold the whole state ...
        assert max(local0, local1) <= full // 2 + 64  # ... each only its half (plus alignment padding)


def test_zero_update_equals_the_one_process_update(zero_run):
    import zero_script
    from evollm.checkpoint import load_agent

    t0, t1 = (load_file(str(zero_run / f"trained-rank{r}.safetensors")) for r in (0, 1))
    o0, o1 = (load_file(str(zero_run / f"optimizer-rank{r}.safetensors")) for r in (0, 1))
    for k in t0:  # the same adapters and gathered optimizer states on both processes
        assert torch.equal(t0[k], t1[k]), k
    for k in o0:
        assert torch.equal(o0[k], o1[k]), k
    pop, tok, norms = zero_script.scenario()  # one process, no DeepSpeed, the whole global batch
    ref, ref_opt = zero_script.adapters(pop), zero_script.optimizer_states(pop)
    assert ref.keys() == t0.keys() and ref_opt.keys() == o0.keys()
    for k in ref:
        torch.testing.assert_close(t0[k], ref[k], atol=5e-5, rtol=1e-3)  # Adam amplifies float rounding on tiny grads
    for k in ref_opt:
        torch.testing.assert_close(o0[k], ref_opt[k], atol=1e-6, rtol=1e-3)
    zero_norms = json.loads((zero_run / "info-rank0.json").read_text())["norms"]
    torch.testing.assert_close(torch.tensor(sum(zero_norms, [])), torch.tensor(sum(norms, [])), atol=1e-5, rtol=1e-4)
    assert norms[0][1] > 1e-3  # member 1's max_grad_norm=1e-3 really clipped
    # process 0's checkpoints hold the full state in torch's layout: a plain member loads them exactly
    for a in pop:
        load_agent(a, zero_run / f"member-{a.index}")
    for k, v in zero_script.optimizer_states(pop).items():
        torch.testing.assert_close(v, o0[k], atol=0, rtol=0)
    zero_script.step(pop, tok)  # ... and a resumed ZeRO run continues as the 1-process run does
    r0, r1 = (load_file(str(zero_run / f"resumed-rank{r}.safetensors")) for r in (0, 1))
    for k, v in zero_script.adapters(pop).items():
        assert torch.equal(r0[k], r1[k]), k
        torch.testing.assert_close(r0[k], v, atol=5e-5, rtol=1e-3)
