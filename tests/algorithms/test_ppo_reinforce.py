"""LLMPPO and LLMREINFORCE: turn-level credit, hyperparameters that take effect, clone and
checkpoint of a PPO member, and short runs that improve a warm-started tiny model."""
import math

import pytest
import torch

from evollm.adapters.shared import default_lora_config
from evollm.rollout import EnvPool
from evollm.algorithms.ppo import LLMPPO
from evollm.algorithms.reinforce import LLMREINFORCE
from evollm.envs.reasoning import ReasoningGym
from evollm.hpo import HyperparameterConfig, Mutations, RLParameter
from evollm.recipes.multiturn_warm_start import load_tiny_multiturn_model
from evollm.tasks.games import task_env_factory
from evollm.models.tiny import build_tiny_model
from evollm.models.tokenizer import build_tokenizer
from evollm.tasks.arithmetic import ARITHMETIC_TEMPLATE, arithmetic_dataset
from evollm.tasks.rewards import exact_match_reward
from evollm.training.loop import finetune_llm_reasoning
from evollm.training.multiturn import evaluate_episodes, finetune_llm_multiturn

TOK = build_tokenizer()
PAD = TOK.pad_token_id


def make_agent(cls=LLMPPO, seed=0, **kw):
    model = build_tiny_model(TOK, seed=seed)
    kw.setdefault("max_output_tokens", 4)
    return cls(model, pad_token_id=PAD, pad_token=TOK.pad_token, lora_config=default_lora_config(r=4), **kw)


def episodes(turns=((1.0, 0.0), (0.0,), (0.0, 1.0), (0.5, 0.5))):
    """A fixed batch of hand-made multi-turn episodes: prompt, then per turn 2 model tokens + 2 env tokens."""
    rows, masks, turn_rows = [], [], []
    for b, rewards in enumerate(turns):
        ids, is_action, turn_of = [3, 10 + b], [False, False], [-1, -1]
        for k, _ in enumerate(rewards):
            ids += [20 + b + k, 1, 3, 4]
            is_action += [True, True, False, False]
            turn_of += [k, k, -1, -1]
        rows.append(torch.tensor([ids]))
        masks.append(torch.tensor([is_action[1:]], dtype=torch.long))
        turn_rows.append(torch.tensor([turn_of[1:]]))
    width = max(r.shape[1] for r in rows)
    pad = lambda ts, v, w: torch.cat([torch.nn.functional.pad(t, (0, w - t.shape[1]), value=v) for t in ts])
    rewards = torch.zeros(len(turns), max(len(t) for t in turns))
    for b, r in enumerate(turns):
        rewards[b, :len(r)] = torch.tensor(r)
    return pad(rows, PAD, width), pad(masks, 0, width - 1), pad(turn_rows, -1, width - 1), rewards


def group_params(agent, group):
    """The tensors of one optimizer param group ("actor": actor adapter; "critic": critic adapter + value head)."""
    return next(g["params"] for g in agent.optimizer.param_groups if g["name"] == group)


def snapshot(agent, group):
    return [p.detach().clone() for p in group_params(agent, group)]


def delta(agent, group, before):
    return sum(float((p.detach() - b).abs().sum()) for p, b in zip(group_params(agent, group), before))


def lrs(agent):
    return {g["name"]: g["lr"] for g in agent.optimizer.param_groups}


# --------------------------------------------------------------------------- credit assignment
def test_single_turn_reward_counts_once_per_turn():
    agent = make_agent(adv_whitening=False, gamma=1.0, gae_lambda=1.0)
    ids = torch.tensor([[3, 10, 4, 20, 21, 22, 1], [3, 11, 4, 23, 1, 0, 0]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [0, 0, 1, 1, 0, 0]])
    out = agent.advantages((ids, mask, torch.tensor([[2.0], [0.0]])))  # rewards [P, G=1]
    assert out["returns"].tolist() == [[2.0], [0.0]]  # V = 0 (zero value head): R = r, not r * tokens
    assert out["advantages"].tolist() == [[0, 0, 2, 2, 2, 2], [0, 0, 0, 0, 0, 0]]
    agent.config.action_granularity = "token"  # token-level GAE: the reward sits on the last token only
    out = agent.advantages((ids, mask, torch.tensor([2.0, 0.0])))
    assert out["returns"][0].tolist() == [0, 0, 2, 2, 2, 2]


def test_turn_level_gae_gamma_and_lambda_change_advantages():
    agent = make_agent(adv_whitening=False, gamma=1.0, gae_lambda=1.0)
    batch = episodes()
    adv = agent.advantages(batch)
    assert adv["returns"][0].tolist() == [1.0, 0.0] and adv["returns"][2].tolist() == [1.0, 1.0]
    ids, mask, turns, _ = batch
    first_turn = (turns[2] == 0)
    assert adv["advantages"][2][first_turn].tolist() == [1.0, 1.0]  # the later reward reaches turn 0
    agent.set_hyperparameter("gamma", 0.5)
    assert agent.advantages(batch)["returns"][2].tolist() == [0.5, 1.0]
    agent.set_hyperparameter("gamma", 1.0)
    agent.set_hyperparameter("gae_lambda", 0.0)
    assert agent.advantages(batch)["advantages"][2][first_turn].tolist() == [0.0, 0.0]  # one-step TD, V = 0


def test_reinforce_rebn_turn_returns():
    agent = make_agent(LLMREINFORCE, gamma=1.0)
    batch = episodes()
    from evollm.algorithms.multiturn_rollout import episode_batch
    adv = agent.normalised_returns(episode_batch(batch, PAD))
    ids, mask, turns, _ = batch
    # turn returns: [1, 0], [0], [1, 1], [1, 0.5] -> z-scored over the 7 played turns
    g = torch.tensor([1, 0, 0, 1, 1, 1, 0.5])
    z = (g - g.mean()) / g.std()
    assert torch.allclose(adv[0][turns[0] == 0], z[0].repeat(2), atol=1e-5)
    assert torch.allclose(adv[3][turns[3] == 1], z[6].repeat(2), atol=1e-5)
    assert (adv[mask == 0] == 0).all()



def test_reinforce_batch_of_equal_returns_skips_the_forwards_and_equals_the_full_update(monkeypatch):
    """Equal returns everywhere: ReBN's advantages are all zero, so the update only steps the optimizer
    (no policy forward), and the adapter and AdamW state end exactly where the full update leaves them."""
    from evollm.algorithms import reinforce_update, updates

    agent = make_agent(LLMREINFORCE, gamma=1.0, lr=1e-2, update_epochs=2, batch_size=2)
    agent.learn(episodes())  # momentum from an informative batch
    twin = agent.clone()
    flat = episodes(turns=((0.0, 1.0), (1.0,), (0.0, 1.0), (1.0,)))  # every turn's return-to-go is 1
    calls = []
    original = reinforce_update.member_logprobs
    monkeypatch.setattr(reinforce_update, "member_logprobs", lambda *a, **k: calls.append(1) or original(*a, **k))
    skipped = agent.learn(flat)
    assert calls == [] and skipped["grad_norm"] == 0.0 and skipped["loss"] == 0.0 and skipped["mean_return"] == 1.0
    monkeypatch.setattr(updates, "SKIP_ZERO_GRADIENT", False)
    full = twin.learn(flat)
    assert calls and full["grad_norm"] == 0.0
    moved = False
    for p, q in zip(group_params(agent, "actor"), group_params(twin, "actor")):
        torch.testing.assert_close(p, q, atol=1e-7, rtol=0)
    for p, q in zip(agent.optimizer.state_dict()["state"].values(), twin.optimizer.state_dict()["state"].values()):
        torch.testing.assert_close(p["exp_avg"], q["exp_avg"], atol=1e-9, rtol=0)
        moved = moved or bool(p["exp_avg"].abs().sum() > 0)
    assert moved and agent.steps == twin.steps

# --------------------------------------------------------------------------- hyperparameters take effect
def learn_pair(setting, value, other=None, **kw):
    """A member and its clone, the clone with ``setting=value``; both learn on the same batch."""
    kw.setdefault("update_epochs", 1)
    kw.setdefault("batch_size", 4)
    a = make_agent(**kw)
    b = a.clone()
    if other is not None:
        a.set_hyperparameter(setting, other)
    b.set_hyperparameter(setting, value)
    snaps = {x.index: {r: snapshot(x, r) for r in ("actor", "critic")} for x in (a, b)}
    metrics = [x.learn(episodes()) for x in (a, b)]
    moved = [{r: delta(x, r, snaps[x.index][r]) for r in ("actor", "critic")} for x in (a, b)]
    return a, b, metrics, moved


def test_lr_actor_moves_only_the_actor_group():
    a, b, _, moved = learn_pair("lr_actor", 1e-2, other=1e-3, lr_critic=1e-3)
    assert lrs(b) == {"actor": 1e-2, "critic": 1e-3} and b.config.lr == 1e-2 and b.get_hyperparameter("lr") == 1e-2
    assert moved[1]["actor"] > 5 * moved[0]["actor"] > 0
    assert moved[1]["critic"] == pytest.approx(moved[0]["critic"], rel=1e-4)


def test_lr_critic_moves_only_the_critic_group():
    a, b, _, moved = learn_pair("lr_critic", 1e-2, other=1e-3, lr_actor=1e-3)
    assert lrs(b) == {"actor": 1e-3, "critic": 1e-2}
    assert moved[1]["critic"] > 5 * moved[0]["critic"] > 0
    assert moved[1]["actor"] == pytest.approx(moved[0]["actor"], rel=1e-4)


def test_an_unset_lr_critic_keeps_the_actors_starting_rate():
    """lr_critic=None takes lr_actor's value at construction and keeps it when lr_actor (or its alias lr) changes
    later (evolution, an anneal, a roll-back): a critic that followed the actor's rate was measured and cost the
    game (benchmarks/README.md, "A critic that follows the actor's rate"). A clone keeps it."""
    a, b, _, moved = learn_pair("lr_actor", 1e-2, lr_actor=1e-3)  # lr_critic unset: 1e-3 from construction
    assert a.config.lr_critic == 1e-3 and lrs(a) == {"actor": 1e-3, "critic": 1e-3}
    assert lrs(b) == {"actor": 1e-2, "critic": 1e-3}
    assert b.get_hyperparameter("lr_critic") == 1e-3 and b.config.lr == 1e-2
    assert moved[1]["actor"] > 5 * moved[0]["actor"] > 0
    assert moved[1]["critic"] == pytest.approx(moved[0]["critic"], rel=1e-4)
    twin = b.clone()
    twin.set_hyperparameter("lr", 4e-3)
    assert lrs(twin) == {"actor": 4e-3, "critic": 1e-3}


def test_vf_coef_scales_critic_gradient_and_loss():
    _, _, (m0, m1), _ = learn_pair("vf_coef", 2.0, other=0.5, max_grad_norm=None)
    assert m1["grad_norm_critic"] == pytest.approx(4 * m0["grad_norm_critic"], rel=1e-3)
    assert m1["grad_norm_actor"] == pytest.approx(m0["grad_norm_actor"], rel=1e-4)
    assert m1["loss"] - m0["loss"] == pytest.approx(1.5 * m0["value_loss"], rel=1e-3)


def test_clip_coef_changes_clip_fraction():
    _, _, (m0, m1), _ = learn_pair("clip_coef", 0.01, other=0.5, update_epochs=4, batch_size=2, lr=3e-2)
    assert m1["clip_fraction"] > m0["clip_fraction"]


def test_ent_coef_changes_loss_and_actor_gradient():
    _, _, (m0, m1), _ = learn_pair("ent_coef", 0.5, other=0.0, max_grad_norm=None)
    assert m0["loss"] - m1["loss"] == pytest.approx(0.5 * m0["entropy"], rel=1e-3)
    assert m1["grad_norm_actor"] != pytest.approx(m0["grad_norm_actor"], rel=1e-3)


def test_beta_adds_kl_when_actor_differs_from_reference():
    agent = make_agent(update_epochs=1)
    with torch.no_grad():  # move the actor away from the base (the reference)
        for p in agent.shared.parameters(agent.adapter_name("actor")):
            p.normal_(0, 0.3)
    other = agent.clone()
    other.set_hyperparameter("beta", 0.5)
    m0, m1 = agent.learn(episodes()), other.learn(episodes())
    assert m1["kl"] > 0 and m0["kl"] == 0.0
    assert m1["policy_loss"] - m0["policy_loss"] == pytest.approx(0.5 * m1["kl"], rel=1e-3)


def test_ppo_hp_config_and_mutation_reach_the_optimizer():
    hp = HyperparameterConfig(lr_actor=RLParameter(min=1e-5, max=1e-2), lr_critic=RLParameter(min=1e-5, max=1e-2),
                              vf_coef=RLParameter(min=0.1, max=2.0))
    agent = make_agent(hp_config=hp, lr_actor=1e-3, lr_critic=2e-3)
    mutations = Mutations(no_mutation=0.0, rl_hp=1.0, rand_seed=0)
    for _ in range(12):
        mutations.mutation([agent])
        assert lrs(agent) == {"actor": agent.config.lr_actor, "critic": agent.config.lr_critic}
    assert set(agent.MUTABLE) >= {"lr_actor", "lr_critic", "clip_coef", "vf_coef", "ent_coef", "gamma", "gae_lambda",
                                  "beta", "update_epochs", "batch_size", "temperature", "max_grad_norm"}
    with pytest.raises(ValueError):
        agent.get_hyperparameter("loss_type")


# --------------------------------------------------------------------------- clone and checkpoint
def test_clone_is_independent():
    agent = make_agent(lr=1e-2)
    agent.learn(episodes())
    clone = agent.clone()
    assert clone.index != agent.index and clone.value_head is not agent.value_head
    ids, *_ = episodes()
    before = (agent.get_logprobs(ids), agent.get_values(ids), agent.value_head.weight.detach().clone(),
              [s["exp_avg"].clone() for s in agent.optimizer.state.values()])
    assert torch.allclose(clone.get_logprobs(ids), before[0]) and torch.allclose(clone.get_values(ids), before[1])
    clone.learn(episodes())
    clone.learn(episodes())
    assert torch.equal(agent.get_logprobs(ids), before[0]) and torch.equal(agent.get_values(ids), before[1])
    assert torch.equal(agent.value_head.weight, before[2])
    assert all(torch.equal(s["exp_avg"], e) for s, e in zip(agent.optimizer.state.values(), before[3]))
    assert not torch.allclose(clone.get_values(ids), before[1])
    clone.set_hyperparameter("lr_critic", 5e-2)
    assert lrs(agent)["critic"] == 1e-2


def test_checkpoint_round_trip(tmp_path):
    agent = make_agent(lr_actor=1e-2, lr_critic=3e-3, vf_coef=0.7)
    agent.learn(episodes())
    agent.save_checkpoint(tmp_path / "ppo")
    assert (tmp_path / "ppo" / "critic" / "adapter_model.safetensors").exists()
    fresh = LLMPPO(agent.shared.model, pad_token_id=PAD, lora_config=default_lora_config(r=4))
    ids, *_ = episodes()
    assert not torch.allclose(fresh.get_values(ids), agent.get_values(ids))
    fresh.load_checkpoint(tmp_path / "ppo")
    assert torch.allclose(fresh.get_logprobs(ids), agent.get_logprobs(ids), atol=1e-6)
    assert torch.allclose(fresh.get_values(ids), agent.get_values(ids), atol=1e-6)
    assert lrs(fresh) == {"actor": 1e-2, "critic": 3e-3} and fresh.config.vf_coef == 0.7
    m_a, m_f = agent.learn(episodes()), fresh.learn(episodes())  # optimizer state came back too
    assert m_f["loss"] == pytest.approx(m_a["loss"], rel=1e-4)
    assert torch.allclose(fresh.get_values(ids), agent.get_values(ids), atol=1e-5)


# --------------------------------------------------------------------------- single-turn path
def test_single_turn_reasoning_loop_accepts_ppo_and_reinforce():
    model = build_tiny_model(TOK, seed=1)
    train, test = arithmetic_dataset(n_train=16, n_test=4, seed=0)
    env = ReasoningGym(train, test, TOK, exact_match_reward, ARITHMETIC_TEMPLATE, data_batch_size_per_gpu=4)
    common = dict(pad_token_id=PAD, lora_config=default_lora_config(r=4), max_output_tokens=3, batch_size=4)
    pop = [LLMREINFORCE(model, group_size=2, **common), LLMPPO(model, **common)]
    agents, record = finetune_llm_reasoning(pop, env, max_steps=2, evaluation_interval=2, verbose=False)
    assert all(len(a.fitness) == 1 and len(a.scores) == 2 and math.isfinite(a.scores[-1]) for a in agents)
    assert isinstance(pop[0].test(env), float)


def test_get_action_and_test_on_a_multiturn_env():
    from evollm.tasks.games import game_env_factory

    agent = make_agent(max_output_tokens=3)
    env = game_env_factory("guess_number", TOK, max_model_len=128, max_output_tokens=3)()
    prompt, _ = env.reset(seed=0)
    ids, masks = agent.get_action([prompt])
    assert ids[0].shape[0] == 1 and masks[0].shape == (1, ids[0].shape[1] - 1)  # group_size 1: one sample
    env.step(ids[0])
    assert len(env.rewards) == 1
    fitness = agent.test(env, loop=2)
    assert isinstance(fitness, float) and agent.fitness == [fitness]


# --------------------------------------------------------------------------- RL improves the tiny model
@pytest.fixture
def chain_calc(cache_dir):
    torch.manual_seed(0)
    return load_tiny_multiturn_model("chain_calc", cache_dir=cache_dir)  # built once per cache, then loaded


@pytest.mark.parametrize("cls,kw", [(LLMPPO, dict(lr_actor=1e-3, lr_critic=1e-3, update_epochs=2)),
                                    (LLMREINFORCE, dict(lr=3e-3))])
def test_short_run_improves_multiturn_success(chain_calc, cls, kw):
    model, tok = chain_calc
    factory = task_env_factory("chain_calc", tok)
    agent = cls(model, pad_token_id=tok.pad_token_id, lora_config=default_lora_config(r=8), max_output_tokens=4,
                batch_size=16, **kw)
    seeds = [10**9 + i for i in range(64)]
    before, _ = evaluate_episodes([agent], EnvPool(factory), seeds, record=False)
    agents, record = finetune_llm_multiturn([agent], max_turns=3, env_factory=factory, max_steps=12,
                                            evaluation_interval=12, episodes_per_step=32, eval_episodes=64,
                                            verbose=False, seed=0)
    after, _ = evaluate_episodes(agents, EnvPool(factory), seeds, record=False)
    train_rewards = agents[0].scores
    assert after[0] > before[0] + 0.15, (before, after)
    # the trained member and a fresh one on the same seeds: their difference is paired seed by seed
    fresh = cls(model, pad_token_id=tok.pad_token_id, lora_config=default_lora_config(r=8), max_output_tokens=4,
                batch_size=16, index=99, **kw)
    both, episodes = evaluate_episodes([agents[0], fresh], EnvPool(factory), seeds, record=False)
    r = [torch.tensor([e.episode_return for e in episodes[i]], dtype=torch.float64) for i in (agents[0].index, 99)]
    assert both.pair_stderrs()[0][1] == pytest.approx((r[0] - r[1]).std().item() / len(seeds) ** 0.5)
    assert both.pair_stderrs()[1][1] == 0.0
    assert sum(train_rewards[-4:]) / 4 > sum(train_rewards[:4]) / 4
