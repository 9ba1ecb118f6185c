"""A population member: named LoRA adapter(s) on the shared base, an optimizer, and
hyperparameters held in a dataclass.

Algorithms (GRPO, LLMPPO, LLMREINFORCE) subclass :class:`LLMAgent` and implement
``learn``; what every member has (history, hooks, clone bookkeeping, release, the quarantine
flag, founders) is :class:`~evollm.algorithms.member.Member`; the adapters, optimizer and
hyperparameter plumbing of an LLM member live here.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import warnings
from dataclasses import dataclass
from typing import Any, ClassVar, Sequence

import torch
from peft import LoraConfig

from ..adapters.routing import check_adapter_layers, check_lora_config
from ..adapters.shared import SharedBase, default_lora_config, describe_lora
from evollm.parallel import zero
from evollm.parallel.distributed import all_reduce_gradients
from ..rollout import SamplingConfig, collate_prompts, eos_ids, forward_logprobs
from ..rollout.sampling import check_extra
from .compat import AgileRLMethods, note_once, translate
from .clip import CLIP_NAMES, check_clip, clip_range, get_clip, set_clip
from .member import Member, MutationHookError  # noqa: F401  (MutationHookError re-exported)
from ..utils.fields import documented

_NO_ZERO = ("does not support DeepSpeed ZeRO: its optimizer is not built with evollm.parallel.zero.wrap; launch it without "
            "a DeepSpeed config")


@dataclass
class AgentConfig:
    """Hyperparameters every LLM agent has.

    The policy contract (what is sampled is what the loss scores):

    * ``temperature``: sampling temperature; the loss scores ``log_softmax(logits / temperature)``.
    * ``top_p`` / ``top_k``: off by default (1.0 / 0). Setting them is an opt-in that warns: the
      loss does not model the truncation.
    * ``stop_strings``: strings that end a completion like an eos (needs ``tokenizer=`` on the member).
    * ``generation_overrides``: other ``transformers.GenerationConfig`` fields (e.g.
      ``{"repetition_penalty": 1.1}``); an opt-in that warns, the loss does not model them. Nothing
      is taken from the model's own ``generation_config`` except its eos ids.
    * ``disable_dropout``: every forward that samples or feeds a loss runs with dropout off (LoRA
      dropout and the base model's own), so the importance ratio is exactly 1 before an update.
    """

    lr: float = documented(5e-5, "AdamW learning rate of the member's adapter.")
    batch_size: int = documented(16, "Rows (completions or episodes) per minibatch of an update.")
    update_epochs: int = documented(1, "Passes over the step's experience per update.")
    target_kl: float | None = documented(None, "Stop an update's epochs early: after an epoch whose mean approx_kl "
                                         "(the policy's KL from the sampling policy) exceeds it, no further epochs "
                                         "run; None: always update_epochs.")
    max_grad_norm: float | None = documented(1.0, "Gradient norm clip per optimizer step; None: no clipping.")
    beta: float = documented(0.0, "Weight of the k3 KL penalty to the reference policy (the base with every adapter "
                             "disabled); 0: no reference forward runs.")
    clip_coef: float | tuple[float, float] | None = documented(
        0.2, "Alias of the clip offsets: a float c sets clip_low = clip_high = c; a tuple (a, b) sets clip_low = a, "
        "clip_high = b (offsets, as TRL's epsilon / epsilon_high); None: the algorithm's default.")
    clip_low: float | None = documented(None, "Lower clip offset: the importance ratio is kept >= 1 - clip_low; "
                                        "None: from clip_coef (wins over it when set).")
    clip_high: float | None = documented(None, "Upper clip offset: the ratio is kept <= 1 + clip_high (DAPO's "
                                         "clip-higher); None: from clip_coef (wins over it when set).")
    temperature: float = documented(1.0, "Sampling temperature; the loss scores log_softmax(logits / temperature), "
                                    "so the sampled policy is the trained one.")
    top_p: float = documented(1.0, "Nucleus sampling; 1.0: off. An opt-in that warns: the loss does not model the "
                              "truncation.")
    top_k: int = documented(0, "Top-k sampling; 0: off. An opt-in that warns: the loss does not model the "
                            "truncation.")
    max_output_tokens: int = documented(32, "Longest completion (new tokens) per sample.")
    max_model_len: int | None = documented(None, "Longest prompt + completion the member may see; None: no limit.")
    logprob_chunk_rows: int | None = documented(None, "Rows per log-prob forward; None: as many as fit "
                                                "logits_budget_mb.")
    logits_budget_mb: float = documented(256.0, "Memory (MiB) one forward's logits, and a fused learn pass's "
                                         "activations, may take.")
    learn_chunk_members: int | None = documented(
        None, "Members per fused learn pass; None: one by one, unless a member's activations are small (below half "
        "its adapter + Adam state, or < 16 MiB), then as many as fit logits_budget_mb (see memory_plan.member_chunks).")
    weight_decay: float = documented(0.0, "AdamW weight decay.")
    seed: int = documented(42, "Seed of the member's own randomness (minibatch shuffling).")
    stop_strings: tuple[str, ...] = documented((), "Strings that end a completion like an eos (needs tokenizer= on "
                                               "the member).")
    generation_overrides: dict = documented({}, "Other transformers.GenerationConfig fields (e.g. "
                                            "{'repetition_penalty': 1.1}); an opt-in that warns: the loss does not "
                                            "model them.")
    disable_dropout: bool = documented(True, "Every forward that samples or feeds a loss runs with dropout off (LoRA "
                                       "dropout and the base model's own), so the ratio is exactly 1 before an "
                                       "update.")

    def validate(self) -> None:
        """Reject values no run can use (one line naming the field); subclasses call this first."""
        for name in ("lr", "lr_actor", "lr_critic"):
            value = getattr(self, name, None)
            if value is not None and not (_finite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        for name in ("batch_size", "update_epochs", "max_output_tokens"):
            if not _integer(getattr(self, name)) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
        if not (_finite(self.temperature) and self.temperature > 0):
            raise ValueError(f"temperature must be > 0, got {self.temperature!r}")
        if not (_finite(self.top_p) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _integer(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0: off), got {self.top_k!r}")
        if self.target_kl is not None and not (_finite(self.target_kl) and self.target_kl > 0):
            raise ValueError(f"target_kl must be > 0 or None (no early stop), got {self.target_kl!r}")
        if not (_finite(self.beta) and self.beta >= 0):
            raise ValueError(f"beta must be >= 0, got {self.beta!r}")
        if self.max_grad_norm is not None and not (_finite(self.max_grad_norm) and self.max_grad_norm > 0):
            raise ValueError(f"max_grad_norm must be > 0 or None, got {self.max_grad_norm!r}")
        if not (_finite(self.weight_decay) and self.weight_decay >= 0):
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay!r}")
        if self.max_model_len is not None and (not _integer(self.max_model_len) or self.max_model_len < 1):
            raise ValueError(f"max_model_len must be an integer >= 1 or None, got {self.max_model_len!r}")
        if not (_finite(self.logits_budget_mb) and self.logits_budget_mb > 0):
            raise ValueError(f"logits_budget_mb must be > 0, got {self.logits_budget_mb!r}")
        check_clip(self)

    def default_clip(self) -> tuple[float, float]:
        """``(clip_low, clip_high)`` when neither they nor ``clip_coef`` are given."""
        return 0.2, 0.2

    def clip_range(self) -> tuple[float, float]:
        """``(clip_low, clip_high)`` in effect (see :mod:`evollm.algorithms.clip`, the one conversion)."""
        return clip_range(self)


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def build_config(config_cls, config, overrides: dict) -> Any:
    """``config`` (or defaults) with keyword overrides; unknown keys are a one-line error."""
    cfg = copy.deepcopy(config) if config is not None else config_cls()
    names = {f.name for f in dataclasses.fields(cfg)}
    unknown = sorted(set(overrides) - names)
    if unknown:
        raise TypeError(f"{config_cls.__name__} has no field(s) {unknown}; valid fields: {sorted(names)}")
    cfg = dataclasses.replace(cfg, **overrides)
    if hasattr(cfg, "validate"):
        cfg.validate()
    return cfg


class LLMAgent(Member, AgileRLMethods):
    """Base class of every algorithm. Not used directly. AgileRL's constructor keywords and methods
    are accepted too (see :mod:`evollm.algorithms.compat`)."""

    config_cls: ClassVar[type] = AgentConfig
    #: hyperparameters the evolution engine may change (beyond ``lora_rank``)
    MUTABLE: ClassVar[tuple[str, ...]] = ("lr", "beta", "clip_coef", "clip_low", "clip_high", "temperature",
                                          "top_p", "top_k",
                                          "max_grad_norm", "update_epochs", "batch_size")
    #: adapter roles a member owns; PPO adds "critic"
    ROLES: ClassVar[tuple[str, ...]] = ("actor",)

    def __init__(self, actor_network: torch.nn.Module | None = None, pad_token_id: int | None = None,
                 pad_token: str | None = None, *, eos_token_id: int | Sequence[int] | None = None, tokenizer=None,
                 config=None, hp_config=None, index: int | None = None, lora_config: LoraConfig | None = None,
                 device: str | torch.device | None = None, model_name: str | None = None, **hyperparameters):
        hyperparameters, agilerl_extras = translate(type(self), hyperparameters)
        actor_network, tokenizer = _resolve_actor(actor_network, model_name, tokenizer)
        if pad_token_id is None:
            raise TypeError(f"{type(self).__name__} needs pad_token_id")
        if lora_config is None:
            warnings.warn("No LoRA config provided. evollm can only be used to finetune adapters at present. Using default "
                          f"LoRA configuration for RL finetuning: {describe_lora(default_lora_config())} (pass "
                          "lora_config=peft.LoraConfig(...) to choose)", stacklevel=2)
        self.config = build_config(self.config_cls, config, hyperparameters)
        check_extra(self.config.generation_overrides)
        if self.config.stop_strings and tokenizer is None:
            raise ValueError("stop_strings need the tokenizer: pass tokenizer= to the member")
        self.pad_token_id = int(pad_token_id)
        self.pad_token = pad_token
        self.tokenizer = tokenizer
        self.eos_token_ids = all_eos_ids(actor_network, eos_token_id, tokenizer, self.pad_token_id)
        self.eos_token_id = self.eos_token_ids[0]
        self.lora_config = copy.deepcopy(lora_config) if lora_config is not None else default_lora_config()
        check_lora_config(self.lora_config)
        if device is not None:
            actor_network.to(device)
        self.shared, self.index = SharedBase.attach(actor_network, self.lora_config, index, self.ROLES)
        try:
            check_adapter_layers(self.shared, self.adapter_name("actor"))
        except ValueError:
            for role in self.ROLES:
                self.shared.delete_adapter(self.adapter_name(role))
            raise
        self._init_extra_modules()
        self.optimizer = self._build_optimizer()
        if zero.active() and not zero.is_zero(self.optimizer):
            for role in self.ROLES:  # a refused member leaves nothing on the shared base
                self.shared.delete_adapter(self.adapter_name(role))
            raise ValueError(f"{type(self).__name__} {_NO_ZERO}")
        self._init_member(hp_config)
        self.__dict__.update(agilerl_extras)

    @classmethod
    def _founders_base(cls, actor_network, kwargs: dict):
        """The founders' base: ``actor_network``, or loaded once from AgileRL's ``model_name=`` (then shared)."""
        if actor_network is None:
            actor_network, tok = _resolve_actor(None, kwargs.pop("model_name", None), kwargs.get("tokenizer"))
            kwargs.setdefault("tokenizer", tok)
        return actor_network

    # ------------------------------------------------------------------ identity
    def adapter_name(self, role: str = "actor") -> str:
        return SharedBase.member_adapter(self.index, role)

    @property
    def device(self) -> torch.device:
        return self.shared.device

    @property
    def actor(self):
        """The shared PeftModel, for code that wants the raw module (None once released)."""
        return None if self.__dict__.get("released") else self.shared.model

    def __getattr__(self, name: str):
        # hyperparameters read as attributes: agent.lr, agent.beta, ...
        config = self.__dict__.get("config")
        if config is not None and name in {f.name for f in dataclasses.fields(config)}:
            return getattr(config, name)
        raise AttributeError(f"{type(self).__name__!s} has no attribute {name!r}")

    @property
    def lora_rank(self) -> int:
        return int(self.shared.config(self.adapter_name("actor")).r)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(index={self.index}, lora_rank={self.lora_rank}, lr={self.config.lr:g})"

    # ------------------------------------------------------------------ parts overridden by algorithms
    def _init_extra_modules(self) -> None:
        """Create non-adapter trainable modules (e.g. PPO's value head)."""

    def _extra_parameters(self) -> dict[str, list[torch.nn.Parameter]]:
        """Hook: the member's trainable tensors outside its adapters, by module (e.g. ``value_head``)."""
        return {}

    def extra_parameters(self) -> dict[str, list[torch.nn.Parameter]]:
        """The member's trainable tensors outside its adapters, by module (e.g. PPO's ``value_head``)."""
        return self._extra_parameters()

    def trainable_parameters(self) -> list[torch.Tensor]:
        """Every tensor the member trains: its adapters' and its extra modules'."""
        params = [p for role in self.ROLES for p in self.shared.parameters(self.adapter_name(role))]
        return params + [p for group in self.extra_parameters().values() for p in group]

    def _param_groups(self) -> list[dict]:
        """One optimizer param group per role, so each can carry its own learning rate: the one route from
        the config's learning rate(s) to the optimizer (set again in place by ``_apply_hyperparameter``)."""
        groups = [{"name": "actor", "params": self.shared.parameters(self.adapter_name("actor")),
                   "lr": self.config.lr}]
        return groups

    def _build_optimizer(self) -> torch.optim.Optimizer:
        # under a DeepSpeed ZeRO launch the AdamW goes into the member's own engine (evollm.parallel.zero)
        return zero.wrap(build_adamw(self._param_groups(), weight_decay=self.config.weight_decay),
                         self.config.max_grad_norm, self.__dict__.get("optimizer"))

    def reinit_optimizers(self) -> None:
        """Rebuild the optimizer from scratch (fresh moments) with the current hyperparameters."""
        self.optimizer = self._build_optimizer()

    # ------------------------------------------------------------------ hyperparameters
    @classmethod
    def evolvable_names(cls, config=None) -> tuple[str, ...]:
        """Hyperparameter names a member of this class can evolve (``lora_rank`` included)."""
        return tuple(cls.MUTABLE) + ("lora_rank",)

    def mutable_hyperparameters(self) -> tuple[str, ...]:
        return self.evolvable_names(self.config)

    def get_hyperparameter(self, name: str):
        if name == "lora_rank":
            return self.lora_rank
        if name not in self.MUTABLE:
            raise ValueError(f"{name!r} cannot evolve on {type(self).__name__}; "
                             f"valid names: {sorted(self.mutable_hyperparameters())}")
        if name in CLIP_NAMES:
            return get_clip(self.config, name)
        return getattr(self.config, name)

    def set_hyperparameter(self, name: str, value) -> None:
        """Set a hyperparameter so that it takes effect where it is used."""
        if name == "lora_rank":
            self.set_lora_rank(int(value))
            return
        self.get_hyperparameter(name)  # validates the name
        trial = copy.deepcopy(self.config)
        if name in CLIP_NAMES:
            set_clip(trial, name, value)
        else:
            setattr(trial, name, value)
        try:
            if hasattr(trial, "validate"):
                trial.validate()
        except (TypeError, ValueError) as e:
            raise ValueError(f"member {self.index}: {name}={value!r} is not valid: {e}") from None
        for f in dataclasses.fields(trial):  # in place: whoever holds self.config sees the new value
            setattr(self.config, f.name, getattr(trial, f.name))
        self._apply_hyperparameter(name, value)

    def _apply_hyperparameter(self, name: str, value) -> None:
        """Push a new value into the objects that cache it. Values read from ``self.config`` at use
        time (beta, clip_coef, sampling settings, epochs, batch size) need nothing here."""
        if name == "lr":
            self._set_group_lr("actor", value)
        if name == "max_grad_norm" and zero.is_zero(self.optimizer):
            self.optimizer.max_grad_norm = value

    def _set_group_lr(self, group_name: str, lr: float) -> None:
        for group in self.optimizer.param_groups:
            if group.get("name") == group_name:
                group["lr"] = lr  # in place: Adam moments are kept

    def set_lora_rank(self, rank: int) -> None:
        from ..adapters.resize import resize_member
        if isinstance(rank, bool) or int(rank) != rank or rank < 1:
            raise ValueError(f"member {self.index}: lora_rank must be an integer >= 1, got {rank!r}")
        resize_member(self, rank)

    # ------------------------------------------------------------------ population methods
    def clone(self, index: int | None = None, wrap: bool = True) -> "LLMAgent":
        """A new member on the same base: in-memory copies of the adapters, extra modules and
        optimizer state; copied hyperparameters and hooks. The clone starts with an EMPTY fitness
        history (it has not been evaluated yet) and ``parent_index`` set to this member's id."""
        new = object.__new__(type(self))
        new.index = self.shared.reserve_index(index)
        new.shared = self.shared
        for role in self.ROLES:
            self.shared.copy_adapter(self.adapter_name(role), new.adapter_name(role))
        new.config = copy.deepcopy(self.config)
        new._init_extra_modules()
        for key, params in self._extra_parameters().items():
            with torch.no_grad():
                for dst, src in zip(new._extra_parameters()[key], params):
                    dst.copy_(src)
        copy_attributes(self, new)
        self._start_clone(new)
        new.optimizer = new._build_optimizer()
        new.optimizer.load_state_dict(_clone_optimizer_state(self.optimizer.state_dict()))
        from ..adapters.resize import carry_fresh_directions
        carry_fresh_directions(self.optimizer, new.optimizer)
        return new

    def _free(self) -> None:
        """Free this member's adapters and optimizer state (the shared base is untouched)."""
        from ..rollout.vllm_engine import engine_of
        engine = engine_of(self.shared)
        if engine is not None:  # rollout_backend="vllm": the engine drops the member's LoRA id too
            engine.release(self.adapter_name("actor"))
        if zero.is_zero(self.optimizer):
            self.optimizer.close()
        for role in self.ROLES:
            self.shared.delete_adapter(self.adapter_name(role))
        self.optimizer = None

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, path, lora_only: bool = True, save_optimizer: bool = True) -> None:
        """Adapter(s) in PEFT's format + optimizer state (safetensors) + hyperparameters (JSON).
        AgileRL's ``lora_only``/``save_optimizer`` are accepted: the shared base is never saved with a
        member, and the optimizer state always is."""
        if not lora_only:
            note_once("lora_only", "a member checkpoint holds its adapters only; the shared base is not copied")
        from evollm.algorithms.checkpoint import save_agent
        save_agent(self, path)

    def load_checkpoint(self, path, merge_lora_configs: bool = False, verify_manifest: bool = True) -> None:
        """Load a checkpoint into this live member. A LoRA rank that differs from the live one is a
        ``ValueError`` unless ``merge_lora_configs`` (then the larger rank wins, function preserved)."""
        from evollm.algorithms.checkpoint import load_agent
        load_agent(self, path, merge_lora_configs=merge_lora_configs, verify_manifest=verify_manifest)

    # ------------------------------------------------------------------ model access
    def sampling_config(self, training: bool = True, group_size: int = 1) -> SamplingConfig:
        c = self.config
        return SamplingConfig(max_new_tokens=c.max_output_tokens, temperature=c.temperature, top_p=c.top_p,
                              top_k=c.top_k, do_sample=training, num_return_sequences=group_size if training else 1,
                              stop_strings=tuple(c.stop_strings), extra=tuple(sorted((k, _frozen(v)) for k, v in c.generation_overrides.items())))

    def get_logprobs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                     use_reference: bool = False, with_entropy: bool = False, start: int | None = None):
        """``[B, L-1]`` per-token log-probs of ``input_ids[:, 1:]`` under this member's actor (or the
        reference: the base with adapters disabled). No gradients. ``start``: the output head runs only
        from this target position on; earlier columns are 0 (see :func:`evollm.rollout.forward_logprobs`)."""
        ctx = self.shared.reference() if use_reference else self.shared.use(self.adapter_name("actor"))
        with torch.no_grad(), ctx as model:
            return forward_logprobs(model, input_ids, attention_mask, self.config.temperature,
                                    self.config.logprob_chunk_rows, with_entropy, self.config.logits_budget_mb,
                                    start=start)

    def _collate(self, prompts):
        return collate_prompts(prompts, self.pad_token_id)

    def optimizer_step(self, loss: torch.Tensor, params: list[torch.nn.Parameter]) -> float:
        """Backward, clip, step. Returns the gradient norm before clipping."""
        self.optimizer.zero_grad(set_to_none=True)
        zero.track(self.optimizer, loss).backward()
        return self.clip_and_step(params)

    def clip_and_step(self, params: list[torch.nn.Parameter]) -> float:
        """Clip the gradients of ``params`` to ``max_grad_norm`` and step. Returns the norm before clipping.
        Under a multi-process launch the gradients are first averaged over processes (under DeepSpeed
        ZeRO the member's engine has reduced and partitioned them during the backward, and clips them)."""
        if zero.is_zero(self.optimizer):
            self.optimizer.max_grad_norm = self.config.max_grad_norm
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            return self.optimizer.last_grad_norm
        all_reduce_gradients(params)
        max_norm = self.config.max_grad_norm
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm else float("inf"))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)  # a member holds no gradient memory between updates
        return float(norm)


def build_adamw(groups: list[dict], **kwargs) -> torch.optim.Optimizer:
    """AdamW with torch's fused kernel where every parameter supports it (float tensors on CPU or
    CUDA), else its multi-tensor ``foreach`` one: one kernel over all tensors instead of a Python
    loop per tensor (the default single-tensor loop cost several times more per step)."""
    params = [p for g in groups for p in g["params"]]
    fused = bool(params) and all(p.dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64)
                                 and p.device.type in ("cpu", "cuda") for p in params)
    try:
        return torch.optim.AdamW(groups, fused=fused, foreach=None if fused else True, **kwargs)
    except (RuntimeError, ValueError):
        return torch.optim.AdamW(groups, foreach=True, **kwargs)


def _frozen(value):
    """Lists (from YAML/JSON) as tuples, so sampling settings can group members."""
    return tuple(_frozen(v) for v in value) if isinstance(value, (list, tuple)) else value


def all_eos_ids(model, eos_token_id, tokenizer, pad_token_id: int) -> tuple[int, ...]:
    """Every id that ends a completion: ``eos_token_id`` (an id or a list), every id of the model's
    ``generation_config.eos_token_id`` (an id or a list) and the tokenizer's eos; the pad id when
    none is known."""
    ids = eos_ids(eos_token_id)
    ids += eos_ids(getattr(getattr(model, "generation_config", None), "eos_token_id", None))
    ids += eos_ids(getattr(tokenizer, "eos_token_id", None))
    return tuple(dict.fromkeys(ids)) or (int(pad_token_id),)


class ActorNetworkError(TypeError, AssertionError):
    """``actor_network`` is not a model (an ``AssertionError`` too, as AgileRL's constructors raise)."""


def _resolve_actor(actor_network, model_name, tokenizer):
    """The base model: ``actor_network``, or loaded from AgileRL's ``model_name`` (a hub id or folder)."""
    if actor_network is not None:
        if not isinstance(actor_network, torch.nn.Module):
            raise ActorNetworkError(f"actor_network must be a causal LM (a PreTrainedModel; AgileRL: a "
                                    f"PeftModelProtocol-like model), got {type(actor_network).__name__}")
        return actor_network, tokenizer
    if model_name is None:
        raise TypeError("pass actor_network= (a causal LM) or model_name= (a hub id or local folder)")
    from ..models.loading import load_model
    model, tok = load_model(model_name)
    return model, tokenizer if tokenizer is not None else tok


def copy_attributes(agent: LLMAgent, clone: LLMAgent) -> LLMAgent:
    """Copy the non-network attributes of ``agent`` onto ``clone`` (ids and adapters excepted)."""
    skip = {"index", "shared", "optimizer", "config", "released", "value_head", "quarantined", "quarantine_reason"}
    for key, value in agent.__dict__.items():
        if key in skip:
            continue
        if key == "mutation_hooks":
            clone.mutation_hooks = list(value)
        elif isinstance(value, (list, dict, set)) or dataclasses.is_dataclass(value):
            clone.__dict__[key] = copy.deepcopy(value)
        else:
            clone.__dict__[key] = value
    clone.config = copy.deepcopy(agent.config)
    clone.released = False
    return clone


def _clone_optimizer_state(state: dict) -> dict:
    """A deep copy of an optimizer state dict (``load_state_dict`` alone would alias moment tensors)."""
    return {
        "state": {k: {n: (t.clone() if torch.is_tensor(t) else copy.deepcopy(t)) for n, t in s.items()}
                  for k, s in state["state"].items()},
        "param_groups": copy.deepcopy(state["param_groups"]),
    }
