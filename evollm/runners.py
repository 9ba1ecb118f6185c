"""What ``evollm train`` runs for each kind of environment: build the env, measure the
warm start, train, measure again."""

from __future__ import annotations

from . import distributed as dist
from .rollout import evaluate_population
from .training.data_parallel import evaluate_data_parallel


def run_reasoning(cfg, members, tokenizer, train_cfg: dict, evo_steps, selection, mutation, quiet: bool) -> dict:
    from .builders import build_task
    from .envs.reasoning import ReasoningGym
    from .training.loop import finetune_llm_reasoning

    train_ds, test_ds, reward_fn, template = build_task(cfg.task, cfg.seed)
    # data_batch_size_per_gpu is per process: the env yields the global batch, each process its share
    env = ReasoningGym(train_ds, test_ds, tokenizer, reward_fn, template, seed=cfg.seed,
                       data_batch_size_per_gpu=cfg.env.data_batch_size_per_gpu * dist.num_processes(),
                       max_context_length=cfg.env.max_context_length, eval_batch_size=cfg.env.eval_batch_size,
                       long_prompts=cfg.env.long_prompts, chat_template_kwargs=cfg.task.chat_template_kwargs)
    initial = evaluate_data_parallel(members[:1], env, evaluate_population, record=False)[0]
    if dist.is_main_process():
        print(f"warm start: held-out accuracy {initial:.3f} on {len(env.test_prompts())} fixed test questions")
    agents, population = finetune_llm_reasoning(
        members, env, evo_steps=evo_steps, tournament=selection, mutation=mutation, verbose=not quiet,
        seed=cfg.seed, **train_cfg)
    final = max(a.fitness[-1] for a in agents)
    return {"agents": agents, "population": population, "initial_fitness": initial, "final_fitness": final}


def run_multiturn(cfg, members, tokenizer, train_cfg: dict, evo_steps, selection, mutation, quiet: bool) -> dict:
    from .training.multiturn import run_multiturn_from_config

    train_cfg = {**train_cfg, "episodes_per_step": cfg.train.episodes_per_step,
                 "eval_episodes": cfg.train.eval_episodes}
    return run_multiturn_from_config(cfg, members, tokenizer, train_cfg, evo_steps, selection, mutation, quiet)


def run_team(cfg, members, tokenizer, train_cfg: dict, evo_steps, selection, mutation, quiet: bool) -> dict:
    """IPPO teams (``algorithm.name: IPPO``) on a cooperative task (``task.name: relay_sum``)."""
    from .training.ippo import run_team_from_config

    return run_team_from_config(cfg, members, tokenizer, train_cfg, evo_steps, selection, mutation, quiet)
