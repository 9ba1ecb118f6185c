"""One member base for single agents and teams: history, hooks, clone bookkeeping, release, the declared
quarantine flag, fitness recorded in one place, founders built in one place, ids per space on the base."""

import math

import pytest
from conftest import make_grpo

from evollm.adapters.shared import default_lora_config
from evollm.algorithms import GRPO, IPPOTeam, LLMPPO
from evollm.algorithms.member import Member
from evollm.hpo import HyperparameterConfig, RLParameter
from evollm.models.tiny import build_tiny_model
from evollm.models.tokenizer import build_tokenizer

TOK = build_tokenizer()


def _team(model, **kw):
    return IPPOTeam(model, TOK, lora_config=default_lora_config(r=2), max_new_tokens=2, rollout_buffer_size=2,
                    mini_batch_size=2, ppo_epochs=1, **kw)


@pytest.fixture
def members():
    model = build_tiny_model(TOK, seed=0)
    agent = GRPO(model, pad_token_id=TOK.pad_token_id, group_size=2, max_output_tokens=2)
    team = _team(model)
    yield agent, team
    for m in (agent, team):
        m.release()


def test_agents_and_teams_share_one_base_and_its_bookkeeping(members):
    for member in members:
        assert isinstance(member, Member)
        assert member.quarantined is False and member.quarantine_reason is None  # declared, not set by training
        calls = []
        member.register_mutation_hook(lambda m: calls.append(m.index))
        member.record_fitness(0.5)
        member.record_score(math.nan)
        member.steps = 3
        twin = member.clone()
        twin.run_mutation_hooks()
        assert calls == [twin.index] and twin.mutation_hooks == member.mutation_hooks
        assert twin.mutation_hooks is not member.mutation_hooks
        assert (twin.fitness, twin.scores, twin.parent_index, twin.steps) == ([], [], member.index, 3)
        assert member.fitness == [0.5] and math.isnan(member.scores[0])
        member.quarantine("step 3: non-finite loss")
        child = member.clone()
        assert member.quarantined and member.quarantine_reason == "step 3: non-finite loss"
        assert not child.quarantined and child.quarantine_reason is None  # clones never inherit the flag
        for m in (twin, child):
            m.release()
            m.release()  # idempotent
            assert m.released


def test_trainable_parameters_cover_adapters_and_extra_modules(members):
    agent, team = members
    assert len(agent.trainable_parameters()) == len(agent.shared.parameters(agent.adapter_name()))
    expected = sum(len(a.trainable_parameters()) for a in team.agents)
    assert len(team.trainable_parameters()) == expected
    head = team.agents[0].extra_parameters()["value_head"]
    assert any(p is head[0] for p in team.trainable_parameters())


def test_team_ids_and_member_ids_are_separate_spaces_on_the_base(members):
    agent, team = members
    shared = agent.shared
    assert team.index == 0 and agent.index == 0  # each space starts at 0
    assert shared.used_indices("team") == [0] and set(shared.used_indices()) >= {0, 1, 2}
    with pytest.raises(ValueError, match="team id 0 was already used"):
        team.clone(index=0)
    twin = team.clone()
    assert twin.index == 1 and shared.next_index("team") == 2
    twin.release()
    shared.return_index(1, "team")  # a saved team coming back under its own id
    back = team.clone(index=1)
    assert back.index == 1
    back.release()
    shared.mark_used([7], "team")
    assert shared.next_index("team") == 8 and shared.next_index() != 8
    assert shared.is_live(agent.adapter_name()) and not shared.is_live("m999")


def test_founders_are_built_in_one_place_for_every_member_kind():
    assert GRPO.population.__func__ is Member.population.__func__
    assert LLMPPO.population.__func__ is IPPOTeam.population.__func__ is Member.population.__func__
    model = build_tiny_model(TOK, seed=0)
    hp = HyperparameterConfig(lr=RLParameter(min=1e-5, max=1e-3, log=True))
    pop = GRPO.population(3, model, hp_config=hp, pad_token_id=TOK.pad_token_id, group_size=2, seed=1)
    lrs = [a.lr for a in pop]
    assert len(set(lrs)) == 3 and all(1e-5 <= lr <= 1e-3 for lr in lrs)  # drawn founders
    assert [g["lr"] for a in pop for g in a.optimizer.param_groups] == lrs  # the value reached the optimizer
    fixed = GRPO.population(2, model, hp_config=hp, pad_token_id=TOK.pad_token_id, group_size=2, lr=3e-4)
    assert [a.lr for a in fixed] == [3e-4, 3e-4]  # a value the caller gives is kept for every founder
    hp_team = HyperparameterConfig(**{"agent1.actor_learning_rate": RLParameter(min=1e-4, max=1e-2, log=True)})
    teams = IPPOTeam.population(2, model, hp_config=hp_team, tokenizer=TOK, max_new_tokens=2, seed=0)
    values = [t.get_hyperparameter("agent1.actor_learning_rate") for t in teams]
    assert values[0] != values[1] and teams[0].get_hyperparameter("agent0.actor_learning_rate") == 1e-4
    with pytest.raises(ValueError, match="population size must be >= 1"):
        GRPO.population(0, model, pad_token_id=TOK.pad_token_id)
    for m in pop + fixed + teams:
        m.release()


def test_the_loop_records_fitness_once_per_evaluation_and_minus_inf_for_a_quarantined_member(tiny):
    from evollm.training.quarantine import evaluate_healthy

    model, tok = tiny
    pop = make_grpo(model, tok, n=2)
    pop[1].quarantine("step 1: non-finite loss")
    seen = []

    def evaluate(agents):  # what the loops pass: records nothing itself
        seen.append([a.index for a in agents])
        return [0.25] * len(agents)

    assert evaluate_healthy(pop, evaluate) == [0.25, -math.inf]
    assert seen == [[pop[0].index]] and pop[0].fitness == [0.25] and pop[1].fitness == [-math.inf]
