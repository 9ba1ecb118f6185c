"""ONE PPO update: a member learning alone (``LLMPPO.learn``) and members learning together (the fused
update, every forward and backward shared) give each member the same loss, gradients and weights."""
import pytest
import torch

from evollm.algorithms.ppo import LLMPPO
from evollm.algorithms.ppo_update import learn_grouped
from test_ppo_reinforce import episodes, make_agent

SETTINGS = dict(update_epochs=2, batch_size=2, beta=0.1, ent_coef=0.01, temperature=0.8, lr_actor=1e-2,
                lr_critic=2e-2, gamma=0.9, gae_lambda=0.8)


def weights(agent) -> dict[str, torch.Tensor]:
    out = {}
    for role in agent.ROLES:
        out.update({f"{role}.{k}": v.detach().clone() for k, v in agent.shared.state_dict(agent.adapter_name(role)).items()})
    out.update({f"value_head.{k}": v.detach().clone() for k, v in agent.value_head.state_dict().items()})
    return out


def moments(agent) -> list[torch.Tensor]:
    return [s["exp_avg"] for s in agent.optimizer.state.values()]


def assert_same_update(ma, mb, a, b, atol=1e-6):
    assert ma.keys() == mb.keys()
    for key in ma:
        assert ma[key] == pytest.approx(mb[key], rel=1e-4, abs=1e-6, nan_ok=True), key
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for key in wa:
        assert torch.allclose(wa[key], wb[key], rtol=1e-4, atol=atol), key
    for x, y in zip(moments(a), moments(b), strict=True):
        assert torch.allclose(x, y, rtol=1e-4, atol=1e-7)


def single_turn():
    ids = torch.tensor([[3, 10, 4, 20, 21, 22, 1], [3, 11, 4, 23, 1, 0, 0], [3, 12, 4, 24, 25, 1, 0],
                        [3, 13, 4, 26, 1, 0, 0]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [0, 0, 1, 1, 0, 0], [0, 0, 1, 1, 1, 0], [0, 0, 1, 1, 0, 0]])
    return ids, mask, torch.tensor([[1.0], [0.0], [0.5], [0.0]])


@pytest.mark.parametrize("data, extra", [(episodes, {}), (episodes, dict(action_granularity="token")),
                                         (single_turn, dict(turn_value_reduce="mean"))])
def test_single_member_and_fused_paths_agree(data, extra):
    torch.manual_seed(0)
    alone = make_agent(**SETTINGS, **extra)
    fused = alone.clone()
    for step in range(2):  # the second step starts from moved weights and Adam state
        ma = alone.learn(data())
        mb = learn_grouped([fused], [data()])[0]
        assert_same_update(ma, mb, alone, fused)


def test_members_fused_together_learn_as_each_alone():
    torch.manual_seed(0)  # the LoRA init
    a = make_agent(**SETTINGS)
    b = a.clone()
    b.set_hyperparameter("clip_coef", 0.05)
    b.set_hyperparameter("ent_coef", 0.0)
    a2, b2 = a.clone(), b.clone()
    together = learn_grouped([a, b], [episodes(), episodes()])
    alone = [a2.learn(episodes()), b2.learn(episodes())]
    # a routed batch sums in another order: Adam turns ~1e-9 gradient differences into up to ~1e-4 weight ones
    # (depending on the LoRA init); a wrong update would differ by steps of ~lr = 1e-2
    assert_same_update(together[0], alone[0], a, a2, atol=2e-4)
    assert_same_update(together[1], alone[1], b, b2, atol=2e-4)
    assert isinstance(a, LLMPPO)


def _without_path(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if k not in ("learn_path", "learn_chunks")}


@pytest.mark.parametrize("chunk, path", [(None, "fused"), (1, "member_by_member")])
def test_a_population_learns_as_each_member_alone_on_the_path_the_memory_plan_picks(chunk, path):
    """``LLMPPO.learn_population`` (what the training loops call for a population): a tiny model's members share
    one pass; ``learn_chunk_members=1`` makes them learn one by one; either way each gets its own update."""
    torch.manual_seed(0)
    a = make_agent(**SETTINGS, learn_chunk_members=chunk)
    b = a.clone()
    b.set_hyperparameter("clip_coef", 0.05)
    a2, b2 = a.clone(), b.clone()
    together = LLMPPO.learn_population([a, b], [episodes(), episodes()])
    alone = [a2.learn(episodes()), b2.learn(episodes())]
    assert {m["learn_path"] for m in together} == {path}
    assert together[0]["pg_loss"] == together[0]["policy_loss"]  # AgileRL's names, as learn gives
    assert_same_update(_without_path(together[0]), alone[0], a, a2, atol=2e-4)
    assert_same_update(_without_path(together[1]), alone[1], b, b2, atol=2e-4)


def test_the_multiturn_loop_updates_a_population_together():
    """finetune_llm_multiturn learns an LLMPPO population through its fused update (one routed pass for
    the tiny model's members), not member by member."""
    from evollm.training.multiturn import finetune_llm_multiturn
    from test_ppo_reinforce import TOK, task_env_factory

    torch.manual_seed(0)
    pop = [make_agent(update_epochs=1, batch_size=8)]
    pop.append(pop[0].clone(index=1))
    agents, record = finetune_llm_multiturn(pop, max_turns=2, env_factory=task_env_factory("chain_calc", TOK),
                                            max_steps=2, evaluation_interval=2, episodes_per_step=4,
                                            eval_episodes=4, verbose=False, seed=0)
    metrics = record.metrics()
    assert len(metrics) == 4 and set(metrics["learn_path"]) == {"fused"}
