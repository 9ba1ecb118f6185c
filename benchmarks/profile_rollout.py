"""Where the time of one population rollout step goes: 1 member vs N members batched.

Four generate calls on the demo model and batch (see rollout_speed.py), interleaved over
repetitions, each split into: the prompt prefix forward (prefill, run once per prompt), the
decode forwards inside HF ``generate``, the routing hook (``evollm.adapters.routing._Router.hook``,
timed by wrapping it in this process only) and the rest (HF generate bookkeeping, logits
processors, sampling, stopping criteria, cache handling):

* ``one``      -- 1 member, PEFT's LoRA path (``generate_population(members[:1], ...)``)
* ``base``     -- the same rows with every adapter disabled (no LoRA at all)
* ``batched``  -- N members routed in ONE generate (``generate_population(members, ...)``)
* ``base_xN``  -- the same N-fold rows with every adapter disabled

``base_xN / base`` is what the N-fold batch costs the frozen model alone; ``batched - base_xN``
is what routing adds. With ``--torch-profile`` the top aten ops of ``one`` and ``batched`` follow;
``--overheads`` times the fixed costs around a step (entering ``routed()`` / ``SharedBase.use()``)
and two alternatives (inverse-CDF sampling instead of ``torch.multinomial``, eager attention).

Usage: ``python benchmarks/profile_rollout.py [--threads 1] [--reps 15] [--torch-profile] [--overheads]``
Writes ``benchmarks/results/profile_rollout.json``.
"""

from __future__ import annotations

import argparse
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
from evollm.rollout import collate_prompts, generate  # noqa: E402
from evollm.envs.reasoning import ReasoningGym  # noqa: E402
from evollm.tasks import ARITHMETIC_TEMPLATE, exact_match_reward  # noqa: E402
from evollm.rollout import generate_population  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


class Clock:
    """Accumulates forward times of the base LlamaForCausalLM (prefill vs decode) and of the routing hook.
    ``now``: ``time.process_time`` (CPU time of all threads; robust to other processes) or ``time.perf_counter``."""

    def __init__(self, llama: torch.nn.Module, now=time.process_time):
        self.now = now
        self.reset()
        llama.register_forward_pre_hook(self._pre, with_kwargs=True)
        llama.register_forward_hook(self._post, with_kwargs=True)
        original = routing._Router.hook

        def timed_hook(router, layer, args, output):
            t0 = self.now()
            out = original(router, layer, args, output)
            self.route += self.now() - t0
            return out

        routing._Router.hook = timed_hook

    def reset(self):
        self.prefill = self.decode = self.route = 0.0
        self.n_decode = 0
        self._t0 = None

    def _pre(self, module, args, kwargs):
        self._t0 = self.now()
        ids = kwargs.get("input_ids", args[0] if args else None)
        self._is_prefill = ids is not None and ids.shape[1] > 1

    def _post(self, module, args, kwargs, output):
        dt = self.now() - self._t0
        if self._is_prefill:
            self.prefill += dt
        else:
            self.decode += dt
            self.n_decode += 1


def base_generate(agent, prompts, copies: int):
    """The frozen base alone (every adapter disabled) on ``copies`` x the member batch."""
    ids, mask = collate_prompts(prompts, agent.pad_token_id)
    with agent.shared.reference() as model:
        return generate(model, ids.repeat(copies, 1), mask.repeat(copies, 1), agent.sampling_config(True, agent.config.group_size),
                        agent.pad_token_id, agent.eos_token_id)


def breakdown(pop, prompts, clock: Clock, reps: int, warmup: int) -> dict:
    n = len(pop)
    calls = {"one": lambda: generate_population(pop[:1], prompts),
             "base": lambda: base_generate(pop[0], prompts, 1),
             "batched": lambda: generate_population(pop, prompts),
             f"base_x{n}": lambda: base_generate(pop[0], prompts, n)}
    names = list(calls)
    rec = {k: {"total": [], "prefill": [], "decode": [], "route": [], "n_decode": []} for k in names}
    for rep in range(warmup + reps):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            torch.manual_seed(rep)
            clock.reset()
            t0 = clock.now()
            calls[name]()
            total = clock.now() - t0
            if rep >= warmup:
                r = rec[name]
                r["total"].append(total * 1e3)
                r["prefill"].append(clock.prefill * 1e3)
                r["decode"].append(clock.decode * 1e3)
                r["route"].append(clock.route * 1e3)
                r["n_decode"].append(clock.n_decode)
    out = {}
    for name, r in rec.items():
        med = {k: statistics.median(v) for k, v in r.items()}
        med["other"] = med["total"] - med["prefill"] - med["decode"]
        med["decode_per_step"] = med["decode"] / max(med["n_decode"], 1)
        out[name] = med
    return out


def median_ms(fn, now, reps: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = now()
        fn()
        times.append((now() - t0) * 1e3)
    return statistics.median(times)


def overheads(pop, prompts, now, reps: int) -> dict:
    """Fixed costs around the batched step, and two cheaper alternatives for sampling and attention."""
    shared, names = pop[0].shared, [a.adapter_name() for a in pop]
    n = len(pop)

    def enter_exit(ctx):
        with ctx():
            pass

    out = {"context_ms": {
        f"routed({n} adapters) enter+exit": median_ms(lambda: enter_exit(lambda: routing.routed(shared, names, [1] * n)),
                                                      now, reps),
        "PeftModel.disable_adapter() enter+exit": median_ms(lambda: enter_exit(shared.model.disable_adapter), now, reps),
        "SharedBase.use(one adapter) enter+exit": median_ms(lambda: enter_exit(lambda: shared.use(names[0])), now, reps),
    }}
    vocab = shared.model.get_output_embeddings().weight.shape[0]
    rows = len(prompts) * pop[0].config.group_size
    out["sampling_ms_per_token"] = {}
    for r in (rows, rows * n):
        probs = torch.softmax(torch.randn(r, vocab), -1)
        out["sampling_ms_per_token"][f"{r} rows"] = {
            "torch.multinomial": median_ms(lambda: torch.multinomial(probs, 1), now, reps * 5),
            "inverse CDF (cumsum + searchsorted)": median_ms(
                lambda: torch.searchsorted(probs.cumsum(-1), torch.rand(r, 1)).clamp_(max=vocab - 1), now, reps * 5)}
    llama = shared.model.get_base_model()
    out["attention_ms"] = {}
    for impl in ("sdpa", "eager"):
        llama.set_attn_implementation(impl)
        out["attention_ms"][impl] = {"one": median_ms(lambda: generate_population(pop[:1], prompts), now, reps),
                                     "batched": median_ms(lambda: generate_population(pop, prompts), now, reps)}
    llama.set_attn_implementation("sdpa")
    return out


def torch_profile(fn, rows: int = 12) -> str:
    fn()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--members", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=5)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--torch-profile", action="store_true")
    ap.add_argument("--overheads", action="store_true",
                    help="also time routed()/use() entry, multinomial vs inverse-CDF sampling, sdpa vs eager attention")
    ap.add_argument("--clock", choices=["cpu", "wall"], default="cpu",
                    help="cpu: process CPU time, robust to other processes on the machine (default); wall: perf_counter")
    ap.add_argument("--out", default=str(RESULTS / "profile_rollout.json"))
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    pop, tok, train, test = build(args.members, args.group_size, args.max_new_tokens, args.seed)
    env = ReasoningGym(train, test, tok, exact_match_reward, ARITHMETIC_TEMPLATE, data_batch_size_per_gpu=args.prompts,
                       seed=args.seed)
    prompts = env.reset()
    clock = Clock(pop[0].shared.model.get_base_model(), time.process_time if args.clock == "cpu" else time.perf_counter)
    load_before = os.getloadavg()
    res = breakdown(pop, prompts, clock, args.reps, args.warmup)
    load_after = os.getloadavg()

    print(f"\nOne rollout step, {args.prompts} prompts x group {args.group_size} per member, "
          f"{args.max_new_tokens} new tokens; median {args.clock} ms of {args.reps}, {args.threads} threads; load avg {load_before[0]:.2f} -> "
          f"{load_after[0]:.2f}\n")
    print("| call | rows | total | prefix prefill | decode forwards (n) | per decode step | routing hook | "
          "generate overhead + sampling |")
    print("|---|---|---|---|---|---|---|---|")
    rows = args.prompts * args.group_size
    for name, m in res.items():
        r = rows * (args.members if name.startswith(("batched", "base_x")) else 1)
        print(f"| {name} | {r} | {m['total']:.1f} | {m['prefill']:.1f} | {m['decode']:.1f} ({m['n_decode']:.0f}) | "
              f"{m['decode_per_step']:.1f} | {m['route']:.1f} | {m['other']:.1f} |")
    n = args.members
    print(f"\nbatched / one = {res['batched']['total'] / res['one']['total']:.2f}; "
          f"base_x{n} / base = {res[f'base_x{n}']['total'] / res['base']['total']:.2f}; "
          f"routing adds {res['batched']['total'] - res[f'base_x{n}']['total']:.1f} ms over base_x{n}")

    tables = {}
    if args.torch_profile:
        for name, fn in (("one", lambda: generate_population(pop[:1], prompts)),
                         ("batched", lambda: generate_population(pop, prompts))):
            torch.manual_seed(0)
            tables[name] = torch_profile(fn)
            print(f"\ntorch.profiler, {name}:\n{tables[name]}")

    extra = {}
    if args.overheads:
        extra = overheads(pop, prompts, clock.now, args.reps)
        print(f"\nFixed costs and alternatives (median {args.clock} ms):")
        for k, v in extra["context_ms"].items():
            print(f"- {k}: {v:.2f}")
        for r, v in extra["sampling_ms_per_token"].items():
            print(f"- sampling one token, {r}: " + ", ".join(f"{k} {t:.3f}" for k, t in v.items()))
        for impl, v in extra["attention_ms"].items():
            print(f"- attn_implementation={impl}: one {v['one']:.1f}, batched {v['batched']:.1f} "
                  f"(ratio {v['batched'] / v['one']:.2f})")

    result = {"benchmark": "profile_rollout", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "torch": torch.__version__, "settings": vars(args), "loadavg": [load_before, load_after],
              "median_ms": res, "overheads": extra, "torch_profiler": tables}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
