"""AgileRL's "LLM Fine-Tuning with HPO" tutorial (GRPO + evolutionary HPO on the Countdown task), run
on evollm with only its imports changed.

    python examples/agilerl_grpo_tutorial.py          # the tutorial's sizes, on a tiny model
    python examples/agilerl_grpo_tutorial.py --tiny   # a few seconds (what tests/agilerl_compat runs)

Everything below the SETUP block is the tutorial's code as published (docs/tutorials/llm_finetuning/
grpo_hpo.rst), except:

* the imports (``agilerl.*`` -> ``evollm``);
* the size, to fit a 2-core CPU machine: ``MODEL_PATH`` is evollm's tiny Llama saved to a folder (not
  Qwen2.5-1.5B), and ``make_dataset`` draws Countdown-style rows locally (no network) instead of
  loading ``Jiayi-Pan/Countdown-Tasks-3to4``; ``--tiny`` also shrinks the population, the batch and
  the evaluation/evolution interval (``SIZE``);
* three names the tutorial uses without defining them: ``create_model``, ``device`` and
  ``conversation_template`` (its template is named ``conversation``).

Every AgileRL keyword of the tutorial is accepted; the ones that ask for something evollm does
differently (``use_vllm=True`` without vLLM installed, ``accelerator=``, ``wb=True``) print a
one-time note. See README "Coming from AgileRL".
"""

# --------------------------------------------------------------------------- imports (changed)
import re
import sys
import tempfile

import numpy as np
import torch
import yaml  # noqa: F401  (imported by the tutorial)
from accelerate import Accelerator
from datasets import Dataset as HFDataset
from peft import LoraConfig, get_peft_model  # noqa: F401  (imported by the tutorial)
from torch.utils.data import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

from evollm import GRPO, VLLMConfig  # agilerl.algorithms, agilerl.utils.algo_utils
from evollm import HyperparameterConfig, RLParameter  # agilerl.algorithms.core.registry
from evollm import Mutations  # agilerl.hpo.mutation
from evollm import TournamentSelection  # agilerl.hpo.tournament
from evollm import finetune_llm_reasoning  # agilerl.training.llm
from evollm import ReasoningGym  # agilerl.llm_envs

# --------------------------------------------------------------------------- SETUP (size, gaps)
TINY = "--tiny" in sys.argv
#: the tutorial's sizes, and the ones the test runs
SIZE = dict(rows=12, pop=2, batch=2, interval=2) if TINY else dict(rows=2000, pop=4, batch=10, interval=10)
torch.set_num_threads(1)  # the tiny model's ops are too small to gain from more threads


def _save_tiny_model() -> str:
    """evollm's tiny Llama (random init) + its character tokenizer, saved as a HF folder: the model
    stand-in for ``Qwen/Qwen2.5-1.5B``. Room for the tutorial's ``max_model_len`` of 1024."""
    from evollm.models.tiny import build_tiny_model
    from evollm.models.tokenizer import build_tokenizer

    path = tempfile.mkdtemp(prefix="tiny-llama-")
    tokenizer = build_tokenizer()
    build_tiny_model(tokenizer, seed=0, max_position_embeddings=1024).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def load_dataset(name, split="train"):
    """Countdown-style rows drawn locally (the tutorial loads ``Jiayi-Pan/Countdown-Tasks-3to4``): three
    or four numbers and a target reachable with + and -."""
    rng = np.random.default_rng(0)
    nums, targets = [], []
    for _ in range(SIZE["rows"]):
        row = [int(x) for x in rng.integers(1, 20, size=int(rng.integers(3, 5)))]
        signs = rng.choice([-1, 1], size=len(row) - 1)
        nums.append(row)
        targets.append(int(row[0] + sum(s * x for s, x in zip(signs, row[1:]))))
    return HFDataset.from_dict({"nums": nums, "target": targets})


def create_model(pretrained_model_name_or_path):
    return AutoModelForCausalLM.from_pretrained(pretrained_model_name_or_path)


device = "cpu"

# --------------------------------------------------------------------------- the tutorial
mut_p = {
    "NO_MUT": 0.1,
    "RL_HP_MUT": 0.6,
    "MUT_SD": 0.1,
    "RAND_SEED": 42,
    "MIN_LR": 0.0000001,
    "MAX_LR": 0.00001,
    "MIN_BETA": 0.0001,
    "MAX_BETA": 0.01,
    "MIN_GROUP_SIZE": 4,
    "MAX_GROUP_SIZE": 12,
}
hp_config = HyperparameterConfig(
    beta=RLParameter(min=mut_p["MIN_BETA"], max=mut_p["MAX_BETA"]),
    lr=RLParameter(min=mut_p["MIN_LR"], max=mut_p["MAX_LR"]),
    group_size=RLParameter(min=mut_p["MIN_GROUP_SIZE"], max=mut_p["MAX_GROUP_SIZE"], dtype=int),
)
# Algorithm hyperparameters
init_hp = {
    "hp_config": hp_config,
    "batch_size": 16,
    "beta": 0.001,
    "lr": 5e-6,
    "clip_coef": 0.2,
    "max_grad_norm": 0.1,
    "update_epochs": 1,
    "group_size": 8,
    "temperature": 0.9,
    "max_model_len": 1024,
    "use_vllm": True,
    "vllm_config": VLLMConfig(
        sleep_mode=False,
        max_num_seqs=4,
    ),
    "lora_config": LoraConfig(
        r=16,
        lora_alpha=64,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        lora_dropout=0.05,
        bias="none",
    ),
}

MODEL_PATH = _save_tiny_model()  # the tutorial: "Qwen/Qwen2.5-1.5B"
DATASET = "Jiayi-Pan/Countdown-Tasks-3to4"


def make_dataset(dataset_name: str) -> tuple[Dataset, Dataset]:
    raw_dataset = (
        load_dataset(dataset_name, split="train").shuffle(seed=42).select(range(SIZE["rows"]))
    )
    raw_dataset = raw_dataset.rename_column("target", "answer")
    raw_dataset = raw_dataset.rename_column("nums", "question")
    train_test_split = raw_dataset.train_test_split(test_size=0.1)
    train_dataset = train_test_split["train"]
    test_dataset = train_test_split["test"]
    return train_dataset, test_dataset


# Instantiate the model and the associated tokenizer
model = create_model(pretrained_model_name_or_path=MODEL_PATH)
tokenizer = AutoTokenizer.from_pretrained(MODEL_PATH)
tokenizer.pad_token_id = tokenizer.eos_token_id
train_dataset, test_dataset = make_dataset(DATASET)


def format_reward_func(completions, target, **kwargs):
    rewards = []
    for completion, gt in zip(completions, target):
        try:
            # add synthetic <think> as its already part of the prompt and prefilled for the assistant to more easily match the regex
            completion = "<think>" + completion
            regex = r"^<think>([^<]*(?:<(?!/?think>)[^<]*)*)<\/think>\n<answer>([\s\S]*?)<\/answer>$"
            match = re.search(regex, completion, re.DOTALL)
            if match is None or len(match.groups()) != 2:
                rewards.append(0.0)
            else:
                rewards.append(1.0)
        except Exception:
            rewards.append(0.0)
    return rewards


def equation_reward_func(completions, target, nums, **kwargs):
    rewards = []
    for completion, gt, numbers in zip(completions, target, nums):
        try:
            # add synthetic <think> as its already part of the prompt and prefilled for the assistant to more easily match the regex
            completion = "<think>" + completion
            answer_tags = re.findall(r"<answer>([\s\S]*?)<\/answer>", completion)
            if len(answer_tags) != 1:
                rewards.append(0.0)
                continue
            equation = answer_tags[0].strip()
            used_numbers = [int(n) for n in re.findall(r"\d+", equation)]
            if sorted(used_numbers) != sorted(numbers.flatten().tolist()):
                rewards.append(0.0)
                continue
            allowed_pattern = r"^[\d+\-*/().\s]+$"
            if not re.match(allowed_pattern, equation):
                rewards.append(0.0)
                continue
            result = eval(equation, {"__builtins__": None}, {})
            if abs(float(result) - float(gt)) < 1e-5:
                rewards.append(1.0)
            else:
                rewards.append(0.0)
        except Exception:
            rewards.append(0.0)
    return rewards


def combined_rewards(completion, solution, prompt):
    reward = (
        equation_reward_func([completion], [solution], [prompt])[0]
        + format_reward_func([completion], [solution])[0]
    )
    return reward


conversation = [
    {
        "role": "system",
        "content": "You are a helpful assistant. You first think about the reasoning process in your mind and then provide the user with the answer.",
    },
    {
        "role": "user",
        "content": "Using each number in this list only once {question}, create an equation that equals {answer}. You can use basic arithmetic operations (+, -, *, /) and each number can only be used once. Show your work in <think> </think> tags. And return the final equation and answer in <answer> </answer> tags, for example <answer>(1 + 2) / 3</answer>.",
    },
    {"role": "assistant", "content": "Let me solve this step by step.\n<think>"},
]
conversation_template = conversation  # the tutorial passes conversation_template= without defining it

# Define accelerators for distributed training
accelerator = Accelerator()

# Convert the HuggingFace dataset into a Gymnasium environment
env = ReasoningGym(
    train_dataset=train_dataset,
    test_dataset=test_dataset,
    tokenizer=tokenizer,
    reward_fn=combined_rewards,
    conversation_template=conversation_template,
    data_batch_size_per_gpu=SIZE["batch"],  # the tutorial: 10
    accelerator=accelerator,
    return_raw_completions=True,  # This is necessary for vLLM to work
)

# Initialise the population
pop = GRPO.population(
    size=SIZE["pop"],  # the tutorial: 4
    model_name=MODEL_PATH,
    pad_token_id=tokenizer.pad_token_id,
    pad_token=tokenizer.pad_token,
    accelerator=accelerator,
    **init_hp,
)

tournament = TournamentSelection(
    tournament_size=2,
    elitism=True,
    population_size=SIZE["pop"],  # the tutorial: 4
)

mutations = Mutations(
    no_mutation=mut_p["NO_MUT"],
    architecture=0,
    new_layer_prob=0,
    parameters=0,
    activation=0,
    rl_hp=mut_p["RL_HP_MUT"],
    mutation_sd=mut_p["MUT_SD"],
    rand_seed=mut_p["RAND_SEED"],
    device=device,
)

finetune_llm_reasoning(
    pop=pop,
    env=env,
    init_hp=init_hp,
    evaluation_interval=SIZE["interval"],  # the tutorial: 10
    wb=True,
    save_elite=True,
    elite_path=tempfile.mkdtemp(prefix="elite-"),  # the tutorial: "path/to/model/directory"
    max_reward=2.0,
    evo_steps=SIZE["interval"],  # the tutorial: 10
    mutation=mutations,
    selection_strategy=tournament,
    accelerator=accelerator,
    verbose=True,
    num_epochs=1,
)
