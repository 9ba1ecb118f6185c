"""The HPO engine on real agents: reproducibility, Optuna seeding and export."""

import optuna
import pandas as pd
import pytest
import torch
from conftest import make_grpo

from evollm.hpo import (HyperparameterConfig, Mutations, RLParameter, TournamentSelection, TruncationSelection,
                        initial_population_hyperparameters)
from evollm.training.loop import finetune_llm_reasoning

HP = HyperparameterConfig(lr=RLParameter(1e-4, 1e-2, log=True), beta=RLParameter(0.0, 0.1),
                          loss_type=RLParameter(choices=["grpo", "dapo", "cispo"]),
                          lora_rank=RLParameter(min=2, max=16, dtype=int))


def _run(arithmetic_env_factory, selection="tournament"):
    from evollm.recipes.warm_start import load_tiny_model

    model, tok = load_tiny_model(warm_start=False, seed=0)
    torch.manual_seed(0)
    init = initial_population_hyperparameters(HP, 3, sampler=optuna.samplers.QMCSampler(seed=0, scramble=True))
    pop = make_grpo(model, tok, n=3, hp_config=HP, init_hyperparameters=init)
    sel = (TournamentSelection(2, True, 3, rand_seed=1) if selection == "tournament"
           else TruncationSelection(3, quantile=0.34, rand_seed=1))
    agents, population = finetune_llm_reasoning(
        pop, arithmetic_env_factory(tok), max_steps=4, evaluation_interval=1, evo_steps=2, tournament=sel,
        mutation=Mutations(no_mutation=0.0, rl_hp=0.5, lora_rank=0.5, rand_seed=2), verbose=False, seed=3)
    return agents, population, init


@pytest.fixture
def env_factory():
    from evollm.envs.reasoning import ReasoningGym
    from evollm.tasks import ARITHMETIC_TEMPLATE, arithmetic_dataset, exact_match_reward

    def make(tok):
        train, test = arithmetic_dataset(n_train=32, n_test=4, digits=(1, 1), seed=0)
        return ReasoningGym(train, test, tok, exact_match_reward, ARITHMETIC_TEMPLATE, data_batch_size_per_gpu=2,
                            seed=0)
    return make


@pytest.mark.parametrize("selection", ["tournament", "truncation"])
def test_same_seeds_same_lineage_and_report(env_factory, selection):
    _, pop_a, init_a = _run(env_factory, selection)
    _, pop_b, init_b = _run(env_factory, selection)
    assert init_a == init_b
    pd.testing.assert_frame_equal(pop_a.lineage(), pop_b.lineage())
    pd.testing.assert_frame_equal(pop_a.report(), pop_b.report())
    assert pop_a.generation == 1 and len(pop_a.lineage()) > 3


def test_optuna_seeding_reaches_members(tiny):
    model, tok = tiny
    init = initial_population_hyperparameters(HP, 4, sampler=optuna.samplers.TPESampler(seed=0))
    pop = make_grpo(model, tok, n=4, hp_config=HP, init_hyperparameters=init)
    for agent, hps in zip(pop, init):
        assert agent.lora_rank == hps["lora_rank"] and agent.loss_type == hps["loss_type"]
        assert agent.optimizer.param_groups[0]["lr"] == hps["lr"] and agent.beta == hps["beta"]
    assert len({a.lora_rank for a in pop}) > 1 or len({a.lr for a in pop}) > 1


def test_export_to_optuna_study(env_factory, tmp_path):
    _, population, _ = _run(env_factory)
    storage = f"sqlite:///{tmp_path / 'run.db'}"
    study = population.to_optuna("evollm-run", storage=storage)
    lineage, report = population.lineage(), population.report()
    assert len(study.trials) == len(lineage)
    for trial in study.trials:
        member = trial.user_attrs["member"]
        assert trial.value == pytest.approx(report[report.member == member].fitness.max())
        assert set(trial.params) == set(HP.names())
    reloaded = optuna.load_study(study_name="evollm-run", storage=storage)
    assert len(reloaded.trials) == len(study.trials)
    # Optuna's analysis tools accept it
    if len({t.value for t in study.trials}) > 1:
        importances = optuna.importance.get_param_importances(study)
        assert set(importances) <= set(HP.names())
