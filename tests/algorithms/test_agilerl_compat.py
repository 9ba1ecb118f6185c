"""Scripts written for AgileRL run with their imports changed to evollm; the aliases stay thin."""

import math

import pytest
import torch
from conftest import make_grpo
from datasets import Dataset


def test_agilerl_style_script_runs_with_imports_changed(tiny):
    """AgileRL's GRPO + HPO example (reference docs), imports changed to evollm, a couple of steps."""
    from evollm import (GRPO, HyperparameterConfig, Mutations, ReasoningGym, RLParameter, TournamentSelection,
                        finetune_llm_reasoning)

    model, tokenizer = tiny
    train_ds = Dataset.from_dict({"question": ["2+2=", "3+1=", "1+1=", "4+4="], "answer": ["4", "4", "2", "8"]})
    test_ds = Dataset.from_dict({"question": ["3+3="], "answer": ["6"]})

    def reward_fn(completion: str, answer: str, question: str) -> float:
        del question
        return float(answer.lower() in completion.lower())

    env = ReasoningGym(train_dataset=train_ds, test_dataset=test_ds, tokenizer=tokenizer, reward_fn=reward_fn,
                       conversation_template=[{"role": "user", "content": "Q: {question}\nA:"}],
                       data_batch_size_per_gpu=2)
    hp_config = HyperparameterConfig(lr=RLParameter(min=1e-5, max=1e-3),
                                     group_size=RLParameter(min=2, max=4, dtype=int))
    pop = GRPO.population(2, actor_network=model, pad_token_id=tokenizer.eos_token_id,
                          pad_token=tokenizer.eos_token, hp_config=hp_config, batch_size=4, group_size=2, lr=1e-4,
                          max_output_tokens=3, max_model_len=1024)
    mutations = Mutations(no_mutation=0.4, architecture=0, new_layer_prob=0, parameters=0, activation=0,
                          rl_hp=0.6, mutation_sd=0.1, rand_seed=1, device="cpu")
    tournament = TournamentSelection(tournament_size=2, elitism=True, population_size=2, eval_loop=1)
    completion_ids, action_masks = pop[0].get_action(env.reset())  # a named result that unpacks as a pair
    agents, population = finetune_llm_reasoning(
        pop=pop, env=env, init_hp={"ALGO": "GRPO"}, evo_steps=2, selection_strategy=tournament,
        mutation=mutations, wb=False, evaluation_interval=2, max_reward=2.0, verbose=False,
        max_steps=8, max_steps_unit="prompts")  # 8 prompts / (2 prompts x 2 members) = 2 iterations
    assert len(agents) == 2 and all(a.steps == 2 or a.steps == 0 for a in agents)
    assert len(population.report()) == 2 and math.isfinite(population.best().fitness[-1])


def test_agilerl_max_steps_meaning_is_warned_or_followed(tiny, arithmetic_env):
    from evollm.training.compat import resolve_max_steps

    with pytest.warns(UserWarning, match="AgileRL counts prompts"):
        assert resolve_max_steps(100, None, None, 4, 2, 64, agilerl_style=True) == 100
    assert resolve_max_steps(100, None, "prompts", 4, 2, 64, agilerl_style=True) == 13
    assert resolve_max_steps(None, 2, None, 4, 2, 64, agilerl_style=True) == 32  # 2 epochs of 64 rows / 4
    with pytest.warns(UserWarning, match="num_epochs=1 and max_steps=10 both given: num_epochs is used"):
        assert resolve_max_steps(10, 1, None, 4, 2, 64, agilerl_style=False) == 16  # AgileRL: num_epochs wins
    with pytest.raises(ValueError, match="max_steps_unit='tokens'"):
        resolve_max_steps(10, None, "tokens", 4, 2, 64, agilerl_style=False)


def test_agilerl_only_keywords_are_checked(tiny, arithmetic_env):
    from evollm.training.loop import finetune_llm_reasoning

    model, tok = tiny
    pop = make_grpo(model, tok)
    with pytest.raises(ValueError, match="exactly one of 'env' or 'env_fn'"):
        finetune_llm_reasoning(pop, arithmetic_env, max_steps=1, env_fn=lambda: arithmetic_env)
    with pytest.raises(ValueError, match="Either 'env' or 'env_fn' must be provided"):
        finetune_llm_reasoning(pop, max_steps=1)
    with pytest.raises(TypeError, match="unexpected keyword"):
        finetune_llm_reasoning(pop, arithmetic_env, max_steps=1, checkpoint_every_typo=3)
    with pytest.raises(ValueError, match="tournament= or selection_strategy="):
        from evollm.hpo import TournamentSelection
        finetune_llm_reasoning(pop, arithmetic_env, max_steps=1, tournament=TournamentSelection(1),
                               selection_strategy=TournamentSelection(1))


def test_mutations_accept_agilerl_signature_and_network_kinds_act_as_agilerl_does_for_llms():
    from evollm import Mutations

    m = Mutations(no_mutation=0.4, architecture=0, new_layer_prob=0, parameters=0, activation=0, rl_hp=0.6,
                  mutation_sd=0.1, rand_seed=1, device="cuda")
    assert (m.no_mutation, m.rl_hp) == pytest.approx((0.4, 0.6))
    with pytest.warns(UserWarning, match="network mutations .* cannot apply to LoRA adapters"):
        m = Mutations(no_mutation=0.4, architecture=0.2, rl_hp=0.4)
    assert m.network["architecture"] == pytest.approx(0.2) and m.no_mutation == pytest.approx(0.4)
    with pytest.raises(TypeError, match="unknown keyword\\(s\\) \\['rl_hpp'\\]"):
        Mutations(rl_hpp=0.5)


def test_max_reward_and_max_time_stop_early(tiny, arithmetic_env):
    from evollm.training.loop import finetune_llm_reasoning

    model, tok = tiny
    agents, population = finetune_llm_reasoning(make_grpo(model, tok), arithmetic_env, max_steps=50,
                                                evaluation_interval=1, max_reward=-1.0, verbose=False)
    assert agents[0].steps == 1 and len(population.report()) == 1
    agents, population = finetune_llm_reasoning(make_grpo(model, tok), arithmetic_env, max_steps=50,
                                                evaluation_interval=10, max_time=1e-6, verbose=False)
    assert agents[0].steps == 1 and len(population.report()) == 1  # a final evaluation when time runs out


def test_selection_after_a_user_clone_takes_ids_from_the_shared_base(tiny):
    from evollm.hpo import TournamentSelection

    model, tok = tiny
    pop = make_grpo(model, tok, n=2)
    extra = pop[0].clone()  # the user's own clone takes id 2 on the shared base
    for a, f in zip(pop, (0.5, 0.1)):
        a.fitness.append(f)
    result = TournamentSelection(tournament_size=2, population_size=2, rand_seed=0).select(pop)
    assert extra.index == 2 and [a.index for a in result.mutate] == [3]


def test_get_action_returns_a_named_pair(tiny, arithmetic_env):
    model, tok = tiny
    agent = make_grpo(model, tok)[0]
    result = agent.get_action(arithmetic_env.reset())
    ids, masks = result
    assert ids is result.completion_ids and masks is result.action_masks
    assert result.completion_ids[0].shape[0] == agent.group_size and torch.is_tensor(result.action_masks[0])
