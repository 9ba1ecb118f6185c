"""Run under ``accelerate launch --num_processes 2`` by tests/test_data_parallel.py (not a test itself).

Part 1: ``evollm train`` (CLI entry point) on the demo config, shortened, with selection and mutation.
Part 2: two learn steps of a fresh population on a FIXED global batch (each process its half).
Part 3: ``evollm train`` on a multi-turn game with LLMPPO members, shortened, with selection.
Part 4: actor-critic members (tests/zero_script.py ``ppo_scenario``) on the fixed global batch.
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


def fixed_batch(tok, n_prompts=4, group=4, width=6, seed=0):
    """A deterministic global batch: prompts + made-up completions + rewards (stacked per prompt)."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(6, len(tok), (n_prompts, 5), generator=g)
    completions = torch.randint(6, len(tok), (n_prompts, group, width), generator=g)
    seqs = torch.cat([prompts[:, None].expand(-1, group, -1), completions], dim=2)
    masks = torch.zeros(n_prompts, group, seqs.shape[2] - 1, dtype=torch.long)
    masks[:, :, 4:] = 1
    rewards = torch.rand(n_prompts, group, generator=g).round()
    return seqs, masks, rewards


def main(out: Path, cache_dir: str):
    from evollm import distributed as dist
    from evollm import runners
    from evollm.cli import main as cli_main

    captured = {}
    run_reasoning = runners.run_reasoning

    def capture(*args, **kwargs):
        result = run_reasoning(*args, **kwargs)
        captured["agents"] = result["agents"]
        return result

    runners.run_reasoning = capture
    rc = cli_main(["train", "configs/demo.yaml", "--quiet", "--set", f"output_dir={out / 'run'}",
                   "--set", f"model.cache_dir={cache_dir}", "--set", "algorithm.population_size=2",
                   "--set", "env.data_batch_size_per_gpu=2", "--set", "algorithm.hyperparameters.group_size=4",
                   "--set", "algorithm.hyperparameters.batch_size=8",
                   "--set", "train.max_steps=4", "--set", "train.evaluation_interval=2", "--set", "train.evo_steps=2",
                   "--set", "task.n_test=8", "--set", "hpo.mutation={no_mutation: 0.0, rl_hp: 1.0}"])
    assert rc == 0, rc
    rank = dist.process_index()
    save_members(captured["agents"], out / f"run-rank{rank}.safetensors")
    (out / f"run-rank{rank}.json").write_text(json.dumps([a.fitness for a in captured["agents"]]))

    # Part 2: fixed global batch, each process its half of the prompts
    from evollm.models.warm_start import load_tiny_model
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

    # Part 3: `evollm train` on a multi-turn game (LLMPPO), each process its half of the episodes
    captured.clear()
    run_multiturn = runners.run_multiturn

    def capture_multiturn(*args, **kwargs):
        result = run_multiturn(*args, **kwargs)
        captured["agents"] = result["agents"]
        return result

    runners.run_multiturn = capture_multiturn
    rc = cli_main(["train", "configs/ppo_multiturn.yaml", "--quiet", "--set", f"output_dir={out / 'multiturn'}",
                   "--set", f"model.cache_dir={cache_dir}", "--set", "algorithm.population_size=2",
                   "--set", "train.max_steps=4", "--set", "train.evaluation_interval=2", "--set", "train.evo_steps=2",
                   "--set", "train.episodes_per_step=4", "--set", "train.eval_episodes=4"])
    assert rc == 0, rc
    agents = captured["agents"]
    tensors = {f"{a.index}/{role}/{k}": v.contiguous() for a in agents for role in a.ROLES
               for k, v in a.shared.state_dict(a.adapter_name(role)).items()}
    tensors.update({f"{a.index}/head/{k}": v.detach().contiguous() for a in agents for k, v in a.value_head.state_dict().items()})
    save_file(tensors, str(out / f"multiturn-rank{rank}.safetensors"))
    (out / f"multiturn-rank{rank}.json").write_text(json.dumps([a.fitness for a in agents]))

    # Part 4: actor-critic members (LLMPPO, IPPO agents) on the fixed global batch
    from zero_script import member_tensors, ppo_scenario

    members, norms = ppo_scenario(dist.shard)
    save_file(member_tensors(members), str(out / f"ppo-rank{rank}.safetensors"))
    (out / f"ppo-rank{rank}.json").write_text(json.dumps(norms))
    dist.barrier()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    torch.set_num_threads(1)
    main(Path(sys.argv[1]), sys.argv[2])
