"""IPPO teams: isolation of each agent's update, the joint reward, clipping, two-round episodes,
clones, checkpoints, per-agent mutations and a short evolved run of teams."""
import math

import pytest
import torch
from peft import PeftModel

import evollm.algorithms.ppo_update as fused
from evollm.adapters.shared import default_lora_config
from evollm.algorithms.ippo import IPPOConfig, IPPOTeam
from evollm.algorithms.ippo_rollout import evaluate_teams, play_teams
from evollm.envs.team import TeamTask
from evollm.hpo import HyperparameterConfig, Mutations, RLParameter, TournamentSelection
from evollm.models.tiny import build_tiny_model
from evollm.models.tokenizer import build_tokenizer
from evollm.tasks.coop import relay_formatters, relay_sum_dataset, relay_sum_reward
from evollm.training.ippo import finetune_ippo

TOK = build_tokenizer()


def length_reward(*agent_completions, **columns):
    """A dense joint reward: depends on every agent's reply (and on the row's ``x``)."""
    return [float(sum(len(c[b]) for c in agent_completions) % 3) + 0.1 * (int(x) % 2)
            for b, x in enumerate(columns["x"])]


def make_task(num_turns=2, reward=length_reward, **kw):
    train, test = relay_sum_dataset(n_train=16, n_test=4, seed=0)
    return TeamTask(train, test, TOK, reward, relay_formatters(), num_turns=num_turns, max_new_tokens=3, **kw)


def make_team(model=None, **kw):
    model = model if model is not None else build_tiny_model(TOK, seed=0)
    kw.setdefault("num_turns", 2)
    settings = dict(max_new_tokens=3, rollout_buffer_size=4, mini_batch_size=4, ppo_epochs=1,
                    actor_learning_rate=1e-2, critic_learning_rate=1e-2)
    settings.update(kw)
    return IPPOTeam(model, TOK, lora_config=default_lora_config(r=4), **settings)


def agent_tensors(agent):
    out = {f"{role}." + n.replace(f".{agent.adapter_name(role)}.", "."): p.detach().clone() for role in agent.ROLES
           for n, p in agent.shared.named_parameters(agent.adapter_name(role))}
    out.update({f"head.{n}": p.detach().clone() for n, p in agent.value_head.named_parameters()})
    return out


def changed(before, agent):
    after = agent_tensors(agent)
    return {k for k in before if not torch.equal(before[k], after[k])}


def lora_B_nonzero(team):
    """Give every adapter a non-zero B and every value head non-zero weights, so that gradients reach
    every tensor from the first step (fresh LoRA has B = 0, a fresh value head is 0)."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for agent in team.agents:
            for p in agent.value_head.parameters():
                p.copy_(0.05 * torch.randn(p.shape, generator=gen))
            for role in agent.ROLES:
                for n, p in agent.shared.named_parameters(agent.adapter_name(role)):
                    if "lora_B" in n:
                        p.copy_(0.05 * torch.randn(p.shape, generator=gen))


@pytest.fixture
def rollout_team():
    torch.manual_seed(0)
    team = make_team()
    lora_B_nonzero(team)
    task = make_task()
    return team, task, play_teams([team], task, task.next_rows(4)).experiences[team.index]


# --------------------------------------------------------------------------- isolation and fusion
def test_each_agents_update_changes_only_its_own_adapters(rollout_team):
    team, _, exp = rollout_team
    before = [agent_tensors(a) for a in team.agents]
    team.agents[0].learn(exp[0])
    assert changed(before[0], team.agents[0])  # its actor, critic and value head moved ...
    assert {k.split(".")[0] for k in changed(before[0], team.agents[0])} == {"actor", "critic", "head"}
    assert not changed(before[1], team.agents[1])  # ... the other agent's did not


def test_fused_update_of_a_team_equals_separate_updates(rollout_team):
    team, _, exp = rollout_team
    twin = team.clone()
    team.learn(exp)  # both agents in shared routed forward/backward passes
    for agent, e in zip(twin.agents, exp):
        agent.learn(e)  # one at a time
    for a, b in zip(team.agents, twin.agents):
        ta, tb = agent_tensors(a), agent_tensors(b)
        for key in ta:
            assert torch.allclose(ta[key], tb[key], atol=2e-5), key


def test_value_head_on_actor_trains_the_actor_from_the_value_loss():
    torch.manual_seed(0)
    team = make_team(use_separate_critic=False, entropy_coef=0.0)
    lora_B_nonzero(team)
    assert team.agents[0].ROLES == ("actor",) and not team.shared.has_adapter(team.agents[0].adapter_name("critic"))
    task = make_task()
    exp = play_teams([team], task, task.next_rows(4)).experiences[team.index]
    before = agent_tensors(team.agents[1])
    team.agents[1].config.vf_coef, team.agents[1].config.adv_whitening = 1.0, False
    with torch.no_grad():  # zero advantages: only the value loss can move the actor adapter
        team.agents[1].value_head.bias.fill_(5.0)
    team.agents[1].learn(exp[1])
    assert {k.split(".")[0] for k in changed(before, team.agents[1])} == {"actor", "head"}


# --------------------------------------------------------------------------- episodes and rewards
def test_joint_reward_reaches_every_agent_and_the_processor_applies():
    torch.manual_seed(0)
    team = make_team(num_agents=2)
    calls = []

    def reward(*completions, x, y, answer):
        calls.append((completions, list(x)))
        return [float(i + 1) for i in range(len(x))]

    task = make_task(reward=reward, reward_processor=lambda r: 10 * r)
    out = play_teams([team], task, task.next_rows(3))
    assert len(calls) == 1 and len(calls[0][0]) == 2  # scored once (last round), one list per agent
    rewards = [e[3] for e in out.experiences[team.index]]
    assert torch.equal(rewards[0], rewards[1])  # the same joint reward for both agents
    assert rewards[0].tolist() == [[0.0, 10.0], [0.0, 20.0], [0.0, 30.0]]  # round 1 unscored, then processed
    assert [e.rewards for e in out.episodes[team.index]] == [[0.0, 10.0], [0.0, 20.0], [0.0, 30.0]]


def test_two_round_episode_shows_each_agent_the_others_reply():
    torch.manual_seed(0)
    team = make_team()
    seen = []

    def formatter(agent):
        def fmt(row, history):
            seen.append((agent, [list(h) for h in history]))
            return f"n={row['x']}" if not history else f"o{history[-1][1 - agent]}"
        return fmt

    task = make_task()
    task.formatters = [formatter(0), formatter(1)]
    out = play_teams([team], task, task.next_rows(2))
    for ep, seat0, seat1 in zip(out.episodes[team.index], *out.seats[team.index]):
        first = ep.history[0]
        for agent, seat in ((0, seat0), (1, seat1)):
            text = TOK.decode(seat.ids)
            assert f"<|user|>o{first[1 - agent]}<|assistant|>" in text  # round 2 shows the other's round-1 reply
            own = [TOK.decode([t]) for t, a, k in zip(seat.ids, seat.is_action, seat.turn_of) if a and k == 0]
            assert "".join(own).replace("<eos>", "") == first[agent]  # what was shown is what it generated
    assert [h for a, h in seen if h] and all(len(h) == 1 for a, h in seen if h)


# --------------------------------------------------------------------------- clipping
def test_ratio_and_value_clipping_take_effect(rollout_team, monkeypatch):
    team, _, exp = rollout_team
    team.set_hyperparameter("agent0.clip_coef", 0.01)
    team.set_hyperparameter("agent1.value_clip_range", 0.05)
    team.agents[1].config.clip_coef = None  # agent 1: no ratio clipping at all
    team.agents[0].config.value_clip = None  # agent 0: unclipped value loss
    for agent in team.agents:
        agent.config.update_epochs, agent.config.batch_size = 3, 2
    seen = {"pg": [], "v": []}
    pg, vl = fused.F.policy_loss_with_stats, fused.F.value_loss
    monkeypatch.setattr(fused.F, "policy_loss_with_stats",
                        lambda *a, **k: seen["pg"].append((k["clip_low"], k["clip_high"])) or pg(*a, **k))
    monkeypatch.setattr(fused.F, "value_loss", lambda *a, **k: seen["v"].append(k["clip"]) or vl(*a, **k))
    m0, m1 = team.learn(exp)
    assert (0.01, 0.01) in seen["pg"] and (1.0, math.inf) in seen["pg"]
    assert None in seen["v"] and 0.05 in seen["v"]
    assert m0["clip_fraction"] > 0  # later minibatches moved the ratio past 1 +- 0.01: gradients were cut
    assert m1["clip_fraction"] == 0  # never clipped without a clip range


# --------------------------------------------------------------------------- population member
def test_team_clone_is_independent(rollout_team):
    team, task, exp = rollout_team
    team.learn(exp)  # optimizer moments exist
    team.fitness.append(0.5)
    twin = team.clone(index=99)
    assert twin.index == 99 and twin.fitness == [] and twin.parent_index == team.index  # a clone is not evaluated yet
    assert {a.index for a in twin.agents}.isdisjoint({a.index for a in team.agents})
    for a, b in zip(team.agents, twin.agents):
        sa, sb = a.optimizer.state_dict()["state"], b.optimizer.state_dict()["state"]
        assert all(torch.equal(sa[k]["exp_avg"], sb[k]["exp_avg"]) for k in sa)
        assert all(sa[k]["exp_avg"].data_ptr() != sb[k]["exp_avg"].data_ptr() for k in sa)
    before = [agent_tensors(a) for a in team.agents]
    twin.learn(play_teams([twin], task, task.next_rows(4)).experiences[twin.index])
    twin.set_hyperparameter("agent0.actor_learning_rate", 0.5)
    assert all(not changed(b, a) for b, a in zip(before, team.agents))
    assert team.get_hyperparameter("agent0.actor_learning_rate") == 1e-2
    with pytest.raises(ValueError, match="team id 99"):
        team.clone(index=99)


def test_mutating_a_per_agent_hyperparameter_reaches_that_agent():
    hp = HyperparameterConfig(**{"agent1.actor_learning_rate": RLParameter(min=1e-4, max=1.0, log=True)})
    team = make_team(hp_config=hp)
    Mutations(no_mutation=0.0, rl_hp=1.0, rand_seed=0).mutation([team])
    new = team.last_mutation.new
    assert team.last_mutation.name == "agent1.actor_learning_rate" and new != 1e-2
    lrs = [{g["name"]: g["lr"] for g in a.optimizer.param_groups} for a in team.agents]
    assert lrs[1]["actor"] == new and lrs[0]["actor"] == 1e-2 and lrs[1]["critic"] == 1e-2
    team.set_hyperparameter("agent0.temperature", 0.5)
    assert team.agents[0].sampling_config().temperature == 0.5 and team.agents[1].sampling_config().temperature == 1.0
    team.set_hyperparameter("entropy_coef", 0.01)  # bare name: every agent
    assert [a.config.ent_coef for a in team.agents] == [0.01, 0.01]
    team.set_hyperparameter("agent1.lora_rank", 6)
    assert [a.lora_rank for a in team.agents] == [4, 6] and team.lora_rank == 6
    with pytest.raises(ValueError, match="cannot evolve"):
        team.set_hyperparameter("agent2.clip_coef", 0.1)
    with pytest.raises(ValueError, match="cannot evolve"):
        HyperparameterConfig(**{"agent0.lr_typo": RLParameter(min=0, max=1)}).validate_for(team)


def test_an_unset_critic_rate_keeps_the_actors_starting_rate_when_the_actor_evolves():
    """critic_learning_rate=None: each agent's critic starts at its actor's rate and keeps it when a mutation of
    actor_learning_rate (the team's default search space) moves the actor's."""
    hp = HyperparameterConfig(actor_learning_rate=RLParameter(min=1e-4, max=1.0, log=True))
    team = make_team(hp_config=hp, critic_learning_rate=None)
    Mutations(no_mutation=0.0, rl_hp=1.0, rand_seed=0).mutation([team])
    new = team.last_mutation.new
    assert team.last_mutation.name == "actor_learning_rate" and new != 1e-2
    for agent in team.agents:
        assert {g["name"]: g["lr"] for g in agent.optimizer.param_groups} == {"actor": new, "critic": 1e-2}
    assert team.get_hyperparameter("critic_learning_rate") == 1e-2


def test_team_checkpoint_round_trip_and_peft_loading(rollout_team, tmp_path):
    team, task, exp = rollout_team
    team.learn(exp)
    team.fitness.append(0.25)
    team.set_hyperparameter("agent1.clip_coef", 0.3)
    team.set_hyperparameter("agent1.lora_rank", 6)
    team.default_founder = True
    team.save_checkpoint(tmp_path / "team")
    assert not list(tmp_path.rglob("*.pt")) and not list(tmp_path.rglob("*.bin"))
    loaded = IPPOTeam.load(tmp_path / "team", team.agents[0].shared.model.get_base_model())
    assert loaded.fitness == [0.25] and loaded.get_hyperparameter("agent1.clip_coef") == 0.3 and loaded.default_founder
    assert [a.lora_rank for a in loaded.agents] == [4, 6]
    for a, b in zip(team.agents, loaded.agents):
        ta, tb = agent_tensors(a), agent_tensors(b)
        assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)
        sa, sb = a.optimizer.state_dict(), b.optimizer.state_dict()
        assert all(torch.equal(sa["state"][k]["exp_avg_sq"], sb["state"][k]["exp_avg_sq"]) for k in sa["state"])
    ids = torch.tensor([[4, 20, 21, 22, 23]])
    fresh = build_tiny_model(TOK, seed=0)
    peft = PeftModel.from_pretrained(fresh, str(tmp_path / "team" / "agent_1" / "adapter")).eval()
    with team.shared.use(team.agents[1].adapter_name("actor")) as model:
        want = model(input_ids=ids).logits
    assert torch.allclose(peft(input_ids=ids).logits, want, atol=1e-5)


def test_evolved_teams_report_one_row_per_team_per_evaluation():
    torch.manual_seed(0)
    model = build_tiny_model(TOK, seed=0)
    hp = HyperparameterConfig(**{"agent0.actor_learning_rate": RLParameter(min=1e-4, max=1e-1, log=True),
                                 "agent1.entropy_coef": RLParameter(min=0.0, max=0.1)})
    teams = [make_team(model, hp_config=hp, num_turns=1, use_separate_critic=i == 0) for i in range(2)]
    task = make_task(num_turns=1, reward=relay_sum_reward)
    teams_out, pop = finetune_ippo(teams, task, max_steps=4, evaluation_interval=2, evo_steps=2,
                                   tournament=TournamentSelection(tournament_size=2, population_size=2, rand_seed=0),
                                   mutation=Mutations(no_mutation=0.0, rl_hp=1.0, rand_seed=0), verbose=False)
    report = pop.report()
    assert len(report) == 4 and set(report.groupby("step").size()) == {2}
    for col in ("success", "hp_agent0.actor_learning_rate", "hp_agent1.entropy_coef", "agent1.policy_loss",
                "agent0.clip_fraction"):
        assert col in report.columns, col
    assert len(pop.lineage()) == 3  # two founders and the clone of the selection
    assert all(t.fitness for t in teams_out)
    fitness, success = evaluate_teams(teams_out, task, record=False)
    assert all(0.0 <= f <= 1.0 for f in fitness) and all(0.0 <= s <= 1.0 for s in success)
    # each team's mean has the standard error of its episodes' returns, as single-agent evaluations do
    returns = [[ep.episode_return for ep in play_teams(teams_out, task, task.eval_rows, training=False).episodes[t.index]]
               for t in teams_out]
    for f, se, r in zip(fitness, fitness.stderr, returns):
        assert f == pytest.approx(sum(r) / len(r))
        assert se == pytest.approx(torch.tensor(r, dtype=torch.float64).std().item() / len(r) ** 0.5)
    # and the two teams' difference, paired row by row (both play the same evaluation rows)
    d = torch.tensor(returns[0], dtype=torch.float64) - torch.tensor(returns[1], dtype=torch.float64)
    assert fitness.pair_stderrs()[0][1] == pytest.approx(d.std().item() / len(d) ** 0.5)


def test_config_errors_are_one_line():
    with pytest.raises(TypeError, match="no field"):
        make_team(num_agent=2)
    with pytest.raises(ValueError, match="agent_overrides\\[0\\]"):
        make_team(agent_overrides=[{"learning_rate": 1.0}])
    with pytest.raises(ValueError, match="returned 1 rewards"):
        team = make_team()
        task = make_task(reward=lambda *c, **k: [1.0])
        play_teams([team], task, task.next_rows(2))


def test_comlrl_style_trainer_runs_and_saves(tmp_path):
    from evollm.training import IPPOTrainer

    torch.manual_seed(0)
    train, test = relay_sum_dataset(n_train=8, n_test=4, seed=0)
    args = IPPOConfig(num_agents=2, num_turns=2, max_new_tokens=3, rollout_buffer_size=4, mini_batch_size=4,
                      ppo_epochs=1, eval_interval=1, output_dir=str(tmp_path / "run"))
    trainer = IPPOTrainer(model=build_tiny_model(TOK, seed=0), tokenizer=TOK, reward_func=relay_sum_reward,
                          formatters=relay_formatters(), args=args, train_dataset=train, eval_dataset=test,
                          lora_config=default_lora_config(r=4), reward_processor=lambda r: 2 * r)
    assert set(trainer.evaluate()) == {"eval_joint_reward", "eval_success"}
    teams, population = trainer.train(max_steps=2, verbose=False)
    assert len(population.report()) == 2 and teams[0].steps == 2
    path = trainer.save_model()
    assert (path / "team.json").exists() and (path / "agent_1" / "adapter" / "adapter_model.safetensors").exists()


def _team_run(ckpt, resume=False, callbacks=()):
    torch.manual_seed(0)
    model = build_tiny_model(TOK, seed=0)
    hp = HyperparameterConfig(**{"agent0.actor_learning_rate": RLParameter(min=1e-3, max=5e-2, log=True)})
    teams = [make_team(model, hp_config=hp, num_turns=1, use_separate_critic=i == 0) for i in range(2)]
    return finetune_ippo(teams, make_task(num_turns=1, reward=relay_sum_reward), max_steps=4, evaluation_interval=2,
                         evo_steps=2, tournament=TournamentSelection(tournament_size=2, population_size=2, rand_seed=0),
                         mutation=Mutations(no_mutation=0.0, rl_hp=1.0, rand_seed=0), verbose=False,
                         checkpoint_dir=ckpt, checkpoint_every=1, callbacks=callbacks, resume=resume)


def test_an_interrupted_team_run_resumes_exactly(tmp_path):
    """Run checkpoints hold whole teams (every agent, the task's position in its rows): a run stopped
    after step 3 and resumed ends bit-identical to the uninterrupted run."""
    from evollm.training import Callback

    class StopAt(Callback):
        def on_step_complete(self, state):
            if state.step == 3:
                raise KeyboardInterrupt

    teams, record = _team_run(tmp_path / "a")
    with pytest.raises(KeyboardInterrupt):
        _team_run(tmp_path / "b", callbacks=[StopAt()])
    again, record2 = _team_run(tmp_path / "b", resume=True)
    assert [t.index for t in teams] == [t.index for t in again]
    for team, other in zip(teams, again):
        one, two = (dict(pair for agent in t.agents for pair in agent_tensors(agent).items()) for t in (team, other))
        assert one.keys() == two.keys() and all(torch.equal(one[k], two[k]) for k in one)
        assert team.fitness == other.fitness and team.agent_hyperparameters() == other.agent_hyperparameters()
    assert record.report().equals(record2.report())
