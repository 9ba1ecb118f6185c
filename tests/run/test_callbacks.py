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
