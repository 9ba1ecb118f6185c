"""Turn-level LLM PPO on a multi-turn text game (guess-the-number with higher/lower feedback).

    python examples/ppo_multiturn.py [configs/ppo_multiturn.yaml]

Same as ``evollm train configs/ppo_multiturn.yaml``: a population of 4 LLMPPO members (actor and
critic LoRA adapters + value head each, all on one shared tiny base) plays the game; fitness is the
mean return over a fixed set of seeded episodes, identical for every member.
"""

import sys

from evollm.recipes.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", sys.argv[1] if len(sys.argv) > 1 else "configs/ppo_multiturn.yaml"]))
