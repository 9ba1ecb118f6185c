"""AgileRL's tests/test_train/test_train_llm.py (finetune_llm_reasoning and finetune_llm_multiturn),
ported.

AgileRL's versions drive the loops with ``MagicMock`` agents and environments and patch the loops'
private helpers (loggers, rollout collection, checkpoint savers, metric aggregation). Here the same
behaviours run on real tiny populations (evollm's tiny Llama, a few steps): model construction is the
change. Left out: the DPO/SFT/preference loops (evollm has neither), the accelerator parametrizations
and ``test_report_metrics_called_on_non_main_process``, the deprecation of ``agilerl.training.train_llm``
(module layout), the checks that count calls into patched private helpers (``collect_rollouts_llm``,
``run_selection_and_mutation``, ``_multiturn_collect_return``, ``init_loggers``, metric registration,
``MultiFrequencySelection``), and the mocked wall clock of ``..._stops_at_wall_clock_limit``.
"""


import pytest
from datasets import Dataset as HFDataset

from evollm import (GRPO, LLMPPO, Mutations, ReasoningGym, TokenObservationWrapper, TournamentSelection,
                    finetune_llm_multiturn, finetune_llm_reasoning)

from .helpers import lora_config, tiny_model
from .test_ppo_llm import ConstantTargetEnv

ONE_ENV = ("evollm's members all answer the same prompts from ONE env each step (a fair comparison); env_fn= is "
           "called once")


def _reasoning_env(tok, rows=6, batch=1):
    data = HFDataset.from_dict({"question": [f"{i}+1=" for i in range(rows)], "answer": [str(i + 1) for i in range(rows)]})
    return ReasoningGym(train_dataset=data, test_dataset=data.select(range(2)), tokenizer=tok,
                        reward_fn=lambda completion, answer, question: float(answer in completion),
                        conversation_template=[{"role": "user", "content": "{question}"}],
                        data_batch_size_per_gpu=batch)


def _grpo_pop(n=1):
    model, tok = tiny_model()
    pop = GRPO.population(n, actor_network=model, pad_token_id=tok.pad_token_id, pad_token="<pad>",
                          lora_config=lora_config(), group_size=2, batch_size=2, max_output_tokens=3,
                          max_model_len=64)
    return pop, tok


class TestFinetuneLlmReasoning:
    @pytest.mark.xfail(strict=True, reason="finetune_llm_reasoning returns (agents, Population): the second item "
                                           "is evollm's run record (report(), best(), lineage), not a fitness list")
    def test_finetune_llm_reasoning_basic_training_loop(self):
        pop, tok = _grpo_pop()
        env = _reasoning_env(tok)
        result = finetune_llm_reasoning(pop=pop, env=env, evaluation_interval=2, max_reward=2.0, accelerator=None,
                                        init_hp={"BATCH_SIZE": 1}, max_steps=6, verbose=False)
        assert isinstance(result, tuple)
        assert len(result) == 2
        agents, fitnesses = result
        assert pop[0] in agents
        assert len(pop[0].fitness) == 3
        assert isinstance(fitnesses, list)

    def test_finetune_llm_reasoning_saves_elite_at_end(self, tmp_path):
        pop, tok = _grpo_pop(2)
        env = _reasoning_env(tok, rows=2)
        agents, _ = finetune_llm_reasoning(pop=pop, env=env, evaluation_interval=1, save_elite=True,
                                           elite_path=str(tmp_path), max_steps=1, verbose=False)
        best = max(agents, key=lambda a: a.fitness[-1])
        saved = sorted(p for p in tmp_path.rglob("agent.json"))
        assert saved, "no elite checkpoint written"
        assert f'"index": {best.index}' in saved[-1].read_text().replace('"id"', '"index"') or \
            str(best.index) in saved[-1].read_text()

    def test_finetune_llm_reasoning_evo_steps_not_set(self):
        pop, tok = _grpo_pop()
        with pytest.raises(ValueError, match="evo_steps"):
            finetune_llm_reasoning(pop=pop, env=_reasoning_env(tok), evo_steps=None, max_steps=1,
                                   selection_strategy=TournamentSelection(1, True, 1), mutation=Mutations(),
                                   verbose=False)

    def test_finetune_llm_reasoning_warning_num_epochs_and_max_steps(self):
        pop, tok = _grpo_pop()
        with pytest.warns(UserWarning, match="num_epochs"):
            finetune_llm_reasoning(pop=pop, env=_reasoning_env(tok, rows=2), num_epochs=1, max_steps=100,
                                   evo_steps=None, evaluation_interval=1, verbose=False)
        assert pop[0].steps == 2  # one epoch of 2 rows in batches of 1, not 100 steps

    def test_finetune_llm_reasoning_break_on_num_epochs(self):
        pop, tok = _grpo_pop()
        env = _reasoning_env(tok, rows=3)
        finetune_llm_reasoning(pop=pop, env=env, num_epochs=2, evaluation_interval=1, verbose=False)
        assert env.num_epochs == 2 and pop[0].steps == 6  # two passes over 3 rows in batches of 1

    @pytest.mark.xfail(strict=True, reason=ONE_ENV)
    def test_finetune_llm_reasoning_env_fn_uses_distinct_env_instances(self):
        pop, tok = _grpo_pop(2)
        made = []

        def env_fn():
            made.append(_reasoning_env(tok))
            return made[-1]

        finetune_llm_reasoning(pop=pop, env_fn=env_fn, max_steps=2, evaluation_interval=2, verbose=False)
        assert len(made) == 2

    @pytest.mark.xfail(strict=True, reason=f"{ONE_ENV}: sharing it is the design, so there is no fairness warning")
    def test_finetune_llm_warns_on_shared_env_with_population(self):
        pop, tok = _grpo_pop(2)
        with pytest.warns(UserWarning, match="fairness bias"):
            finetune_llm_reasoning(pop=pop, env=_reasoning_env(tok), max_steps=1, evaluation_interval=1,
                                   verbose=False)

    @pytest.mark.xfail(strict=True, reason="tournament= is evollm's own name (not deprecated); selection_strategy= "
                                           "is accepted as AgileRL's")
    def test_finetune_llm_reasoning_deprecated_tournament_argument(self):
        pop, tok = _grpo_pop(2)
        with pytest.warns(DeprecationWarning, match="'tournament' argument"):
            finetune_llm_reasoning(pop=pop, env=_reasoning_env(tok), max_steps=2, evaluation_interval=1, evo_steps=1,
                                   tournament=TournamentSelection(2, True, 2), mutation=Mutations(), verbose=False)


def test_finetune_llm_env_and_env_fn_mutually_exclusive():
    pop, tok = _grpo_pop()
    env = _reasoning_env(tok)
    with pytest.raises(ValueError, match="Provide exactly one of 'env' or 'env_fn'"):
        finetune_llm_reasoning(pop=pop, env=env, env_fn=lambda: env, max_steps=1, verbose=False)


def test_finetune_llm_requires_env_or_env_fn():
    pop, _ = _grpo_pop()
    with pytest.raises(ValueError, match="Either 'env' or 'env_fn' must be provided"):
        finetune_llm_reasoning(pop=pop, env=None, env_fn=None, max_steps=1, verbose=False)


def _ppo_pop(n=1):
    model, tok = tiny_model()
    pop = LLMPPO.population(n, actor_network=model, pad_token_id=tok.pad_token_id, pad_token="<pad>",
                            lora_config=lora_config(r=4, alpha=16), batch_size=2, max_output_tokens=3)
    factory = lambda: TokenObservationWrapper(ConstantTargetEnv(target_digit="1", prompt="1"), tok, max_turns=1,  # noqa: E731
                                              pad_id=tok.pad_token_id, apply_chat_template=False,
                                              max_model_len=64, max_output_tokens=3)
    return pop, factory


class TestFinetuneLlmMultiturn:
    def test_finetune_llm_multiturn_value_error_when_evo_steps_missing_with_selection_strategy(self):
        pop, factory = _ppo_pop()
        with pytest.raises(ValueError, match="evo_steps"):
            finetune_llm_multiturn(pop=pop, env_factory=factory, max_turns=1, init_hp={"BATCH_SIZE": 1, "ALGO": "LLMPPO"},
                                   max_steps=1, evo_steps=None, selection_strategy=TournamentSelection(1, True, 1),
                                   mutation=Mutations(), accelerator=None, verbose=False)

    @pytest.mark.xfail(strict=True, reason="evo_steps without a selection strategy is refused "
                       "before any work (evollm's settings take effect or fail loudly); AgileRL warns and ignores it")
    def test_finetune_llm_multiturn_warns_when_evo_steps_without_selection_strategy(self):
        pop, factory = _ppo_pop()
        with pytest.warns(UserWarning, match="evo_steps"):
            finetune_llm_multiturn(pop=pop, env_factory=factory, max_turns=1, init_hp={"BATCH_SIZE": 1, "ALGO": "LLMPPO"},
                                   max_steps=1, evo_steps=3, selection_strategy=None, mutation=None, accelerator=None,
                                   verbose=False)

    def test_finetune_llm_multiturn_saves_elite_at_end(self, tmp_path):
        pop, factory = _ppo_pop(2)
        agents, _ = finetune_llm_multiturn(pop=pop, env_factory=factory, max_turns=1,
                                           init_hp={"BATCH_SIZE": 1, "ALGO": "LLMPPO"}, max_steps=1,
                                           evaluation_interval=1, save_elite=True, elite_path=str(tmp_path),
                                           episodes_per_step=2, eval_episodes=2, verbose=False, accelerator=None)
        assert any(tmp_path.rglob("agent.json")), "no elite checkpoint written"

    def test_finetune_llm_multiturn_eval_interval_calls_test(self):
        pop, factory = _ppo_pop()
        finetune_llm_multiturn(pop=pop, env_factory=factory, max_turns=1, init_hp={"BATCH_SIZE": 1, "ALGO": "LLMPPO"},
                               max_steps=3, evaluation_interval=1, episodes_per_step=2, eval_episodes=2,
                               verbose=False, accelerator=None)
        assert len(pop[0].fitness) == 3
