"""The benchmark's task configs and the reward files they name: every config is a run config ``evollm train``
accepts (so a task enters the benchmark as written), and the word-facts reward scores as documented."""
from pathlib import Path

import pytest

from benchmarks.hpo.chat.word_facts_reward import score
from evollm.config import RunConfig
from evollm.tasks import resolve_reward
from evollm.tasks.user import task_parts

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "benchmarks" / "hpo" / "configs").glob("*.yaml"))


def test_the_benchmark_has_its_task_configs():
    names = {p.stem for p in CONFIGS}
    assert {"tiny_arithmetic", "guess_number_ppo", "smollm2_word_facts", "guess_number_reinforce",
            "two_digit_gspo", "chain_calc_reinforce", "smollm2_everyday_reinforce"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_every_task_config_is_a_valid_run_config(path):
    cfg = RunConfig.from_yaml(path)
    assert cfg.algorithm.name in ("GRPO", "LLMPPO", "LLMREINFORCE", "IPPO")
    assert not cfg.hpo.given("hp_config")  # a task config sets no search space: each arm brings its own
    if cfg.task.name == "dataset":  # the user's reward file resolves to a callable
        assert callable(resolve_reward(cfg.task.reward))


@pytest.mark.parametrize("path", [p for p in CONFIGS if RunConfig.from_yaml(p).task.name == "dataset"],
                         ids=lambda p: p.stem)
def test_every_chat_dataset_splits_and_its_answers_score_full_marks(path):
    cfg = RunConfig.from_yaml(path)
    root = Path(__file__).resolve().parents[2]
    train, test, reward, _ = task_parts("dataset", dataset=root / cfg.task.dataset, test_size=cfg.task.test_size,
                                        reward=cfg.task.reward, system_prompt=cfg.task.system_prompt)
    assert len(test) == cfg.task.test_size and len(train) >= 100
    for row in list(train) + list(test):  # every stored answer is one the reward gives full marks to
        assert reward(row["answer"], row["answer"], row["question"]) == 1.0, row


@pytest.mark.parametrize("reply, answer, want", [
    ("went", "went", 1.0),
    ("Went.", "went", 1.0),                                  # case and punctuation ignored
    ("The past tense of go is went", "went", 1.0),           # a lead-in ending in "is"
    ("A baby cat is called a kitten", "kitten", 1.0),        # ... or "called", then an article
    ("They are mice", "mice", 1.0),
    ("The answer: mice", "mice", 0.5),                       # the answer later in the reply
    ("It is not went but goed", "went", 0.5),                # a word of the reply, not its first: partial credit
    ("I think 42", "42", 0.5),
    ("Spanish", "Portuguese", 0.0),
    ("", "went", 0.0),
    ("New Zealand", "New Zealand", 1.0),                     # answers of several words
])
def test_the_word_facts_reward_by_hand(reply, answer, want):
    assert score(reply, answer, "a question") == want
