"""A whole run on every device this machine has (CUDA when present): a narrowing GRPO population trains,
evaluates, checkpoints and resumes exactly, and its adapters, optimizer state and RNG stay on the model's
device. CUDA kernels, generator states and device placement are what differ from the CPU's."""

import pytest
import torch
from conftest import StopAt, make_grpo

from evollm.hpo import Narrowing
from evollm.run import list_checkpoints
from evollm.training.loop import finetune_llm_reasoning

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _by_length(completion, answer, question=""):
    return float(len(completion) % 3)  # rewards differ within groups: every step updates


def _run(device, ckpt, resume=False, callbacks=()):
    from evollm.envs.reasoning import ReasoningGym
    from evollm.recipes.warm_start import load_tiny_model
    from evollm.tasks import ARITHMETIC_TEMPLATE, arithmetic_dataset

    torch.manual_seed(0)
    model, tok = load_tiny_model(warm_start=False, seed=0, device=device)
    pop = make_grpo(model, tok, n=2, lr=1e-3)
    train, test = arithmetic_dataset(n_train=64, n_test=8, digits=(1, 1), seed=0)
    env = ReasoningGym(train, test, tok, _by_length, ARITHMETIC_TEMPLATE, data_batch_size_per_gpu=4)
    return finetune_llm_reasoning(pop, env, max_steps=5, evaluation_interval=1, evo_steps=None, verbose=False, seed=0,
                                  narrowing=Narrowing(at=(0.2,), keep=0.5), callbacks=callbacks, checkpoint_dir=ckpt,
                                  checkpoint_every=1, keep_checkpoints=2, resume=resume)


@pytest.mark.parametrize("device", DEVICES)
def test_a_run_trains_on_its_device_and_resumes_exactly(tmp_path, device):
    agents, record = _run(device, tmp_path / "a")
    member = agents[0]
    assert all(p.device.type == device for p in member.shared.parameters(member.adapter_name()))
    state = member.optimizer.state_dict()["state"]
    assert state and all(v.device.type == device for s in state.values() for v in s.values()
                         if torch.is_tensor(v) and v.dim() > 0)
    metrics = record.metrics()
    assert metrics["loss"].notna().all() and (metrics["learn_path"] != "no_gradient").any()
    folder = tmp_path / "b"
    with pytest.raises(KeyboardInterrupt):
        _run(device, folder, callbacks=[StopAt(3)])
    assert list_checkpoints(folder)[-1][0] == 3
    again, record2 = _run(device, folder, resume=True)
    assert [a.index for a in again] == [a.index for a in agents]
    assert record.report().equals(record2.report())
    assert record.selections().equals(record2.selections())
    a, b = agents[0], again[0]
    for (k, v), (k2, v2) in zip(a.shared.state_dict(a.adapter_name()).items(),
                                b.shared.state_dict(b.adapter_name()).items()):
        assert k == k2 and torch.equal(v, v2)
