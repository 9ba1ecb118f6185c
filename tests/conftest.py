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


def lone_member_run(narrowing, reward, ckpt=None, resume=False, callbacks=(), max_steps=8, verbose=False,
                    lrs=(1e-3, 1e-3), default_founder=None):
    """Two GRPO members (learning rates ``lrs``) on a fresh tiny model, evaluated every step on 8 one-digit sums
    scored by ``reward``, narrowed by ``narrowing`` (e.g. to one member at step 1): the scene of the rules for a
    member training alone (stall swap, roll-back, anneal). Checkpoints every step into ``ckpt`` when given.
    ``default_founder``: the member (0 or 1) that holds the starting values (``algorithm.default_founder``)."""
    from evollm.envs.reasoning import ReasoningGym
    from evollm.recipes.warm_start import load_tiny_model
    from evollm.tasks import ARITHMETIC_TEMPLATE, arithmetic_dataset
    from evollm.training.loop import finetune_llm_reasoning

    torch.manual_seed(0)
    model, tok = load_tiny_model(warm_start=False, seed=0)
    pop = make_grpo(model, tok, n=2, lr=1e-3)
    for member, lr in zip(pop, lrs):
        member.set_hyperparameter("lr", lr)
    if default_founder is not None:
        pop[default_founder].default_founder = True
    train, test = arithmetic_dataset(n_train=64, n_test=8, digits=(1, 1), seed=0)
    env = ReasoningGym(train, test, tok, reward, ARITHMETIC_TEMPLATE, data_batch_size_per_gpu=4)
    return finetune_llm_reasoning(
        pop, env, max_steps=max_steps, evaluation_interval=1, evo_steps=None, verbose=verbose, seed=0,
        narrowing=narrowing, callbacks=list(callbacks), checkpoint_dir=ckpt, checkpoint_every=1 if ckpt else None,
        keep_checkpoints=2, resume=resume)
