"""The update every algorithm shares: approx_kl reported, target_kl stopping a member's epochs early,
GRPO's entropy metric the entropy of the scored distribution, PPO bootstrapping truncated episodes."""
import pytest
import torch
from conftest import make_grpo

from evollm import functional as F
from evollm.algorithms.grpo import GRPO
from evollm.algorithms.ppo_update import learn_grouped
from evollm.algorithms.reinforce import LLMREINFORCE
from evollm.rollout import attention_from_sequences
from test_ppo_reinforce import episodes, make_agent


def adam_steps(agent) -> int:
    return int(max(float(s["step"]) for s in agent.optimizer.state.values()))


def test_target_kl_stops_only_that_members_epochs():
    torch.manual_seed(0)
    a = make_agent(update_epochs=4, batch_size=2, lr_actor=5e-2)
    b = a.clone()
    b.config.target_kl = 1e-9  # the first epoch's later minibatch moved the policy past it
    ma, mb = learn_grouped([a, b], [episodes(), episodes()])
    assert ma["epochs"] == 4 and adam_steps(a) == 8  # 4 episodes in minibatches of 2, 4 epochs
    assert mb["epochs"] == 1 and adam_steps(b) == 2
    assert ma["approx_kl"] > 0 and mb["approx_kl"] > 0
    with pytest.raises(ValueError, match="target_kl must be > 0"):
        make_agent(target_kl=0.0)


def test_target_kl_decides_on_the_epoch_mean_over_processes(monkeypatch):
    """Under a multi-process launch each process measures approx_kl on its own rows; a member stops only when
    the mean over processes exceeds its target, so every process stops the same members (a member stopped
    on one process alone would leave the others waiting in its next collective)."""
    from types import SimpleNamespace

    from evollm.algorithms import updates

    agents = [SimpleNamespace(config=SimpleNamespace(target_kl=0.015)), SimpleNamespace(config=SimpleNamespace(target_kl=None)),
              SimpleNamespace(config=SimpleNamespace(target_kl=0.015))]
    epoch_kl = [[0.01, 0.03], [5.0], [0.01, 0.01]]  # this process: member 0 over its target (0.02), member 2 under
    assert updates._within_target_kl(agents, [0, 1, 2], epoch_kl) == [1, 2]  # one process: its own means
    other = [0.0, 5.0, 0.03]  # the other process's epoch means
    monkeypatch.setattr(updates, "is_distributed", lambda: True)
    monkeypatch.setattr(updates, "all_reduce_mean", lambda v: (torch.tensor(v) + torch.tensor(other)) / 2)
    assert updates._within_target_kl(agents, [0, 1, 2], epoch_kl) == [0, 1]  # means 0.01, 5.0, 0.02


def test_target_kl_on_grpo_and_reinforce(tiny):
    model, tok = tiny
    ids = torch.randint(3, 20, (8, 12), generator=torch.Generator().manual_seed(1))
    masks = torch.zeros(8, 11, dtype=torch.long)
    masks[:, 6:] = 1
    rewards = torch.tensor([[1.0, 0, 0, 1], [0, 1, 1, 0]])
    pop = make_grpo(model, tok, n=2, lr=5e-2, update_epochs=3, batch_size=4)
    pop[1].config.target_kl = 1e-9
    full, early = GRPO.learn_population(pop, [(ids, masks, rewards)] * 2)
    assert full["epochs"] == 3 and early["epochs"] == 1 and full["approx_kl"] > 0
    rf = LLMREINFORCE(model, tok.pad_token_id, lr=5e-2, update_epochs=3, batch_size=4, target_kl=1e-9)
    assert rf.learn((ids, masks, rewards.reshape(-1)))["epochs"] == 1


def test_grpo_entropy_metric_is_the_entropy_of_the_scored_distribution(tiny):
    model, tok = tiny
    agent = make_grpo(model, tok, lr=1e-2, temperature=0.7)[0]
    ids = torch.randint(3, 20, (8, 12), generator=torch.Generator().manual_seed(2))
    masks = torch.zeros(8, 11, dtype=torch.long)
    masks[:, 6:] = 1
    logp, entropy = agent.get_logprobs(ids, attention_from_sequences(ids, tok.pad_token_id), with_entropy=True)
    expected = float(F.masked_mean(entropy, masks))  # before the step: one epoch, one minibatch of all rows
    metrics = agent.learn((ids, masks, torch.tensor([[1.0, 0, 0, 1], [0, 1, 1, 0]])))
    assert metrics["entropy"] == pytest.approx(expected, rel=1e-5)
    assert metrics["entropy"] != pytest.approx(float(F.masked_mean(-logp, masks)), rel=1e-3)  # not the sampled NLL


def test_truncated_episodes_bootstrap_from_the_critic():
    agent = make_agent(adv_whitening=False, gamma=1.0, gae_lambda=1.0)
    torch.nn.init.constant_(agent.value_head.bias, 1.0)  # V = 1 for every prefix
    ids, masks, turns, rewards = episodes()
    ended = agent.advantages((ids, masks, turns, rewards))
    cut = agent.advantages((ids, masks, turns, rewards, torch.tensor([True, False, False, False])))
    # row 0 played 2 turns and was cut: every return gains the critic's value after it (gamma = lambda = 1)
    assert (cut["returns"][0] - ended["returns"][0]).tolist() == pytest.approx([1.0, 1.0])
    assert torch.equal(cut["returns"][1:], ended["returns"][1:])
    assert agent.learn((ids, masks, turns, rewards, torch.tensor([True, False, False, False])))["truncated"] == 0.25
