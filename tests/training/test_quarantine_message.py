"""A member quarantined during a Python API run is reported in one printed line, also with verbose=False."""

from conftest import make_grpo

from evollm.envs.reasoning import ReasoningGym
from evollm.tasks import ARITHMETIC_TEMPLATE, arithmetic_dataset
from evollm.training.loop import finetune_llm_reasoning


def test_api_run_prints_one_line_per_quarantine(tiny, capsys):
    model, tok = tiny
    train, test = arithmetic_dataset(n_train=64, n_test=8, digits=(1, 1), seed=0)
    env = ReasoningGym(train, test, tok, lambda c, a, q: float(len(c)), ARITHMETIC_TEMPLATE, data_batch_size_per_gpu=4)
    pop = make_grpo(model, tok, n=2)
    pop[1].set_hyperparameter("lr", 1e6)  # blows up on its first update
    finetune_llm_reasoning(pop, env, max_steps=2, evaluation_interval=2, verbose=False)
    assert pop[1].quarantined
    lines = [line for line in capsys.readouterr().out.splitlines() if "quarantined" in line]
    assert len(lines) == 1 and lines[0].startswith(f"member {pop[1].index} quarantined at step 1")
