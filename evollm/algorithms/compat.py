"""AgileRL's constructor keywords and methods on evollm's agents, so AgileRL scripts run unchanged.

Every keyword of AgileRL's ``GRPO`` / ``LLMPPO`` / ``LLMREINFORCE`` is accepted:

* **renamed** to evollm's field with AgileRL's meaning (``chunk_rows`` -> ``logprob_chunk_rows``,
  ``adv_norm`` -> ``scale_rewards``, ``advantage_granularity`` -> ``action_granularity``,
  ``turn_value_reduction`` -> ``turn_value_reduce``, ``whiten_advantages`` -> ``adv_whitening``,
  ``vllm_importance_sampling_*`` -> ``sampler_correction*``, ``repetition_penalty``/``min_p`` ->
  ``generation_overrides``, ``use_vllm=True`` -> the vLLM rollout backend);
* **engineering knobs** of AgileRL's own implementation (``wrap``, ``micro_batch_size_per_gpu``,
  ``gradient_checkpointing``, ...) are accepted and have no effect; the ones whose non-default value
  asks for something evollm does differently (``use_liger_loss=True``, ``accelerator=``, a cosine LR
  schedule, ``use_sequence_packing=True``, ...) print a one-time note saying so;
* **refused** in one line where a value would silently mean something else here.

The checks AgileRL's constructors make are made with AgileRL's messages (output tokens vs model
length, advantage granularity, chunk sizes, turn-value reduction, clip range, ...).
"""

from __future__ import annotations

import contextlib
import warnings

import numpy as np
import torch

#: keywords with no effect here, accepted with any value
SILENT = ("wrap", "clone", "calc_position_embeddings", "micro_batch_size_per_gpu", "mini_batch_size",
          "hf_generate_chunk_size", "reduce_memory_peak", "cast_logprobs_to_fp32", "use_memory_efficient_params",
          "model_config", "loss_norm", "gradient_checkpointing", "vllm_config", "lora_target_scope",
          "turn_advantage_trajectory_fallback", "min_output_tokens")
#: keyword -> (the value(s) with nothing to note, the one-time note for any other value)
NOTED = {
    "accelerator": ((None,), "the Accelerator object is not used; launch with `accelerate launch` (a DeepSpeed "
                             "config there turns on ZeRO for the population)"),
    "use_liger_loss": ((False,), "Liger kernels are not used; evollm computes the loss with its own fused "
                                 "log-prob path (same loss)"),
    "use_sequence_packing": ((False,), "sequences are not packed; evollm batches left-padded rows"),
    "cosine_lr_schedule_config": ((None,), "no LR schedule: each member keeps its (evolving) lr"),
    "torch_compiler": ((None,), "models are not compiled"),
    "activation_offload": ((False,), "activations are not offloaded"),
    "use_separate_reference_adapter": ((False,), "the KL reference is always the frozen base (adapters "
                                                 "disabled), never a copy of the actor"),
    "turn_level_clip": ((True,), "the ratio is clipped per token"),
    "quantization_config": ((None,), "ignored here: load a quantised base with evollm.load_model instead"),
}
_NOTES_GIVEN: set[str] = set()


def note_once(key: str, message: str) -> None:
    """A one-time ``UserWarning`` per keyword."""
    if key not in _NOTES_GIVEN:
        _NOTES_GIVEN.add(key)
        warnings.warn(f"{key}: {message} (AgileRL keyword accepted for compatibility)", UserWarning, stacklevel=4)


def _reject(cond: bool, exc, message: str) -> None:
    if cond:
        raise exc(message)


def _positive_int(name: str, value) -> None:
    _reject(value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1), ValueError,
            f"{name} must be a positive int or None, got {value!r}")


def translate(cls, kwargs: dict) -> tuple[dict, dict]:
    """AgileRL keywords in ``kwargs`` -> ``(evollm keywords, AgileRL-only attributes)``."""
    kw, extras = dict(kwargs), {}
    name = cls.__name__
    grpo_family = hasattr(cls.config_cls, "group_size") and name in ("GRPO", "GSPO", "CISPO") or \
        issubclass_named(cls, "GRPO")
    for key in SILENT:
        if key in kw:
            extras[key] = kw.pop(key)
    for key, (quiet, message) in NOTED.items():
        if key in kw:
            extras[key] = value = kw.pop(key)
            if not any(value is q or value == q for q in quiet):
                note_once(key, message)
    _positive_int("micro_batch_size_per_gpu", extras.get("micro_batch_size_per_gpu"))
    if "chunk_rows" in kw:
        rows = kw.pop("chunk_rows")
        _reject(rows is not None and (not isinstance(rows, int) or isinstance(rows, bool) or rows < 1), ValueError,
                f"chunk_rows must be a positive int or None, got {rows!r}")
        extras["chunk_rows"] = rows
        kw.setdefault("logprob_chunk_rows", rows)
    if "use_vllm" in kw:
        extras["use_vllm"] = bool(kw.pop("use_vllm"))
    for key, default in (("repetition_penalty", 1.0), ("min_p", 0.0)):
        if key in kw:
            value = kw.pop(key)
            if value != default:
                kw["generation_overrides"] = {**kw.get("generation_overrides", {}), key: value}
    if "vllm_importance_sampling_correction" in kw:
        if not kw.pop("vllm_importance_sampling_correction"):
            kw.setdefault("sampler_correction", "none")
    if "vllm_importance_sampling_cap" in kw:
        kw.setdefault("sampler_correction_cap", kw.pop("vllm_importance_sampling_cap"))
    if "max_output_tokens" in kw and kw["max_output_tokens"] is None:
        kw.pop("max_output_tokens")
        _reject("max_model_len" in kw and kw["max_model_len"] is None, ValueError,
                "Either max_output_tokens or max_model_len must be specified")
    if kw.get("max_model_len") is not None and "max_output_tokens" in kw and name != "GRPO" and not grpo_family:
        _reject(kw["max_output_tokens"] >= kw["max_model_len"], ValueError,
                f"max_output_tokens ({kw['max_output_tokens']}) must be less than max_model_len "
                f"({kw['max_model_len']})")
    _clip_checks(kw, extras)
    _reject("update_epochs" in kw and isinstance(kw["update_epochs"], int) and kw["update_epochs"] < 1,
            UpdateEpochsError, f"update_epochs must be >= 1, got {kw.get('update_epochs')}")
    _granularity(kw, extras, grpo_family)
    if grpo_family:
        _grpo_keywords(cls, kw, extras)
    else:
        _episode_keywords(kw, extras)
    return kw, extras


def issubclass_named(cls, name: str) -> bool:
    return any(c.__name__ == name for c in cls.__mro__)


class UpdateEpochsError(ValueError, AssertionError):
    """``update_epochs < 1`` (an ``AssertionError`` too, as AgileRL's constructor raises)."""


class ClipCoefError(ValueError, AssertionError):
    """A negative ``clip_coef`` (an ``AssertionError`` too, as AgileRL's LLMPPO/LLMREINFORCE raise)."""


def _clip_checks(kw: dict, extras: dict) -> None:
    c = kw.get("clip_coef")
    if isinstance(c, (int, float)) and not isinstance(c, bool) and c < 0:
        raise ClipCoefError(f"clip_coef must be greater than or equal to zero, got {c}")
    if "clip_coef" in kw and c is None:
        raise TypeError("clip_coef must be a float or a tuple or list of two floats, got None")


def _granularity(kw: dict, extras: dict, grpo_family: bool) -> None:
    if "action_granularity" in kw and grpo_family:
        value = kw.pop("action_granularity")
        warnings.warn("action_granularity is deprecated; use advantage_granularity", DeprecationWarning, stacklevel=4)
        kw.setdefault("advantage_granularity", value)
    if "advantage_granularity" not in kw:
        return
    value = kw.pop("advantage_granularity")
    valid = ("auto", "trajectory", "turn") if grpo_family else ("turn", "token", "auto")
    _reject(value not in valid, ValueError, f"Invalid advantage_granularity {value!r}. Expected one of {list(valid)}.")
    extras["advantage_granularity"] = value
    if grpo_family:
        _reject(value == "turn", ValueError, "advantage_granularity='turn' is not available for GRPO in evollm "
                "(group-relative advantages are per trajectory); use LLMPPO or LLMREINFORCE for turn-level credit")
    else:
        kw.setdefault("action_granularity", value)


def _grpo_keywords(cls, kw: dict, extras: dict) -> None:
    if "adv_norm" in kw:
        norm = kw.pop("adv_norm")
        valid = {"mean_std": "group", "mean_only": "none"}
        _reject(norm not in valid, ValueError, f"Invalid adv_norm {norm!r}. Expected one of {list(valid)}.")
        extras["adv_norm"] = norm
        kw.setdefault("scale_rewards", valid[norm])
    loss_type = kw.get("loss_type", getattr(cls, "FIXED_LOSS_TYPE", None))
    if loss_type is not None:
        from ..functional import LOSS_TYPES
        others = [t for t in LOSS_TYPES if t not in ("grpo", "gspo", "cispo")]
        _reject(loss_type not in LOSS_TYPES, ValueError, f"Invalid loss_type {loss_type!r}. Expected one of "
                f"['grpo', 'gspo', 'cispo']. (loss_type={loss_type!r} is not valid; evollm also has {others})")
    if "adv_clip_range" in kw:
        rng = kw.pop("adv_clip_range")
        _reject(rng is not None and not rng > 0, ValueError, "adv_clip_range must be > 0 when provided.")
        extras["adv_clip_range"] = rng
    if "adv_filter_eps" in kw:
        eps = kw.pop("adv_filter_eps")
        _reject(not eps >= 0, ValueError, "adv_filter_eps must be >= 0.")
        extras["adv_filter_eps"] = eps
    if kw.pop("filter_zero_adv", False):
        raise ValueError("filter_zero_adv=True is not supported: use dynamic_sampling=True (drops the groups whose "
                         "rewards are all equal and refills the batch)")
    if kw.pop("use_kl_advantage_shaping", False):
        raise ValueError("use_kl_advantage_shaping=True is not supported: the KL enters the loss (beta * k3)")
    if kw.pop("whiten_advantages", False):
        raise ValueError("whiten_advantages=True is not supported for GRPO: advantages are normalised per group "
                         "(adv_norm / scale_rewards)")
    level = kw.pop("importance_sampling_level", None)
    loss_type = loss_type or "grpo"
    if loss_type == "gspo":
        if level not in (None, "trajectory"):
            warnings.warn(f"loss_type='gspo' implies trajectory-level importance sampling; "
                          f"importance_sampling_level={level!r} is overridden to 'trajectory'", UserWarning,
                          stacklevel=4)
        level = "trajectory"
    else:
        _reject(level not in (None, "token"), ValueError,
                f"importance_sampling_level={level!r} is not available with loss_type={loss_type!r} (token-level "
                "ratios); loss_type='gspo' is the trajectory-level one")
        level = "token"
    extras["importance_sampling_level"] = level
    if loss_type == "cispo" and kw.get("beta", 0.0):
        warnings.warn("CISPO is typically used with beta=0 (no KL penalty)", UserWarning, stacklevel=4)


def _episode_keywords(kw: dict, extras: dict) -> None:
    if "turn_value_reduction" in kw:
        value = kw.pop("turn_value_reduction")
        valid = {"final_value": "last", "mean": "mean"}
        _reject(value not in valid, ValueError, f"Invalid turn_value_reduction {value!r}. Expected one of "
                f"{list(valid)}.")
        extras["turn_value_reduction"] = value
        kw.setdefault("turn_value_reduce", valid[value])
    pooling = kw.pop("turn_ratio_pooling", "sum")
    _reject(pooling not in ("sum", "mean"), ValueError, f"Invalid turn_ratio_pooling {pooling!r}. Expected one of "
            "['sum', 'mean'].")
    _reject(pooling == "mean", ValueError, "turn_ratio_pooling='mean' is not supported: evollm's turn-level "
            "ratio is the sum of the turn's token log-ratios (AgileRL's 'sum')")
    extras["turn_ratio_pooling"] = pooling
    if "whiten_advantages" in kw:
        value = kw.pop("whiten_advantages")
        _reject(not isinstance(value, bool), TypeError, "whiten_advantages must be a boolean.")
        kw.setdefault("adv_whitening", value)
    level = kw.pop("importance_sampling_level", "auto")
    _reject(level not in ("auto", "token", "turn", "trajectory"), ValueError,
            f"Invalid importance_sampling_level {level!r}")
    if level not in ("auto", "token"):
        note_once("importance_sampling_level", "the PPO/REINFORCE ratio is per token here")
    extras["importance_sampling_level"] = level


# ---------------------------------------------------------------------- AgileRL's methods


def agilerl_style_test(agent, env, loop: int) -> np.float64:
    """``agent.test`` on an environment written for AgileRL (not one of evollm's own): a
    ``ReasoningGym``-like env (``eval_mode``, ``reset``, ``step`` -> ``(prompts, rewards)``) scored
    over ``loop`` greedy batches, or a multi-turn env (``reset(seed)`` -> ``(prompt, info)``, ``step``
    -> 5-tuple) played for ``loop`` greedy episodes; the mean reward / return is the fitness."""
    from ..envs.reasoning import ReasoningGym
    if isinstance(env, ReasoningGym) or (hasattr(env, "eval_mode") and not hasattr(env, "get_episode_data")):
        scores = []
        ctx = env.eval_mode() if hasattr(env, "eval_mode") else contextlib.nullcontext()
        with ctx:
            prompts = env.reset()
            for _ in range(loop):
                if isinstance(prompts, dict):  # one batched prompt dict: split into rows
                    prompts = [{"input_ids": prompts["input_ids"][i:i + 1],
                                "attention_mask": prompts["attention_mask"][i:i + 1]}
                               for i in range(prompts["input_ids"].shape[0])]
                completion_ids, _ = agent.get_action(prompts, training=False)[:2]
                prompts, rewards = env.step(completion_ids)
                scores.append(torch.as_tensor(rewards, dtype=torch.float32).mean().item())
        fitness = float(np.mean(scores))
    elif hasattr(env, "reset") and hasattr(env, "step"):
        returns = []
        for _ in range(loop):
            prompt, _ = env.reset(seed=None)
            total, done, turns = 0.0, False, 0
            while not done and turns < getattr(env, "max_turns", 1 << 30):
                completion_ids = agent.get_action([prompt], training=False)[0]
                prompt, reward, terminated, truncated, _ = env.step(completion_ids[0])
                total += float(reward)
                done = bool(terminated or truncated)
                turns += 1
            returns.append(total)
        fitness = float(np.mean(returns))
    else:
        raise TypeError(f"env must be a ReasoningGym (or subclass) or TokenizedMultiTurnEnv-like multi-turn env "
                        f"(reset/step, e.g. evollm's TokenObservationWrapper), got {type(env).__name__}")
    agent.record_fitness(fitness)
    return np.float64(fitness)


def is_evollm_env(env) -> bool:
    """An env evollm's own evaluation handles: a ReasoningGym with its test set, or a TokenObservationWrapper."""
    from ..envs.multiturn import TokenObservationWrapper
    return getattr(env, "test_set", None) is not None or isinstance(env, TokenObservationWrapper)


class AgileRLMethods:
    """AgileRL's agent methods and attributes on every evollm agent (mixed into ``LLMAgent``)."""

    lr_scheduler = None  # evollm has no LR schedule (see ``cosine_lr_schedule_config``)
    reference_update_tracker = 0

    @classmethod
    def load(cls, path, *args, **kwargs):
        """AgileRL's ``GRPO.load`` is not implemented for LLM agents either: build the member on its base,
        then :meth:`load_checkpoint`."""
        raise NotImplementedError(f"{cls.__name__}.load is not available for LLM agents: create the agent on its "
                                  "base model, then call agent.load_checkpoint(path)")

    @property
    def batch_size_per_process(self) -> int:
        from evollm.parallel import distributed as dist
        return self.config.batch_size // dist.num_processes()

    @property
    def clip_coef_min(self) -> float:
        """AgileRL's name of the lower clip offset (``clip_low``)."""
        return self.get_hyperparameter("clip_low")

    @property
    def clip_coef_max(self) -> float:
        """AgileRL's name of the upper clip offset (``clip_high``)."""
        return self.get_hyperparameter("clip_high")

    @property
    def mut(self):
        """AgileRL's record of the last mutation: the mutated hyperparameter's name, ``"None"`` when the
        last mutation left the member unchanged, ``None`` before any (evollm's: ``last_mutation``)."""
        if "mut" in self.__dict__:
            return self.__dict__["mut"]
        record = self.__dict__.get("last_mutation")
        return None if record is None else ("None" if record.kind == "none" else record.name)

    @mut.setter
    def mut(self, value) -> None:
        self.__dict__["mut"] = value

    def clean_up(self) -> None:
        """AgileRL's name of :meth:`release`."""
        self.release()

    def preprocess_observation(self, observation):
        return observation

    def recompile(self) -> None:
        """Nothing to recompile (models are not compiled)."""

    def set_reference_policy(self, reference_update_tracker: int) -> None:
        """Recorded only: the KL reference is always the frozen base with adapters disabled (AgileRL can
        instead copy the actor into a separate reference adapter when the tracker moves)."""
        if reference_update_tracker != self.reference_update_tracker:
            note_once("set_reference_policy", "the KL reference stays the frozen base (adapters disabled)")
        self.reference_update_tracker = reference_update_tracker


def with_turn_ids(experiences, turn_ids):
    """AgileRL's ``learn((ids, masks, rewards), turn_ids=...)`` as evollm's ``(ids, masks, turn_ids, rewards)``;
    1-D rewards become one column."""
    if turn_ids is None:
        return experiences
    if len(experiences) != 3:
        raise ValueError("turn_ids= goes with (completion_ids, action_masks, rewards) experiences")
    ids, masks, rewards = experiences
    rewards = torch.as_tensor(rewards, dtype=torch.float32)
    return ids, masks, turn_ids, rewards.unsqueeze(-1) if rewards.dim() == 1 else rewards


class AgileRLMetrics(dict):
    """A learn result that also answers AgileRL's metric names (``metrics["pg_loss"]``, ``"clipfrac" in
    metrics``) without holding them twice: iteration, logs and reports see evollm's names only."""

    ALIASES = {"pg_loss": "policy_loss", "vf_loss": "value_loss", "clipfrac": "clip_fraction"}

    def __missing__(self, key):
        if key in self.ALIASES and dict.__contains__(self, self.ALIASES[key]):
            return self[self.ALIASES[key]]
        raise KeyError(key)

    def __contains__(self, key) -> bool:
        return dict.__contains__(self, key) or (key in self.ALIASES and dict.__contains__(self, self.ALIASES[key]))

    def get(self, key, default=None):
        return self[key] if key in self else default


class VLLMConfig(dict):
    """AgileRL's vLLM settings (``VLLMConfig(sleep_mode=..., max_num_seqs=..., gpu_memory_utilization=...)``),
    accepted as ``vllm_config=`` beside ``use_vllm=True``. The fields evollm's engine knows reach it
    (:class:`evollm.rollout.vllm_engine.VLLMSettings`); the rest are AgileRL's own."""

    def __init__(self, **fields):
        super().__init__(**fields)

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def wants_vllm(pop) -> bool:
    """AgileRL's ``use_vllm=True`` on a member: the vLLM rollout backend where vLLM is installed (a
    one-time note and Hugging Face generation where it is not)."""
    import importlib.util
    if not any(getattr(a, "__dict__", {}).get("use_vllm") for a in pop):
        return False
    if importlib.util.find_spec("vllm") is None:
        note_once("use_vllm", "vLLM is not installed here; members generate with Hugging Face generate")
        return False
    return True
