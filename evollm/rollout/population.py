"""Sampling for a group of members: ONE batched ``generate`` over the shared base for all
members whose sampling settings agree, each row routed to its member's adapter (see
:mod:`evollm.adapters.routing`); and evaluation of every member on fixed test prompts.

Members are duck-typed: ``shared``, ``index``, ``adapter_name(role)``, ``sampling_config(training,
group_size)``, ``pad_token_id``, ``eos_token_ids`` (or ``eos_token_id``), ``tokenizer`` (optional, for
stop strings) and ``config.group_size`` are all that is used.

Members whose adapters are routed exactly (:func:`evollm.adapters.routing.batch_path`) share one
forward; otherwise (DoRA) each member's rows run through PEFT's own layers, one member at a time.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace
from typing import Callable, Sequence

import torch

from ..adapters.routing import ROUTED, batch_path, routed
from .common_prefix import greedy_shared_prefix
from .sampling import SamplingConfig, generate, shares_rows, stop_string_ends
from .vllm_engine import engine_of
from .tokens import Rollout, action_mask_for, collate_prompts, sequence_attention_mask


def sampling_groups(agents: Sequence, training: bool, group_size_of: Callable[[object], int]) -> dict:
    """Members that can share one generate call: same base, same sampling settings, same pad/eos.
    Keys are ``(id(shared), sampling, pad_token_id, eos_token_id)``.

    Temperature does not split a group: greedy decoding ignores it, and plain sampling on the HF
    backend applies each member's own temperature row by row (:func:`member_temperatures`). In those
    cases the key's ``sampling.temperature`` is 1.0 and the members' own values are passed to
    :func:`generate_for_members` as ``temperatures``."""
    groups = defaultdict(list)
    for agent in agents:
        sampling = agent.sampling_config(training, group_size_of(agent))
        if not sampling.do_sample or _row_temperatures(sampling, agent.shared):
            sampling = replace(sampling, temperature=1.0)
        groups[(id(agent.shared), sampling, agent.pad_token_id, member_eos_ids(agent))].append(agent)
    return groups


def member_temperatures(members: Sequence, sampling: SamplingConfig) -> list[float] | None:
    """Each member's own sampling temperature, for a group keyed by :func:`sampling_groups` (None where
    the key's settings already hold the temperature: greedy, or an engine / opt-in processor group)."""
    if sampling.temperature != 1.0 or not _row_temperatures(sampling, members[0].shared):
        return None
    return [float(m.sampling_config(True, 1).temperature) for m in members]


def _row_temperatures(sampling: SamplingConfig, shared) -> bool:
    """Whether members sampling with ``sampling`` on ``shared`` get their temperatures row by row (HF
    backend, plain sampling) rather than from the settings of their own group."""
    return shares_rows(sampling) and engine_of(shared) is None


def member_eos_ids(agent) -> tuple[int, ...]:
    """Every id that ends a completion of ``agent``."""
    ids = getattr(agent, "eos_token_ids", None)
    if ids is None:
        ids = (agent.eos_token_id,) if agent.eos_token_id is not None else ()
    return tuple(ids)


def generate_for_members(members: Sequence, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                         counts: Sequence[int], sampling: SamplingConfig, pad_token_id: int,
                         eos_token_id, return_scores: bool = False, temperatures: Sequence[float] | None = None):
    """One ``generate`` where the prompt rows come in contiguous blocks, ``counts[i]`` rows for
    ``members[i]`` (all on one shared base, equal sampling settings). Returns prompt + completion ids,
    ``num_return_sequences`` consecutive rows per prompt row (and, with ``return_scores``, the
    log-probs of the sampled distributions, see :func:`~evollm.rollout.sampling.generate`).
    ``temperatures`` (one per member) replace ``sampling.temperature``: each member's rows are
    sampled at its own temperature, still in one call."""
    shared = members[0].shared
    tokenizer = getattr(members[0], "tokenizer", None)
    names = [m.adapter_name("actor") for m in members]
    kw = dict(tokenizer=tokenizer, return_scores=return_scores)
    own = [sampling] * len(members)
    if temperatures is not None:
        own = [replace(sampling, temperature=float(t)) for t in temperatures]
        if len(set(temperatures)) == 1:
            sampling = own[0]
        else:
            kw["row_temperatures"] = torch.tensor([float(t) for t, n in zip(temperatures, counts) for _ in range(n)])
    if not return_scores:  # greedy evaluation: the prompts' common prefix once per member
        out = greedy_shared_prefix(shared, names, counts, input_ids, attention_mask, sampling, pad_token_id,
                                   eos_token_id, tokenizer)
        if out is not None:
            return out
    if len(members) == 1:
        kw.pop("row_temperatures", None)
        with shared.use(names[0]) as model:
            return generate(model, input_ids, attention_mask, own[0], pad_token_id, eos_token_id, **kw)
    if batch_path(shared, names) == ROUTED:
        with routed(shared, names, counts) as model:
            return generate(model, input_ids, attention_mask, sampling, pad_token_id, eos_token_id, **kw)
    kw.pop("row_temperatures", None)
    outs, start = [], 0  # PEFT's own forward, one member at a time
    for name, count, member_sampling in zip(names, counts, own):
        with shared.use(name) as model:
            outs.append(generate(model, input_ids[start:start + count], attention_mask[start:start + count],
                                 member_sampling, pad_token_id, eos_token_id, **kw))
        start += count
    if return_scores:
        width = max(o[1].shape[1] for o in outs)
        scores = [torch.nn.functional.pad(o[1], (0, 0, 0, width - o[1].shape[1])) for o in outs]
        return torch.cat([o[0] for o in outs]), torch.cat(scores)
    return torch.cat(outs)


def rollout_masks(members: Sequence, seqs: torch.Tensor, prompt_len: int, sampling: SamplingConfig,
                  eos_token_id) -> torch.Tensor:
    """The action mask of sampled rows: up to the first eos id or stop string."""
    stops = None
    if sampling.stop_strings:
        stops = stop_string_ends(seqs, prompt_len, members[0].tokenizer, sampling.stop_strings)
    return action_mask_for(seqs, prompt_len, eos_token_id, stops)


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
    jobs: dict[int, list] = defaultdict(list)  # engine id -> the groups it samples, in ONE call
    for (_, sampling, pad_id, eos_id), members in sampling_groups(agents, training, group_of).items():
        ids, mask = collate_prompts(prompts, pad_id)
        n = len(members)
        job = (members, ids.repeat(n, 1), mask.repeat(n, 1), [ids.shape[0]] * n, sampling, pad_id, eos_id)
        engine = engine_of(members[0].shared)  # rollout_backend="vllm": every member a LoRA id of one engine
        if engine is not None:
            jobs[id(engine)].append((engine, job, mask))
        else:
            _split(out, job, generate_for_members(*job, temperatures=member_temperatures(members, sampling)), None,
                   mask)
    for items in jobs.values():
        results = items[0][0].generate_jobs([job for _, job, _ in items])
        for (_, job, mask), (seqs, sampler_logp) in zip(items, results):
            _split(out, job, seqs, sampler_logp, mask)
    return out


def _split(out: dict, job: tuple, seqs: torch.Tensor, sampler_logp, mask: torch.Tensor) -> None:
    """One :class:`Rollout` per member of ``job`` from a generate over contiguous member blocks."""
    members, sampling, eos_id = job[0], job[4], job[6]
    prompt_len = mask.shape[1]
    rows = mask.shape[0] * sampling.num_return_sequences
    for i, member in enumerate(members):
        s = seqs[i * rows:(i + 1) * rows]
        out[member.index] = Rollout(s, sequence_attention_mask(s, mask),
                                    rollout_masks(members, s, prompt_len, sampling, eos_id), prompt_len,
                                    sampling.num_return_sequences,
                                    None if sampler_logp is None else sampler_logp[i * rows:(i + 1) * rows])


class Fitness(list):
    """Fitness per member (a plain list of floats) that also carries ``stderr``: the standard error of
    each member's mean over the evaluation's items (prompts or episodes), ``sum_sq``: the sum of
    the squared item scores (to combine shards), and, where the members scored the same items,
    ``cross``: the sums over items of the products of two members' scores (``cross[i][j]``; its
    diagonal is ``sum_sq``) with ``count`` items, which give the standard error of the difference
    between two members paired item by item (:meth:`pair_stderrs`; ``pair_se`` holds them by member id
    once the training loop's evaluation has matched the rows to its members)."""

    def __init__(self, values, stderr=None, sum_sq=None, cross=None, count=None):
        super().__init__(values)
        self.pair_se: dict[tuple[int, int], float] = {}
        self.stderr = list(stderr) if stderr is not None else [float("nan")] * len(self)
        self.sum_sq = list(sum_sq) if sum_sq is not None else None
        self.cross = [list(map(float, row)) for row in cross] if cross is not None else None
        self.count = int(count) if count is not None else None

    def pair_stderrs(self) -> list[list[float]] | None:
        """``[i][j]``: the standard error of member i's mean minus member j's, paired over the items
        both scored (:func:`paired_stderr`); ``None`` without ``cross``."""
        if self.cross is None or not self.count:
            return None
        sums = [float(v) * self.count for v in self]
        return [[paired_stderr(sums[i], sums[j], self.cross[i][i], self.cross[j][j], self.cross[i][j], self.count)
                 for j in range(len(self))] for i in range(len(self))]


def mean_stderr(total: float, sum_sq: float, n: int) -> float:
    """Standard error of a mean of ``n`` items from their sum and sum of squares (ddof=1; NaN for n < 2)."""
    if n < 2:
        return float("nan")
    var = max(sum_sq - total * total / n, 0.0) / (n - 1)
    return (var / n) ** 0.5


def paired_stderr(sum_i: float, sum_j: float, sq_i: float, sq_j: float, cross_ij: float, n: int) -> float:
    """Standard error of the mean difference ``x_i - x_j`` over ``n`` items both members scored, from the
    sums of their scores, of their squares and of their products: the noise of comparing the two on the
    same items, which leaves out how hard each item is (two members that agree on every item differ by
    exactly 0).

    >>> round(paired_stderr(3, 2, 3, 2, 2, 4), 4)   # x_i = 1 1 1 0, x_j = 1 1 0 0: d = 0 0 1 0
    0.25
    >>> paired_stderr(2, 2, 2, 2, 2, 4)              # the same answers: no noise in the difference
    0.0
    """
    return mean_stderr(sum_i - sum_j, max(sq_i + sq_j - 2.0 * cross_ij, 0.0), n)


def item_products(scores: torch.Tensor) -> torch.Tensor:
    """``[members, items]`` scores -> ``[members, members]`` sums over items of products (``Fitness.cross``)."""
    x = scores.to(torch.float64)
    return x @ x.T


def evaluate_population(agents: Sequence, env, record: bool = True) -> Fitness:
    """Fitness of every member: mean reward over the env's fixed test prompts, greedy decoding,
    all members batched (with each mean's standard error, see :class:`Fitness`). Recorded in each
    member's fitness history when ``record``."""
    prompts = env.test_prompts()
    totals = torch.zeros(len(agents))
    sums = torch.zeros(len(agents), dtype=torch.float64)  # the standard errors' accumulators
    cross = torch.zeros(len(agents), len(agents), dtype=torch.float64)  # and the paired ones'
    count = 0
    step = getattr(env, "eval_batch_size", 64)
    for start in range(0, len(prompts), step):
        batch = prompts[start:start + step]
        rollouts = generate_population(agents, batch, training=False)
        per_member = []
        for j, agent in enumerate(agents):
            completions, _ = rollouts[agent.index].per_prompt()
            scores = env.score(completions, batch)
            totals[j] += scores.sum()
            per_member.append(torch.as_tensor(scores, dtype=torch.float64).reshape(-1))
        scores = torch.stack(per_member)
        sums += scores.sum(dim=1)
        cross += item_products(scores)
        count += len(batch)
    squares = cross.diagonal().tolist()
    fitness = Fitness((totals / count).tolist(),
                      [mean_stderr(float(t), float(q), count) for t, q in zip(sums, squares)], squares,
                      cross.tolist(), count)
    if record:
        for agent, f in zip(agents, fitness):
            agent.record_fitness(f)
    return fitness
