"""Shared pieces of the AgileRL test port: AgileRL's dummy datasets and a tiny model of ours.

AgileRL builds its test agents on a tiny dense model (``create_module``) or a tiny checkpoint
(``TINY_LLM_FIXTURE_PATH``); the port builds them on evollm's tiny Llama (``tiny`` fixture of
tests/conftest.py), so vocabulary sizes and pad ids come from its tokenizer.
"""

import pytest
import torch


class Info:
    def __init__(self, name: str) -> None:
        self.dataset_name = name


class DummyReasoningDataset(torch.utils.data.Dataset):
    def __init__(self, num_samples: int) -> None:
        self.questions = [f"This is question {i}?" for i in range(num_samples)]
        self.answers = [f"This is answer {i}." for i in range(num_samples)]
        self.features = {"question": self.questions, "answer": self.answers}
        self.info = Info("dummy_dataset")

    def __len__(self) -> int:
        return len(self.questions)

    def __getitem__(self, index: int) -> dict[str, str]:
        if index >= len(self):
            raise IndexError(index)
        return {"question": self.questions[index], "answer": self.answers[index]}


DUMMY_CONVERSATION_TEMPLATE = [{"role": "system", "content": "question: {question}\nanswer: {answer}"}]


def dummy_reward_fn(*args, **kwargs):
    return 1.0


@pytest.fixture
def reasoning_dataset(num_samples):
    return DummyReasoningDataset(int(num_samples * 0.8)), DummyReasoningDataset(int(num_samples * 0.2))


@pytest.fixture
def tokenizer(tiny):
    return tiny[1]


@pytest.fixture(autouse=True)
def set_seed():
    torch.manual_seed(42)
