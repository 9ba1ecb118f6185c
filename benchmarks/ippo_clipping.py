"""IPPO with a clipped PPO update vs CoMLRL's on-policy update, at equal samples.

    python benchmarks/ippo_clipping.py --variant clipped --seed 0 --steps 30

One team of two agents on the relay-sum warm start, 30 updates x 32 episodes per agent (960 episodes)
for every variant; joint reward and joint success on the 200 fixed held-out rows, greedy.

* ``clipped``  : evollm's update: 2 epochs x 2 minibatches of 16, ratio clip 0.2, value clip 0.2.
* ``onpolicy`` : CoMLRL's on-policy IPPO: one gradient step per rollout on the whole buffer, so the
  ratio is always 1 and nothing is clipped (no importance ratio in effect).
* ``noclip``   : evollm's schedule (2 epochs x 2 minibatches) with clipping switched off
  (``clip_coef=None``, ``value_clip_range=None``): what clipping itself contributes.

Writes ``benchmarks/results/ippo_clipping_<variant>_s<seed>.json`` with wall and CPU time.
"""

import argparse
import json
import time
from pathlib import Path

import torch

VARIANTS = {
    "clipped": dict(ppo_epochs=2, mini_batch_size=16, clip_coef=0.2, value_clip_range=0.2),
    "onpolicy": dict(ppo_epochs=1, mini_batch_size=32, clip_coef=None, value_clip_range=None),
    "noclip": dict(ppo_epochs=2, mini_batch_size=16, clip_coef=None, value_clip_range=None),
}


def run(variant: str, seed: int, steps: int) -> dict:
    from evollm.adapters.shared import default_lora_config
    from evollm.algorithms.ippo import IPPOTeam
    from evollm.algorithms.ippo_rollout import evaluate_teams
    from evollm.recipes.coop_warm_start import load_tiny_coop_model
    from evollm.tasks.coop import relay_task
    from evollm.training.ippo import finetune_ippo

    model, tok = load_tiny_coop_model()
    task = relay_task(tok, seed=seed)
    team = IPPOTeam(model, tok, lora_config=default_lora_config(r=8), num_agents=2, num_turns=2, max_new_tokens=4,
                    actor_learning_rate=2e-3, critic_learning_rate=2e-3, rollout_buffer_size=32, seed=seed,
                    **VARIANTS[variant])
    before = evaluate_teams([team], task, record=False)
    t0, c0 = time.perf_counter(), time.process_time()
    _, pop = finetune_ippo([team], task, max_steps=steps, evaluation_interval=10, verbose=False, seed=seed)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    report = pop.report()
    return {"variant": variant, "seed": seed, "steps": steps, "episodes_per_agent": steps * 32, **VARIANTS[variant],
            "joint_reward_before": before[0][0], "success_before": before[1][0],
            "joint_reward": report["fitness"].tolist(), "success": report["success"].tolist(),
            "eval_steps": report["step"].tolist(), "wall_s": wall, "cpu_s": cpu,
            "load_avg": list(__import__("os").getloadavg())}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--variant", choices=sorted(VARIANTS), required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args()
    torch.set_num_threads(1)
    out = run(args.variant, args.seed, args.steps)
    path = Path(__file__).parent / "results" / f"ippo_clipping_{args.variant}_s{args.seed}.json"
    path.write_text(json.dumps(out, indent=1))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
