"""Whole-population rollouts and evaluation: ONE batched ``generate`` over the shared
base for all members whose sampling settings agree, each row routed to its member's
adapter (see :mod:`evollm.adapters.routing`)."""

from __future__ import annotations

from collections import defaultdict
from typing import Sequence

import torch

from ..adapters.routing import routed
from ..algorithms.grpo import Rollout
from ..algorithms.rollout import action_mask_for, collate_prompts, generate, sequence_attention_mask


def _groups(agents: Sequence, training: bool, group_size_of) -> dict:
    """Members that can share one generate call: same base, same sampling settings, same pad/eos."""
    groups = defaultdict(list)
    for agent in agents:
        sampling = agent.sampling_config(training, group_size_of(agent))
        groups[(id(agent.shared), sampling, agent.pad_token_id, agent.eos_token_id)].append(agent)
    return groups


def generate_population(agents: Sequence, prompts: Sequence[dict], training: bool = True,
                        group_size: int | None = None) -> dict[int, Rollout]:
    """Sample completions of ``prompts`` for every member; returns ``{agent.index: Rollout}``.

    With ``training=True`` each member samples its ``group_size`` completions per prompt; otherwise
    one greedy completion per prompt.
    """
    def group_of(agent):
        if not training:
            return 1
        return group_size if group_size is not None else agent.config.group_size

    out: dict[int, Rollout] = {}
    for (_, sampling, pad_id, eos_id), members in _groups(agents, training, group_of).items():
        ids, mask = collate_prompts(prompts, pad_id)
        shared = members[0].shared
        n = len(members)
        rows = ids.shape[0] * sampling.num_return_sequences
        if n == 1:
            with shared.use(members[0].adapter_name("actor")) as model:
                model.eval()
                seqs = generate(model, ids, mask, sampling, pad_id, eos_id)
        else:
            with routed(shared, [m.adapter_name("actor") for m in members], [ids.shape[0]] * n) as model:
                seqs = generate(model, ids.repeat(n, 1), mask.repeat(n, 1), sampling, pad_id, eos_id)
        for i, member in enumerate(members):
            s = seqs[i * rows:(i + 1) * rows]
            out[member.index] = Rollout(s, sequence_attention_mask(s, mask), action_mask_for(s, ids.shape[1], eos_id),
                                        ids.shape[1], sampling.num_return_sequences)
    return out


def evaluate_population(agents: Sequence, env, record: bool = True) -> list[float]:
    """Fitness of every member: mean reward over the env's fixed test prompts, greedy decoding,
    all members batched. Appends to each member's ``fitness`` when ``record``."""
    prompts = env.test_prompts()
    totals = torch.zeros(len(agents))
    count = 0
    step = getattr(env, "eval_batch_size", 64)
    for start in range(0, len(prompts), step):
        batch = prompts[start:start + step]
        rollouts = generate_population(agents, batch, training=False)
        for j, agent in enumerate(agents):
            completions, _ = rollouts[agent.index].per_prompt()
            totals[j] += env.score(completions, batch).sum()
        count += len(batch)
    fitness = (totals / count).tolist()
    if record:
        for agent, f in zip(agents, fitness):
            agent.fitness.append(f)
    return fitness
