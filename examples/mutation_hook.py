"""A mutation hook: code of yours that runs on a member after every mutation and clone.

Here the hook couples two hyperparameters: whenever evolution changes a member's
learning rate, its KL coefficient follows (a larger step gets a stronger pull back
to the reference policy), and every call is logged. Hooks are inherited by clones.

    python examples/mutation_hook.py
"""

import torch

from evollm.algorithms import GRPO
from evollm.envs import ReasoningGym
from evollm.hpo import HyperparameterConfig, Mutations, RLParameter, TournamentSelection
from evollm.recipes import load_tiny_model
from evollm.tasks import ARITHMETIC_TEMPLATE, arithmetic_dataset, exact_match_reward
from evollm.training import finetune_llm_reasoning

BASE_LR, BASE_BETA = 2e-3, 0.01


def couple_beta_to_lr(agent) -> None:
    """Keep beta proportional to the learning rate, whatever the mutation did."""
    beta = BASE_BETA * agent.lr / BASE_LR
    agent.set_hyperparameter("beta", min(beta, 0.1))
    print(f"  hook: member {agent.index} lr={agent.lr:.2e} -> beta={agent.beta:.4f}")


def main() -> None:
    torch.manual_seed(0)
    model, tokenizer = load_tiny_model()
    train, test = arithmetic_dataset(n_train=2000, n_test=100)
    env = ReasoningGym(train, test, tokenizer, exact_match_reward, ARITHMETIC_TEMPLATE, data_batch_size_per_gpu=8)
    hp = HyperparameterConfig(lr=RLParameter(min=5e-4, max=5e-3, log=True))
    pop = GRPO.population(3, actor_network=model, hp_config=hp, pad_token_id=tokenizer.pad_token_id,
                          pad_token=tokenizer.pad_token, group_size=8, batch_size=32, lr=BASE_LR, beta=BASE_BETA,
                          max_output_tokens=5)
    for agent in pop:
        agent.register_mutation_hook(couple_beta_to_lr)
    agents, population = finetune_llm_reasoning(
        pop, env, max_steps=20, evaluation_interval=10, evo_steps=10,
        tournament=TournamentSelection(tournament_size=2, elitism=True, population_size=3, rand_seed=0),
        mutation=Mutations(no_mutation=0.0, rl_hp=1.0, rand_seed=0), verbose=False)
    print(population.lineage()[["member", "parent", "generation", "mutation", "old_value", "new_value", "hp_lr",
                                "hp_beta"]].to_string(index=False))


if __name__ == "__main__":
    main()
