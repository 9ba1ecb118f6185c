"""The vLLM engine serves exactly what the trainer trained (vLLM stage; skipped without vLLM)."""

import pytest
import torch

from vllm_support import requires_vllm, tiny_vllm_model

pytestmark = requires_vllm


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """Three members of mixed LoRA ranks with random (non-zero) adapters, and the population's engine."""
    import os

    from evollm.algorithms.grpo import GRPO
    from evollm.hpo import HyperparameterConfig, RLParameter
    from evollm.rollout.vllm_engine import VLLMEngine

    cache = os.environ.get("EVOLLM_CACHE") or str(tmp_path_factory.mktemp("cache"))
    model, tok = tiny_vllm_model(cache, warm_start=False)
    torch.manual_seed(0)
    hp = HyperparameterConfig(lora_rank=RLParameter(min=4, max=16, dtype=int))
    pop = GRPO.population(3, actor_network=model, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                          group_size=4, max_output_tokens=6, batch_size=64, lr=1e-2, hp_config=hp)
    pop[0].set_lora_rank(4)
    pop[2].set_lora_rank(16)
    for a in pop:
        for p in a.shared.parameters(a.adapter_name()):
            torch.nn.init.normal_(p, std=0.15)
    engine = VLLMEngine.for_members(pop, {"max_model_len": 64})
    yield pop, tok, engine
    engine.close()


def _prompts(n=3):
    from evollm.rollout import collate_prompts

    rows = [torch.tensor([3, 10, 11, 12, 4]), torch.tensor([3, 13, 4]), torch.tensor([3, 20, 21, 4])][:n]
    return collate_prompts([{"input_ids": r} for r in rows], 0)


def _trainer_logp(member, seqs, attn, temperature):
    return member.get_logprobs(seqs, attn) if temperature == member.config.temperature else None


def test_mixed_batch_tokens_and_logprobs_equal_hf_peft(served):
    from evollm.rollout import SamplingConfig, action_mask_for, generate, sequence_attention_mask

    pop, tok, engine = served
    ids, mask = _prompts()
    n = len(pop)
    greedy = SamplingConfig(max_new_tokens=6, do_sample=False)
    seqs, logp = engine.generate_for_members(pop, ids.repeat(n, 1), mask.repeat(n, 1), [3] * n, greedy, 0, tok.eos_token_id)
    for i, member in enumerate(pop):
        block = seqs[3 * i:3 * (i + 1)]
        with member.shared.use(member.adapter_name()) as model:
            hf = generate(model, ids, mask, greedy, 0, tok.eos_token_id)
        assert torch.equal(block, hf), f"member {member.index}: engine {block} vs HF {hf}"
        act = action_mask_for(block, ids.shape[1], tok.eos_token_id).bool()
        trained = member.get_logprobs(block, sequence_attention_mask(block, mask))
        torch.testing.assert_close(logp[3 * i:3 * (i + 1)][act], trained[act], atol=1e-4, rtol=0)
    # sampled at temperature 0.7: the engine's sampled-token log-probs are the trainer's at 0.7
    for m in pop:
        m.set_hyperparameter("temperature", 0.7)
    sampled = SamplingConfig(max_new_tokens=6, temperature=0.7, num_return_sequences=4)
    seqs, logp = engine.generate_for_members(pop, ids.repeat(n, 1), mask.repeat(n, 1), [3] * n, sampled, 0,
                                             tok.eos_token_id)
    assert seqs.shape == (3 * n * 4, ids.shape[1] + 6)
    for i, member in enumerate(pop):
        block = seqs[12 * i:12 * (i + 1)]
        act = action_mask_for(block, ids.shape[1], tok.eos_token_id).bool()
        trained = member.get_logprobs(block, sequence_attention_mask(block, mask))
        torch.testing.assert_close(logp[12 * i:12 * (i + 1)][act], trained[act], atol=1e-4, rtol=0)
        member.set_hyperparameter("temperature", 1.0)


def test_learn_step_reregisters_only_the_changed_member(served):
    from evollm.rollout import SamplingConfig, generate

    pop, tok, engine = served
    engine.sync(pop)
    ids_before = engine.registered()
    ids, mask = _prompts(2)
    member = pop[1]
    seqs, amask = member.get_action([{"input_ids": ids[0][mask[0].bool()]}, {"input_ids": ids[1][mask[1].bool()]}])
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.0, 1.0, 0.0, 0.0]])
    member.learn((seqs, amask, rewards))
    changed = engine.sync(pop)
    assert changed == [member.adapter_name()]
    after = engine.registered()
    assert after[member.adapter_name()] != ids_before[member.adapter_name()]
    assert {k: v for k, v in after.items() if k != member.adapter_name()} == \
        {k: v for k, v in ids_before.items() if k != member.adapter_name()}
    loaded = engine.backend.llm.llm_engine.list_loras()
    assert ids_before[member.adapter_name()] not in loaded and after[member.adapter_name()] in loaded
    greedy = SamplingConfig(max_new_tokens=6, do_sample=False)
    served_seqs, _ = engine.generate_for_members([member], ids, mask, [2], greedy, 0, tok.eos_token_id)
    with member.shared.use(member.adapter_name()) as model:
        assert torch.equal(served_seqs, generate(model, ids, mask, greedy, 0, tok.eos_token_id))
    assert engine.check([member]) < 1e-3


def test_clones_rank_changes_and_releases_follow_the_population(served):
    pop, tok, engine = served
    engine.sync(pop)
    child = pop[0].clone()
    live = [pop[0], pop[1], child]
    assert engine.sync(live) == [child.adapter_name()]
    assert pop[2].adapter_name() not in engine.registered()  # not in the population any more
    child.set_lora_rank(16)  # growth keeps the function but changes the tensors: re-registered, still equal
    assert engine.sync(live) == [child.adapter_name()]
    assert engine.check([child]) < 1e-3
    child.set_lora_rank(32)
    with pytest.raises(ValueError, match="max_lora_rank=16"):
        engine.sync(live)
    child.release()


def test_integrity_check_fails_loudly_when_the_engine_serves_stale_weights(served):
    from evollm.rollout.vllm_engine import EngineMismatchError, adapter_fingerprint

    pop, tok, engine = served
    member = pop[0]
    engine.sync([member], release_others=False)
    with torch.no_grad():
        for p in member.shared.parameters(member.adapter_name()):
            p.add_(0.3 * torch.randn_like(p))
    # pretend the change was registered: the engine still serves the old tensors
    engine._registered[member.adapter_name()].fingerprint = adapter_fingerprint(member.shared, member.adapter_name())
    with pytest.raises(EngineMismatchError, match=f"member {member.index}"):
        engine.check([member])
    engine._registered[member.adapter_name()].fingerprint = ()
    engine.sync([member], release_others=False)
    assert engine.check([member]) < 1e-3


def test_members_with_different_sampling_settings_share_one_engine_call(served):
    from evollm.rollout import generate_population

    pop, tok, engine = served
    live = [a for a in pop if not a.released]
    live[0].set_hyperparameter("temperature", 0.5)
    engine.sync(live)  # registrations (and their integrity probes) done before counting
    calls = []
    generate = engine.backend.generate
    engine.backend.generate = lambda *args: calls.append(len(args[0])) or generate(*args)
    try:
        ids, mask = _prompts(2)
        rollouts = generate_population(live, [{"input_ids": ids[i][mask[i].bool()]} for i in range(2)])
    finally:
        engine.backend.generate = generate
        live[0].set_hyperparameter("temperature", 1.0)
    assert len(calls) == 1 and calls[0] == 2 * len(live)  # one call, every member's prompt rows
    for a in live:
        r = rollouts[a.index]
        assert r.sequences.shape[0] == 2 * a.config.group_size and r.sampler_logp is not None
        assert torch.all(r.sampler_logp[r.action_mask.bool()] < 0)


def test_samples_follow_torch_seed_not_the_engines_own_rng(served):
    """Every sampled request carries a seed drawn from torch's global generator: another engine (with
    another engine seed, its RNG in another state) given the same torch seed samples the same tokens."""
    from evollm.rollout.vllm_engine import VLLMEngine

    pop, tok, engine = served
    live = [a for a in pop if not a.released]
    ids, mask = _prompts(2)
    sampling = live[0].sampling_config(training=True, group_size=4)

    def sample(eng, seed):
        torch.manual_seed(seed)
        return eng.generate_for_members(live, torch.cat([ids] * len(live)), torch.cat([mask] * len(live)),
                                        [2] * len(live), sampling, tok.pad_token_id, tok.eos_token_id)

    first = sample(engine, 11)
    other = VLLMEngine(live[0].shared, {"max_model_len": 64, "seed": 7}, max_rank=16, population_size=3)
    try:
        again = sample(other, 11)
    finally:
        other.close()
    assert torch.equal(first[0], again[0])  # the same tokens for every member, prompt and sample
    torch.testing.assert_close(first[1], again[1], atol=1e-5, rtol=0)
    assert torch.equal(sample(engine, 11)[0], first[0])  # the same engine later: the same tokens
    assert not torch.equal(sample(engine, 12)[0], first[0])  # another torch seed: other samples
