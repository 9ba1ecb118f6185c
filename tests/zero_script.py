"""Run under ``accelerate launch --config_file configs/deepspeed/zero2.yaml --num_processes 2`` by
tests/parallel/test_zero.py (not a test itself); also the 1-process reference (``scenario`` without a launch).

Members are trained on a FIXED global batch (each process its half of the prompts): three learn steps,
a clone made after the first, the clone's LoRA rank halved after the second, member 1 on its own
learning rate and a tight max_grad_norm. Every
process writes its members' adapters and gathered optimizer states, and the size of the optimizer
state it holds itself; process 0 writes member checkpoints. Then a fresh population is loaded from
those checkpoints (each process keeps its partition) and takes one more learn step. Last, actor-critic
members (LLMPPO, IPPO agents) take two steps each (:func:`ppo_scenario`).
"""

import json
import os
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file


def build(cache_dir=None):
    from conftest import make_grpo
    from evollm.recipes.warm_start import load_tiny_model

    model, tok = load_tiny_model(warm_start=False, seed=0)
    torch.manual_seed(0)
    pop = make_grpo(model, tok, n=2, lr=1e-2, batch_size=64)
    pop[1].set_hyperparameter("lr", 3e-3)
    pop[1].set_hyperparameter("max_grad_norm", 1e-3)  # clipping is active for member 1
    return pop, tok


def step(pop, tok, shard=lambda rows: rows):
    from data_parallel_script import fixed_batch
    from evollm.training.loop import learn_all

    seqs, masks, rewards = fixed_batch(tok)
    mine = shard(list(range(seqs.shape[0])))
    exp = (seqs[mine].reshape(-1, seqs.shape[2]), masks[mine].reshape(-1, masks.shape[2]), rewards[mine])
    return learn_all(pop, [exp] * len(pop))


def scenario(shard=lambda rows: rows):
    """Step, clone member 0, step, halve the clone's LoRA rank, step: the population of 3 members and
    the grad norms of the steps."""
    pop, tok = build()
    norms = [[m["grad_norm"] for m in step(pop, tok, shard)]]
    pop.append(pop[0].clone())
    norms.append([m["grad_norm"] for m in step(pop, tok, shard)])
    pop[2].set_lora_rank(pop[2].lora_rank // 2)  # new parameters: a new engine under ZeRO
    norms.append([m["grad_norm"] for m in step(pop, tok, shard)])
    return pop, tok, norms


def ppo_scenario(shard=lambda rows: rows, adv_whitening=False, ragged=False):
    """Actor-critic members: an LLMPPO member (critic adapter; its own learn) and two IPPO agents with
    the value head on the actor (the fused update), two steps on the fixed global batch; clones of the
    LLMPPO member and of an IPPO agent (their full optimizer states loaded into new engines) take the
    second step too.
    ``adv_whitening``: whiten the advantages (over the global batch, also when each process holds a share);
    ``ragged``: completions of different lengths (token means over the global batch).
    Returns the members and each step's (actor, critic) grad norms."""
    from data_parallel_script import fixed_batch
    from evollm.algorithms.ippo import IPPOAgent
    from evollm.algorithms.ppo import LLMPPO
    from evollm.recipes.warm_start import load_tiny_model

    model, tok = load_tiny_model(warm_start=False, seed=0)
    torch.manual_seed(0)
    common = dict(pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, batch_size=64, update_epochs=2,
                  adv_whitening=adv_whitening, lr=1e-2)
    ppo = LLMPPO(model, lr_critic=3e-3, max_grad_norm=1e-3, **common)
    ippo = [IPPOAgent(model, use_separate_critic=False, lr_critic=5e-3, **common) for _ in range(2)]
    seqs, masks, rewards = fixed_batch(tok, ragged=ragged)
    mine = shard(list(range(seqs.shape[0])))
    exp = (seqs[mine].reshape(-1, seqs.shape[2]), masks[mine].reshape(-1, masks.shape[2]), rewards[mine].reshape(-1))
    norms, clones = [], []
    for _ in range(2):
        stats = [m.learn(exp) for m in [ppo, *clones]] + IPPOAgent.learn_population(ippo, [exp, exp])
        norms.append([[m["grad_norm_actor"], m["grad_norm_critic"]] for m in stats])
        clones = clones or [ppo.clone(), ippo[0].clone()]  # full optimizer states loaded into new engines
    return [ppo, *ippo, *clones], norms


def reinforce_scenario(shard=lambda rows: rows):
    """Two LLMREINFORCE members (the fused population update; ReBN z-scores and token means over the global
    batch), two steps on the fixed global batch of completions of different lengths. Returns the members."""
    from data_parallel_script import fixed_batch
    from evollm.algorithms.reinforce import LLMREINFORCE
    from evollm.recipes.warm_start import load_tiny_model

    model, tok = load_tiny_model(warm_start=False, seed=0)
    torch.manual_seed(0)
    pop = [LLMREINFORCE(model, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, batch_size=64, lr=1e-2)]
    pop.append(pop[0].clone())
    pop[1].set_hyperparameter("lr", 3e-3)
    seqs, masks, rewards = fixed_batch(tok, ragged=True)
    mine = shard(list(range(seqs.shape[0])))
    exp = (seqs[mine].reshape(-1, seqs.shape[2]), masks[mine].reshape(-1, masks.shape[2]), rewards[mine])
    for _ in range(2):
        metrics = LLMREINFORCE.learn_population(pop, [exp, exp])
        assert {m["learn_path"] for m in metrics} == {"fused"}, metrics
    return pop


def grpo_scenario(shard=lambda rows: rows):
    """Two GRPO members with the token-mean loss (``loss_type="dapo"``), two steps on the fixed global batch
    of completions of different lengths. Returns the members."""
    from conftest import make_grpo
    from data_parallel_script import fixed_batch
    from evollm.recipes.warm_start import load_tiny_model
    from evollm.training.loop import learn_all

    model, tok = load_tiny_model(warm_start=False, seed=0)
    torch.manual_seed(0)
    pop = make_grpo(model, tok, n=2, lr=1e-2, batch_size=64, loss_type="dapo")
    pop[1].set_hyperparameter("lr", 3e-3)
    seqs, masks, rewards = fixed_batch(tok, ragged=True)
    mine = shard(list(range(seqs.shape[0])))
    exp = (seqs[mine].reshape(-1, seqs.shape[2]), masks[mine].reshape(-1, masks.shape[2]), rewards[mine])
    for _ in range(2):
        learn_all(pop, [exp, exp])
    return pop


def member_tensors(pop) -> dict:
    """Every adapter of every role and every value head."""
    out = {}
    for a in pop:
        for role in a.ROLES:
            out.update({f"{a.index}/{role}/{k}": v.contiguous() for k, v in a.shared.state_dict(a.adapter_name(role)).items()})
        out.update({f"{a.index}/head/{k}": v.detach().contiguous() for k, v in a.value_head.state_dict().items()})
    return out


def adapters(pop) -> dict:
    return {f"{a.index}/{k}": v.contiguous() for a in pop for k, v in a.shared.state_dict(a.adapter_name()).items()}


def optimizer_states(pop) -> dict:
    from evollm.algorithms.checkpoint import optimizer_to_safetensors

    out = {}
    for a in pop:
        tensors, _ = optimizer_to_safetensors(a.optimizer)
        out.update({f"{a.index}/{k}": v for k, v in tensors.items()})
    return out


def main(out: Path):
    from evollm.parallel import distributed as dist
    from evollm.parallel import zero

    dist.init()
    rank = dist.process_index()
    pop, tok, norms = scenario(dist.shard)
    sizes = {a.index: [a.optimizer.local_state_numel(), a.optimizer.full_state_numel(), type(a.optimizer).__name__,
                       a.optimizer.zero_stage, a.optimizer.local_master_numel(),
                       a.optimizer.local_param_numel()] for a in pop}
    save_file(adapters(pop), str(out / f"trained-rank{rank}.safetensors"))
    save_file(optimizer_states(pop), str(out / f"optimizer-rank{rank}.safetensors"))  # collective gather
    zero.snapshot_members(pop)  # then process 0 alone writes the checkpoints
    if rank == 0:
        for a in pop:
            a.save_checkpoint(out / f"member-{a.index}")
    dist.barrier()
    (out / f"info-rank{rank}.json").write_text(json.dumps({"sizes": sizes, "norms": norms}))

    for a in pop:  # as in a resumed run: the process holds only the population it resumes
        a.release()
    fresh, tok = build()
    fresh.append(fresh[0].clone())
    fresh[2].set_lora_rank(fresh[2].lora_rank // 2)
    for a in fresh:  # load on every process: each keeps its partition of the full saved state
        a.load_checkpoint(out / f"member-{a.index}")
    step(fresh, tok, dist.shard)
    save_file(adapters(fresh), str(out / f"resumed-rank{rank}.safetensors"))
    for a in fresh:
        a.release()

    members, ppo_norms = ppo_scenario(dist.shard)  # actor-critic members: one engine per param group
    save_file(member_tensors(members), str(out / f"ppo-rank{rank}.safetensors"))
    save_file(optimizer_states(members), str(out / f"ppo-optimizer-rank{rank}.safetensors"))
    (out / f"ppo-rank{rank}.json").write_text(json.dumps({"norms": ppo_norms, "kinds": [
        [type(a.optimizer).__name__, a.optimizer.local_state_numel(), a.optimizer.full_state_numel()] for a in members]}))

    class Team:  # a member made of agents (as an IPPO team): the snapshot reaches each agent's optimizer
        agents = members[2:4]

    zero.snapshot_members([Team()])
    if rank == 0:  # process 0 alone writes: with no snapshot its collective gather would never return
        for i, agent in enumerate(Team.agents):
            agent.save_checkpoint(out / f"team-agent-{i}")
    dist.shutdown()  # as the evollm command ends: every process waits, then the process group is closed


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    torch.set_num_threads(1)
    main(Path(sys.argv[1]))
    # Every output is written and closed. Under ZeRO-3 on gloo a process still aborts in the interpreter's own
    # teardown about once in ten runs ("terminate called without an active exception", after the process group
    # is destroyed), and the launcher then fails the finished run; this script leaves without that teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
