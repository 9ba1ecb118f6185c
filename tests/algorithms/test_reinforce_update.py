"""ONE LLMREINFORCE update: members learning together (one routed forward and backward per minibatch)
give each member the same loss, gradients, weights and AdamW state as learning alone; a member without
signal only steps its optimizer; the training loops update a REINFORCE population together."""
import pytest
import torch

from evollm.algorithms.reinforce import LLMREINFORCE
from evollm.algorithms.reinforce_update import reinforce_update, update_key
from test_ppo_reinforce import TOK, episodes, make_agent

SETTINGS = dict(update_epochs=2, batch_size=2, beta=0.1, temperature=0.8, lr=1e-2, gamma=0.9)


def weights(agent) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in agent.shared.state_dict(agent.adapter_name("actor")).items()}


def assert_same_update(ma: dict, mb: dict, a, b, atol: float) -> None:
    keys = ma.keys() - {"learn_path", "learn_chunks"}
    assert keys == mb.keys() - {"learn_path", "learn_chunks"}
    for key in keys:
        assert ma[key] == pytest.approx(mb[key], rel=1e-4, abs=1e-6, nan_ok=True), key
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys() and wa
    for key in wa:
        assert torch.allclose(wa[key], wb[key], rtol=1e-4, atol=atol), key
    sa, sb = a.optimizer.state_dict()["state"], b.optimizer.state_dict()["state"]
    assert len(sa) == len(sb) > 0
    for x, y in zip(sa.values(), sb.values()):
        assert torch.allclose(x["exp_avg"], y["exp_avg"], rtol=1e-4, atol=1e-7)


def pair(**kw):
    """A member and a clone with other settings (clip range, KL weight, temperature), and copies of both."""
    torch.manual_seed(0)  # the LoRA init
    a = make_agent(LLMREINFORCE, **{**SETTINGS, **kw})
    b = a.clone()
    b.set_hyperparameter("clip_coef", 0.05)
    b.set_hyperparameter("beta", 0.0)
    b.set_hyperparameter("temperature", 1.0)
    return a, b, a.clone(), b.clone()


@pytest.mark.parametrize("granularity", ["turn", "token"])
def test_members_fused_together_learn_as_each_alone(granularity):
    a, b, a2, b2 = pair(action_granularity=granularity)
    for step in range(2):  # the second step starts from moved weights and Adam state
        together = reinforce_update([a, b], [episodes(), episodes(turns=((0.0, 1.0), (1.0,), (0.0, 0.0), (0.5,)))])
        alone = [a2.learn(episodes()), b2.learn(episodes(turns=((0.0, 1.0), (1.0,), (0.0, 0.0), (0.5,))))]
        assert {m["learn_path"] for m in together} == {"fused"} and {m["learn_path"] for m in alone} == {"single"}
        # a routed batch sums in another order: Adam turns ~1e-9 gradient differences into up to ~1e-4 weight
        # differences; a wrong update would differ by steps of ~lr = 1e-2
        assert_same_update(together[0], alone[0], a, a2, atol=2e-4)
        assert_same_update(together[1], alone[1], b, b2, atol=2e-4)
    assert together[0]["kl"] != 0.0 and together[1]["kl"] == 0.0  # each member's own beta
    assert any(not torch.allclose(x, y) for x, y in zip(weights(a).values(), weights(b).values()))


@pytest.mark.parametrize("chunk, path", [(None, "fused"), (1, "member_by_member")])
def test_learn_population_takes_the_path_the_memory_plan_picks(chunk, path):
    """``LLMREINFORCE.learn_population`` (what the training loops call): the tiny model's members share one
    pass; ``learn_chunk_members=1`` makes them learn one by one; either way each gets its own update."""
    a, b, a2, b2 = pair(learn_chunk_members=chunk)
    together = LLMREINFORCE.learn_population([a, b], [episodes(), episodes()])
    alone = [a2.learn(episodes()), b2.learn(episodes())]
    assert {m["learn_path"] for m in together} == {path}
    assert {m["learn_chunks"] for m in together} == {1.0 if chunk is None else 2.0}
    assert_same_update(together[0], alone[0], a, a2, atol=2e-4)
    assert_same_update(together[1], alone[1], b, b2, atol=2e-4)


def test_a_member_without_signal_only_steps_its_optimizer_and_the_other_learns_as_alone(monkeypatch):
    from evollm.algorithms import reinforce_update as module

    a, b, a2, b2 = pair(beta=0.0, gamma=1.0)  # a KL term (or a discount) would give the flat batch a gradient
    flat = episodes(turns=((0.0, 1.0), (1.0,), (0.0, 1.0), (1.0,)))  # every return-to-go is 1: ReBN gives 0
    scored = []
    original = module.member_logprobs
    monkeypatch.setattr(module, "member_logprobs", lambda *x, **k: scored.append(len(x[1])) or original(*x, **k))
    together = LLMREINFORCE.learn_population([a, b], [flat, episodes()])
    assert together[0]["learn_path"] == "no_gradient" and together[0]["grad_norm"] == 0.0
    assert set(scored) == {1}  # every forward ran the informative member alone
    alone = [a2.learn(flat), b2.learn(episodes())]
    assert_same_update(together[0], alone[0], a, a2, atol=1e-7)
    assert_same_update(together[1], alone[1], b, b2, atol=2e-4)


def test_members_with_other_schedules_are_not_fused_and_a_mixed_call_is_refused():
    a, b, a2, b2 = pair()
    b.set_hyperparameter("batch_size", 4)
    b2.set_hyperparameter("batch_size", 4)
    assert update_key(a, 4) != update_key(b, 4)
    with pytest.raises(ValueError, match="update_key"):
        reinforce_update([a, b], [episodes(), episodes()])
    together = LLMREINFORCE.learn_population([a, b], [episodes(), episodes()])
    assert {m["learn_path"] for m in together} == {"single"}  # two groups of one
    alone = [a2.learn(episodes()), b2.learn(episodes())]
    assert_same_update(together[0], alone[0], a, a2, atol=1e-6)
    assert_same_update(together[1], alone[1], b, b2, atol=1e-6)


def test_the_multiturn_loop_updates_a_reinforce_population_together():
    from evollm.tasks.games import task_env_factory
    from evollm.training.multiturn import finetune_llm_multiturn

    torch.manual_seed(0)
    # beta > 0: the KL term gives every step a gradient, even where the untrained model's rewards are all equal
    pop = [make_agent(LLMREINFORCE, update_epochs=1, batch_size=8, lr=1e-3, beta=0.05)]
    pop.append(pop[0].clone(index=1))
    _, record = finetune_llm_multiturn(pop, max_turns=2, env_factory=task_env_factory("chain_calc", TOK),
                                       max_steps=2, evaluation_interval=2, episodes_per_step=4, eval_episodes=4,
                                       verbose=False, seed=0)
    metrics = record.metrics()
    assert len(metrics) == 4
    assert set(metrics["learn_path"]) == {"fused"}
