"""Sampling for a group of members: ONE batched ``generate`` over the shared base for all
members whose sampling settings agree, each row routed to its member's adapter (see
:mod:`evollm.adapters.routing`); and evaluation of every member on fixed test prompts.

Members are duck-typed: ``shared``, ``index``, ``adapter_name(role)``, ``sampling_config(training,
group_size)``, ``pad_token_id``, ``eos_token_id`` and ``config.group_size`` are all that is used.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable, Sequence

import torch

from ..adapters.routing import routed
from .sampling import SamplingConfig, generate
from .vllm_engine import engine_of
from .tokens import Rollout, action_mask_for, collate_prompts, sequence_attention_mask


def sampling_groups(agents: Sequence, training: bool, group_size_of: Callable[[object], int]) -> dict:
    """Members that can share one generate call: same base, same sampling settings, same pad/eos.
    Keys are ``(id(shared), sampling, pad_token_id, eos_token_id)``."""
    groups = defaultdict(list)
    for agent in agents:
        sampling = agent.sampling_config(training, group_size_of(agent))
        groups[(id(agent.shared), sampling, agent.pad_token_id, agent.eos_token_id)].append(agent)
    return groups


def generate_for_members(members: Sequence, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                         counts: Sequence[int], sampling: SamplingConfig, pad_token_id: int,
                         eos_token_id: int | None) -> torch.Tensor:
    """One ``generate`` where the prompt rows come in contiguous blocks, ``counts[i]`` rows for
    ``members[i]`` (all on one shared base, equal sampling settings). Returns prompt + completion ids,
    ``num_return_sequences`` consecutive rows per prompt row."""
    shared = members[0].shared
    if len(members) == 1:
        with shared.use(members[0].adapter_name("actor")) as model:
            return generate(model, input_ids, attention_mask, sampling, pad_token_id, eos_token_id)
    with routed(shared, [m.adapter_name("actor") for m in members], counts) as model:
        return generate(model, input_ids, attention_mask, sampling, pad_token_id, eos_token_id)


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
    groups = list(sampling_groups(agents, training, group_of).items())
    jobs: dict[int, list] = defaultdict(list)  # engine id -> the groups it samples, in ONE call
    for key, members in groups:
        ids, mask = collate_prompts(prompts, key[2])
        n = len(members)
        job = (members, ids.repeat(n, 1), mask.repeat(n, 1), [ids.shape[0]] * n, key[1], key[2], key[3])
        engine = engine_of(members[0].shared)  # rollout_backend="vllm": every member a LoRA id of one engine
        if engine is not None:
            jobs[id(engine)].append((engine, job, mask))
        else:
            _split(out, members, generate_for_members(*job), None, mask, key[1], key[3])
    for items in jobs.values():
        results = items[0][0].generate_jobs([job for _, job, _ in items])
        for (_, job, mask), (seqs, sampler_logp) in zip(items, results):
            _split(out, job[0], seqs, sampler_logp, mask, job[4], job[6])
    return out


def _split(out: dict, members: Sequence, seqs: torch.Tensor, sampler_logp, mask: torch.Tensor,
           sampling: SamplingConfig, eos_id) -> None:
    """One :class:`Rollout` per member from a generate over contiguous member blocks."""
    prompt_len = mask.shape[1]
    rows = mask.shape[0] * sampling.num_return_sequences
    for i, member in enumerate(members):
        s = seqs[i * rows:(i + 1) * rows]
        out[member.index] = Rollout(s, sequence_attention_mask(s, mask), action_mask_for(s, prompt_len, eos_id),
                                    prompt_len, sampling.num_return_sequences,
                                    None if sampler_logp is None else sampler_logp[i * rows:(i + 1) * rows])


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
