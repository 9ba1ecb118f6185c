"""Episode collection for multi-turn environments, and the episode tensors learners consume.

Episodes are played in lockstep: each turn, the prompts of every still-running episode
are answered by ONE batched ``generate`` (per group of members whose sampling settings
agree), each row routed to its member's adapter on the shared base
(:func:`evollm.adapters.routing.routed`).  Finished episodes are stacked into
right-padded tensors::

    input_ids   [B, L]      the whole conversation of each episode
    action_mask [B, L-1]    1 on model tokens (refers to input_ids[:, 1:])
    turn_ids    [B, L-1]    turn index of each model token, -1 elsewhere
    rewards     [B, K]      per-turn rewards (0 on turns that were not played)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from ..adapters.routing import routed
from .base import LLMAgent
from .grpo import GRPO, _attention_from_sequences, _stack
from .rollout import collate_prompts, generate, position_ids_from_mask


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
    def success(self) -> bool:
        """``info["success"]`` when the env reports it, else a positive return."""
        return bool(self.info.get("success", self.episode_return > 0))


@dataclass
class EpisodeBatch:
    """Stacked episodes (see the module docstring for shapes)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    action_mask: torch.Tensor
    turn_ids: torch.Tensor
    rewards: torch.Tensor

    @property
    def num_turns(self) -> int:
        return self.rewards.shape[1]

    def turn_mask(self) -> torch.Tensor:
        """``[B, K]`` bool: turn ``k`` of row ``b`` was played (it has at least one model token)."""
        turns = torch.arange(self.num_turns, device=self.turn_ids.device)
        return (self.turn_ids.unsqueeze(-1) == turns).any(1)

    def episode_returns(self) -> torch.Tensor:
        return (self.rewards * self.turn_mask()).sum(1)


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
    for env, seed in zip(envs, seeds):
        ids, mask, turns, rewards = env.get_episode_data()
        episodes.append(Episode(ids, mask, turns, rewards, dict(getattr(env, "last_info", {}) or {}), seed))
    return episodes


def model_generate_fn(model, sampling, pad_token_id: int, eos_token_id: int | None) -> GenerateFn:
    """A ``generate_fn`` for a plain model (or an already-selected adapter)."""
    def fn(active, prompts):
        ids, mask = collate_prompts(prompts, pad_token_id)
        seqs = generate(model, ids, mask, sampling, pad_token_id, eos_token_id)
        return list(seqs[:, ids.shape[1]:].cpu())
    return fn


def population_generate_fn(owners: Sequence, training: bool) -> GenerateFn:
    """A ``generate_fn`` where episode ``i`` is played by member ``owners[i]``: members whose sampling
    settings agree answer in ONE generate, rows routed to their own adapters."""
    from ..training.batched import _groups  # members that can share one generate call

    def fn(active, prompts):
        out: list[torch.Tensor | None] = [None] * len(active)
        members = list({id(owners[i]): owners[i] for i in active}.values())
        for (_, sampling, pad_id, eos_id), group in _groups(members, training, lambda a: 1).items():
            blocks = [[j for j, i in enumerate(active) if owners[i] is m] for m in group]  # rows per member
            rows = [j for block in blocks for j in block]
            ids, mask = collate_prompts([prompts[j] for j in rows], pad_id)
            shared = group[0].shared
            if len(group) == 1:
                with shared.use(group[0].adapter_name("actor")) as model:
                    model.eval()
                    seqs = generate(model, ids, mask, sampling, pad_id, eos_id)
            else:
                with routed(shared, [m.adapter_name("actor") for m in group], [len(b) for b in blocks]) as model:
                    seqs = generate(model, ids, mask, sampling, pad_id, eos_id)
            for k, j in enumerate(rows):
                out[j] = seqs[k, ids.shape[1]:].cpu()
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


# --------------------------------------------------------------------------- #
# Stacking and unpacking experiences
# --------------------------------------------------------------------------- #
def _right_pad(rows: Sequence[torch.Tensor], value) -> torch.Tensor:
    rows = [torch.as_tensor(r) for r in rows]
    rows = [r.unsqueeze(0) if r.dim() == 1 else r for r in rows]
    width = max(r.shape[1] for r in rows)
    return torch.cat([torch.nn.functional.pad(r, (0, width - r.shape[1]), value=value) for r in rows])


def stack_episodes(episodes: Sequence[Episode], pad_token_id: int, num_turns: int | None = None) -> tuple:
    """``(input_ids, action_masks, turn_ids, rewards)`` of ``episodes``, right-padded (the 4-tuple
    PPO/REINFORCE ``learn`` take). ``rewards`` is ``[B, K]`` with ``K = num_turns`` or the longest."""
    k = num_turns or max(max(e.rewards.numel() for e in episodes), 1)
    rewards = torch.zeros(len(episodes), k)
    for i, e in enumerate(episodes):
        rewards[i, :e.rewards.numel()] = e.rewards[:k]
    return (_right_pad([e.input_ids for e in episodes], pad_token_id),
            _right_pad([e.action_mask for e in episodes], 0),
            _right_pad([e.turn_ids for e in episodes], -1), rewards)


def episode_batch(experiences, pad_token_id: int) -> EpisodeBatch:
    """Normalise what ``learn`` accepts into an :class:`EpisodeBatch`.

    * ``(input_ids, action_masks, turn_ids, rewards[B, K])``: multi-turn episodes;
    * ``(completion_ids, action_masks, rewards)``: single-turn samples as returned by ``get_action``
      (per-prompt lists or stacked tensors), rewards ``[P, G]`` or ``[B]``; every action token is
      turn 0, so the reward counts once per sample.
    """
    if len(experiences) == 4:
        ids, masks, turn_ids, rewards = experiences
        ids, masks = _stack(ids, pad_token_id), _stack(masks, 0)
        turn_ids = _stack(turn_ids, -1).long()
        rewards = torch.as_tensor(rewards, dtype=torch.float32)
        if rewards.dim() == 1:
            rewards = rewards.unsqueeze(1)
    elif len(experiences) == 3:
        ids, masks, rewards = experiences
        ids, masks = _stack(ids, pad_token_id), _stack(masks, 0)
        rewards = torch.as_tensor(rewards, dtype=torch.float32).reshape(-1, 1)
        turn_ids = torch.where(masks.bool(), 0, -1).long()
    else:
        raise ValueError("experiences must be (ids, action_masks, rewards) or (ids, action_masks, turn_ids, rewards)")
    if not (ids.shape[0] == masks.shape[0] == turn_ids.shape[0] == rewards.shape[0]):
        raise ValueError(f"batch sizes differ: ids {tuple(ids.shape)}, masks {tuple(masks.shape)}, "
                         f"turn_ids {tuple(turn_ids.shape)}, rewards {tuple(rewards.shape)}")
    if masks.shape != (ids.shape[0], ids.shape[1] - 1) or turn_ids.shape != masks.shape:
        raise ValueError(f"action_masks/turn_ids must be [B, L-1] for ids {tuple(ids.shape)}, got "
                         f"{tuple(masks.shape)} / {tuple(turn_ids.shape)}")
    if turn_ids.numel() and int(turn_ids.max()) >= rewards.shape[1]:
        raise ValueError(f"turn id {int(turn_ids.max())} has no reward column (rewards {tuple(rewards.shape)})")
    turn_ids = torch.where(masks.bool(), turn_ids, torch.full_like(turn_ids, -1))
    return EpisodeBatch(ids, _attention_from_sequences(ids, pad_token_id), masks.long(), turn_ids, rewards)


# --------------------------------------------------------------------------- #
# Token-level helpers: action tokens packed to the left, so per-token recursions
# (GAE, discounted returns) run over consecutive actions only.
# --------------------------------------------------------------------------- #
def pack_actions(x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x[b]`` at the action positions of row ``b``, moved to the front: returns
    ``(packed [B, N], packed_mask [B, N], index [B, N])`` with ``N`` the most actions in a row."""
    valid = mask.bool()
    n = max(int(valid.sum(1).max()), 1) if valid.numel() else 1
    # stable sort puts the action positions first, in order
    index = torch.sort((~valid).to(torch.int8), dim=1, stable=True).indices[:, :n]
    packed_mask = torch.gather(valid, 1, index)
    return torch.gather(x, 1, index), packed_mask, index


def unpack_actions(packed: torch.Tensor, packed_mask: torch.Tensor, index: torch.Tensor, width: int) -> torch.Tensor:
    """Inverse of :func:`pack_actions`: ``[B, width]`` with the packed values back in place, 0 elsewhere."""
    out = torch.zeros(packed.shape[0], width, dtype=packed.dtype, device=packed.device)
    return out.scatter(1, index, torch.where(packed_mask, packed, torch.zeros_like(packed)))


def last_token_of_turn(turn_ids: torch.Tensor, num_turns: int) -> torch.Tensor:
    """``[B, T]`` bool: the last token of each turn (where a token-level turn reward is placed)."""
    positions = torch.arange(turn_ids.shape[1], device=turn_ids.device).expand_as(turn_ids)
    out = torch.zeros_like(turn_ids, dtype=torch.bool)
    for k in range(num_turns):
        is_k = turn_ids == k
        last = torch.where(is_k, positions, torch.full_like(positions, -1)).amax(1)
        out |= is_k & (positions == last.unsqueeze(1))
    return out


# --------------------------------------------------------------------------- #
# What LLMPPO and LLMREINFORCE share
# --------------------------------------------------------------------------- #
class EpisodeAgent(LLMAgent):
    """Base of the agents that learn from whole episodes (LLMPPO, LLMREINFORCE): sampling and the
    population constructor are GRPO's (``group_size`` samples per prompt, 1 by default), and
    :meth:`test` works on a :class:`~evollm.envs.reasoning.ReasoningGym` or a multi-turn wrapper."""

    population = classmethod(GRPO.population.__func__)
    get_action = GRPO.get_action
    rollout = GRPO.rollout

    def test(self, env, loop: int = 1) -> float:
        """Fitness, appended to ``self.fitness``: on a ReasoningGym the mean reward on its fixed test set;
        on a :class:`~evollm.envs.multiturn.TokenObservationWrapper` the mean greedy return over ``loop``
        episodes seeded ``0..loop-1``."""
        if hasattr(env, "test_prompts"):
            from ..training.batched import evaluate_population
            return evaluate_population([self], env)[0]
        returns = []
        for seed in range(loop):
            returns += [e.episode_return for e in collect_episodes([self], [env], [seed], training=False)[self.index]]
        fitness = sum(returns) / len(returns)
        self.fitness.append(fitness)
        return fitness

    def _forward_logits(self, model, ids: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """``[B, L-1, V]`` next-token logits at the sampling temperature (with gradients)."""
        logits = model(input_ids=ids, attention_mask=attn, position_ids=position_ids_from_mask(attn),
                       use_cache=False).logits[:, :-1]
        return logits / self.config.temperature if self.config.temperature != 1.0 else logits
