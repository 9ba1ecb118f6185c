"""Partial supervised warm start of the tiny model on the cooperative relay-sum task, cached on disk.

The teacher (:func:`evollm.tasks.coop.relay_teacher`) adds correctly whatever it is shown but relays
its own number with the digits swapped most of the time, so the imitating model's most likely
relay is the wrong one and its greedy joint success starts low. Transcripts are played through the
same team rollout RL uses (:func:`evollm.envs.team.play_rounds`: one conversation
per agent, both agents' replies of a round shown to the other in the next), so the warm start sees
exactly the token layout RL trains on; the SFT loss is on the agents' own tokens only.

Cached like :func:`evollm.recipes.warm_start.load_tiny_model`: safetensors weights + tokenizer under
``cache_dir/tiny-coop-<hash>``, the hash covering model config, task, teacher, SFT settings and seed.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import torch

from evollm.recipes.multiturn_warm_start import sft_on_transcripts
from evollm.models.tiny import TINY_DEFAULTS, build_tiny_model
from evollm.models.tokenizer import build_tokenizer, tokenizer_fingerprint
from evollm.recipes.warm_start import default_cache_dir, load_or_build, recipe_hash
from evollm.tasks.coop import RELAY_MAX_NEW_TOKENS, RELAY_TASK, relay_task, relay_teacher

#: Settings of the relay-sum warm start: task, teacher, SFT.
COOP_DEFAULTS: dict[str, Any] = dict(task=dict(RELAY_TASK), relay_prob=0.35, episodes=4000, steps=700,
                                     lr=3e-3, batch_size=32, max_new_tokens=RELAY_MAX_NEW_TOKENS)

#: Bump when the recipe changes in a way the hashed settings do not capture.
RECIPE_VERSION = 1


def teacher_transcripts(tokenizer, n: int, seed: int = 0, relay_prob: float = 0.35):
    """``n`` teacher-played episodes, both agents' conversations, as ``(ids, is-model-token flags)``."""
    from evollm.envs.team import play_rounds, team_seats

    task = relay_task(tokenizer, seed=seed)
    rng = random.Random(seed)
    rows = task.next_rows(n)
    episodes, seats = team_seats(task, rows, 0, 2)

    def teacher(active, prompts):
        out = []
        for i in active:
            ep, j, _ = seats[i]
            text = relay_teacher(ep.row, j, ep.history[:-1], rng, relay_prob)
            out.append(torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]))
        return out

    play_rounds(task, episodes, seats, teacher)
    return [(list(w.ids), list(w.is_action)) for _, _, w in seats]


def build_coop_warm_start(seed: int = 0, settings: dict | None = None):
    """Build (without caching) the warm-started model; returns ``(model, tokenizer)``. One torch thread
    (the tiny model gains nothing from more; restored afterwards)."""
    s = {**COOP_DEFAULTS, **(settings or {})}
    tokenizer = build_tokenizer()
    model = build_tiny_model(tokenizer, seed=seed)
    transcripts = teacher_transcripts(tokenizer, s["episodes"], seed=seed, relay_prob=s["relay_prob"])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        sft_on_transcripts(model, transcripts, tokenizer.pad_token_id, s["steps"], s["lr"], s["batch_size"], seed)
    finally:
        torch.set_num_threads(threads)
    return model, tokenizer


def load_tiny_coop_model(warm_start: bool = True, cache_dir: str | Path | None = None, seed: int = 0,
                         device: str | torch.device = "cpu", settings: dict | None = None):
    """``(model, tokenizer)``: the tiny model warm-started on relay sum (built once, then from the cache)."""
    s = {**COOP_DEFAULTS, **(settings or {})}
    if not warm_start:
        tokenizer = build_tokenizer()
        return build_tiny_model(tokenizer, seed=seed).to(device), tokenizer
    recipe = dict(version=RECIPE_VERSION, model=TINY_DEFAULTS, settings=s, seed=seed, tokenizer=tokenizer_fingerprint())
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return load_or_build(root / f"tiny-coop-{recipe_hash(recipe)}", lambda: build_coop_warm_start(seed, s), device)


def _main() -> None:  # pragma: no cover - manual measurement helper
    """Build the warm start from scratch and print build time and greedy joint success of one team."""
    from evollm.algorithms.ippo import IPPOTeam
    from evollm.algorithms.ippo_rollout import evaluate_teams

    torch.set_num_threads(1)
    t0 = time.time()
    model, tok = build_coop_warm_start()
    build_s = time.time() - t0
    team = IPPOTeam(model, tok, num_agents=2, num_turns=2, max_new_tokens=COOP_DEFAULTS["max_new_tokens"])
    fitness, success = evaluate_teams([team], relay_task(tok), record=False)
    print(f"build {build_s:.1f}s greedy joint reward {fitness[0]:.3f} joint success {success[0]:.3f}")


if __name__ == "__main__":  # pragma: no cover
    _main()
