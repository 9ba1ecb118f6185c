"""``train.lr_cooldown``: every member's learning rates constant until the last share of the budget, then falling
linearly to a floor: the factor by hand, in the loop (reaching the optimizer, the hyperparameters left alone, a
mutation during the cool-down scaled too), its settings, and exact resume from a checkpoint inside it."""

import json

import pytest
import torch
from conftest import StopAt, make_grpo

from evollm.run import list_checkpoints
from evollm.training.callbacks import Callback
from evollm.training.schedule import cooldown_factor


def test_the_factor_by_hand():
    assert cooldown_factor(0.0, 0.2) == 1.0 and cooldown_factor(0.8, 0.2) == 1.0  # constant until the last fifth
    assert cooldown_factor(0.9, 0.2, 0.1) == pytest.approx(0.55)  # half way: 0.1 + 0.9 * 0.5
    assert cooldown_factor(0.95, 0.2, 0.0) == pytest.approx(0.25)
    assert cooldown_factor(1.0, 0.2, 0.1) == pytest.approx(0.1) and cooldown_factor(2.0, 0.2, 0.1) == pytest.approx(0.1)
    assert cooldown_factor(0.99, 0.0, 0.1) == 1.0  # off


def test_bad_settings_name_the_option():
    from evollm.config import ConfigError, RunConfig
    from evollm.training.settings import LoopSettings

    with pytest.raises(ValueError, match=r"lr_cooldown must be a share of the budget in \[0, 1\), got 1.0"):
        LoopSettings(max_steps=4, lr_cooldown=1.0)
    with pytest.raises(ValueError, match=r"lr_cooldown_floor must be a factor in \[0, 1\], got 1.5"):
        LoopSettings(max_steps=4, lr_cooldown=0.2, lr_cooldown_floor=1.5)
    with pytest.raises(ConfigError, match=r"train.lr_cooldown must be a share of the budget in \[0, 1\)"):
        RunConfig.from_dict({"model": {"source": "tiny"}, "algorithm": {"name": "GRPO"}, "train": {"lr_cooldown": -0.1}})
    cfg = RunConfig.from_dict({"model": {"source": "tiny"}, "algorithm": {"name": "GRPO"},
                               "train": {"lr_cooldown": 0.2, "lr_cooldown_floor": 0.0}})
    s = cfg.train.loop_settings("out", seed=0)
    assert (s.lr_cooldown, s.lr_cooldown_floor) == (0.2, 0.0)


def _reward(completion, answer, question=""):
    return 1.0 + float(len(completion) % 3)


class _Rates(Callback):
    """Each member's hyperparameter and actor group rate at the end of every step; at step ``mutate_at`` (in
    ``on_step_end``, before the loop sets the next step's rates) member 0's lr is set to ``new_lr``."""

    def __init__(self, mutate_at=None, new_lr=None):
        self.seen, self.mutate_at, self.new_lr = [], mutate_at, new_lr

    def on_step_end(self, state, metrics):
        if state.step == self.mutate_at:
            state.agents[0].set_hyperparameter("lr", self.new_lr)

    def on_step_complete(self, state):
        a = state.agents[0]
        group = next(g for g in a.optimizer.param_groups if g.get("name") == "actor")
        self.seen.append((state.step, a.get_hyperparameter("lr"), group["lr"], a.lr_factor))


def _run(ckpt=None, resume=False, callbacks=(), cooldown=0.5, floor=0.1, max_steps=10):
    from evollm.envs.reasoning import ReasoningGym
    from evollm.recipes.warm_start import load_tiny_model
    from evollm.tasks import ARITHMETIC_TEMPLATE, arithmetic_dataset
    from evollm.training.loop import finetune_llm_reasoning

    torch.manual_seed(0)
    model, tok = load_tiny_model(warm_start=False, seed=0)
    pop = make_grpo(model, tok, n=1, lr=1e-3)
    train, test = arithmetic_dataset(n_train=64, n_test=8, digits=(1, 1), seed=0)
    env = ReasoningGym(train, test, tok, _reward, ARITHMETIC_TEMPLATE, data_batch_size_per_gpu=4)
    return finetune_llm_reasoning(pop, env, max_steps=max_steps, evaluation_interval=2, evo_steps=None, verbose=False,
                                  seed=0, lr_cooldown=cooldown, lr_cooldown_floor=floor, callbacks=list(callbacks),
                                  checkpoint_dir=ckpt, checkpoint_every=1 if ckpt else None, keep_checkpoints=2,
                                  resume=resume)


def test_the_rates_fall_over_the_last_share_of_the_steps_and_the_hyperparameters_stay():
    """10 steps, the last half cooling down to 0.1: after step d the group trains the next step at
    1e-3 * factor(d / 10); a mutation to 2e-3 at step 8 is scaled too; the member's lr is the hyperparameter's."""
    rates = _Rates(mutate_at=8, new_lr=2e-3)
    _run(callbacks=[rates])
    for step, lr, group_lr, factor in rates.seen:
        want = cooldown_factor(step / 10, 0.5, 0.1)
        assert factor == pytest.approx(want) and group_lr == pytest.approx(lr * want)
        assert lr == (2e-3 if step >= 8 else 1e-3)  # the hyperparameter itself is never scaled
    assert [round(g / lr, 3) for _, lr, g, _ in rates.seen] == [1.0] * 5 + [0.82, 0.64, 0.46, 0.28, 0.1]


def test_off_the_rates_stay():
    rates = _Rates()
    _run(callbacks=[rates], cooldown=0.0)
    assert all(g == lr == 1e-3 and f == 1.0 for _, lr, g, f in rates.seen)


def test_resume_inside_the_cool_down_is_exact(tmp_path):
    agents, record = _run(tmp_path / "a")
    folder = tmp_path / "b"
    with pytest.raises(KeyboardInterrupt):
        _run(folder, callbacks=[StopAt(7)])
    step, path = list_checkpoints(folder)[-1]
    assert step == 7
    meta = json.loads(next(path.rglob("optimizer.json")).read_text())
    assert meta["lr_factor"] == pytest.approx(cooldown_factor(0.7, 0.5, 0.1))  # the saved rates are the scaled ones
    again, record2 = _run(folder, resume=True)
    assert record.report().equals(record2.report())
    state, state2 = (a.shared.state_dict(a.adapter_name()) for a in (agents[0], again[0]))
    assert list(state) == list(state2) and all(torch.equal(state[k], state2[k]) for k in state)
    assert again[0].lr_factor == agents[0].lr_factor == pytest.approx(0.1)


def test_every_agent_of_a_team_is_scaled_from_its_own_rates():
    """An IPPO team steps one optimizer per agent (actor and critic groups at rates of their own)."""
    from types import SimpleNamespace

    from evollm.training.schedule import apply_lr_factor

    class Agent:
        def __init__(self, index, actor, critic):
            self.index, self.lr_factor, self.rates = index, 1.0, {"actor": actor, "critic": critic}
            self.optimizer = SimpleNamespace(param_groups=[{"name": n, "lr": r} for n, r in self.rates.items()])

        def _param_groups(self):
            return [{"name": n, "lr": r} for n, r in self.rates.items()]

    team = SimpleNamespace(agents=[Agent(0, 1e-4, 2e-4), Agent(1, 3e-4, 1e-4)])
    apply_lr_factor([team], 0.5)
    assert [[g["lr"] for g in a.optimizer.param_groups] for a in team.agents] == [[5e-5, 1e-4], [1.5e-4, 5e-5]]
    assert [a.lr_factor for a in team.agents] == [0.5, 0.5]
    team.agents[0].rates["actor"] = 4e-4  # a mutation: the next factor scales the new rate
    apply_lr_factor([team], 0.25)
    assert [g["lr"] for g in team.agents[0].optimizer.param_groups] == [1e-4, 5e-5]
    with pytest.raises(ValueError, match="has no param groups to scale"):
        apply_lr_factor([SimpleNamespace(index=3, lr_factor=1.0, optimizer=object(), _param_groups=list)], 0.5)
