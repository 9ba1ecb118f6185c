"""AgileRL's tests/test_wrappers/test_multiturn_wrappers.py (TokenObservationWrapper), ported.

Changed: imports; a private-attribute assert (``_last_full_prompt_token_len``) dropped; the two guard
tests build the wrapper normally instead of with ``__new__`` and cleared private fields. Left out
(AgileRL internals): every test that builds the wrapper with ``__new__`` and sets private fields or
calls private methods (``_build_model_prompt_fields``, ``_chat_template_boundary_ids``,
``_tokenize_feedback``, ``_tokenize_initial_prompt``, ``_format_obs``, ``_step``,
``get_episode_data``/``get_debug_info`` on hand-set ``full_ids``/``turn_boundaries``,
``_initial_messages``, ``_env_system_prompt``), ``SyncMultiTurnVecEnv``, ``TrajectoryBuffer``,
``SearchTool``, ``FormatRewardWrapper`` and ``_as_prompt`` (AgileRL's vectorised multi-turn
machinery; evollm plays episodes with :func:`evollm.rollout.episodes.play_episodes`), and the
sliding-window/vLLM stitch layout helpers.
"""

import pytest
import torch

from evollm import TokenObservationWrapper


class _ChrTokenizer:
    pad_token_id = 0
    pad_token = "<pad>"

    def __call__(self, texts, **kwargs):
        ids = [[ord(c) for c in texts[0]]]
        t = torch.tensor(ids, dtype=torch.long)
        return {"input_ids": t, "attention_mask": torch.ones_like(t)}

    def encode(self, s: str, add_special_tokens: bool = True) -> list[int]:
        del add_special_tokens
        return [ord(c) for c in s]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(int(x)) for x in ids)


class _RecordingGemEnv:
    def __init__(self) -> None:
        self.last_gen: str | None = None

    def reset(self):
        return "hello", {}

    def step(self, gen_text: str):
        self.last_gen = gen_text
        return "", 1.0, True, False, {}


class _SeedlessResetEnv:
    def reset(self):
        return "obs", {}

    def step(self, gen_text: str):
        del gen_text
        return "done", 0.0, True, False, {}


class _NonTerminalEnv:
    def __init__(self) -> None:
        self.calls = 0
        self.last_gen: str | None = None

    def reset(self, seed: int | None = None):
        del seed
        return "hello", {"prefix": "P:", "suffix": "S"}

    def step(self, gen_text: str):
        self.calls += 1
        self.last_gen = gen_text
        if self.calls == 1:
            return "feedback", 0.5, False, False, {"prefix": "F:", "suffix": "T"}
        return "done", 1.0, True, False, {}


class TestTokenObservationWrapperGuards:
    """AgileRL's ``test_step_raises_without_prior_policy_observation`` and
    ``test_get_episode_data_raises_without_reset`` on a wrapper built normally (AgileRL's build it with
    ``__new__`` and clear private fields to reach the same state)."""

    def test_step_raises_without_prior_policy_observation(self) -> None:
        w = TokenObservationWrapper(_RecordingGemEnv(), _ChrTokenizer(), max_turns=1, apply_chat_template=False)
        with pytest.raises(RuntimeError, match="requires a prior reset"):
            w.step(torch.ones(1, 2, dtype=torch.long))

    def test_get_episode_data_raises_without_reset(self) -> None:
        w = TokenObservationWrapper(_RecordingGemEnv(), _ChrTokenizer(), max_turns=1, apply_chat_template=False)
        with pytest.raises(RuntimeError, match="No episode data"):
            w.get_episode_data()


class TestTokenObservationWrapperReset:
    def test_reset_returns_tuple_with_text_and_sets_prompt_len(self) -> None:
        inner = _RecordingGemEnv()
        w = TokenObservationWrapper(inner, _ChrTokenizer(), max_turns=3, pad_id=None, apply_chat_template=False)
        obs, info = w.reset()
        assert isinstance(info, dict)
        assert set(obs.keys()) >= {"input_ids", "attention_mask", "text"}
        assert obs["text"] == "hello"

    def test_reset_seed_fallback_for_seedless_env(self) -> None:
        w = TokenObservationWrapper(_SeedlessResetEnv(), _ChrTokenizer(), max_turns=1, pad_id=None,
                                    apply_chat_template=False)
        obs, _ = w.reset(seed=123)
        assert "input_ids" in obs


class TestTokenObservationWrapperStep:
    def test_step_from_full_completion_slices_generation(self) -> None:
        inner = _RecordingGemEnv()
        w = TokenObservationWrapper(inner, _ChrTokenizer(), max_turns=3, pad_id=None, apply_chat_template=False)
        obs, _ = w.reset()
        gen_ids = torch.tensor([[ord("x"), ord("y")]], dtype=torch.long)
        full = torch.cat([obs["input_ids"], gen_ids], dim=1)
        _pd, _r, term, _trunc, _i = w.step(full)
        assert inner.last_gen == "xy"
        assert term is True
        assert _pd == {}

    def test_non_chat_feedback_tokenization_path(self) -> None:
        env = _NonTerminalEnv()
        w = TokenObservationWrapper(env, _ChrTokenizer(), max_turns=2, pad_id=None, apply_chat_template=False)
        obs, _ = w.reset()
        completion = torch.cat([obs["input_ids"], torch.tensor([[120, 121]], dtype=torch.long)], dim=1)
        next_obs, _, terminated, truncated, _ = w.step(completion)
        assert not terminated
        assert not truncated
        assert next_obs["input_ids"].shape[1] > completion.shape[1]

    def test_strict_mode_terminates_on_context_overflow(self) -> None:
        env = _NonTerminalEnv()
        w = TokenObservationWrapper(env, _ChrTokenizer(), max_turns=4, pad_id=None, apply_chat_template=False,
                                    max_model_len=20, max_output_tokens=4)
        obs, _ = w.reset()
        completion = torch.cat([obs["input_ids"], torch.tensor([[120, 121]], dtype=torch.long)], dim=1)
        next_obs, _, terminated, truncated, info = w.step(completion)
        assert truncated is True
        assert terminated is False
        assert next_obs == {}
        assert "agilerl_context_overflow" in info
        overflow = info["agilerl_context_overflow"]
        assert overflow["max_prompt_tokens"] == 16
        assert overflow["max_model_len"] == 20
        assert overflow["max_output_tokens"] == 4
        assert overflow["full_prompt_len"] > overflow["max_prompt_tokens"]

    @pytest.mark.xfail(strict=True, raises=ValueError, reason="enable_sliding_window=True is refused: a window "
                       "would train on a conversation other than the one the model was prompted with")
    def test_sliding_window_silently_truncates_instead_of_terminating(self) -> None:
        env = _NonTerminalEnv()
        w = TokenObservationWrapper(env, _ChrTokenizer(), max_turns=4, pad_id=None, apply_chat_template=False,
                                    max_model_len=20, max_output_tokens=4, enable_sliding_window=True)
        obs, _ = w.reset()
        completion = torch.cat([obs["input_ids"], torch.tensor([[120, 121]], dtype=torch.long)], dim=1)
        next_obs, _, terminated, truncated, info = w.step(completion)
        assert not terminated
        assert not truncated
        assert "agilerl_context_overflow" not in info
        assert next_obs["trajectory_input_ids"].shape[1] <= 16
