"""DeepSpeed ZeRO-2 and ZeRO-3 for a population (2 CPU processes, gloo, launched with
configs/deepspeed/zero2.yaml and zero3.yaml): every member's fp32 master parameters and optimizer state
are partitioned (each process holds its half), the adapters are identical on both processes and equal
to a 1-process run, and checkpoints hold the full state (safetensors).
Skipped when DeepSpeed is not installed (``pip install -e .[deepspeed]``)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]


def test_zero_stages_and_offload(monkeypatch):
    from evollm.parallel import zero

    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    for stage in (1, 2, 3):
        monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", str(stage))
        assert zero.stage() == stage and not zero.active()  # one process: nothing to partition
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "4")
    with pytest.raises(ValueError, match="zero_stage=4 is not valid; use 1, 2 or 3"):
        zero.stage()
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO3_INIT", "true")
    with pytest.raises(ValueError, match="zero3_init_flag=true is not supported.*set zero3_init_flag: false"):
        zero.stage()
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO3_INIT", "false")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", "cpu")
    with pytest.raises(ValueError, match="offload_optimizer_device='cpu' is not supported"):
        zero.stage()


def test_stage3_engine_config_keeps_every_adapter_parameter_whole():
    from evollm.parallel import zero

    cfg = zero.deepspeed_config(3, 0.5)
    assert cfg["zero_optimization"]["stage"] == 3 and cfg["gradient_clipping"] == 0.5
    assert cfg["zero_optimization"]["stage3_param_persistence_threshold"] >= 2 ** 40
    assert "stage3_param_persistence_threshold" not in zero.deepspeed_config(2, None)["zero_optimization"]


def test_a_member_whose_optimizer_is_not_zero_wrapped_is_refused_in_one_line(monkeypatch, tiny):
    from evollm.parallel import zero
    from evollm.algorithms.grpo import GRPO

    class Plain(GRPO):
        def _build_optimizer(self):
            return torch.optim.SGD(self._param_groups(), lr=0.1)

    model, tok = tiny
    monkeypatch.setattr(zero, "active", lambda: True)
    with pytest.raises(ValueError, match="Plain does not support DeepSpeed ZeRO: its optimizer is not built with "
                                         "evollm.parallel.zero.wrap"):
        Plain(model, pad_token_id=tok.pad_token_id)


@pytest.fixture(scope="module", params=[2, 3], ids=["zero2", "zero3"])
def zero_run(request, tmp_path_factory, cache_dir):
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install -e .[deepspeed])")
    out = tmp_path_factory.mktemp(f"zero{request.param}")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}",
           "EVOLLM_CACHE": cache_dir}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ROOT / f"configs/deepspeed/zero{request.param}.yaml"),
           "--num_processes", "2", "--main_process_port", "29527", str(ROOT / "tests" / "zero_script.py"), str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return out, request.param


def test_each_process_holds_only_its_shard_of_every_members_optimizer_state(zero_run):
    zero_run, zero_stage = zero_run
    infos = [json.loads((zero_run / f"info-rank{r}.json").read_text()) for r in (0, 1)]
    assert infos[0]["sizes"].keys() == {"0", "1", "2"}  # two members and a clone
    for member, (local0, full, kind, stage, master0, params0) in infos[0]["sizes"].items():
        local1, master1, params1 = (infos[1]["sizes"][member][i] for i in (0, 4, 5))
        assert kind == "ZeroOptimizer" and stage == zero_stage
        assert local0 + local1 >= full  # together the processes hold the whole state ...
        assert max(local0, local1) <= full // 2 + 64  # ... each only its half (plus alignment padding)
        assert master0 + master1 >= full // 2 and max(master0, master1) <= full // 4 + 64  # fp32 masters too
        if zero_stage == 3:  # ... and the parameters' own shards
            assert params0 + params1 >= full // 2 and max(params0, params1) <= full // 4 + 64
        else:
            assert params0 == params1 == full // 2


def test_zero_update_equals_the_one_process_update(zero_run):
    import zero_script

    zero_run, _ = zero_run
    from evollm.algorithms.checkpoint import load_agent

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


def test_actor_critic_members_train_under_zero_as_in_one_process(zero_run):
    """LLMPPO (critic adapter) and IPPO agents (value head on the actor, fused update): one engine per
    param group, each group clipped on its own; the same adapters, value heads and optimizer states as
    one process on the whole batch."""
    import zero_script

    zero_run, _ = zero_run
    t0, t1 = (load_file(str(zero_run / f"ppo-rank{r}.safetensors")) for r in (0, 1))
    o0, o1 = (load_file(str(zero_run / f"ppo-optimizer-rank{r}.safetensors")) for r in (0, 1))
    for k in t0:
        assert torch.equal(t0[k], t1[k]), k
    for k in o0:
        assert torch.equal(o0[k], o1[k]), k
    info = json.loads((zero_run / "ppo-rank0.json").read_text())
    for kind, local, full in info["kinds"]:
        assert kind == "ZeroGroups" and local <= full // 2 + 128  # each process: about half of the state
    pop, norms = zero_script.ppo_scenario()
    ref, ref_opt = zero_script.member_tensors(pop), zero_script.optimizer_states(pop)
    assert ref.keys() == t0.keys() and ref_opt.keys() == o0.keys()
    assert any("/critic/" in k for k in ref) and any("/head/" in k for k in ref)
    for k in ref:  # 4 Adam steps at lr 1e-2: a near-zero gradient's rounding moves an entry by up to ~1e-4;
        # a wrong reduction shows in the moments and norms below (Adam's step itself is scale-free)
        torch.testing.assert_close(t0[k], ref[k], atol=5e-4, rtol=1e-3)
    for k in ref_opt:
        torch.testing.assert_close(o0[k], ref_opt[k], atol=1e-6, rtol=1e-3)
    torch.testing.assert_close(torch.tensor(sum(info["norms"], [])), torch.tensor(sum(norms, [])), atol=1e-5, rtol=1e-4)
    assert norms[0][0][0] > 1e-3  # the LLMPPO member's max_grad_norm=1e-3 really clipped its actor
    assert len(pop) == 5 and len(norms[1]) == 5  # clones of both kinds took the second step
    assert all((zero_run / f"team-agent-{i}" / "optimizer.safetensors").is_file() for i in (0, 1))
