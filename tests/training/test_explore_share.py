"""``hpo.narrowing.explore_share``: while several members train, each trains on a share of the step's rows (a
reasoning task's prompts, a game's episode seeds, a team task's rows); the member left alone trains on all of them."""

import pytest
import torch
from conftest import make_grpo

from evollm.hpo import Narrowing
from evollm.training.cuts import step_rows


def test_step_rows_takes_the_first_share_while_several_members_train():
    half = Narrowing(at=(0.5,), explore_share=0.5)
    items = list(range(8))
    assert step_rows(items, half, 8) == [0, 1, 2, 3]
    assert step_rows(items, half, 2) == [0, 1, 2, 3]
    assert step_rows(items, half, 1) == items  # alone: the whole step
    assert step_rows(items, Narrowing(at=(0.5,), explore_share=0.3), 4) == [0, 1, 2]  # 2.4 rows: rounded up
    assert step_rows([7], half, 4) == [7]  # never none
    assert step_rows(items, None, 8) == items and step_rows(items, Narrowing(at=(0.5,)), 8) == items  # off
    assert half.share(3) == 0.5 and half.share(1) == 1.0
    for bad in (0.0, -0.5, 1.5):
        with pytest.raises(ValueError, match="explore_share must be a share"):
            Narrowing(explore_share=bad)


def test_reasoning_members_answer_half_the_prompts_until_one_trains_alone(monkeypatch):
    """Two members, cut to one at half of 4 steps (evaluations every step): steps 1-2 generate 2 of the env's 4
    prompts for both members, steps 3-4 all 4 for the member left; the env still moves one batch per step."""
    import evollm.training.loop as loop
    from evollm.envs.reasoning import ReasoningGym
    from evollm.recipes.warm_start import load_tiny_model
    from evollm.tasks import ARITHMETIC_TEMPLATE, arithmetic_dataset, exact_match_reward

    calls, generate = [], loop.generate_population
    monkeypatch.setattr(loop, "generate_population",
                        lambda agents, prompts: calls.append((len(agents), len(prompts))) or generate(agents, prompts))
    torch.manual_seed(0)
    model, tok = load_tiny_model(warm_start=False, seed=0)
    train, test = arithmetic_dataset(n_train=64, n_test=8, digits=(1, 1), seed=0)
    env = ReasoningGym(train, test, tok, exact_match_reward, ARITHMETIC_TEMPLATE, data_batch_size_per_gpu=4)
    seen = []
    monkeypatch.setattr(env, "step_to_next_batch", lambda f=env.step_to_next_batch: seen.append(1) or f())
    agents, _ = loop.finetune_llm_reasoning(make_grpo(model, tok, n=2, lr=1e-3), env, max_steps=4,
                                            evaluation_interval=1, verbose=False, seed=0,
                                            narrowing=Narrowing(at=(0.5,), explore_share=0.5))
    assert calls == [(2, 2), (2, 2), (1, 4), (1, 4)] and len(agents) == 1 and len(seen) == 4


def test_game_members_play_half_the_seeds_until_one_trains_alone(monkeypatch):
    import evollm.training.multiturn as multiturn
    from evollm.adapters.shared import default_lora_config
    from evollm.algorithms.ppo import LLMPPO
    from evollm.models.tiny import build_tiny_model
    from evollm.models.tokenizer import build_tokenizer
    from evollm.tasks.games import game_env_factory

    played, collect = [], multiturn.collect_episodes

    def spy(agents, envs, seeds, training=True, **kw):
        if training:
            played.append((len(agents), list(seeds)))
        return collect(agents, envs, seeds, training=training, **kw)

    monkeypatch.setattr(multiturn, "collect_episodes", spy)
    tok = build_tokenizer()
    torch.manual_seed(0)
    model = build_tiny_model(tok, seed=0)
    pop = [LLMPPO(model, pad_token_id=tok.pad_token_id, lora_config=default_lora_config(r=4), max_output_tokens=3,
                  batch_size=4) for _ in range(2)]
    factory = game_env_factory("guess_number", tok, game={"max_turns": 2}, max_model_len=96, max_output_tokens=3)
    agents, _ = multiturn.finetune_llm_multiturn(pop, max_turns=2, env_factory=factory, max_steps=4,
                                                 evaluation_interval=1, episodes_per_step=4, eval_episodes=2,
                                                 verbose=False, narrowing=Narrowing(at=(0.5,), explore_share=0.5))
    # the seeds of step k are k*4 .. k*4+3 (seed 0): the first two of them while both play, all four after the cut
    assert played == [(2, [0, 1]), (2, [4, 5]), (1, [8, 9, 10, 11]), (1, [12, 13, 14, 15])] and len(agents) == 1


def test_teams_play_half_the_rows_until_one_trains_alone(monkeypatch):
    import evollm.training.ippo as ippo
    from evollm.adapters.shared import default_lora_config
    from evollm.algorithms.ippo import IPPOTeam
    from evollm.envs.team import TeamTask
    from evollm.models.tiny import build_tiny_model
    from evollm.models.tokenizer import build_tokenizer
    from evollm.tasks.coop import relay_formatters, relay_sum_dataset, relay_sum_reward

    played, play = [], ippo.play_teams
    monkeypatch.setattr(ippo, "play_teams", lambda teams, task, rows, training=True:
                        played.append((len(teams), len(rows))) or play(teams, task, rows, training=training))
    tok = build_tokenizer()
    torch.manual_seed(0)
    model = build_tiny_model(tok, seed=0)
    train, test = relay_sum_dataset(n_train=16, n_test=4, seed=0)
    task = TeamTask(train, test, tok, relay_sum_reward, relay_formatters(), num_turns=1, max_new_tokens=3)
    asked = []
    monkeypatch.setattr(task, "next_rows", lambda n, f=task.next_rows: asked.append(n) or f(n))
    teams = [IPPOTeam(model, tok, lora_config=default_lora_config(r=4), num_turns=1, max_new_tokens=3,
                      rollout_buffer_size=4, mini_batch_size=2, ppo_epochs=1) for _ in range(2)]
    out, _ = ippo.finetune_ippo(teams, task, max_steps=4, evaluation_interval=1, verbose=False,
                                narrowing=Narrowing(at=(0.5,), explore_share=0.5))
    assert played == [(2, 2), (2, 2), (1, 4), (1, 4)] and len(out) == 1
    assert asked == [4, 4, 4, 4]  # the task's rows are consumed as without the option


def test_a_share_of_prompts_that_does_not_fit_the_minibatches_is_refused_before_any_work():
    """4 prompts x group_size 2 = 8 rows fill two minibatches of 4; at a share of 0.75 a member's 3 prompts make
    6 rows, which do not: one line names both settings, before a step is taken."""
    from evollm.envs.reasoning import ReasoningGym
    from evollm.recipes.warm_start import load_tiny_model
    from evollm.tasks import ARITHMETIC_TEMPLATE, arithmetic_dataset, exact_match_reward
    from evollm.training.loop import finetune_llm_reasoning

    model, tok = load_tiny_model(warm_start=False, seed=0)
    train, test = arithmetic_dataset(n_train=16, n_test=4, digits=(1, 1), seed=0)
    env = ReasoningGym(train, test, tok, exact_match_reward, ARITHMETIC_TEMPLATE, data_batch_size_per_gpu=4)
    pop = make_grpo(model, tok, n=2, group_size=2, batch_size=4)
    with pytest.raises(ValueError, match=r"^member 0: data_batch_size_per_gpu \(4\) at hpo.narrowing.explore_share="
                                         r"0.75: 3 x group_size \(2\) = 6 rows do not divide into batch_size=4$"):
        finetune_llm_reasoning(pop, env, max_steps=2, evaluation_interval=1, verbose=False,
                               narrowing=Narrowing(at=(0.5,), explore_share=0.75))
    assert all(a.steps == 0 for a in pop)
