"""A population trained with rollout_backend='vllm' learns, and the engine keeps up with evolution
(vLLM stage; skipped without vLLM)."""

import math
import os

import pytest
import torch

from vllm_support import requires_vllm, tiny_vllm_model

pytestmark = requires_vllm


def test_population_run_with_vllm_rollouts_learns(tmp_path):
    from evollm.algorithms.grpo import GRPO
    from evollm.envs.reasoning import ReasoningGym
    from evollm.hpo import HyperparameterConfig, Mutations, RLParameter, TournamentSelection
    from evollm.rollout.vllm_engine import engine_of
    from evollm.tasks import ARITHMETIC_TEMPLATE, arithmetic_dataset, exact_match_reward
    from evollm.training.callbacks import Callback
    from evollm.training.loop import finetune_llm_reasoning

    model, tok = tiny_vllm_model(os.environ.get("EVOLLM_CACHE") or str(tmp_path / "cache"))
    train, _ = arithmetic_dataset(n_train=8, n_test=4, digits=(1, 1), seed=3)  # 8 questions, seen every step
    env = ReasoningGym(train, train, tok, exact_match_reward, ARITHMETIC_TEMPLATE,
                       data_batch_size_per_gpu=8, seed=0)
    hp = HyperparameterConfig(lr=RLParameter(min=2e-3, max=6e-3), lora_rank=RLParameter(min=4, max=16, dtype=int))
    torch.manual_seed(0)  # the adapters' init does not depend on what ran before in this process
    pop = GRPO.population(2, actor_network=model, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                          hp_config=hp, group_size=8, lr=5e-3, batch_size=64, max_output_tokens=4)

    class Record(Callback):
        def __init__(self):
            self.steps = []

        def on_step_end(self, state, metrics):
            self.steps.append(metrics)

    record = Record()
    torch.manual_seed(0)
    agents, population = finetune_llm_reasoning(
        pop, env, max_steps=24, evaluation_interval=6, evo_steps=12,
        tournament=TournamentSelection(population_size=2, tournament_size=2, elitism=True, rand_seed=0),
        mutation=Mutations(no_mutation=0.0, rl_hp=0.5, lora_rank=0.5, rand_seed=1),
        verbose=False, seed=0, callbacks=[record], rollout_backend="vllm", vllm={"max_model_len": 64})
    engine = engine_of(agents[0].shared)
    assert engine is not None and engine.stats["swaps"] >= 24  # every learn step re-registered the members
    assert sorted(engine.registered()) == sorted(a.adapter_name() for a in agents)  # released members left
    assert engine.stats["integrity_checks"] > 0 and engine.stats["integrity_max_diff"] < 1e-3
    rewards = [sum(m["mean_reward"] for m in step.values()) / len(step) for step in record.steps]
    first, last = sum(rewards[:6]) / 6, sum(rewards[-6:]) / 6
    assert last > first + 0.15, rewards  # HF rollouts, same settings: 0.07 -> 0.33
    # every step logs the mismatch; a step without signal skipped its forward and logs nan (not measured)
    logged = [m for step in record.steps for m in step.values()]
    measured = [m for m in logged if not math.isnan(m["sampler_logp_diff_max"])]
    assert measured and max(m["sampler_logp_diff_max"] for m in measured) < 1e-3  # float32: trainer = sampler
    assert all(abs(m["sampler_is_ratio_mean"] - 1) < 1e-3 for m in measured)  # weights ~1
    engine.close()


def test_resumed_vllm_run_samples_the_same_tokens(tmp_path):
    """A run with rollout_backend='vllm' checkpointed at step 2 and resumed (new process state: a new
    base and a new engine) continues exactly as the uninterrupted run."""
    from evollm.algorithms.grpo import GRPO
    from evollm.envs.reasoning import ReasoningGym
    from evollm.rollout.vllm_engine import engine_of
    from evollm.tasks import ARITHMETIC_TEMPLATE, arithmetic_dataset, exact_match_reward
    from evollm.training.callbacks import Callback
    from evollm.training.loop import finetune_llm_reasoning

    cache = os.environ.get("EVOLLM_CACHE") or str(tmp_path / "cache")
    train, test = arithmetic_dataset(n_train=16, n_test=4, digits=(1, 1), seed=3)

    class Record(Callback):
        def __init__(self):
            self.steps = {}

        def on_step_end(self, state, metrics):
            self.steps[state.step] = {i: (m["mean_reward"], m["completion_length"], m["loss"])
                                      for i, m in metrics.items()}

    def run(max_steps, resume):
        model, tok = tiny_vllm_model(cache)
        env = ReasoningGym(train, test, tok, exact_match_reward, ARITHMETIC_TEMPLATE,
                           data_batch_size_per_gpu=4, seed=0)
        torch.manual_seed(0)
        pop = GRPO.population(2, actor_network=model, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                              group_size=4, lr=5e-3, batch_size=64, max_output_tokens=4)
        record = Record()
        agents, _ = finetune_llm_reasoning(pop, env, max_steps=max_steps, evaluation_interval=2, verbose=False,
                                           seed=0, callbacks=[record], checkpoint_dir=tmp_path / "ckpt",
                                           checkpoint_every=2, keep_checkpoints=None, resume=resume,
                                           rollout_backend="vllm", vllm={"max_model_len": 64})
        adapters = {a.index: {k: v.clone() for k, v in a.shared.state_dict(a.adapter_name()).items()} for a in agents}
        engine_of(agents[0].shared).close()
        return record.steps, adapters

    whole, whole_adapters = run(4, resume=False)  # writes step_2 and step_4
    import shutil
    shutil.rmtree(tmp_path / "ckpt" / "step_4")
    resumed, resumed_adapters = run(4, resume=True)  # continues from step_2 on a new base and engine
    assert sorted(resumed) == [3, 4]
    for step in (3, 4):
        assert resumed[step] == whole[step], step  # the same samples, hence the same rewards and losses
    for i, tensors in whole_adapters.items():
        for k, v in tensors.items():
            assert torch.equal(resumed_adapters[i][k], v), k
