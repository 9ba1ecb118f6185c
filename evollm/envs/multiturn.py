"""Multi-turn text environments in token space.

A *text environment* is gym-style and knows nothing about tokens::

    reset(seed=None) -> (observation: str, info: dict)
    step(action: str) -> (observation, reward, terminated, truncated, info)

:class:`TokenObservationWrapper` turns one into what an LLM agent consumes: the whole
conversation so far as token ids (chat-templated, ending with the assistant generation
prompt), and after the episode the token ids of the full conversation with an action
mask that is 1 only on tokens the model generated, the turn index of each of those
tokens and the reward of each turn.  Environment tokens are never trained on.

Token alignment: ``input_ids`` is ``[1, L]``; ``action_mask`` and ``turn_ids`` are
``[1, L-1]`` and refer to ``input_ids[:, 1:]`` (the positions log-probs are computed
for), exactly like the masks of :func:`evollm.rollout.action_mask_for`.
"""

from __future__ import annotations

import inspect
from typing import Any, Protocol, Sequence

import torch


class TextEnv(Protocol):
    """What :class:`TokenObservationWrapper` needs from a text environment."""

    def reset(self, seed: int | None = None) -> tuple[str, dict]: ...

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]: ...


class TokenObservationWrapper:
    """One episode at a time of a text environment, as token ids.

    Args:
        env: the text environment.
        tokenizer: a Hugging Face tokenizer (with a chat template when ``apply_chat_template``).
        max_turns: the episode is truncated after this many model turns.
        pad_id: padding id (used to recognise left padding in the ids given to ``step``).
        max_model_len: longest conversation (in tokens) the model may see; an episode whose next
            prompt plus ``max_output_tokens`` would not fit ends as truncated with
            ``info["context_overflow"] = True``.  None: no limit.
        max_output_tokens: longest model turn; longer completions are cut to this length.
        apply_chat_template: render the conversation with the tokenizer's chat template (user =
            environment, assistant = model); otherwise plain text, one message per line.
        system_prompt: optional system message at the start of the conversation.
        strict_chat_template_boundary: AgileRL's keyword, accepted (True is evollm's only mode: the
            turn boundaries always come from the chat template itself).
        enable_sliding_window: AgileRL's keyword; only False. A window would train on a conversation
            other than the one the model was prompted with (the sampled policy must be the trained one).

    As in AgileRL: ``pad_id=None`` takes the tokenizer's pad id; an environment whose ``reset`` takes
    no ``seed`` is reset without one; ``info`` ``prefix``/``suffix`` strings frame an observation
    (``prefix + observation + "\\n" + suffix``); the prompt's ``text`` is the latest observation; a
    finished episode's next observation is ``{}``.
    """

    def __init__(self, env: TextEnv, tokenizer, max_turns: int, pad_id: int | None = None,
                 max_model_len: int | None = None, max_output_tokens: int = 32, apply_chat_template: bool = True,
                 system_prompt: str | None = None, strict_chat_template_boundary: bool = True,
                 enable_sliding_window: bool = False):
        if max_turns < 1 or max_output_tokens is None or max_output_tokens < 1:
            raise ValueError(f"need max_turns >= 1 and max_output_tokens >= 1, got {max_turns}, {max_output_tokens}")
        if enable_sliding_window:
            raise ValueError("enable_sliding_window=True is not supported: evollm trains on the whole conversation "
                             "the model was prompted with; give max_model_len room for max_turns instead")
        if apply_chat_template and not getattr(tokenizer, "chat_template", None):
            raise ValueError("apply_chat_template=True but the tokenizer has no chat_template")
        if pad_id is None:
            pad_id = getattr(tokenizer, "pad_token_id", None)
        self.env = env
        self.tokenizer = tokenizer
        self.max_turns = int(max_turns)
        self.pad_id = int(pad_id) if pad_id is not None else -1  # -1: no padding id (nothing is padding)
        self.max_model_len = max_model_len
        self.max_output_tokens = int(max_output_tokens)
        self.apply_chat_template = apply_chat_template
        self.system_prompt = system_prompt
        self.strict_chat_template_boundary = bool(strict_chat_template_boundary)
        self.eos_id = getattr(tokenizer, "eos_token_id", None)
        self._reset_takes_seed = _takes_seed(getattr(env, "reset", None))
        self.done = True
        self.started = False  # reset() called at least once
        self._reset_state()

    def _reset_state(self) -> None:
        self.messages: list[dict] = []
        self._rendered = ""
        self.ids: list[int] = []  # the whole conversation
        self.is_action: list[bool] = []  # per token of ``ids``: generated by the model
        self.turn_of: list[int] = []  # per token: turn index for model tokens, -1 otherwise
        self.rewards: list[float] = []
        self.infos: list[dict] = []
        self.turn = 0
        self.observation_text = ""

    # ------------------------------------------------------------------ rendering
    def _render(self, messages: Sequence[dict], add_generation_prompt: bool) -> str:
        if self.apply_chat_template:
            return self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt,
                                                      tokenize=False)
        text = "\n".join(m["content"] for m in messages)
        return text + "\n" if add_generation_prompt else text

    def _encode(self, text: str) -> list[int]:
        if hasattr(self.tokenizer, "encode"):
            return [int(i) for i in self.tokenizer.encode(text, add_special_tokens=False)]
        return [int(i) for i in torch.as_tensor(self.tokenizer([text], add_special_tokens=False)["input_ids"])
                .reshape(-1).tolist()]

    def _append(self, ids: Sequence[int], action: bool) -> None:
        self.ids.extend(int(i) for i in ids)
        self.is_action.extend([action] * len(ids))
        self.turn_of.extend([self.turn if action else -1] * len(ids))

    def _fits_next_turn(self) -> bool:
        return self.max_model_len is None or len(self.ids) + self.max_output_tokens <= self.max_model_len

    def prompt(self) -> dict:
        """The current prompt: ``{"input_ids": [1, L], "attention_mask": [1, L], "text"}``."""
        ids = torch.tensor([self.ids], dtype=torch.long)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "text": self.observation_text}

    # ------------------------------------------------------------------ gym-style API
    def reset(self, seed: int | None = None) -> tuple[dict, dict]:
        """Start an episode. Returns ``(prompt, info)``; ``prompt["input_ids"]`` is ``[1, L]``.

        If even the first prompt leaves no room for ``max_output_tokens`` within ``max_model_len``,
        ``info["context_overflow"]`` is True and the episode is already over (``step`` then only
        reports the truncation)."""
        self._reset_state()
        self.started = True
        observation, info = self.env.reset(seed=seed) if self._reset_takes_seed else self.env.reset()
        observation = self.observation_text = format_observation(observation, info)
        if self.system_prompt is not None:
            self.messages.append({"role": "system", "content": self.system_prompt})
        self.messages.append({"role": "user", "content": str(observation)})
        self._rendered = self._render(self.messages, add_generation_prompt=True)  # conversation so far, as text
        self._append(self._encode(self._rendered), action=False)
        info = dict(info or {})
        self.done = not self._fits_next_turn()
        if self.done:
            info.update(context_overflow=True, truncated=True, agilerl_context_overflow=self._overflow())
        self.last_info = info
        return self.prompt(), info

    def new_turn_tokens(self, completion_ids) -> list[int]:
        """The model's new turn out of ``completion_ids``: either the full row (current prompt, maybe
        left-padded, then the completion) or the completion alone. Cut after the first eos (kept: the
        model chose to stop), trailing padding dropped, at most ``max_output_tokens``."""
        row = [int(t) for t in torch.as_tensor(completion_ids).reshape(-1).tolist()]
        start = 0
        while start < len(row) and row[start] == self.pad_id:
            start += 1
        n = len(self.ids)
        new = row[start + n:] if row[start:start + n] == self.ids else row
        if self.eos_id is not None and self.eos_id in new:
            new = new[:new.index(self.eos_id) + 1]
        else:
            while new and new[-1] == self.pad_id:
                new.pop()
        return new[:self.max_output_tokens]

    def step(self, completion_ids) -> tuple[dict, float, bool, bool, dict]:
        """Play one model turn. ``completion_ids``: see :meth:`new_turn_tokens`.

        Returns ``(next_prompt, reward, terminated, truncated, info)``. The episode is truncated after
        ``max_turns`` turns or when the next prompt would overflow ``max_model_len``
        (``info["context_overflow"]``)."""
        if not self.started:
            raise RuntimeError("step() requires a prior reset(): reset() was never called")
        if self.done:
            info = {**self.last_info, "truncated": True}
            return {}, 0.0, False, True, info
        new = self.new_turn_tokens(completion_ids)
        ended_with_eos = bool(new) and new[-1] == self.eos_id
        text = self.tokenizer.decode(new[:-1] if ended_with_eos else new, skip_special_tokens=True)
        self._append(new, action=True)
        observation, reward, terminated, truncated, info = self.env.step(text)
        info = dict(info or {})
        observation = format_observation(observation, info)
        info["action_text"] = text
        self.rewards.append(float(reward))
        self.turn += 1
        if self.turn >= self.max_turns and not terminated:
            truncated = True
            info["max_turns_reached"] = True
        if not (terminated or truncated):
            self._append(self._environment_tokens(text, str(observation), ended_with_eos), action=False)
            self.observation_text = str(observation)
            if not self._fits_next_turn():
                truncated = True
                info["context_overflow"] = True
                info["agilerl_context_overflow"] = self._overflow()
        self.messages += [{"role": "assistant", "content": text}, {"role": "user", "content": str(observation)}]
        self.done = bool(terminated or truncated)
        info["truncated"] = bool(truncated)
        self.infos.append(info)
        self.last_info = info
        return ({} if self.done else self.prompt()), float(reward), bool(terminated), bool(truncated), info

    def _overflow(self) -> dict:
        """AgileRL's ``info["agilerl_context_overflow"]`` record of a context overflow."""
        return {"full_prompt_len": len(self.ids), "max_prompt_tokens": self.max_model_len - self.max_output_tokens,
                "max_model_len": self.max_model_len, "max_output_tokens": self.max_output_tokens}

    def _environment_tokens(self, text: str, observation: str, ended_with_eos: bool) -> list[int]:
        """Tokens between the model's turn and the next generation: whatever closes the assistant
        message (unless the model already generated it), the feedback as a user message, and the
        generation prompt. Found as differences of rendered conversations, so any chat template works."""
        before = self._rendered
        closed = self._render(self.messages + [{"role": "assistant", "content": text}], add_generation_prompt=False)
        following = self._render(self.messages + [{"role": "assistant", "content": text},
                                                  {"role": "user", "content": observation}],
                                 add_generation_prompt=True)
        eos_text = getattr(self.tokenizer, "eos_token", None) or ""
        if closed.startswith(before + text):
            close = closed[len(before) + len(text):]
        else:  # the template rewrites assistant messages: close with eos only
            close = eos_text
        if ended_with_eos and eos_text and close.startswith(eos_text):
            close = close[len(eos_text):]
        if following.startswith(closed):
            rest = following[len(closed):]
        else:
            rest = self._render([{"role": "user", "content": observation}], add_generation_prompt=True)
        self._rendered = following
        return self._encode(close + rest)

    # ------------------------------------------------------------------ results
    def get_episode_data(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(input_ids [1, L], action_mask [1, L-1], turn_ids [1, L-1], rewards [K])`` of the episode
        so far; masks refer to ``input_ids[:, 1:]``, ``turn_ids`` is -1 off the model's tokens, and
        ``rewards`` has one entry per turn played."""
        if not self.started:
            raise RuntimeError("No episode data: reset() was never called")
        ids = torch.tensor([self.ids], dtype=torch.long)
        mask = torch.tensor([self.is_action[1:]], dtype=torch.long)
        turns = torch.tensor([self.turn_of[1:]], dtype=torch.long)
        return ids, mask, turns, torch.tensor(self.rewards, dtype=torch.float32)

    @property
    def full_ids(self) -> torch.Tensor | None:
        """AgileRL's name of the conversation so far, ``[1, L]`` (None before the first reset)."""
        return torch.tensor([self.ids], dtype=torch.long) if self.started else None

    @property
    def episode_return(self) -> float:
        return float(sum(self.rewards))

    def render_text(self) -> str:
        """The conversation so far as text (special tokens included)."""
        return self.tokenizer.decode(self.ids)

    def __repr__(self) -> str:
        return f"TokenObservationWrapper({type(self.env).__name__}, max_turns={self.max_turns})"


def format_observation(observation, info) -> str:
    """An observation framed by ``info["prefix"]``/``info["suffix"]`` where given (AgileRL's convention)."""
    prefix, suffix = (info or {}).get("prefix"), (info or {}).get("suffix")
    if prefix is None and suffix is None:
        return str(observation)
    return f"{prefix or ''}{observation}\n{suffix or ''}"


def _takes_seed(reset) -> bool:
    try:
        params = inspect.signature(reset).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(p.name == "seed" or p.kind is p.VAR_KEYWORD for p in params)


def make_token_env(env: TextEnv, tokenizer, max_turns: int, max_model_len: int | None = None,
                   max_output_tokens: int = 32, **kwargs: Any) -> TokenObservationWrapper:
    """A :class:`TokenObservationWrapper` with the tokenizer's pad id."""
    return TokenObservationWrapper(env, tokenizer, max_turns=max_turns, pad_id=tokenizer.pad_token_id,
                                   max_model_len=max_model_len, max_output_tokens=max_output_tokens, **kwargs)
