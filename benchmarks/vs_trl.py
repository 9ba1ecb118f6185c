"""evollm vs TRL on the same GRPO work, step by step, interleaved in one process.

TRL is an optional install; keep it in its own environment so it cannot change the shared packages::

    python -m venv --system-site-packages /path/venv-trl && /path/venv-trl/bin/pip install trl
    /path/venv-trl/bin/python benchmarks/vs_trl.py --steps 30

The work (the same for every arm): a 1M-parameter Llama built from a config (fp32, the tiny
character tokenizer), LoRA r=8 / alpha 16 on all 7 projections, 4 prompts x group 4 = 16
completions of 4 new tokens, temperature 1, beta 0.001, the ``grpo`` loss, lr 1e-4, clip 0.2,
max grad norm 1, one update per generation. Reward: the share of digits in the completion.

Arms, run one after the other inside TRL's own training loop (a callback runs the evollm arms after
each TRL step, so every step of every arm sees the same machine load):
- ``trl``: one ``GRPOTrainer`` step (generate, score, reference pass, learn);
- ``evollm``: one ``GRPO`` member's step (``get_action``, score, ``learn``);
- ``population``: 8 members on one shared base, every member samples and learns
  (``generate_population`` + ``GRPO.learn_population``).

Each step is timed with the main thread's CPU time (``time.thread_time``, 1 torch thread) and
wall time. Ratios are taken per step (a pair) and the median is reported. "rest" (the learn step) is a
step less its generation; TRL's generation (``_generate_and_score_completions``) includes its reference
pass, evollm's learn includes its own.

``--prompt chat`` is the realistic shape of a chat task: SmolLM2's chat template with a system prompt and
an arithmetic question (~120 tokens), e.g. 32-token completions in groups of 8::

    python benchmarks/vs_trl.py --model smollm2 --prompt chat --new-tokens 32 --group-size 8 \
        --prompts-per-step 1 --members 0 --steps 3 --warmup 1 --out benchmarks/results/vs_trl_chat.json

(TRL's learn step holds the activations of every prompt token of every completion: ~1.5 MiB per token on
SmolLM2 without checkpointing, ~1.8 GB per 8 rows at this shape.)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPTS = [f"{a}+{b}=" for a in range(10, 40) for b in range(3, 9)]
#: the chat shape: a system prompt and a question, through the model's chat template (~120 tokens on SmolLM2)
SYSTEM = ("You are a careful math tutor. Solve the user's arithmetic problem step by step. Show the intermediate "
          "results on separate lines, check each step, and keep the explanation short and precise. At the end, "
          "write the final answer on its own line in the form 'Answer: <number>'. Do not use any tools, do not "
          "repeat the question, and never guess: if a step is unclear, redo it before you continue.")
QUESTIONS = [f"What is {a} * {b} + {a + b} - {b}?" for a in range(11, 41) for b in range(12, 18)]
LORA = dict(r=8, lora_alpha=16, lora_dropout=0.0,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])


def build_model(tok, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=384, num_hidden_layers=5,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
                      tie_word_embeddings=True, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                      bos_token_id=tok.eos_token_id)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).float()
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    return model


def digit_share(text: str) -> float:
    return sum(ch.isdigit() for ch in text) / max(1, len(text))


def trl_reward(completions, **kwargs):
    return [digit_share(c if isinstance(c, str) else c[-1]["content"]) for c in completions]


def chat(question: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


class Clock:
    def __init__(self):
        self.cpu = time.thread_time()
        self.wall = time.perf_counter()

    def stop(self) -> tuple[float, float]:
        return time.thread_time() - self.cpu, time.perf_counter() - self.wall


def _ids(out) -> list[int]:
    """Token ids from ``apply_chat_template(tokenize=True)`` (a list, or a mapping in newer transformers)."""
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def model_factory(args):
    """``(tokenizer, make_model)`` for ``--model``: the 1M-parameter Llama, or SmolLM2-135M-Instruct."""
    if args.model == "smollm2":
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from smollm2_local import load_smollm2

        model, tok = load_smollm2()
        loaded = [model]  # the first arm takes the model loaded with the tokenizer (each load ~25 CPU s)
        return tok, lambda: loaded.pop() if loaded else load_smollm2()[0]
    from evollm.models.tokenizer import build_tokenizer

    tok = build_tokenizer()
    tok.padding_side = "left"
    return tok, lambda: build_model(tok)


def evollm_arms(tok, make_model, args):
    from peft import LoraConfig

    from evollm.algorithms.grpo import GRPO
    from evollm.rollout import generate_population

    kw = dict(pad_token_id=tok.pad_token_id, pad_token=tok.pad_token, eos_token_id=tok.eos_token_id,
              group_size=args.group_size, batch_size=args.group_size * args.prompts_per_step,
              max_output_tokens=args.new_tokens, lr=1e-4, beta=0.001, clip_coef=0.2,
              loss_type="grpo", max_grad_norm=1.0, temperature=1.0,
              lora_config=LoraConfig(task_type="CAUSAL_LM", **LORA))
    single = GRPO.population(1, make_model(), **kw)[0]
    pop = GRPO.population(args.members, make_model(), **kw) if args.members else []

    def score(completions, prompt_len):
        return torch.tensor([[digit_share(tok.decode(row[prompt_len:], skip_special_tokens=True)) for row in c]
                             for c in completions])

    def step_single(prompts, timings):
        clock = Clock()
        rollout = single.rollout(prompts)
        completions, masks = rollout.per_prompt()
        rewards = score(completions, rollout.prompt_len)
        gen = clock.stop()
        metrics = single.learn((completions, masks, rewards))
        timings.append((clock.stop(), gen))
        return metrics.get("shared_prompt")

    def step_population(prompts, timings):
        clock = Clock()
        rollouts = generate_population(pop, prompts)
        exps = []
        for m in pop:
            completions, masks = rollouts[m.index].per_prompt()
            exps.append((completions, masks, score(completions, rollouts[m.index].prompt_len)))
        gen = clock.stop()
        metrics = GRPO.learn_population(pop, exps)
        timings.append((clock.stop(), gen))
        return metrics[0].get("learn_path"), metrics[0].get("shared_prompt")

    return step_single, step_population


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--members", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--model", default="tiny", choices=["tiny", "smollm2"])
    parser.add_argument("--new-tokens", type=int, default=4)
    parser.add_argument("--prompt", default="arith", choices=["arith", "chat"],
                        help="arith: short arithmetic prompts; chat: system prompt + question via the chat template")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--prompts-per-step", type=int, default=4)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "vs_trl.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    import trl
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    tok, make_model = model_factory(args)
    step_single, step_population = evollm_arms(tok, make_model, args)
    if args.prompt == "chat":
        texts = QUESTIONS
        prompt_ids = {q: {"input_ids": _ids(tok.apply_chat_template(chat(q), add_generation_prompt=True, tokenize=True))}
                      for q in texts}
    else:
        texts = PROMPTS
        prompt_ids = {p: {"input_ids": tok(p, add_special_tokens=False)["input_ids"]} for p in PROMPTS}
    prompt_tokens = statistics.mean(len(v["input_ids"]) for v in prompt_ids.values())
    shared: list = []
    rows = {"trl": [], "evollm": [], "population": []} if args.members else {"trl": [], "evollm": []}
    gen_trl: list[tuple[float, float]] = []
    paths: set = set()
    threads: set = set()

    class Interleave(TrainerCallback):
        def __init__(self):
            self.clock = None

        def on_step_begin(self, a, state, control, **kw):
            self.clock = Clock()

        def on_step_end(self, a, state, control, **kw):
            threads.add(torch.get_num_threads())
            rows["trl"].append((self.clock.stop(), gen_trl[-1] if gen_trl else (0.0, 0.0)))
            batch = [prompt_ids[p] for p in trainer._last_prompts]
            order = [step_single, step_population] if state.global_step % 2 else [step_population, step_single]
            if not args.members:
                order = [step_single]
            for fn in order:
                if fn is step_single:
                    shared.append(fn(batch, rows["evollm"]))
                else:
                    path, used = fn(batch, rows["population"])
                    paths.add(path)
                    shared.append(used)

    rows_per_step = args.group_size * args.prompts_per_step
    cfg = GRPOConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=rows_per_step,
                     num_generations=args.group_size,
                     max_completion_length=args.new_tokens, learning_rate=1e-4, beta=0.001, epsilon=0.2, loss_type="grpo",
                     scale_rewards="group", max_grad_norm=1.0, temperature=1.0, num_iterations=1,
                     max_steps=args.steps + args.warmup, logging_steps=10**6, save_strategy="no",
                     report_to="none", use_cpu=True, disable_tqdm=True, seed=0, dataloader_num_workers=0,
                     gradient_accumulation_steps=1, lr_scheduler_type="constant", warmup_steps=0,
                     weight_decay=0.0, bf16=False, fp16=False, gradient_checkpointing=False)
    ds = Dataset.from_dict({"prompt": [chat(q) for q in texts] if args.prompt == "chat" else texts})
    trainer = GRPOTrainer(model=make_model(), reward_funcs=trl_reward, args=cfg, train_dataset=ds,
                          processing_class=tok, peft_config=LoraConfig(task_type="CAUSAL_LM", **LORA),
                          callbacks=[Interleave()])
    original = trainer._generate_and_score_completions

    def timed_generate(inputs):
        trainer._last_prompts = [x["prompt"] if isinstance(x["prompt"], str) else x["prompt"][-1]["content"]
                                 for x in inputs][::args.group_size]
        clock = Clock()
        out = original(inputs)
        gen_trl.append(clock.stop())
        return out

    trainer._generate_and_score_completions = timed_generate
    trainer.train()

    def summary(key, idx=0):
        steps = rows[key][args.warmup:]
        return {"cpu_s": statistics.median(s[idx][0] for s in steps),
                "wall_s": statistics.median(s[idx][1] for s in steps)}

    def ratios(key, idx=0, clock=0):
        return [a[idx][clock] / b[idx][clock] for a, b in zip(rows[key][args.warmup:], rows["trl"][args.warmup:])]

    result = {
        "settings": vars(args) | {"trl": trl.__version__, "torch": torch.__version__,
                                  "params": sum(p.numel() for p in trainer.model.get_base_model().parameters()
                                                if p.requires_grad is False)},
        "load_average": list(__import__("os").getloadavg()),
        "population_learn_path": sorted(p for p in paths if p),
        "prompt_tokens_mean": prompt_tokens,
        "evollm_shared_prompt": sorted({x for x in shared if x is not None}),
        "torch_threads_seen": sorted(threads),
        "step": {k: summary(k) for k in rows},
        "generation": {k: summary(k, 1) for k in rows},
    }
    for key in [k for k in rows if k != "trl"]:
        for clock, name in ((0, "cpu"), (1, "wall")):
            r = ratios(key, 0, clock)
            result[f"{key}_vs_trl_{name}"] = {"median": statistics.median(r), "pairs": r}
        g = ratios(key, 1, 0)
        result[f"{key}_vs_trl_generation_cpu"] = statistics.median(g)
        rest = [(a[0][0] - a[1][0]) / (b[0][0] - b[1][0])
                for a, b in zip(rows[key][args.warmup:], rows["trl"][args.warmup:])]
        result[f"{key}_vs_trl_rest_cpu"] = statistics.median(rest)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print("| arm | CPU s/step | wall s/step | CPU ratio vs TRL (median of pairs) | wall ratio | "
          "generation CPU ratio | rest CPU ratio |")
    print("|---|---|---|---|---|---|---|")
    print(f"| TRL GRPOTrainer, 1 agent | {result['step']['trl']['cpu_s']:.4f} | "
          f"{result['step']['trl']['wall_s']:.4f} | 1 | 1 | 1 | 1 |")
    for key, label in [(k, v) for k, v in (("evollm", "evollm GRPO, 1 agent"),
                                            ("population", f"evollm, {args.members} members")) if k in rows]:
        print(f"| {label} | {result['step'][key]['cpu_s']:.4f} | {result['step'][key]['wall_s']:.4f} | "
              f"**{result[f'{key}_vs_trl_cpu']['median']:.2f}** | {result[f'{key}_vs_trl_wall']['median']:.2f} | "
              f"{result[f'{key}_vs_trl_generation_cpu']:.2f} | {result[f'{key}_vs_trl_rest_cpu']:.2f} |")
    print(f"load average {result['load_average']}, population learn path {result['population_learn_path']}, "
          f"prompt tokens {prompt_tokens:.0f}, shared_prompt {result['evollm_shared_prompt']}")
    return result


if __name__ == "__main__":
    main()
