"""CoMLRL-style IPPO: a team of two cooperating agents on ONE shared base model, evolved as a population.

    python examples/ippo_team.py

Relay sum: agent 0 holds x, agent 1 holds y. In round 1 each passes its number on; in round 2 each sees
its own number and the other's round-1 reply and answers x + y. The joint reward (fraction of agents
right) is shared by both agents, so neither can succeed alone. The tiny offline model is warm-started
on a teacher that mostly relays its number with the digits swapped; RL has to find out, from the joint
reward alone, that passing the number on unchanged is what lets the partner succeed.

Same run as ``evollm train configs/ippo_team.yaml``, written the way CoMLRL's ``IPPOTrainer`` is used.
"""

import torch

from evollm.algorithms import IPPOConfig
from evollm.hpo import HyperparameterConfig, Mutations, RLParameter, TournamentSelection
from evollm.recipes.coop_warm_start import COOP_DEFAULTS, load_tiny_coop_model
from evollm.tasks.coop import relay_formatters, relay_sum_dataset, relay_sum_reward
from evollm.training import IPPOTrainer

torch.set_num_threads(1)  # the tiny model's ops are too small to gain from more threads

model, tokenizer = load_tiny_coop_model()  # offline tiny Llama + char tokenizer, cached warm start
train, test = relay_sum_dataset(seed=0, **COOP_DEFAULTS["task"])  # the warm start never saw `test`

args = IPPOConfig(
    num_agents=2, num_turns=2,  # two rounds: each agent sees the other's first reply in round 2
    actor_learning_rate=2e-3, critic_learning_rate=2e-3,
    rollout_buffer_size=32, mini_batch_size=16, ppo_epochs=2,
    clip_coef=0.2, value_clip_range=0.2, value_loss_coef=0.5, entropy_coef=0.0,
    gamma=1.0, gae_lambda=0.95, use_separate_critic=True,
    max_new_tokens=4, temperature=1.0, eval_interval=10, output_dir="runs/ippo_example",
)

# Evolution of whole teams: per-agent learning rates and clip ranges are mutated.
hp = HyperparameterConfig(**{
    "agent0.actor_learning_rate": RLParameter(min=5e-4, max=5e-3, log=True),
    "agent1.actor_learning_rate": RLParameter(min=5e-4, max=5e-3, log=True),
    "agent1.clip_coef": RLParameter(min=0.1, max=0.4),
})

trainer = IPPOTrainer(
    model=model, tokenizer=tokenizer,
    reward_func=relay_sum_reward,  # reward_func(*agent_completions, **columns) -> list[float]
    formatters=relay_formatters(),  # one per agent: formatter(row, history) -> that agent's message
    args=args, train_dataset=train, eval_dataset=test,
    population_size=2, hp_config=hp, evo_steps=10,
    tournament=TournamentSelection(tournament_size=2, elitism=True, population_size=2, rand_seed=0),
    mutation=Mutations(no_mutation=0.3, rl_hp=0.7, rand_seed=0),
)
print("before:", trainer.evaluate())
teams, population = trainer.train(max_steps=30)
print("after: ", trainer.evaluate())
print(population.report()[["step", "member", "fitness", "success", "hp_agent0.actor_learning_rate",
                            "hp_agent1.clip_coef", "agent0.clip_fraction", "agent1.policy_loss"]].to_string())
print("best team saved to", trainer.save_model())  # agent_<i>/adapter loads with PeftModel.from_pretrained
