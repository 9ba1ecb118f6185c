"""Episode collection for multi-turn environments.

Episodes are played in lockstep: each turn, the prompts of every still-running episode
are answered by ONE batched ``generate`` (per group of members whose sampling settings
agree), each row routed to its member's adapter on the shared base
(:func:`evollm.rollout.population.generate_for_members`). Finished episodes are stacked into
right-padded tensors by :func:`stack_episodes`::

    input_ids   [B, L]      the whole conversation of each episode
    action_mask [B, L-1]    1 on model tokens (refers to input_ids[:, 1:])
    turn_ids    [B, L-1]    turn index of each model token, -1 elsewhere
    rewards     [B, K]      per-turn rewards (0 on turns that were not played)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from .population import generate_for_members, member_temperatures, rollout_masks, sampling_groups
from .sampling import generate
from .tokens import action_mask_for, collate_prompts, stack_rows


@dataclass
class Episode:
    """One finished episode: the wrapper's :meth:`get_episode_data` plus the final info."""

    input_ids: torch.Tensor  # [1, L]
    action_mask: torch.Tensor  # [1, L-1]
    turn_ids: torch.Tensor  # [1, L-1]
    rewards: torch.Tensor  # [K]
    info: dict = field(default_factory=dict)
    seed: int | None = None

    @property
    def episode_return(self) -> float:
        return float(self.rewards.sum())

    @property
    def truncated(self) -> bool:
        """The episode was cut short (a turn limit or the context length), not ended by the environment."""
        return bool(self.info.get("truncated", False))

    @property
    def success(self) -> bool:
        """``info["success"]`` when the env reports it, else a positive return."""
        return bool(self.info.get("success", self.episode_return > 0))


# --------------------------------------------------------------------------- #
# Playing episodes
# --------------------------------------------------------------------------- #
GenerateFn = Callable[[list[int], list[dict]], list[torch.Tensor]]


def play_episodes(envs: Sequence, seeds: Sequence[int | None], generate_fn: GenerateFn,
                  max_turns: int | None = None) -> list[Episode]:
    """Play one episode in each :class:`~evollm.envs.multiturn.TokenObservationWrapper` of ``envs``
    (``envs[i]`` reset with ``seeds[i]``), all in lockstep.

    ``generate_fn(active, prompts)`` receives the indices of the running episodes and their prompts and
    returns one completion id row per prompt. ``max_turns`` caps the turns (the wrappers' own
    ``max_turns`` normally ends the episodes first)."""
    if len(envs) != len(seeds):
        raise ValueError(f"got {len(seeds)} seeds for {len(envs)} envs")
    prompts: dict[int, dict] = {}
    for i, (env, seed) in enumerate(zip(envs, seeds)):
        prompt, _ = env.reset(seed=seed)
        if not env.done:
            prompts[i] = prompt
    turn = 0
    while prompts and (max_turns is None or turn < max_turns):
        active = sorted(prompts)
        completions = generate_fn(active, [prompts[i] for i in active])
        for i, completion in zip(active, completions):
            prompt, _, terminated, truncated, _ = envs[i].step(completion)
            if terminated or truncated:
                del prompts[i]
            else:
                prompts[i] = prompt
        turn += 1
    episodes = []
    for i, (env, seed) in enumerate(zip(envs, seeds)):
        ids, mask, turns, rewards = env.get_episode_data()
        info = dict(getattr(env, "last_info", {}) or {})
        if i in prompts:  # still running when max_turns stopped the play: cut short, not ended
            info["truncated"] = True
        episodes.append(Episode(ids, mask, turns, rewards, info, seed))
    return episodes


def model_generate_fn(model, sampling, pad_token_id: int, eos_token_id: int | None) -> GenerateFn:
    """A ``generate_fn`` for a plain model (or an already-selected adapter)."""
    def fn(active, prompts):
        ids, mask = collate_prompts(prompts, pad_token_id)
        seqs = generate(model, ids, mask, sampling, pad_token_id, eos_token_id)
        return completions(seqs, ids.shape[1], action_mask_for(seqs, ids.shape[1], eos_token_id))
    return fn


def completions(seqs: torch.Tensor, prompt_len: int, action_mask: torch.Tensor) -> list[torch.Tensor]:
    """Each row's completion ids, up to and including its first eos / stop string (padding dropped)."""
    lengths = action_mask[:, prompt_len - 1:].sum(1).tolist()
    return [seqs[i, prompt_len:prompt_len + int(n)].cpu() for i, n in enumerate(lengths)]


def population_generate_fn(owners: Sequence, training: bool) -> GenerateFn:
    """A ``generate_fn`` where episode ``i`` is played by member ``owners[i]``: members whose sampling
    settings agree answer in ONE generate, rows routed to their own adapters."""
    def fn(active, prompts):
        out: list[torch.Tensor | None] = [None] * len(active)
        members = list({id(owners[i]): owners[i] for i in active}.values())
        for (_, sampling, pad_id, eos_id), group in sampling_groups(members, training, lambda a: 1).items():
            blocks = [[j for j, i in enumerate(active) if owners[i] is m] for m in group]  # rows per member
            rows = [j for block in blocks for j in block]
            ids, mask = collate_prompts([prompts[j] for j in rows], pad_id)
            seqs = generate_for_members(group, ids, mask, [len(b) for b in blocks], sampling, pad_id, eos_id,
                                        temperatures=member_temperatures(group, sampling))
            done = completions(seqs, ids.shape[1], rollout_masks(group, seqs, ids.shape[1], sampling, eos_id))
            for k, j in enumerate(rows):
                out[j] = done[k]
        return out
    return fn


def collect_episodes(agents: Sequence, envs: Sequence, seeds: Sequence[int | None], training: bool = True,
                     max_turns: int | None = None) -> dict[int, list[Episode]]:
    """Every member plays every seed (``group_size`` times when training; once, greedily, otherwise).

    ``envs`` must hold at least ``len(agents) * len(seeds) * max(group_size)`` wrappers (see
    :class:`EnvPool`). Returns ``{agent.index: [episodes]}``, episodes ordered seed by seed with a
    seed's ``group_size`` repeats contiguous (the layout GRPO's ``rewards[P, G]`` expects)."""
    owners, episode_seeds = [], []
    for agent in agents:
        group = max(1, int(getattr(agent.config, "group_size", 1))) if training else 1
        for seed in seeds:
            owners += [agent] * group
            episode_seeds += [seed] * group
    if len(envs) < len(owners):
        raise ValueError(f"{len(owners)} episodes need as many environments, got {len(envs)}")
    episodes = play_episodes(envs[:len(owners)], episode_seeds, population_generate_fn(owners, training), max_turns)
    out: dict[int, list[Episode]] = {a.index: [] for a in agents}
    for agent, episode in zip(owners, episodes):
        out[agent.index].append(episode)
    return out


class EnvPool:
    """A growing list of wrappers built by ``env_factory`` (one per concurrently played episode)."""

    def __init__(self, env_factory: Callable[[], object]):
        self.env_factory = env_factory
        self.envs: list = []

    def get(self, n: int) -> list:
        while len(self.envs) < n:
            self.envs.append(self.env_factory())
        return self.envs[:n]


def stack_episodes(episodes: Sequence[Episode], pad_token_id: int, num_turns: int | None = None) -> tuple:
    """``(input_ids, action_masks, turn_ids, rewards)`` of ``episodes``, right-padded (the 4-tuple
    PPO/REINFORCE ``learn`` take). ``rewards`` is ``[B, K]`` with ``K = num_turns`` or the longest."""
    k = num_turns or max(max(e.rewards.numel() for e in episodes), 1)
    rewards = torch.zeros(len(episodes), k)
    for i, e in enumerate(episodes):
        rewards[i, :e.rewards.numel()] = e.rewards[:k]
    return (stack_rows([e.input_ids for e in episodes], pad_token_id),
            stack_rows([e.action_mask for e in episodes], 0),
            stack_rows([e.turn_ids for e in episodes], -1), rewards)


