"""Partial supervised warm start of the tiny model on a multi-turn game, cached on disk.

The teacher policies of :mod:`evollm.tasks.games` are deliberately imperfect, so RL has
room to improve:

* ``guess_number``: each guess is the midpoint of the possible range only 30 % of the
  time, otherwise the lowest possible number, so the imitating model's *most likely* guess
  is the worse strategy (linear search wins ~25 % of games in 4 turns, binary search
  ~94 %).  RL has to move probability mass to binary search, with the win at the end of
  the episode as the only reward.
* ``chain_calc``: subtractions are done as additions 60 % of the time, so the greedy
  model gets most subtractions wrong (and the episode ends at the first wrong answer).

Measured on 2 shared CPU cores (200 fixed episodes; greedy / one sample at temperature 1):

=============  ==========  =================  =================
task           build time  greedy success     sampled success
=============  ==========  =================  =================
guess_number   ~25 s       0.22               0.34
chain_calc     ~20-35 s    0.21               0.32
=============  ==========  =================  =================

Transcripts are produced by playing the teacher through
:class:`~evollm.envs.multiturn.TokenObservationWrapper`, so the warm start sees exactly
the token layout RL later trains on; the SFT loss is on the model's (assistant) tokens
only.  The build is deterministic for a recipe and cached like
:func:`evollm.recipes.warm_start.load_tiny_model`: safetensors weights + tokenizer under
``cache_dir/tiny-<task>-<hash>`` (the hash covers model config, task, teacher, SFT
settings and seed), written to a temporary folder and renamed into place.
"""

from __future__ import annotations

import math
import random
import time
from pathlib import Path
from typing import Any

import torch

from evollm.models.tiny import TINY_DEFAULTS, build_tiny_model
from evollm.models.tokenizer import build_tokenizer, tokenizer_fingerprint
from evollm.recipes.warm_start import default_cache_dir, load_or_build, recipe_hash
from evollm.rollout import SamplingConfig, model_generate_fn, play_episodes
from evollm.tasks.games import MULTITURN_TASKS, task_env_factory, task_settings

#: SFT settings of the warm start (full-parameter AdamW on the assistant tokens).
MULTITURN_SFT_DEFAULTS: dict[str, Any] = dict(episodes=3000, steps=250, lr=3e-3, batch_size=32)

#: Bump when the recipe changes in a way the hashed settings do not capture.
RECIPE_VERSION = 2


# --------------------------------------------------------------------------- #
# Teacher transcripts and SFT
# --------------------------------------------------------------------------- #
def teacher_transcripts(task: str, tokenizer, n: int, seed: int = 0) -> list[tuple[list[int], list[bool]]]:
    """``n`` teacher-played episodes as ``(token ids, is-model-token flags)``."""
    spec = task_settings(task)
    env = task_env_factory(task, tokenizer)()
    rng = random.Random(seed)
    out = []
    for i in range(n):
        env.reset(seed=seed * 1_000_003 + i)
        while not env.done:
            text = env.env.teacher_action(rng, **spec["teacher"])
            env.step(tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id])
        out.append((list(env.ids), list(env.is_action)))
    return out


def sft_on_transcripts(model, transcripts, pad_token_id: int, steps: int, lr: float, batch_size: int,
                       seed: int = 0, warmup_frac: float = 0.1) -> torch.nn.Module:
    """Full-parameter SFT with the loss on model tokens only; linear warm-up then cosine decay."""
    gen = torch.Generator().manual_seed(seed)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.98))
    warmup = max(1, int(warmup_frac * steps))
    model.train()
    for step in range(steps):
        scale = (step + 1) / warmup if step < warmup else 0.5 * (1 + math.cos(math.pi * (step - warmup)
                                                                               / max(1, steps - warmup)))
        for group in opt.param_groups:
            group["lr"] = lr * scale
        idx = torch.randint(len(transcripts), (batch_size,), generator=gen).tolist()
        width = max(len(transcripts[i][0]) for i in idx)
        ids = torch.full((batch_size, width), pad_token_id, dtype=torch.long)
        labels = torch.full((batch_size, width), -100, dtype=torch.long)
        mask = torch.zeros((batch_size, width), dtype=torch.long)
        for row, i in enumerate(idx):
            seq, flags = transcripts[i]
            ids[row, :len(seq)] = torch.tensor(seq)
            mask[row, :len(seq)] = 1
            labels[row, :len(seq)] = torch.where(torch.tensor(flags), torch.tensor(seq), -100)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
    model.eval()
    return model


@torch.no_grad()
def evaluate_game(model, tokenizer, task: str, n: int = 200, do_sample: bool = False, seed: int = 10**6,
                  temperature: float = 1.0) -> dict[str, float]:
    """Mean return and success rate of ``model`` over ``n`` seeded episodes (greedy by default)."""
    spec = task_settings(task)
    factory = task_env_factory(task, tokenizer)
    sampling = SamplingConfig(max_new_tokens=spec["max_output_tokens"], temperature=temperature,
                              do_sample=do_sample)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        episodes = play_episodes([factory() for _ in range(n)], [seed + i for i in range(n)],
                                 model_generate_fn(model, sampling, tokenizer.pad_token_id, tokenizer.eos_token_id))
    return {"mean_return": sum(e.episode_return for e in episodes) / n,
            "success": sum(e.success for e in episodes) / n}


# --------------------------------------------------------------------------- #
# Build and cache
# --------------------------------------------------------------------------- #
def _recipe(task: str, seed: int, sft: dict) -> dict:
    return dict(version=RECIPE_VERSION, model=TINY_DEFAULTS, task=task, spec=task_settings(task), sft=sft, seed=seed,
                tokenizer=tokenizer_fingerprint())


def sft_settings(task: str, sft: dict | None = None) -> dict[str, Any]:
    """SFT settings of a task: defaults, then the task's own, then ``sft``."""
    return {**MULTITURN_SFT_DEFAULTS, **task_settings(task).get("sft", {}), **(sft or {})}


def build_multiturn_warm_start(task: str, seed: int = 0, sft: dict | None = None):
    """Build (without caching) the warm-started model of ``task``; returns ``(model, tokenizer)``.

    The SFT runs on ONE torch thread (restored afterwards): the tiny model's matrices are too small
    to gain from more, and on shared cores two threads measured ~10x slower."""
    sft = sft_settings(task, sft)
    tokenizer = build_tokenizer()
    model = build_tiny_model(tokenizer, seed=seed)
    transcripts = teacher_transcripts(task, tokenizer, sft["episodes"], seed=seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        sft_on_transcripts(model, transcripts, tokenizer.pad_token_id, sft["steps"], sft["lr"], sft["batch_size"],
                           seed)
    finally:
        torch.set_num_threads(threads)
    return model, tokenizer


def load_tiny_multiturn_model(task: str = "guess_number", warm_start: bool = True,
                              cache_dir: str | Path | None = None, seed: int = 0,
                              device: str | torch.device = "cpu", sft: dict | None = None):
    """``(model, tokenizer)``: the tiny model warm-started on a multi-turn game.

    Args:
        task: ``"guess_number"`` or ``"chain_calc"`` (see :data:`MULTITURN_TASKS`).
        warm_start: False gives the random init (nothing is written).
        cache_dir: cache root; defaults to ``$EVOLLM_CACHE`` or ``~/.cache/evollm``.
        seed: seed of the init, transcripts and SFT.
        device: where to put the model.
        sft: overrides of the task's SFT settings (part of the recipe hash).
    """
    sft = sft_settings(task, sft)  # validates the task name too
    if not warm_start:
        tokenizer = build_tokenizer()
        return build_tiny_model(tokenizer, seed=seed).to(device), tokenizer
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = root / f"tiny-{task.replace('_', '-')}-{recipe_hash(_recipe(task, seed, sft))}"
    return load_or_build(target, lambda: build_multiturn_warm_start(task, seed=seed, sft=sft), device)


def _main() -> None:  # pragma: no cover - manual measurement helper
    """Build each task's warm start from scratch and print build time and greedy/sampled scores."""
    torch.set_num_threads(2)
    for task in MULTITURN_TASKS:
        t0 = time.time()
        model, tok = build_multiturn_warm_start(task)
        build_s = time.time() - t0
        greedy = evaluate_game(model, tok, task)
        sampled = evaluate_game(model, tok, task, do_sample=True)
        print(f"{task}: build {build_s:.1f}s greedy {greedy} sampled {sampled}")


if __name__ == "__main__":  # pragma: no cover
    _main()
