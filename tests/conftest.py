import os
import warnings

import pytest
import torch

from evollm.training import Callback

torch.set_num_threads(1)  # the tiny models' ops are too small to gain from threads
warnings.filterwarnings("ignore", category=UserWarning)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    """One on-disk model cache for the whole test session (or $EVOLLM_CACHE when set)."""
    return os.environ.get("EVOLLM_CACHE") or str(tmp_path_factory.mktemp("evollm-cache"))


@pytest.fixture
def warm(cache_dir):
    """The warm-started tiny model (built once per cache, then loaded from disk)."""
    from evollm.recipes.warm_start import load_tiny_model

    return load_tiny_model(warm_start=True, cache_dir=cache_dir)


@pytest.fixture
def tiny(request):
    """A fresh random-init tiny model + tokenizer (cheap; each test gets its own base)."""
    from evollm.recipes.warm_start import load_tiny_model

    torch.manual_seed(0)
    return load_tiny_model(warm_start=False, seed=0)


@pytest.fixture
def arithmetic_env(tiny):
    from evollm.envs.reasoning import ReasoningGym
    from evollm.tasks import ARITHMETIC_TEMPLATE, arithmetic_dataset, exact_match_reward

    _, tok = tiny
    train, test = arithmetic_dataset(n_train=64, n_test=8, digits=(1, 1), seed=0)
    return ReasoningGym(train, test, tok, exact_match_reward, ARITHMETIC_TEMPLATE, data_batch_size_per_gpu=4)


def make_grpo(model, tok, n=1, **kw):
    from evollm.algorithms.grpo import GRPO

    kw.setdefault("group_size", 4)
    kw.setdefault("max_output_tokens", 4)
    kw.setdefault("batch_size", 16)
    return GRPO.population(n, actor_network=model, pad_token_id=tok.pad_token_id, pad_token=tok.pad_token,
                           eos_token_id=tok.eos_token_id, **kw)


class StopAt(Callback):
    """Interrupts a run (as Ctrl-C does) once step ``step`` is complete."""

    def __init__(self, step):
        self.step = step

    def on_step_complete(self, state):
        if state.step == self.step:
            raise KeyboardInterrupt
