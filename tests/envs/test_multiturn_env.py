"""TokenObservationWrapper contract, the synthetic games, and episode collection."""
import random

import pytest
import torch

from evollm.algorithms.multiturn_rollout import episode_batch, pack_actions, unpack_actions
from evollm.envs.multiturn import TokenObservationWrapper
from evollm.models.tokenizer import build_tokenizer
from evollm.rollout import play_episodes, stack_episodes
from evollm.tasks.games import ChainCalcEnv, GuessNumberEnv, game_env_factory, make_game, parse_int


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


class EchoEnv:
    """Reward = turn index + 1 when the action is 'ok'; feedback 'again'; never terminates."""

    def __init__(self):
        self.actions = []

    def reset(self, seed=None):
        self.actions = []
        return "start", {"seed": seed}

    def step(self, action):
        self.actions.append(action)
        reward = float(len(self.actions)) if action == "ok" else 0.0
        return "again", reward, False, False, {}


def encode(tok, text, eos=True):
    return tok(text, add_special_tokens=False)["input_ids"] + ([tok.eos_token_id] if eos else [])


def wrapper(tok, env=None, **kw):
    kw.setdefault("max_turns", 3)
    kw.setdefault("max_model_len", 200)
    kw.setdefault("max_output_tokens", 4)
    return TokenObservationWrapper(env or EchoEnv(), tok, pad_id=tok.pad_token_id, **kw)


def test_reset_gives_chat_templated_prompt(tok):
    w = wrapper(tok)
    prompt, info = w.reset(seed=7)
    assert prompt["input_ids"].shape[0] == 1 and prompt["input_ids"].dim() == 2
    assert tok.decode(prompt["input_ids"][0]) == "<|user|>start<|assistant|>"
    assert info["seed"] == 7 and not w.done


def test_masks_turn_ids_rewards_and_decoding(tok):
    env = EchoEnv()
    w = wrapper(tok, env)
    prompt, _ = w.reset()
    # full row: left padding + current prompt + completion + padding after eos
    row = [tok.pad_token_id] * 3 + prompt["input_ids"][0].tolist() + encode(tok, "ok") + [tok.pad_token_id] * 2
    prompt, r, term, trunc, info = w.step(torch.tensor([row]))
    assert env.actions == ["ok"] and r == 1.0 and not term and not trunc
    assert tok.decode(prompt["input_ids"][0]) == "<|user|>start<|assistant|>ok<eos><|user|>again<|assistant|>"
    # completion-only ids work too; an answer without eos is closed by the environment
    w.step(torch.tensor(encode(tok, "no", eos=False)))
    _, _, _, trunc, info = w.step(torch.tensor(encode(tok, "ok")))
    assert env.actions == ["ok", "no", "ok"]
    assert trunc and info["max_turns_reached"] and w.done

    ids, mask, turns, rewards = w.get_episode_data()
    assert mask.shape == turns.shape == (1, ids.shape[1] - 1)
    assert rewards.tolist() == [1.0, 0.0, 3.0]
    generated = ids[0, 1:][mask[0].bool()]
    assert tok.decode(generated) == "ok<eos>no" + "ok<eos>"
    assert ((turns >= 0) == mask.bool()).all()
    assert turns[0][mask[0].bool()].tolist() == [0, 0, 0, 1, 1, 2, 2, 2]
    # environment tokens (including the <eos> closing the un-terminated "no") are not actions
    text = tok.decode(ids[0])
    assert text == ("<|user|>start<|assistant|>ok<eos><|user|>again<|assistant|>no<eos><|user|>again"
                    "<|assistant|>ok<eos>")
    env_ids = ids[0, 1:][~mask[0].bool()]
    assert tok.eos_token_id in env_ids.tolist()


def test_only_new_turn_is_decoded_and_cut_at_eos(tok):
    env = EchoEnv()
    w = wrapper(tok, env, max_output_tokens=6)
    prompt, _ = w.reset()
    w.step(torch.tensor([prompt["input_ids"][0].tolist() + encode(tok, "ok") + encode(tok, "zz")]))
    assert env.actions == ["ok"]  # nothing after the first eos, nothing from the prompt
    prompt, *_ = w.step(torch.tensor(encode(tok, "abcdefghij", eos=False)))
    assert env.actions[-1] == "abcdef"  # cut to max_output_tokens


def test_context_overflow_truncates_without_crash(tok):
    env = EchoEnv()
    w = wrapper(tok, env, max_turns=10, max_model_len=40, max_output_tokens=4)
    prompt, _ = w.reset()
    steps = 0
    while not w.done:
        prompt, r, term, trunc, info = w.step(torch.tensor(encode(tok, "ok")))
        steps += 1
    assert trunc and not term and info["context_overflow"] is True
    assert steps < 10
    ids, mask, turns, rewards = w.get_episode_data()
    assert ids.shape[1] <= 40 and rewards.numel() == steps
    # stepping a finished episode reports truncation again instead of failing
    _, r, term, trunc, info = w.step(torch.tensor(encode(tok, "ok")))
    assert trunc and r == 0.0 and info["context_overflow"]


def test_prompt_longer_than_context_is_an_empty_truncated_episode(tok):
    w = wrapper(tok, max_model_len=8)
    _, info = w.reset()
    assert info["context_overflow"] and w.done
    _, _, _, trunc, _ = w.step(torch.tensor(encode(tok, "ok")))
    ids, mask, turns, rewards = w.get_episode_data()
    assert trunc and mask.sum() == 0 and rewards.numel() == 0


def test_plain_text_rendering(tok):
    w = wrapper(tok, apply_chat_template=False)
    prompt, _ = w.reset()
    assert tok.decode(prompt["input_ids"][0]) == "start\n"
    prompt, *_ = w.step(torch.tensor(encode(tok, "ok")))
    assert tok.decode(prompt["input_ids"][0]) == "start\nok<eos>\nagain\n"


# --------------------------------------------------------------------------- games
def test_guess_number_rules():
    g = GuessNumberEnv(high=16, max_turns=4)
    obs, info = g.reset(seed=3)
    secret = info["secret"]
    assert obs == "guess 1-16" and g.reset(seed=3)[1]["secret"] == secret
    low = secret - 1 if secret > 1 else None
    if low is not None:
        obs, r, term, trunc, _ = g.step(str(low))
        assert obs.startswith("higher") and r == 0.0 and not term
    obs, r, term, _, info = g.step(str(secret))
    assert obs == "correct" and r == 1.0 and term and info["success"]
    g.reset(seed=0)
    for _ in range(3):
        assert not g.step("x")[3]
    obs, r, term, trunc, info = g.step("x")
    assert obs == "invalid" and trunc and not info["success"]


def test_teachers_play_by_the_rules():
    rng = random.Random(0)
    wins = 0
    for seed in range(200):
        g = GuessNumberEnv()
        g.reset(seed=seed)
        done = False
        while not done:
            _, r, term, trunc, _ = g.step(g.teacher_action(rng, optimal_prob=1.0))
            done = term or trunc
        wins += r
    assert wins >= 175  # binary search finds 15 of 16 secrets in 4 guesses
    c = ChainCalcEnv(n_ops=3)
    obs, _ = c.reset(seed=1)
    total = 0.0
    for _ in range(3):
        _, r, term, _, info = c.step(c.teacher_action(rng, error_prob=0.0))
        total += r
    assert term and info["success"] and total == pytest.approx(1.0)
    c.reset(seed=1)
    _, r, term, _, info = c.step("-1")
    assert term and r == 0.0 and not info["success"]
    assert parse_int(" 12 ") == 12 and parse_int("1 2") is None
    with pytest.raises(ValueError):
        make_game("chess")


# --------------------------------------------------------------------------- collection
def test_play_episodes_and_stacking(tok):
    factory = game_env_factory("chain_calc", tok, game={"n_ops": 2}, max_model_len=128)
    envs = [factory() for _ in range(3)]

    def always_seven(active, prompts):  # a "model" that answers 7 every turn
        return [torch.tensor(encode(tok, "7")) for _ in prompts]

    episodes = play_episodes(envs, [0, 1, 2], always_seven)
    assert len(episodes) == 3
    ids, masks, turn_ids, rewards = stack_episodes(episodes, tok.pad_token_id, num_turns=2)
    assert ids.shape[0] == 3 and masks.shape == turn_ids.shape == (3, ids.shape[1] - 1) and rewards.shape == (3, 2)
    batch = episode_batch((ids, masks, turn_ids, rewards), tok.pad_token_id)
    assert batch.turn_mask().sum(1).tolist() == [e.rewards.numel() for e in episodes]
    assert batch.attention_mask[:, 0].all()
    for row, e in enumerate(episodes):
        assert tok.decode(ids[row, 1:][masks[row].bool()]).split("<eos>")[0] == "7"


def test_pack_unpack_roundtrip():
    x = torch.tensor([[0.0, 1, 2, 0, 3], [4, 0, 0, 5, 0]])
    mask = torch.tensor([[0, 1, 1, 0, 1], [1, 0, 0, 1, 0]])
    packed, pmask, index = pack_actions(x, mask)
    assert packed[pmask].tolist() == [1, 2, 3, 4, 5]
    assert torch.equal(unpack_actions(packed, pmask, index, 5), x * mask)


# --------------------------------------------------------------------------- training loop
def test_finetune_llm_multiturn_evolves_mixed_population(tok):
    from evollm.adapters.shared import default_lora_config
    from evollm.algorithms.grpo import GRPO
    from evollm.rollout import collect_episodes
    from evollm.algorithms.ppo import LLMPPO
    from evollm.algorithms.reinforce import LLMREINFORCE
    from evollm.hpo import HyperparameterConfig, Mutations, RLParameter, TournamentSelection
    from evollm.models.tiny import build_tiny_model
    from evollm.training.multiturn import episodes_to_experiences, finetune_llm_multiturn

    model = build_tiny_model(tok, seed=0)
    common = dict(pad_token_id=tok.pad_token_id, lora_config=default_lora_config(r=4), max_output_tokens=3,
                  batch_size=4)
    hp = HyperparameterConfig(lr=RLParameter(min=1e-5, max=1e-2), beta=RLParameter(min=0.0, max=0.1))
    pop = [LLMPPO(model, hp_config=hp, **common), LLMREINFORCE(model, hp_config=hp, **common),
           GRPO(model, hp_config=hp, group_size=2, **common)]
    assert len({id(a.shared) for a in pop}) == 1
    factory = game_env_factory("guess_number", tok, game={"max_turns": 2}, max_model_len=96, max_output_tokens=3)
    # GRPO gets one summed reward per episode, the seed's group_size episodes side by side
    episodes = collect_episodes([pop[2]], [factory() for _ in range(4)], [0, 1])[pop[2].index]
    assert [e.seed for e in episodes] == [0, 0, 1, 1]
    ids, masks, rewards = episodes_to_experiences(pop[2], episodes, 2)
    assert rewards.shape == (2, 2) and ids.shape[0] == 4 and masks.shape == (4, ids.shape[1] - 1)
    assert rewards.flatten().tolist() == [e.episode_return for e in episodes]
    seen = []
    agents, record = finetune_llm_multiturn(
        pop, max_turns=2, env_factory=factory, max_steps=4, evaluation_interval=2, evo_steps=2,
        tournament=TournamentSelection(tournament_size=2, population_size=3, rand_seed=0),
        mutation=Mutations(no_mutation=0.0, rl_hp=1.0, rand_seed=0), episodes_per_step=2, eval_episodes=3,
        verbose=False, on_evaluation=lambda step, agents, eps: seen.append((step, {k: len(v) for k, v in eps.items()})))
    assert [s for s, _ in seen] == [2, 4] and all(set(n.values()) == {3} for _, n in seen)
    assert len(agents) == 3 and record.generation == 1
    assert len(record.report()) == 6 and all(len(a.fitness) >= 1 for a in agents)


def _multiturn_run(tok, ckpt, resume=False, callbacks=()):
    from evollm.adapters.shared import default_lora_config
    from evollm.algorithms.grpo import GRPO
    from evollm.algorithms.ppo import LLMPPO
    from evollm.algorithms.reinforce import LLMREINFORCE
    from evollm.hpo import HyperparameterConfig, Mutations, RLParameter, TournamentSelection
    from evollm.models.tiny import build_tiny_model
    from evollm.training.multiturn import finetune_llm_multiturn

    torch.manual_seed(0)
    model = build_tiny_model(tok, seed=0)
    common = dict(pad_token_id=tok.pad_token_id, lora_config=default_lora_config(r=4), max_output_tokens=3,
                  batch_size=4, lr=5e-3)
    hp = HyperparameterConfig(lr=RLParameter(min=1e-4, max=1e-2, log=True))
    pop = [LLMPPO(model, hp_config=hp, **common), LLMREINFORCE(model, hp_config=hp, **common),
           GRPO(model, hp_config=hp, group_size=2, **common)]
    factory = game_env_factory("guess_number", tok, game={"max_turns": 2}, max_model_len=96, max_output_tokens=3)
    return finetune_llm_multiturn(
        pop, max_turns=2, env_factory=factory, max_steps=4, evaluation_interval=2, evo_steps=2,
        tournament=TournamentSelection(tournament_size=2, population_size=3, rand_seed=0),
        mutation=Mutations(no_mutation=0.0, rl_hp=1.0, rand_seed=0), episodes_per_step=2, eval_episodes=2,
        verbose=False, checkpoint_dir=ckpt, checkpoint_every=1, callbacks=callbacks, resume=resume)


def test_an_interrupted_multiturn_run_resumes_exactly(tok, tmp_path):
    """A mixed LLMPPO / LLMREINFORCE / GRPO run on a game, stopped after step 3 and resumed from its run
    checkpoint, ends bit-identical to the uninterrupted run (adapters, value head, fitness, report)."""
    from evollm.training import Callback

    class StopAt(Callback):
        def on_step_complete(self, state):
            if state.step == 3:
                raise KeyboardInterrupt

    agents, record = _multiturn_run(tok, tmp_path / "a")
    with pytest.raises(KeyboardInterrupt):
        _multiturn_run(tok, tmp_path / "b", callbacks=[StopAt()])
    again, record2 = _multiturn_run(tok, tmp_path / "b", resume=True)
    assert [type(a).__name__ for a in agents] == [type(a).__name__ for a in again]
    for a, b in zip(agents, again):
        assert a.index == b.index and a.fitness == b.fitness and a.config == b.config
        for role in a.ROLES:
            one, two = a.shared.state_dict(a.adapter_name(role)), b.shared.state_dict(b.adapter_name(role))
            assert one.keys() == two.keys() and all(torch.equal(one[k], two[k]) for k in one)
        for p, q in zip(a.extra_parameters().get("value_head", []), b.extra_parameters().get("value_head", [])):
            assert torch.equal(p, q)
    assert record.report().equals(record2.report())
    assert record.metrics()["loss"].equals(record2.metrics()["loss"])  # the steps before the stop were restored
