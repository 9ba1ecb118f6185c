"""PBT mechanics: mutations always move, founders differ, clones start unevaluated, the elite is
the evaluated best, PBT options, and the loss-variant presets against hand-computed losses."""

import math

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import make_grpo

from evollm import functional as F
from evollm.algorithms.grpo import GRPOConfig
from evollm.hpo import HyperparameterConfig, Mutations, RLParameter, TournamentSelection, TruncationSelection

# --- 1. every mutation changes the value ---------------------------------------------------------

KINDS = {
    "float": RLParameter(0.0, 1.0),
    "float_negative": RLParameter(-1.0, 1.0),
    "float_log": RLParameter(1e-5, 1e-2, log=True),
    "float_narrow_factors": RLParameter(0.0, 0.1, grow_factor=1.01, shrink_factor=0.99),
    "int": RLParameter(1, 100, dtype=int),
    "int_two_values": RLParameter(3, 4, dtype=int),
    "int_log": RLParameter(2, 64, dtype=int, log=True),
    "categorical": RLParameter(choices=["grpo", "dr_grpo", "dapo", "gspo", "cispo"]),
    "categorical_two": RLParameter(choices=[True, False]),
}


def _in_range_values(p: RLParameter, rng) -> list:
    if p.is_categorical:
        return list(p.choices)
    edges = [p.min, p.max] + ([0] if p.min <= 0 <= p.max else [])
    return edges + [p.sample(rng) for _ in range(20)]


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("explore", [0.0, 0.5, 1.0])
def test_every_mutation_of_an_in_range_value_moves_and_stays_in_range(kind, explore):
    p, rng = KINDS[kind], np.random.default_rng(0)
    for value in _in_range_values(p, rng):
        for _ in range(25):
            new, _ = p.mutate(value, rng, explore_prob=explore)
            assert new != value, (kind, value)
            if p.is_categorical:
                assert new in p.choices
            else:
                assert p.min <= new <= p.max and isinstance(new, p.dtype)


def test_zero_is_not_a_fixed_point_and_bounds_reflect():
    beta, rng = RLParameter(0.0, 0.05), np.random.default_rng(1)
    steps = {round(beta.mutate(0.0, rng)[0], 12) for _ in range(40)}
    assert steps == {0.001}  # 0 + 0.2 * 0.005 (grow) or 0 - 0.2 * 0.005 reflected off 0 (shrink)
    top = RLParameter(0.0, 1.0)
    assert {round(top.mutate(1.0, rng)[0], 12) for _ in range(40)} == {0.8}  # 1.2 reflects to 0.8


def test_single_value_range_is_recorded_as_none():
    class One:
        index, lora_rank, fitness, last_mutation = 0, 8, [], None
        hp_config = HyperparameterConfig(beta=RLParameter(0.1, 0.1))
        beta = 0.1

        def get_hyperparameter(self, name):
            return self.beta

        def set_hyperparameter(self, name, value):
            raise AssertionError("nothing to set")

        def mutable_hyperparameters(self):
            return ("beta",)

        def run_mutation_hooks(self):
            raise AssertionError("no hook for a non-mutation")

    record = Mutations(no_mutation=0, rl_hp=1, rand_seed=0).mutate_agent(One())
    assert record.kind == "none"


RANGES = {
    "lr": RLParameter(1e-5, 1e-2, log=True), "lr_actor": RLParameter(1e-5, 1e-2, log=True),
    "lr_critic": RLParameter(1e-5, 1e-2, log=True), "beta": RLParameter(0.0, 0.1),
    "clip_coef": RLParameter(0.1, 0.4), "clip_low": RLParameter(0.05, 0.4), "clip_high": RLParameter(0.05, 0.5),
    "temperature": RLParameter(0.5, 1.5), "top_p": RLParameter(0.5, 1.0), "top_k": RLParameter(0, 50, dtype=int),
    "max_grad_norm": RLParameter(0.1, 10.0), "update_epochs": RLParameter(1, 4, dtype=int),
    "batch_size": RLParameter(4, 32, dtype=int), "vf_coef": RLParameter(0.1, 1.0),
    "ent_coef": RLParameter(0.0, 0.1), "gamma": RLParameter(0.9, 1.0), "gae_lambda": RLParameter(0.8, 1.0),
    "value_clip": RLParameter(0.05, 0.5),
    "loss_type": RLParameter(choices=list(F.LOSS_TYPES)),
    "scale_rewards": RLParameter(choices=list(F.ADVANTAGE_SCALES)),
    "lora_rank": RLParameter(2, 12, dtype=int), "group_size": RLParameter(2, 16, dtype=int),
}


def _algorithms():
    from evollm.algorithms.grpo import CISPO, GRPO, GSPO
    from evollm.algorithms.ppo import LLMPPO
    from evollm.algorithms.reinforce import LLMREINFORCE
    return [GRPO, GSPO, CISPO, LLMPPO, LLMREINFORCE]


@pytest.mark.parametrize("cls_index", range(5))
def test_every_mutable_hyperparameter_of_every_algorithm_moves(tiny, cls_index):
    model, tok = tiny
    cls = _algorithms()[cls_index]
    names = [n for n in cls(model, tok.pad_token_id, tok.pad_token).mutable_hyperparameters()]
    missing = sorted(set(names) - set(RANGES))
    assert not missing, f"give these hyperparameters a range in RANGES: {missing}"
    agent = cls(model, tok.pad_token_id, tok.pad_token, hp_config=HyperparameterConfig(**{n: RANGES[n] for n in names}))
    mutation = Mutations(no_mutation=0, rl_hp=1, rand_seed=0)
    for name in names:
        param = RANGES[name]
        agent.hp_config = HyperparameterConfig(**{name: param})
        if not param.is_categorical:  # an in-range start, e.g. the lower bound (beta = 0)
            agent.set_hyperparameter(name, param.min if name != "lora_rank" else 4)
        for _ in range(3):
            before = agent.get_hyperparameter(name)
            if name == "lora_rank":
                record = mutation._mutate_lora_rank(agent)
            else:
                record = mutation.mutate_agent(agent)
            after = agent.get_hyperparameter(name)
            assert record.kind != "none" and record.old == before and record.new == pytest.approx(after), name
            assert after != before, name
            assert after in param.choices if param.is_categorical else param.min <= after <= param.max


def test_tuple_clip_coef_mutates_keeping_its_asymmetry(tiny):
    model, tok = tiny
    agent = make_grpo(model, tok, clip_coef=(0.2, 0.28), hp_config=HyperparameterConfig(clip_coef=RANGES["clip_coef"]),
                      init_sampler=None)[0]
    assert agent.config.clip_range() == pytest.approx((0.2, 0.28))  # a tuple: the two offsets
    assert agent.get_hyperparameter("clip_coef") == pytest.approx(0.24)
    record = Mutations(no_mutation=0, rl_hp=1, rand_seed=0).mutate_agent(agent)
    low, high = agent.config.clip_range()
    assert record.new != record.old and (low + high) / 2 == pytest.approx(record.new)
    assert high / low == pytest.approx(0.28 / 0.2)


def test_perturb_all_moves_every_hyperparameter():
    from test_hpo import FakeAgent, full_config
    agent = FakeAgent(0, full_config())
    before = dict(agent.hps)
    record = Mutations(no_mutation=0, rl_hp=1, perturb="all", rand_seed=0).mutate_agent(agent)
    assert all(agent.hps[k] != before[k] for k in before)
    assert set(record.new) == set(before) and record.old == before
    with pytest.raises(ValueError, match="perturb"):
        Mutations(perturb="some")
    assert Mutations(resample_prob=0.3).explore_prob == 0.3


# --- 2. founders, clones, elite, PBT options ----------------------------------------------------

HP = HyperparameterConfig(lr=RLParameter(1e-4, 5e-3, log=True), beta=RLParameter(0.0, 0.05),
                          loss_type=RLParameter(choices=["grpo", "dapo"]))


def test_founders_are_drawn_from_the_hp_config(tiny):
    model, tok = tiny
    pop = make_grpo(model, tok, n=4, hp_config=HP, default_founder=False)
    lrs = [a.lr for a in pop]
    assert len(set(lrs)) == 4 and all(1e-4 <= lr <= 5e-3 for lr in lrs)
    assert len({a.beta for a in pop}) == 4
    fixed = make_grpo(model, tok, n=4, hp_config=HP, lr=1e-3, default_founder=False)  # a user's value wins
    assert {a.lr for a in fixed} == {1e-3} and len({a.beta for a in fixed}) == 4
    # by default the first founder keeps the starting values (GRPOConfig's: lr 5e-5, beta 0, loss grpo)
    # when they lie inside the space, and the other three are drawn from it
    inside = HyperparameterConfig(lr=RLParameter(1e-5, 1e-3, log=True), beta=RLParameter(0.0, 0.05),
                                  loss_type=RLParameter(choices=["grpo", "dapo"]))
    pop = make_grpo(model, tok, n=4, hp_config=inside)
    start = GRPOConfig()
    assert (pop[0].lr, pop[0].beta, pop[0].loss_type) == (start.lr, start.beta, start.loss_type)
    assert pop[0].default_founder and not any(a.default_founder for a in pop[1:])
    assert pop[0].optimizer.param_groups[0]["lr"] == start.lr
    assert len({a.lr for a in pop[1:]}) == 3 and all(1e-5 <= a.lr <= 1e-3 for a in pop[1:])
    mine = make_grpo(model, tok, n=3, hp_config=inside, beta=0.02)  # ... or the ones the user set
    assert mine[0].beta == 0.02 and mine[0].lr == start.lr and len({a.lr for a in mine}) == 3
    # a range that leaves the starting lr out (HP: 1e-4 .. 5e-3) says where to search: every founder drawn
    assert not make_grpo(model, tok, n=4, hp_config=HP)[0].default_founder
    same = make_grpo(model, tok, n=3, hp_config=HP, init_sampler=None)
    assert len({a.lr for a in same}) == 1


def test_elite_is_the_evaluated_best_and_saved_every_selection_and_at_end(tiny, tmp_path):
    from evollm.envs.reasoning import ReasoningGym
    from evollm.tasks import ARITHMETIC_TEMPLATE, arithmetic_dataset, exact_match_reward
    from evollm.training.loop import finetune_llm_reasoning, selection_elite

    model, tok = tiny
    train, test = arithmetic_dataset(n_train=32, n_test=4, digits=(1, 1), seed=0)
    env = ReasoningGym(train, test, tok, exact_match_reward, ARITHMETIC_TEMPLATE, data_batch_size_per_gpu=2, seed=0)
    pop = make_grpo(model, tok, n=3, hp_config=HP)
    agents, record = finetune_llm_reasoning(
        pop, env, max_steps=4, evaluation_interval=2, evo_steps=2, tournament=TruncationSelection(3, quantile=0.34,
                                                                                                  rand_seed=0),
        mutation=Mutations(no_mutation=0, rl_hp=1, rand_seed=0), save_elite=True, elite_path=tmp_path, verbose=False)
    assert (tmp_path / "step_2").is_dir() and (tmp_path / "final").is_dir()
    clones = [a for a in agents if getattr(a, "parent_index", None) is not None]
    assert clones and all(len(c.fitness) == 1 for c in clones)  # evaluated once since birth, nothing inherited
    # selection result: a clone is never the elite, and without elitism the best old member is
    sel = TournamentSelection(2, elitism=False, population_size=3, rand_seed=0)
    for a, f in zip(agents, (0.1, 0.9, 0.5)):
        a.fitness.append(f)
    result = sel.select(agents)
    assert selection_elite(result, agents) is agents[1]
    assert all(c.fitness == [] for c in result.population)
    # with no evolution at all, the end still saves the elite
    single = make_grpo(model, tok, n=1)
    finetune_llm_reasoning(single, env, max_steps=2, evaluation_interval=2, save_elite=True,
                           elite_path=tmp_path / "single", verbose=False)
    assert (tmp_path / "single" / "final").is_dir()


def test_mutate_elite_option():
    from test_hpo import FakeAgent, full_config

    from evollm.run.population import Population
    from evollm.training.loop import _evolve_once

    class Agent(FakeAgent):
        quarantined = False  # what the loop reads of a member beyond the protocol (declared on Member)

        def get_hyperparameter(self, name):
            if name not in self.hps:
                raise ValueError(name)
            return self.hps[name]

        def release(self):
            self.released = True

    for flag in (False, True):
        pop = [Agent(i, full_config(), fitness=[f]) for i, f in enumerate((0.1, 0.9, 0.5))]
        before = dict(pop[1].hps)
        mutation = Mutations(no_mutation=0, rl_hp=1, mutate_elite=flag, rand_seed=0)
        record = Population(pop)
        new, result = _evolve_once(pop, TournamentSelection(2, population_size=3, rand_seed=0), mutation, record, 1)
        assert result.elite is pop[1] and (pop[1].hps != before) == flag
        rows = record.lineage()
        elite_rows = rows[rows.member == 1]
        # the founder row is kept; a mutated elite gets its own row (parent: itself) naming the change
        assert pd.isna(elite_rows.iloc[0].parent)  # a founder
        assert elite_rows.iloc[0].mutation == "none"
        assert len(elite_rows) == (2 if flag else 1)
        if flag:
            last = elite_rows.iloc[-1]
            assert last.parent == 1 and last.mutation != "none" and last.old_value != last.new_value


# --- 4. loss presets against hand-computed losses -----------------------------------------------

def _preset_case():
    """Two sequences of two tokens; every token's ratio is 1.25; advantages +1 and -1."""
    old = torch.log(torch.tensor([[0.4, 0.5], [0.2, 0.25]]))
    logp = old + math.log(1.25)
    return logp, old, torch.tensor([1.0, -1.0]), torch.ones(2, 2)


@pytest.mark.parametrize("loss_type, expected", [
    # grpo: clip to [0.8, 1.2]; seq 1 (A=+1): -min(1.25, 1.2) = -1.2; seq 2 (A=-1): -min(-1.25, -1.2) = 1.25
    # -> sequence means -1.2 and 1.25, mean 0.025
    ("grpo", 0.025),
    # dr_grpo: same token terms, sum / (B * max_len = 2 * 4) = (2 * -1.2 + 2 * 1.25) / 8
    ("dr_grpo", 0.0125),
    # dapo: clip-higher 1.28 leaves 1.25 unclipped: token terms -1.25, -1.25, 1.25, 1.25 -> token mean 0
    ("dapo", 0.0),
    # gspo: sequence ratio 1.25 clipped to 1.0004 for A>0: -1.0004; A<0: -min(-1.25, -1.0004) = 1.25
    ("gspo", (-1.0004 + 1.25) / 2),
    # cispo: -sg(min(1.25, 5)) * A * logp, token mean
    ("cispo", -1.25 * (math.log(0.5) + math.log(0.625) - math.log(0.25) - math.log(0.3125)) / 4),
])
def test_preset_losses_match_hand_computed(loss_type, expected):
    from evollm.algorithms.grpo import GRPOConfig

    cfg = GRPOConfig(loss_type=loss_type, max_output_tokens=4)
    logp, old, adv, mask = _preset_case()
    low, high = cfg.clip_range()
    loss = F.policy_loss(logp, old, adv, mask, loss_type=loss_type, clip_low=low, clip_high=high,
                         max_completion_length=cfg.max_output_tokens)
    assert float(loss) == pytest.approx(expected, rel=1e-5, abs=1e-7)


def test_preset_table_settings_and_user_overrides(tiny):
    from evollm.algorithms.grpo import CISPO, GSPO, GRPOConfig

    model, tok = tiny
    assert GRPOConfig(loss_type="dapo").clip_range() == pytest.approx((0.2, 0.28))
    assert GRPOConfig(loss_type="dr_grpo").reward_scaling() == "none"
    assert GRPOConfig(loss_type="grpo").reward_scaling() == "group"
    assert GSPO(model, tok.pad_token_id).config.clip_range() == pytest.approx((3e-4, 4e-4))
    assert CISPO(model, tok.pad_token_id).config.clip_range()[1] == pytest.approx(4.0)
    assert GSPO(model, tok.pad_token_id, clip_high=0.01).config.clip_range() == pytest.approx((3e-4, 0.01))
    assert GRPOConfig(loss_type="dr_grpo", scale_rewards="group").reward_scaling() == "group"
    agent = make_grpo(model, tok)[0]  # a loss_type mutation brings its preset along
    agent.set_hyperparameter("loss_type", "gspo")
    assert agent.config.clip_range() == pytest.approx((3e-4, 4e-4))
    with pytest.raises(ValueError, match="bnpo.*removed.*dapo"):
        GRPOConfig(loss_type="bnpo").validate()


def test_dr_grpo_advantages_are_not_std_scaled():
    from evollm.algorithms.grpo import GRPOConfig

    r = torch.tensor([1.0, 0.0, 0.0, 0.0])
    adv = F.group_advantages(r, 4, scale=GRPOConfig(loss_type="dr_grpo").reward_scaling())
    assert adv.tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25])


def test_overlong_penalty_and_informative_groups():
    # L_max 10, buffer 4: 0 up to 6, then (6 - L) / 4, -1 beyond 10
    got = F.overlong_penalty(torch.tensor([3, 6, 7, 9, 10, 12]), 10, 4, penalty=0.5)
    assert got.tolist() == pytest.approx([0, 0, -0.125, -0.375, -0.5, -0.5])
    assert F.overlong_penalty(torch.tensor([10]), 10, 0).tolist() == [0.0]
    assert F.informative_groups(torch.tensor([1.0, 1.0, 0.0, 1.0]), 2).tolist() == [False, True]


def test_dynamic_sampling_drops_uninformative_groups(tiny, arithmetic_env):
    model, tok = tiny
    agent = make_grpo(model, tok, loss_type="dapo", dynamic_sampling=True)[0]
    ids, masks = agent.get_action(arithmetic_env.reset())
    before = [p.detach().clone() for p in agent.shared.parameters(agent.adapter_name())]
    flat = torch.ones(len(ids), 4)  # every group's rewards equal: nothing to learn, no update
    metrics = agent.learn((ids, masks, flat))
    assert metrics["zero_std_groups"] == 1.0
    assert all(torch.equal(a, b) for a, b in zip(before, agent.shared.parameters(agent.adapter_name())))
    mixed = flat.clone()
    mixed[0, 0] = 0.0
    assert agent.learn((ids, masks, mixed))["grad_norm"] > 0


def test_dynamic_sampling_under_several_processes_is_refused_in_one_line(tiny, arithmetic_env, monkeypatch):
    """Each process would refill its own share and their updates (collective per minibatch) would no longer line
    up: refused before any work."""
    from evollm.parallel import distributed
    from evollm.training.loop import finetune_llm_reasoning

    model, tok = tiny
    pop = make_grpo(model, tok, loss_type="dapo", dynamic_sampling=True)
    monkeypatch.setattr(distributed, "init", lambda: None)
    monkeypatch.setattr(distributed, "num_processes", lambda: 2)
    with pytest.raises(ValueError, match=r"^member 0: dynamic_sampling is not supported with 2 processes .*; set "
                                         r"dynamic_sampling: false or run one process$"):
        finetune_llm_reasoning(pop, arithmetic_env, max_steps=1, verbose=False)


def test_dynamic_sampling_refills_the_batch_with_informative_groups():
    from types import SimpleNamespace

    from evollm.training.dynamic_sampling import refill

    class Env:
        def __init__(self):
            self.batch = 0

        def reset(self):
            return [{"batch": self.batch, "i": i} for i in range(2)]

        def step_to_next_batch(self):
            self.batch += 1

        def score(self, completions, prompts):  # batch 1: one informative group; batch 2: two
            b = prompts[0]["batch"]
            rows = [[1.0, 1.0], [1.0, 1.0]] if b == 0 else [[1.0, 0.0], [1.0, 1.0]] if b == 1 else [[0.0, 1.0]] * 2
            return torch.tensor(rows)

    class Rollout:
        def __init__(self, tag):
            self.tag = tag

        def per_prompt(self):
            return [torch.full((2, 3), self.tag + k) for k in range(2)], [torch.ones(2, 2)] * 2

    env = Env()
    agent = SimpleNamespace(index=7, config=SimpleNamespace(dynamic_sampling=True, dynamic_sampling_max_batches=3,
                                                            group_size=2))
    plain = SimpleNamespace(index=8, config=SimpleNamespace(dynamic_sampling=False, group_size=2))
    first = Rollout(0).per_prompt()
    experiences = [(*first, env.score(first[0], env.reset())), (*first, torch.ones(2, 2))]
    env.step_to_next_batch()
    calls = []

    def generate(agents, prompts):
        calls.append([a.index for a in agents])
        return {a.index: Rollout(10 * prompts[0]["batch"]) for a in agents}

    out = refill([agent, plain], experiences, env, generate)
    completions, masks, rewards = out[0]
    assert calls == [[7], [7]]  # two extra batches for the dynamic-sampling member only
    assert len(completions) == 2 and rewards.tolist() == [[1.0, 0.0], [0.0, 1.0]]
    assert [int(c[0, 0]) for c in completions] == [10, 20]  # group 0 of batch 1, group 0 of batch 2
    assert out[1] is experiences[1]
