"""The LLM cases of AgileRL's tests/test_hpo/ (test_mutation.py, test_tournament.py), ported, with the
constructor cases an LLM script meets (``Mutations``/``TournamentSelection`` positional arguments and
checks).

Changed: imports; model construction (AgileRL's ``create_population(algo="GRPO", ...)`` on its dummy MLP
is ``GRPO.population(...)`` on evollm's tiny Llama); AgileRL's ``agent.optimizer.optimizer`` (its
optimizer wrapper) is ``agent.optimizer``.

Left out: the DPO parametrizations (evollm has no DPO), the accelerator/DeepSpeed parametrizations,
``test_detects_llm_by_type_not_algo_name`` (patches the private ``_select_llm_agents``), and every
non-LLM case (network architecture, parameter and activation mutations of RL networks).
"""

import pytest
import torch

from evollm import GRPO, HyperparameterConfig, Mutations, RLParameter, TournamentSelection
from evollm.hpo import MutationError

from .helpers import lora_config, tiny_model



@pytest.fixture
def grpo_hp_config():
    return HyperparameterConfig(lr=RLParameter(min=0.00001, max=1))


def create_population(hp_config, size=2):
    model, tok = tiny_model()
    return GRPO.population(size, actor_network=model, hp_config=hp_config, lora_config=lora_config(),
                           pad_token_id=tok.pad_token_id, pad_token="<pad>", batch_size=2, beta=0.001, lr=0.001,
                           max_grad_norm=0.5, update_epochs=1, max_output_tokens=32, max_model_len=100,
                           group_size=2)


class TestMutationsInit:
    def test_constructor_initializes_attributes(self):
        no_mutation, architecture, new_layer_prob, parameters, activation, rl_hp = 0.1, 0.2, 0.3, 0.4, 0.5, 0.6
        mutation_sd, activation_selection, mutate_elite, rand_seed = 0.7, ["ReLU", "Sigmoid"], True, 12345
        device, accelerator = "cpu", None
        mutations = Mutations(no_mutation, architecture, new_layer_prob, parameters, activation, rl_hp, mutation_sd,
                              activation_selection, mutate_elite, rand_seed, device, accelerator)
        assert mutations.rng is not None
        assert mutations.no_mut == no_mutation
        assert mutations.architecture_mut == architecture
        assert mutations.new_layer_prob == new_layer_prob
        assert mutations.parameters_mut == parameters
        assert mutations.activation_mut == activation
        assert mutations.rl_hp_mut == rl_hp
        assert mutations.mutation_sd == mutation_sd
        assert mutations.activation_selection == activation_selection
        assert mutations.mutate_elite == mutate_elite
        assert mutations.device == device
        assert mutations.accelerator == accelerator

    def test_raises_for_negative_no_mutation(self):
        with pytest.raises(AssertionError, match="greater than or equal to zero"):
            Mutations(-0.1, 0, 0.5, 0, 0, 0, 0.1, device="cpu")

    def test_raises_for_invalid_new_layer_prob(self):
        with pytest.raises(AssertionError, match="between zero and one"):
            Mutations(0, 0, 1.5, 0, 0, 0, 0.1, device="cpu")


class TestMutationsLLM:
    @pytest.mark.parametrize("algo", ["GRPO"])
    @pytest.mark.parametrize("hp_to_mutate", ["lr"])
    def test_applies_rl_hp_mutation_llm_algorithm(self, algo, hp_to_mutate, grpo_hp_config):
        population = create_population(grpo_hp_config)
        mutations = Mutations(0, 0, 0, 0, 0, 1, 1, device="cpu", accelerator=None)
        new_population = [agent.clone(wrap=False) for agent in population]
        mutated_population = mutations.mutation(new_population, False)
        assert len(mutated_population) == len(population)
        for old, individual in zip(new_population, mutated_population, strict=False):
            assert individual.mut in grpo_hp_config.names()
            new_value = getattr(individual, individual.mut)
            assert grpo_hp_config[individual.mut].min <= new_value <= grpo_hp_config[individual.mut].max
            assert old.index == individual.index
        for agent in mutated_population:
            for param_group in agent.optimizer.param_groups:
                assert param_group["lr"] == agent.lr
        for agent in mutated_population + population:
            agent.clean_up()

    @pytest.mark.parametrize("mutation_type", ["architecture", "parameters", "activation"])
    def test_warns_on_llm_algorithm(self, grpo_hp_config, mutation_type):
        population = create_population(grpo_hp_config)
        mutations = Mutations(0, 1 if mutation_type == "architecture" else 0,
                              0.5 if mutation_type == "architecture" else 0,
                              1 if mutation_type == "parameters" else 0, 1 if mutation_type == "activation" else 0,
                              0, 0.1, device="cpu", accelerator=None)
        new_population = [agent.clone(wrap=False) for agent in population]
        if mutation_type == "architecture":
            with pytest.raises(MutationError):
                mutations.mutation(new_population, False)
            mutated_population = new_population
            for individual in mutated_population:
                individual.mut = "None"
        else:
            with pytest.warns(UserWarning, match="mutations are not supported"):
                mutated_population = mutations.mutation(new_population, False)
        assert len(mutated_population) == len(population)
        for old, individual in zip(population, mutated_population, strict=False):
            assert old.mut is None
            assert individual.mut == "None"
        for agent in mutated_population + population:
            agent.clean_up()

    def test_warns_for_llm_algorithms(self, grpo_hp_config):
        pop = create_population(grpo_hp_config, size=1)
        muts = Mutations(0, 0, 0, 0, 1, 0, 0.1, device="cpu", accelerator=None)
        agent = pop[0].clone(wrap=False)
        try:
            with pytest.warns(UserWarning, match="Activation mutations are not supported for LLM algorithms"):
                out = muts.activation_mutation(agent)
            assert out.mut == "None"
        finally:
            agent.clean_up()


class TestTournamentSelectionInit:
    def test_with_given_parameters(self):
        ts = TournamentSelection(5, True, 100)
        assert ts.tournament_size == 5
        assert ts.elitism is True
        assert ts.population_size == 100

    @pytest.mark.parametrize(("tournament_size", "elitism", "population_size", "match"), [
        (0, True, 4, "greater than zero"), (2, "invalid", 4, "boolean"), (2, True, 0, "greater than zero")])
    def test_validation(self, tournament_size, elitism, population_size, match):
        with pytest.raises(AssertionError, match=match):
            TournamentSelection(tournament_size=tournament_size, elitism=elitism, population_size=population_size)


class TestTournamentSelectionLLM:
    def test_language_model_tournament(self):
        tournament_selection = TournamentSelection(3, True, 4)
        model, tok = tiny_model()
        population = [GRPO(actor_network=model, pad_token_id=tok.pad_token_id, pad_token="<pad>", hp_config=None,
                           index=idx, batch_size=1, beta=0.001, lr=0.000005, clip_coef=0.2, max_grad_norm=0.1,
                           update_epochs=1, group_size=2, temperature=0.9, calc_position_embeddings=True,
                           use_memory_efficient_params=True, max_output_tokens=8, min_output_tokens=None,
                           lora_config=lora_config(), cosine_lr_schedule_config=None, accelerator=None, device="cpu")
                      for idx in range(4)]
        for i, agent in enumerate(population):
            agent.fitness = [3 * i + 1, 3 * i + 2, 3 * i + 3]
        elite, new_population, indices = tournament_selection.select(population)
        assert indices is None
        assert elite.fitness == [10, 11, 12]
        assert elite.index == 3
        assert len(new_population) == 4

    @pytest.mark.xfail(strict=True, reason="elitism=False is allowed for LLM populations in evollm")
    def test_llm_without_elitism_rejected(self):
        model, tok = tiny_model()
        agent = GRPO(actor_network=model, pad_token_id=tok.pad_token_id, pad_token="<pad>", group_size=2,
                     max_output_tokens=8, lora_config=lora_config())
        agent.fitness = [1.0]
        with pytest.raises(ValueError):
            TournamentSelection(1, False, 1).select([agent])
