"""The evolution loop calls every callback at its fixed points, in order."""

from conftest import make_grpo

from evollm.hpo import Mutations, TournamentSelection
from evollm.training import Callback
from evollm.training.loop import finetune_llm_reasoning


class Recorder(Callback):
    def __init__(self):
        self.events = []

    def on_train_begin(self, state):
        self.events.append(("begin", state.step))

    def on_step_end(self, state, metrics):
        self.events.append(("step", state.step, sorted(metrics)))

    def on_evaluation(self, state, fitness):
        self.events.append(("eval", state.step, len(fitness)))

    def on_selection(self, state, result):
        self.events.append(("select", state.step, sorted(a.index for a in state.agents)))

    def on_train_end(self, state):
        self.events.append(("end", state.step))


def test_callbacks_see_every_step_evaluation_and_selection(tiny, arithmetic_env):
    model, tok = tiny
    pop = make_grpo(model, tok, n=2)
    rec = Recorder()
    agents, _ = finetune_llm_reasoning(
        pop, arithmetic_env, max_steps=4, evaluation_interval=2, evo_steps=2, verbose=False,
        tournament=TournamentSelection(2, True, 2), mutation=Mutations(no_mutation=1.0, rl_hp=0.0, rand_seed=0),
        callbacks=[rec])
    kinds = [e[0] for e in rec.events]
    assert kinds == ["begin", "step", "step", "eval", "select", "step", "step", "eval", "end"]
    assert rec.events[1] == ("step", 1, sorted(a.index for a in pop))
    select = rec.events[4]
    assert select[1] == 2 and len(select[2]) == 2
    assert rec.events[-1] == ("end", 4)


def test_tensorboard_shows_each_step_once_after_a_kill_and_resume(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from evollm.run.callbacks import LoopState
    from evollm.run.logging import TensorBoardLogger

    def segment(first, last, resumed_at):
        logger = TensorBoardLogger(tmp_path)
        logger.on_train_begin(LoopState(resumed_at, 10, [], None))
        for step in range(first, last + 1):
            logger.on_step_end(LoopState(step, 10, [], None), {0: {"loss": float(step)}})
        for w in logger.writers.values():
            w.flush()  # a kill -9: flushed, never closed
        return logger

    segment(1, 5, 0)           # killed after step 5; the newest checkpoint is step 3
    segment(4, 6, 3).on_train_end(None)
    acc = EventAccumulator(str(tmp_path / "member_0"))
    acc.Reload()
    tag = next(t for t in acc.Tags()["scalars"] if "loss" in t)
    events = acc.Scalars(tag)
    assert [e.step for e in events] == [1, 2, 3, 4, 5, 6] and [e.value for e in events] == [1, 2, 3, 4, 5, 6]
