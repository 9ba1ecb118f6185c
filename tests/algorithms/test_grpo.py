"""GRPO agent: actions, learning, reference policy, checkpoints, a short run that improves."""

import json

import pytest
import torch
from conftest import make_grpo
from peft import PeftModel

from evollm.algorithms.grpo import CISPO, GRPO, GSPO
from evollm.envs.reasoning import ReasoningGym
from evollm.tasks import ARITHMETIC_TEMPLATE


def test_get_action_masks_cover_completion_up_to_eos(tiny, arithmetic_env):
    model, tok = tiny
    agent = make_grpo(model, tok, group_size=3, max_output_tokens=6)[0]
    prompts = arithmetic_env.reset()
    ids, masks = agent.get_action(prompts)
    width = max(p["input_ids"].shape[1] for p in prompts)
    for seq, mask in zip(ids, masks):
        assert seq.shape == (3, width + 6) and mask.shape == (3, width + 5)
        assert mask[:, : width - 1].sum() == 0  # prompt positions never trained
        for row, m in zip(seq, mask):
            gen = row[width:]
            eos = (gen == tok.eos_token_id).nonzero()
            n = int(eos[0]) + 1 if len(eos) else len(gen)
            assert int(m.sum()) == n
    greedy, _ = agent.get_action(prompts, training=False)
    assert greedy[0].shape[0] == 1


def test_learn_metrics_and_update(tiny, arithmetic_env):
    model, tok = tiny
    agent = make_grpo(model, tok, lr=1e-2)[0]
    prompts = arithmetic_env.reset()
    ids, masks = agent.get_action(prompts)
    before = [p.detach().clone() for p in agent.shared.parameters(agent.adapter_name())]
    rewards = torch.tensor([[1.0, 0, 0, 0]] * 2 + [[1.0, 1, 1, 1]] * 2)
    metrics = agent.learn((ids, masks, rewards))
    for key in ("loss", "kl", "clip_fraction", "entropy", "mean_reward", "zero_std_groups", "completion_length"):
        assert key in metrics
    assert metrics["zero_std_groups"] == 0.5
    assert metrics["mean_reward"] == pytest.approx(float(rewards.mean()))
    assert any(not torch.equal(a, b) for a, b in zip(before, agent.shared.parameters(agent.adapter_name())))


def test_no_reference_forward_when_beta_zero(tiny, arithmetic_env, monkeypatch):
    model, tok = tiny
    agent = make_grpo(model, tok, beta=0.0)[0]
    calls = []
    original = agent.shared.reference
    monkeypatch.setattr(agent.shared, "reference", lambda: calls.append(1) or original())
    ids, masks = agent.get_action(arithmetic_env.reset())
    agent.learn((ids, masks, torch.rand(4, 4)))
    assert calls == []
    agent.set_hyperparameter("beta", 0.1)
    metrics = agent.learn((ids, masks, torch.rand(4, 4)))
    assert calls == [1] and metrics["kl"] >= 0


def test_reference_is_base_with_adapters_disabled(tiny):
    model, tok = tiny
    x = torch.randint(5, 40, (2, 8))
    with torch.no_grad():
        base = torch.log_softmax(model(x).logits[:, :-1], -1).gather(-1, x[:, 1:, None])[..., 0]
    agent = make_grpo(model, tok)[0]
    with torch.no_grad():
        for p in agent.shared.parameters(agent.adapter_name()):
            p.add_(0.05)
    ref = agent.get_logprobs(x, use_reference=True)
    torch.testing.assert_close(ref, base, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(agent.get_logprobs(x), base, atol=1e-3)


def test_variants_pin_loss_type(tiny):
    model, tok = tiny
    kw = dict(pad_token_id=tok.pad_token_id, pad_token=tok.pad_token)
    assert GSPO(model, **kw).loss_type == "gspo"
    assert CISPO(model, **kw).loss_type == "cispo"
    with pytest.raises(ValueError, match="loss_type='ppo' is not valid"):
        GRPO(model, loss_type="ppo", **kw)
    with pytest.raises(TypeError, match="no field"):
        GRPO(model, learning_rate=1e-3, **kw)


def test_checkpoint_round_trip(tiny, tmp_path, arithmetic_env):
    model, tok = tiny
    a, b = make_grpo(model, tok, n=2, lr=1e-2)
    ids, masks = a.get_action(arithmetic_env.reset())
    a.learn((ids, masks, torch.rand(4, 4)))
    a.fitness.append(0.25)
    a.default_founder = True  # a narrowing's tie-break keeps its lineage first: a resumed run must know it
    a.save_checkpoint(tmp_path / "ckpt")
    files = sorted(str(p.relative_to(tmp_path / "ckpt")) for p in (tmp_path / "ckpt").rglob("*") if p.is_file())
    assert files == ["adapter/adapter_config.json", "adapter/adapter_model.safetensors", "agent.json", "manifest.json",
                     "optimizer.json", "optimizer.safetensors"]
    seqs = torch.cat(ids)
    expected = a.get_logprobs(seqs)
    b.load_checkpoint(tmp_path / "ckpt")
    torch.testing.assert_close(b.get_logprobs(seqs), expected)
    assert b.fitness == [0.25] and b.lr == a.lr and b.steps == 1 and b.default_founder
    sa, sb = a.optimizer.state_dict()["state"], b.optimizer.state_dict()["state"]
    assert all(torch.equal(sa[k]["exp_avg_sq"], sb[k]["exp_avg_sq"]) for k in sa)
    info = json.loads((tmp_path / "ckpt" / "agent.json").read_text())
    assert info["algorithm"] == "GRPO"


def test_adapter_loads_with_peft_from_pretrained(tiny, tmp_path):
    from evollm.recipes.warm_start import load_tiny_model

    model, tok = tiny
    agent = make_grpo(model, tok)[0]
    with torch.no_grad():
        for p in agent.shared.parameters(agent.adapter_name()):
            p.add_(0.03)
    agent.save_checkpoint(tmp_path / "ckpt")
    fresh, _ = load_tiny_model(warm_start=False, seed=0)  # same deterministic base, a separate object
    peft_model = PeftModel.from_pretrained(fresh, str(tmp_path / "ckpt" / "adapter"))
    x = torch.randint(5, 40, (2, 8))
    with torch.no_grad():
        got = torch.log_softmax(peft_model(x).logits[:, :-1], -1).gather(-1, x[:, 1:, None])[..., 0]
    torch.testing.assert_close(got, agent.get_logprobs(x), atol=1e-5, rtol=1e-5)


def test_short_grpo_run_improves_reward(warm):
    """GRPO with an exact-match reward raises the reward on a small set of addition questions."""
    from evollm.tasks import arithmetic_dataset, exact_match_reward

    model, tok = warm
    train, _ = arithmetic_dataset(n_train=16, n_test=4, digits=(2, 2), seed=3)
    env = ReasoningGym(train, train.select(range(4)), tok, exact_match_reward, ARITHMETIC_TEMPLATE,
                       data_batch_size_per_gpu=8, seed=0)
    agent = make_grpo(model, tok, group_size=8, lr=5e-3, batch_size=64, max_output_tokens=4)[0]
    torch.manual_seed(0)
    rewards = []
    for _ in range(30):
        prompts = env.reset()
        ids, masks = agent.get_action(prompts)
        _, r = env.step(ids)
        rewards.append(float(r.mean()))
        agent.learn((ids, masks, r))
    first, last = sum(rewards[:6]) / 6, sum(rewards[-6:]) / 6
    assert last > first + 0.15, rewards


def test_fused_population_update_equals_member_by_member(tiny, arithmetic_env):
    """learn_population shares forward/backward passes but gives each member exactly its own update."""
    model, tok = tiny
    pop = make_grpo(model, tok, n=3, lr=1e-2, batch_size=8, update_epochs=2, learn_chunk_members=3)  # one pass
    pop[1].set_hyperparameter("beta", 0.1)
    pop[2].set_hyperparameter("clip_coef", 0.05)
    pop[2].set_hyperparameter("temperature", 1.3)  # scored at its own temperature within the fused pass
    for i, a in enumerate(pop):
        with torch.no_grad():
            for p in a.shared.parameters(a.adapter_name()):
                p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(i)))
    twins = [a.clone() for a in pop]
    prompts = arithmetic_env.reset()
    experiences = []
    for i, a in enumerate(pop):
        ids, masks = a.get_action(prompts)
        experiences.append((ids, masks, torch.rand(4, 4, generator=torch.Generator().manual_seed(i))))
    fused = GRPO.learn_population(pop, experiences)
    assert {m["learn_path"] for m in fused} == {"fused"}
    alone = [t.learn(e) for t, e in zip(twins, experiences)]
    for a, t, mf, ma in zip(pop, twins, fused, alone):
        for p, q in zip(a.shared.parameters(a.adapter_name()), t.shared.parameters(t.adapter_name())):
            torch.testing.assert_close(p, q, atol=5e-4, rtol=0)  # Adam steps are ~lr; fp noise only
        assert mf["loss"] == pytest.approx(ma["loss"], rel=1e-4, abs=1e-6)
        assert mf["kl"] == pytest.approx(ma["kl"], rel=1e-4, abs=1e-7)


def test_no_signal_update_skips_the_forwards_and_equals_the_full_update(tiny, arithmetic_env, monkeypatch):
    """A batch whose every group has equal rewards has an exactly zero loss and gradient: the update
    skips its forwards and backward (no logprob call), yet the optimizer takes the same steps, so
    AdamW's momentum and weight decay move the adapter exactly as the full update does."""
    from evollm.algorithms import grpo as grpo_module
    from evollm.algorithms import updates

    model, tok = tiny
    pop = make_grpo(model, tok, n=2, lr=1e-2, batch_size=8, update_epochs=2, weight_decay=0.1)
    prompts = arithmetic_env.reset()
    ids, masks = pop[0].get_action(prompts)
    signal = torch.tensor([[1.0, 0, 0, 1]] * 4)
    pop[0].learn((ids, masks, signal))  # momentum from an informative step
    twin = pop[0].clone()
    flat = torch.tensor([[1.0, 1, 1, 1], [0.0, 0, 0, 0]] * 2)  # every group equal: no signal

    calls = []
    original = grpo_module._joint_logprobs
    monkeypatch.setattr(grpo_module, "_joint_logprobs", lambda *a, **k: calls.append(1) or original(*a, **k))
    skipped = pop[0].learn((ids, masks, flat))
    assert calls == [] and skipped["learn_path"] == "no_gradient" and skipped["zero_std_groups"] == 1.0
    assert skipped["loss"] == 0.0 and skipped["epochs"] == 2.0 and skipped["mean_reward"] == 0.5

    monkeypatch.setattr(updates, "SKIP_ZERO_GRADIENT", False)
    full = twin.learn((ids, masks, flat))
    assert calls and full["learn_path"] != "no_gradient" and full["grad_norm"] == 0.0
    assert pop[0].steps == twin.steps
    moved = False
    for p, q, r in zip(pop[0].shared.parameters(pop[0].adapter_name()), twin.shared.parameters(twin.adapter_name()),
                       pop[1].shared.parameters(pop[1].adapter_name())):
        torch.testing.assert_close(p, q, atol=1e-7, rtol=0)
    for p, q in zip(pop[0].optimizer.state_dict()["state"].values(), twin.optimizer.state_dict()["state"].values()):
        torch.testing.assert_close(p["exp_avg"], q["exp_avg"], atol=1e-9, rtol=0)
        moved = moved or bool(p["exp_avg"].abs().sum() > 0)
    assert moved  # the momentum the skipped update applied was real

    # in a population, a member with signal still learns through the shared passes beside a skipped one
    monkeypatch.setattr(updates, "SKIP_ZERO_GRADIENT", True)
    out = GRPO.learn_population(pop, [(ids, masks, flat), (ids, masks, signal)])
    assert out[0]["learn_path"] == "no_gradient" and out[1]["learn_path"] != "no_gradient" and out[1]["grad_norm"] > 0


def test_engine_rollouts_log_the_sampler_mismatch_on_every_step(tiny, arithmetic_env):
    """Rollouts that carry the sampling engine's log-probs log ``sampler_*`` on every step: measured
    where the update ran its forward, ``nan`` where a step without signal skipped it (same columns)."""
    from evollm import functional as F

    model, tok = tiny
    agent = make_grpo(model, tok, beta=0.0)[0]
    ids, masks = agent.get_action(arithmetic_env.reset())
    sampler = [torch.zeros(m.shape) for m in masks]
    learned = agent.learn((ids, masks, torch.tensor([[1.0, 0, 0, 0]] * 4), sampler))
    skipped = agent.learn((ids, masks, torch.ones(4, 4), sampler))  # every group's rewards equal
    columns = {f"sampler_{k}" for k in F.SAMPLER_STATS}
    assert columns <= set(learned) and columns <= set(skipped)
    assert learned["sampler_logp_diff_max"] > 0 and learned["sampler_is_ratio_mean"] > 0
    assert all(skipped[c] != skipped[c] for c in columns)  # nan: not measured
    assert not columns & set(agent.learn((ids, masks, torch.ones(4, 4))))  # no engine: no sampler columns
