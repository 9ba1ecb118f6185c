"""DAPO's dynamic sampling: keep only prompt groups whose rewards differ, refill from further prompts.

A group whose completions all get the same reward has zero advantage everywhere and gives no policy
gradient. Members with ``config.dynamic_sampling`` drop such groups and sample further prompt batches
(at most ``config.dynamic_sampling_max_batches``) until they have as many informative groups as the
step started with; a member that cannot fill its batch learns from the groups it has.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from .. import functional as F


def _informative(completions, masks, rewards, group_size: int):
    rewards = torch.as_tensor(rewards, dtype=torch.float32).reshape(-1, group_size)
    keep = F.informative_groups(rewards.reshape(-1), group_size).tolist()
    return ([c for c, k in zip(completions, keep) if k], [m for m, k in zip(masks, keep) if k],
            [r for r, k in zip(rewards, keep) if k])


def refill(agents: Sequence, experiences: list, env, generate: Callable) -> list:
    """``experiences[i] = (completions, masks, rewards)`` per prompt for ``agents[i]``; returns them with
    the uninformative groups of dynamic-sampling members replaced by informative ones from new prompts.
    ``generate(agents, prompts) -> {index: Rollout}`` samples completions; the env advances one batch per
    extra generation."""
    want = [i for i, a in enumerate(agents) if getattr(a.config, "dynamic_sampling", False)]
    if not want:
        return experiences
    original, experiences = list(experiences), list(experiences)
    target = {}
    for i in want:
        completions, masks, rewards = experiences[i]
        target[i] = len(completions)
        experiences[i] = _informative(completions, masks, rewards, agents[i].config.group_size)
    for _ in range(max(agents[i].config.dynamic_sampling_max_batches for i in want)):
        short = [i for i in want if len(experiences[i][0]) < target[i]
                 and _ < agents[i].config.dynamic_sampling_max_batches]
        if not short:
            break
        prompts = env.reset()
        rollouts = generate([agents[i] for i in short], prompts)
        env.step_to_next_batch()
        for i in short:
            completions, masks = rollouts[agents[i].index].per_prompt()
            extra = _informative(completions, masks, env.score(completions, prompts), agents[i].config.group_size)
            experiences[i] = tuple(have + new for have, new in zip(experiences[i], extra))
    for i in want:
        completions, masks, rewards = (list(part[:target[i]]) for part in experiences[i])
        # nothing informative at all: keep the batch; the update drops every group and is skipped
        experiences[i] = (completions, masks, torch.stack(rewards)) if rewards else original[i]
    return experiences
