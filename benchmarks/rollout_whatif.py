"""What-if for the 8-vs-1 rollout step: two fixes tried IN THIS PROCESS ONLY (monkeypatches; the
library is not changed), timed against the code as it is, interleaved.

* ``cheap routed()``: enter the routing context by flipping ``_disable_adapters`` on the routed LoRA
  layers only, instead of ``PeftModel.disable_adapter()`` (which calls ``get_model_status()`` and
  walks every module twice) and an unconditional ``model.eval()`` / ``model.train()`` walk.
* ``inverse-CDF sampling``: ``torch.multinomial(probs, 1)`` (an exponential draw per vocabulary entry)
  replaced by one uniform per row + ``cumsum`` + ``searchsorted`` (same distribution).

Usage: ``python benchmarks/rollout_whatif.py [--threads 2] [--reps 15]``
Writes ``benchmarks/results/rollout_whatif.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rollout_speed import build  # noqa: E402  (same model, members and data as the speed benchmark)

from evollm.adapters import routing  # noqa: E402
from evollm.envs.reasoning import ReasoningGym  # noqa: E402
from evollm.tasks import ARITHMETIC_TEMPLATE, exact_match_reward  # noqa: E402
from evollm.rollout import population as batched  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
ORIGINAL_ROUTED, ORIGINAL_MULTINOMIAL = batched.routed, torch.multinomial


@contextlib.contextmanager
def cheap_routed(shared, names, counts, differentiable=False):
    """``routing.routed`` for generation, entered by flag flips on the routed layers only."""
    if differentiable:
        raise NotImplementedError("what-if covers generation only")
    router = routing._Router(shared, names, counts, differentiable)
    model = shared.model
    handles = [m.register_forward_hook(router.hook) for m in router.layers]
    flags = [(m, m._disable_adapters) for m in router.layers]
    was_training = model.training
    if was_training:
        model.eval()
    try:
        for m, _ in flags:
            m._disable_adapters = True  # PEFT computes the base output only; the hook adds the routed update
        yield model
    finally:
        for m, flag in flags:
            m._disable_adapters = flag
        for h in handles:
            h.remove()
        if was_training:
            model.train()


def inverse_cdf_multinomial(probs, num_samples=1, replacement=False, generator=None):
    if num_samples != 1:
        return ORIGINAL_MULTINOMIAL(probs, num_samples, replacement, generator=generator)
    u = torch.rand(probs.shape[0], 1, generator=generator, device=probs.device) * probs.sum(-1, keepdim=True)
    return torch.searchsorted(probs.cumsum(-1), u).clamp_(max=probs.shape[-1] - 1)


VARIANTS = {"as is": (False, False), "cheap routed()": (True, False), "inverse-CDF sampling": (False, True),
            "both": (True, True)}


def use_variant(route: bool, sample: bool) -> None:
    batched.routed = cheap_routed if route else ORIGINAL_ROUTED
    torch.multinomial = inverse_cdf_multinomial if sample else ORIGINAL_MULTINOMIAL


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--members", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(RESULTS / "rollout_whatif.json"))
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    pop, tok, train, test = build(args.members, 8, 5, args.seed)
    env = ReasoningGym(train, test, tok, exact_match_reward, ARITHMETIC_TEMPLATE, data_batch_size_per_gpu=args.prompts,
                       seed=args.seed)
    prompts = env.reset()
    times = {(v, w): [] for v in VARIANTS for w in ("one", "batched")}
    loads = []
    for rep in range(args.warmup + args.reps):
        for variant, flags in VARIANTS.items():
            use_variant(*flags)
            for who, members in (("one", pop[:1]), ("batched", pop)):
                torch.manual_seed(rep)
                t0 = time.perf_counter()
                batched.generate_population(members, prompts)
                if rep >= args.warmup:
                    times[(variant, who)].append((time.perf_counter() - t0) * 1e3)
        loads.append(os.getloadavg()[0])
    use_variant(False, False)

    rows = []
    for variant in VARIANTS:
        one, many = (statistics.median(times[(variant, w)]) for w in ("one", "batched"))
        rows.append({"variant": variant, "one_ms": one, "batched_ms": many, "ratio": many / one})
    print(f"\nWhat-if, {args.members} members x {args.prompts} prompts x group 8, {args.threads} threads, median wall ms "
          f"of {args.reps}, load avg {min(loads):.2f}-{max(loads):.2f}\n")
    print(f"| variant | 1 member (ms) | {args.members} batched (ms) | ratio |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['variant']} | {r['one_ms']:.1f} | {r['batched_ms']:.1f} | {r['ratio']:.2f} |")
    result = {"benchmark": "rollout_whatif", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "torch": torch.__version__, "settings": vars(args), "loadavg_1min": [min(loads), max(loads)],
              "rows": rows, "all_ms": {f"{v}|{w}": t for (v, w), t in times.items()}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
