"""Mutations take effect where they are used; the elite survives; the report matches."""

import math

import pytest
import torch
from conftest import make_grpo

from evollm.hpo import HyperparameterConfig, Mutations, RLParameter, TournamentSelection
from evollm.training.loop import finetune_llm_reasoning


@pytest.fixture
def batch(tiny, arithmetic_env):
    model, tok = tiny
    prompts = arithmetic_env.reset()
    probe = make_grpo(model, tok)[0]
    torch.manual_seed(0)
    ids, masks = probe.get_action(prompts)
    rewards = torch.tensor([[1.0, 0, 0, 1], [0, 1, 0, 0], [1, 1, 0, 0], [0, 0, 0, 1]])
    return prompts, ids, masks, rewards


def _pair(tiny, name, low, high, **kw):
    """Two clones of one member, differing only in ``name``."""
    model, tok = tiny
    a = make_grpo(model, tok, **kw)[0]
    with torch.no_grad():
        for p in a.shared.parameters(a.adapter_name()):
            p.add_(0.02 * torch.randn_like(p))
    b = a.clone()
    a.set_hyperparameter(name, low)
    b.set_hyperparameter(name, high)
    return a, b


def _delta(agent, before):
    return sum((p - q).abs().sum() for p, q in zip(agent.shared.parameters(agent.adapter_name()), before))


def test_lr_reaches_optimizer_in_place_keeping_moments(tiny, batch):
    _, ids, masks, rewards = batch
    a, b = _pair(tiny, "lr", 1e-4, 1e-4)
    a.learn((ids, masks, rewards))
    state_before = {k: v["exp_avg"].clone() for k, v in a.optimizer.state.items()}
    opt = a.optimizer
    a.set_hyperparameter("lr", 3e-3)
    assert a.optimizer is opt and opt.param_groups[0]["lr"] == 3e-3
    assert all(torch.equal(opt.state[k]["exp_avg"], v) for k, v in state_before.items())
    # the update size follows the learning rate (Adam's first step is ~lr per coordinate)
    a2, b2 = _pair(tiny, "lr", 1e-4, 1e-3)
    before_a = [p.detach().clone() for p in a2.shared.parameters(a2.adapter_name())]
    before_b = [p.detach().clone() for p in b2.shared.parameters(b2.adapter_name())]
    a2.learn((ids, masks, rewards))
    b2.learn((ids, masks, rewards))
    ratio = float(_delta(b2, before_b) / _delta(a2, before_a))
    assert 8 < ratio < 12


def test_beta_reaches_kl_term(tiny, batch):
    _, ids, masks, rewards = batch
    a, b = _pair(tiny, "beta", 0.0, 1.0)
    la, lb = a.learn((ids, masks, rewards)), b.learn((ids, masks, rewards))
    assert lb["kl"] > 0
    assert lb["loss"] == pytest.approx(la["loss"] + 1.0 * lb["kl"], rel=1e-3, abs=1e-5)


def test_clip_coef_reaches_loss_bounds(tiny, batch):
    _, ids, masks, rewards = batch
    a, b = _pair(tiny, "clip_coef", 0.001, 0.9, update_epochs=3, lr=3e-2)
    ma, mb = a.learn((ids, masks, rewards)), b.learn((ids, masks, rewards))
    assert ma["clip_fraction"] > mb["clip_fraction"]
    assert a.config.clip_range() == (0.001, 0.001)


@pytest.mark.parametrize("name", ["clip_low", "clip_high"])
def test_clip_low_and_high_reach_loss_bounds(tiny, batch, name):
    _, ids, masks, rewards = batch
    a, b = _pair(tiny, name, 0.001, 0.9, update_epochs=3, lr=3e-2)
    ma, mb = a.learn((ids, masks, rewards)), b.learn((ids, masks, rewards))
    assert ma["clip_fraction"] > mb["clip_fraction"]
    side = 0 if name == "clip_low" else 1
    assert a.config.clip_range()[side] == pytest.approx(0.001)
    assert a.config.clip_range()[1 - side] == pytest.approx(0.2)  # the other side: preset


@pytest.mark.parametrize("name, low, high", [("loss_type", "grpo", "dr_grpo"), ("scale_rewards", "group", "none")])
def test_categorical_hyperparameters_reach_loss(tiny, batch, name, low, high):
    _, ids, masks, rewards = batch
    a, b = _pair(tiny, name, low, high)
    assert a.learn((ids, masks, rewards))["loss"] != pytest.approx(b.learn((ids, masks, rewards))["loss"], rel=1e-3)


@pytest.mark.parametrize("name, focused, spread", [("temperature", 1e-3, 5.0), ("top_k", 1, 0), ("top_p", 1e-6, 1.0)])
def test_sampling_hyperparameters_reach_sampler(tiny, batch, name, focused, spread):
    prompts = batch[0]
    a, b = _pair(tiny, name, focused, spread, group_size=8, max_output_tokens=6)
    torch.manual_seed(1)
    ids_a, _ = a.get_action(prompts)
    torch.manual_seed(1)
    ids_b, _ = b.get_action(prompts)
    distinct_a = sum(len({tuple(r.tolist()) for r in g}) for g in ids_a)
    distinct_b = sum(len({tuple(r.tolist()) for r in g}) for g in ids_b)
    assert distinct_a == len(prompts)  # one distinct completion per prompt: (near-)greedy
    assert distinct_b > 2 * len(prompts)


def test_temperature_reaches_logprobs(tiny, batch):
    _, ids, _, _ = batch
    a, b = _pair(tiny, "temperature", 1.0, 2.0)
    seqs = torch.cat(ids)
    assert not torch.allclose(a.get_logprobs(seqs), b.get_logprobs(seqs))


def test_max_grad_norm_clips_gradients(tiny, batch):
    _, ids, masks, rewards = batch
    a, b = _pair(tiny, "max_grad_norm", 1e-4, 1e6)
    seen = {}
    for agent in (a, b):  # the gradient norm the optimizer actually steps with
        step = agent.optimizer.step

        def spy(*args, agent=agent, step=step, **kw):
            seen[agent.index] = math.sqrt(sum(float(p.grad.pow(2).sum())
                                              for p in agent.shared.parameters(agent.adapter_name())))
            return step(*args, **kw)
        agent.optimizer.step = spy
    a.learn((ids, masks, rewards))
    mb = b.learn((ids, masks, rewards))
    assert seen[a.index] == pytest.approx(1e-4, rel=1e-2)
    assert seen[b.index] == pytest.approx(mb["grad_norm"], rel=1e-3)
    assert all(p.grad is None for p in a.shared.parameters(a.adapter_name()))  # freed after the step


@pytest.mark.parametrize("name, low, high, steps_low, steps_high",
                         [("update_epochs", 1, 3, 1, 3), ("batch_size", 16, 4, 1, 4)])
def test_epochs_and_batch_size_reach_update_loop(tiny, batch, name, low, high, steps_low, steps_high):
    _, ids, masks, rewards = batch
    a, b = _pair(tiny, name, low, high)
    a.learn((ids, masks, rewards))
    b.learn((ids, masks, rewards))
    step = lambda ag: int(next(iter(ag.optimizer.state.values()))["step"])
    assert (step(a), step(b)) == (steps_low, steps_high)


def test_group_size_reaches_sampler_and_advantage_groups(tiny, batch):
    prompts, ids, masks, _ = batch
    a, b = _pair(tiny, "group_size", 2, 4)
    assert [g.shape[0] for g in a.get_action(prompts).completion_ids] == [2] * len(prompts)
    assert [g.shape[0] for g in b.get_action(prompts).completion_ids] == [4] * len(prompts)
    # the same 4 completions per prompt: as 2 groups of 2 with equal rewards inside each group there is
    # no advantage (no gradient); as one group of 4 there is
    rewards = torch.tensor([[1.0, 1.0, 0.0, 0.0]] * len(prompts))
    assert a.learn((ids, masks, rewards))["grad_norm"] == 0.0
    assert b.learn((ids, masks, rewards))["grad_norm"] > 0.0
    with pytest.raises(ValueError, match="group_size must be >= 2"):
        a.set_hyperparameter("group_size", 1)


def test_every_grpo_hyperparameter_is_covered():
    """Each name below has an effect test in this file (lora_rank: tests/adapters/test_lora_rank.py)."""
    from evollm.algorithms.grpo import GRPO

    covered = {"lr", "beta", "clip_coef", "clip_low", "clip_high", "loss_type", "scale_rewards", "temperature",
               "top_k", "top_p", "max_grad_norm", "update_epochs", "batch_size", "lora_rank", "group_size"}
    assert set(GRPO.MUTABLE) | {"lora_rank"} == covered


def test_unknown_hp_name_lists_valid_names(tiny):
    model, tok = tiny
    with pytest.raises(ValueError, match="lr"):
        make_grpo(model, tok, hp_config=HyperparameterConfig(learning_rate=RLParameter(1e-5, 1e-3)))


def test_mutations_apply_through_agent(tiny):
    model, tok = tiny
    hp = HyperparameterConfig(lr=RLParameter(1e-5, 1e-2))
    pop = make_grpo(model, tok, n=3, hp_config=hp, lr=1e-3)
    Mutations(no_mutation=0.0, rl_hp=1.0, rand_seed=0).mutation(pop)
    for a in pop:
        assert a.last_mutation.name == "lr" and a.last_mutation.new != 1e-3
        assert a.optimizer.param_groups[0]["lr"] == a.last_mutation.new == a.lr


def test_elite_survives_unmutated(tiny):
    model, tok = tiny
    hp = HyperparameterConfig(lr=RLParameter(1e-5, 1e-2), beta=RLParameter(0.0, 0.5))
    pop = make_grpo(model, tok, n=4, hp_config=hp)
    for a, f in zip(pop, [0.1, 0.9, 0.3, 0.2]):
        a.fitness.append(f)
    elite = pop[1]
    weights = [p.detach().clone() for p in elite.shared.parameters(elite.adapter_name())]
    hps = (elite.lr, elite.beta, elite.clip_coef)
    result = TournamentSelection(2, True, 4, rand_seed=0).select(pop)
    Mutations(no_mutation=0.0, rl_hp=1.0, rand_seed=0).mutation(result.mutate)
    assert result.population[0] is elite and elite not in result.mutate
    assert (elite.lr, elite.beta, elite.clip_coef) == hps
    assert all(torch.equal(w, p) for w, p in zip(weights, elite.shared.parameters(elite.adapter_name())))
    assert all(m.last_mutation.kind == "rl_hp" for m in result.mutate)


def test_report_rows_match_what_happened(tiny, arithmetic_env):
    model, tok = tiny
    hp = HyperparameterConfig(lr=RLParameter(1e-5, 1e-2))
    pop = make_grpo(model, tok, n=3, hp_config=hp)
    founders = [a.index for a in pop]
    agents, population = finetune_llm_reasoning(
        pop, arithmetic_env, max_steps=4, evaluation_interval=2, evo_steps=2,
        tournament=TournamentSelection(2, True, 3, rand_seed=0), mutation=Mutations(0.0, 1.0, rand_seed=0),
        verbose=False)
    report, lineage = population.report(), population.lineage()
    assert len(report) == 6
    assert sorted(report[report.step == 2].member) == founders
    assert sorted(report[report.step == 4].member) == sorted(a.index for a in agents)
    for a in agents:
        rows = report[(report.step == 4) & (report.member == a.index)]
        assert rows.fitness.item() == a.fitness[-1] and rows.hp_lr.item() == a.lr
    births = lineage[lineage.generation == 1]
    assert len(births) == 2 and set(births.parent) <= set(founders)
    for _, b in births.iterrows():
        child = next(a for a in agents if a.index == b.member)
        assert b.mutation == "lr" and b.new_value == child.lr == b.hp_lr
        assert b.old_value == pytest.approx(next(r for r in report[report.step == 2].itertuples()
                                                 if r.member == b.parent).hp_lr)


def test_inconsistent_settings_rejected(tiny, arithmetic_env):
    model, tok = tiny
    pop = make_grpo(model, tok, n=2)
    with pytest.raises(ValueError, match="multiple of evaluation_interval"):
        finetune_llm_reasoning(pop, arithmetic_env, max_steps=4, evaluation_interval=3, evo_steps=2,
                               tournament=TournamentSelection(2, True, 2), mutation=Mutations())
    with pytest.raises(ValueError, match="do not divide"):
        finetune_llm_reasoning(make_grpo(model, tok, n=1, batch_size=5), arithmetic_env, max_steps=1)
    with pytest.raises(ValueError, match="population_size=3"):
        finetune_llm_reasoning(pop, arithmetic_env, max_steps=4, evaluation_interval=2, evo_steps=2,
                               tournament=TournamentSelection(2, True, 3), mutation=Mutations())
