"""Run under ``accelerate launch --num_processes 2`` by tests/parallel/test_data_parallel.py (not a test itself).

Part 1: ``evollm train`` (CLI entry point) on the demo config, shortened, with selection and mutation.
Part 2: two learn steps of a fresh population on a FIXED global batch (each process its half).
Part 3: ``evollm train`` on a multi-turn game with LLMPPO members, shortened, with selection.
Part 4: ``evollm train`` on a team task (IPPO teams), shortened, with selection.
Part 5: actor-critic members (tests/zero_script.py ``ppo_scenario``) on the fixed global batch.
Part 6: advantages normalised and token means taken over the global batch, on a fixed global batch of
completions of different lengths: ``ppo_scenario`` with whitened advantages, two LLMREINFORCE members
(``reinforce_scenario``, ReBN) and two GRPO members with the token-mean loss (``grpo_scenario``, dapo).
Every process saves its members' adapters to OUT/<part>-rank<r>.safetensors.
"""

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file


def save_members(agents, path):
    tensors = {f"{a.index}/{k}": v.contiguous() for a in agents for k, v in a.shared.state_dict(a.adapter_name()).items()}
    meta = {"members": json.dumps([[a.index, a.lora_rank, a.config.lr] for a in agents])}
    save_file(tensors, str(path), metadata=meta)


def fixed_batch(tok, n_prompts=4, group=4, width=6, seed=0, ragged=False):
    """A deterministic global batch: prompts + made-up completions + rewards (stacked per prompt);
    ``ragged``: completions of 1 to ``width`` tokens (the rest masked out), so the processes' shares hold
    different numbers of tokens."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(6, len(tok), (n_prompts, 5), generator=g)
    completions = torch.randint(6, len(tok), (n_prompts, group, width), generator=g)
    seqs = torch.cat([prompts[:, None].expand(-1, group, -1), completions], dim=2)
    masks = torch.zeros(n_prompts, group, seqs.shape[2] - 1, dtype=torch.long)
    masks[:, :, 4:] = 1
    rewards = torch.rand(n_prompts, group, generator=g).round()
    if ragged:
        lengths = torch.randint(1, width + 1, (n_prompts, group), generator=g)
        masks = masks * (torch.arange(masks.shape[2]) < 4 + lengths[..., None]).long()
    return seqs, masks, rewards


def train_cli(runner: str, config: str, out: Path, cache_dir: str, *settings: str) -> list:
    """``evollm train CONFIG`` (shortened by ``settings``); returns the final members, caught from
    :mod:`evollm.recipes.runners`' ``runner``."""
    from evollm.recipes import runners
    from evollm.recipes.cli import main as cli_main

    captured = {}
    original = getattr(runners, runner)

    def capture(*args, **kwargs):
        result = original(*args, **kwargs)
        captured["agents"] = result["agents"]
        return result

    setattr(runners, runner, capture)
    try:
        args = ["train", config, "--quiet", "--set", f"output_dir={out}", "--set", f"model.cache_dir={cache_dir}",
                "--set", "train.max_steps=4", "--set", "train.evaluation_interval=2", "--set", "train.evo_steps=2"]
        rc = cli_main(args + [x for setting in settings for x in ("--set", setting)])
    finally:
        setattr(runners, runner, original)
    assert rc == 0, rc
    return captured["agents"]


def main(out: Path, cache_dir: str):
    from evollm.parallel import distributed as dist
    from zero_script import grpo_scenario, member_tensors, ppo_scenario, reinforce_scenario

    dist.init()
    rank = dist.process_index()
    agents = train_cli("run_reasoning", "configs/demo.yaml", out / "run", cache_dir, "algorithm.population_size=2",
                       "env.data_batch_size_per_gpu=2", "algorithm.hyperparameters.group_size=4",
                       "algorithm.hyperparameters.batch_size=8", "task.n_test=8",
                       "hpo.mutation={no_mutation: 0.0, rl_hp: 1.0}")
    save_members(agents, out / f"run-rank{rank}.safetensors")
    (out / f"run-rank{rank}.json").write_text(json.dumps([a.fitness for a in agents]))

    # Part 2: fixed global batch, each process its half of the prompts
    from evollm.recipes.warm_start import load_tiny_model
    from evollm.training.loop import learn_all
    from conftest import make_grpo

    model, tok = load_tiny_model(warm_start=False, seed=0)
    torch.manual_seed(0)
    pop = make_grpo(model, tok, n=2, lr=1e-2, batch_size=64)
    pop[1].set_hyperparameter("lr", 3e-3)
    seqs, masks, rewards = fixed_batch(tok)
    mine = dist.shard(list(range(seqs.shape[0])))
    for step in range(2):
        exp = (seqs[mine].reshape(-1, seqs.shape[2]), masks[mine].reshape(-1, masks.shape[2]), rewards[mine])
        learn_all(pop, [exp, exp])
    save_members(pop, out / f"fixed-rank{rank}.safetensors")
    for a in pop:
        a.release()

    # Part 3: a multi-turn game (LLMPPO), each process its half of the episodes
    agents = train_cli("run_multiturn", "configs/ppo_multiturn.yaml", out / "multiturn", cache_dir,
                       "algorithm.population_size=2", "train.episodes_per_step=4", "train.eval_episodes=4")
    save_file(member_tensors(agents), str(out / f"multiturn-rank{rank}.safetensors"))
    (out / f"multiturn-rank{rank}.json").write_text(json.dumps([a.fitness for a in agents]))

    # Part 4: a team task (IPPO teams), each process its half of the rows
    teams = train_cli("run_team", "configs/ippo_team.yaml", out / "team", cache_dir,
                      "algorithm.hyperparameters.rollout_buffer_size=8", "algorithm.hyperparameters.mini_batch_size=4")
    tensors = {f"{t.index}/{i}/{k}": v for t in teams for i, a in enumerate(t.agents) for k, v in member_tensors([a]).items()}
    save_file(tensors, str(out / f"team-rank{rank}.safetensors"))
    (out / f"team-rank{rank}.json").write_text(json.dumps([t.fitness for t in teams]))
    for t in teams:
        t.release()

    # Part 5: actor-critic members (LLMPPO, IPPO agents) on the fixed global batch
    members, norms = ppo_scenario(dist.shard)
    save_file(member_tensors(members), str(out / f"ppo-rank{rank}.safetensors"))
    (out / f"ppo-rank{rank}.json").write_text(json.dumps(norms))

    # Part 6: advantages whitened / ReBN-normalised over the global batch, each process its half of the rows
    members, _ = ppo_scenario(dist.shard, adv_whitening=True, ragged=True)
    save_file(member_tensors(members), str(out / f"ppo-whitened-rank{rank}.safetensors"))
    save_members(reinforce_scenario(dist.shard), out / f"reinforce-rank{rank}.safetensors")
    save_members(grpo_scenario(dist.shard), out / f"grpo-dapo-rank{rank}.safetensors")
    dist.shutdown()  # as `evollm train` ends: every process waits, then the process group is closed
    (out / f"shutdown-rank{rank}.json").write_text(json.dumps({"initialized": torch.distributed.is_initialized()}))

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    torch.set_num_threads(1)
    main(Path(sys.argv[1]), sys.argv[2])
