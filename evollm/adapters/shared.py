"""One frozen base model, many LoRA adapters.

Every member of a population lives on the same :class:`SharedBase`: a single
``peft.PeftModel`` wrapping the user's base model once. A member *is* its named
adapters (plus its optimizer and hyperparameters, held by the agent). Adding,
copying, resizing and dropping a member only touches adapter tensors; no base
tensor is ever copied.

The reference policy is the base with every adapter disabled
(:meth:`SharedBase.reference`).
"""

from __future__ import annotations

import contextlib
import copy
import weakref
from typing import Iterator

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora import LoraLayer
from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict

from . import fastlora

DEFAULT_TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

_REGISTRY: "weakref.WeakKeyDictionary[torch.nn.Module, SharedBase]" = weakref.WeakKeyDictionary()


def default_lora_config(r: int = 8, lora_alpha: int | None = None, **kwargs) -> LoraConfig:
    """A causal-LM LoRA config on the attention and MLP projections."""
    kwargs.setdefault("target_modules", list(DEFAULT_TARGET_MODULES))
    kwargs.setdefault("lora_dropout", 0.0)
    return LoraConfig(r=r, lora_alpha=lora_alpha if lora_alpha is not None else 2 * r, task_type="CAUSAL_LM", **kwargs)


def describe_lora(config: LoraConfig) -> str:
    """``r=8, lora_alpha=16, lora_dropout=0.0, target_modules=[...]``: what a user needs of a LoRA config."""
    return (f"r={config.r}, lora_alpha={config.lora_alpha}, lora_dropout={config.lora_dropout}, "
            f"target_modules={sorted(config.target_modules)}")


_CHECKPOINT_LAYERS: "weakref.WeakKeyDictionary[torch.nn.Module, tuple]" = weakref.WeakKeyDictionary()


def checkpointing(model) -> bool:
    """Whether ``model`` recomputes activations in backward (gradient checkpointing): transformers'
    ``is_activation_checkpointing``, i.e. any module with a true ``gradient_checkpointing`` flag.

    The modules that carry the flag (transformers gives it to a model's layers when they are built, and
    ``gradient_checkpointing_enable`` only flips it) are found once per model: transformers' property
    walks every module on each call, and with many members' LoRA modules on the base those walks cost
    more than the rest of a small learn step."""
    if not isinstance(model, torch.nn.Module):
        return bool(getattr(model, "is_activation_checkpointing", getattr(model, "is_gradient_checkpointing", False)))
    layers = _CHECKPOINT_LAYERS.get(model)
    if layers is None:
        layers = _CHECKPOINT_LAYERS[model] = tuple(m for m in model.modules() if hasattr(m, "gradient_checkpointing"))
    return any(m.gradient_checkpointing for m in layers)


class SharedBase:
    """The single ``PeftModel`` all members of a population share.

    Use :meth:`of` rather than the constructor: calling it twice with the same model
    returns the same object, so agents created separately still share one base.
    """

    def __init__(self, model: torch.nn.Module, lora_config: LoraConfig, first_adapter: str):
        self._used_ids: dict[str, set[int]] = {}  # id space ("member", "team") -> every id ever given
        self._computed: dict[str, object] = {}  # computed_once: facts of the frozen base
        self._released_kept: set[str] = set()  # released adapters PEFT would not delete (the last one)
        self._param_cache: dict[str, list] = {}
        self._layers: list | None = None
        self._fast = fastlora.FastState()
        self._fast_support: dict[str, str] = {}
        if isinstance(model, PeftModel):
            self.peft_model = model
            self._inherited = model.active_adapter
            self.peft_model.add_adapter(first_adapter, copy.deepcopy(lora_config))
        else:
            self._inherited = None
            self.peft_model = get_peft_model(model, copy.deepcopy(lora_config), adapter_name=first_adapter)
        for p in self.base_parameters():
            p.requires_grad_(False)
        self.peft_model.eval()  # sampling and loss forwards run in eval mode: contexts then switch nothing

    # ------------------------------------------------------------------ registry
    @staticmethod
    def member_adapter(index: int, role: str = "actor") -> str:
        """Adapter name of a member's role: ``m3`` (actor), ``m3_critic``, ..."""
        return f"m{index}" if role == "actor" else f"m{index}_{role}"

    @classmethod
    def attach(cls, model: torch.nn.Module, lora_config: LoraConfig, index: int | None = None,
               roles: tuple[str, ...] = ("actor",)) -> tuple["SharedBase", int]:
        """Give a new member adapters on ``model``'s shared base (created on first use).

        Returns the shared base and the member's id, unique on that base and never reused.
        """
        shared = _REGISTRY.get(model)
        if shared is None and isinstance(model, PeftModel):
            shared = _REGISTRY.get(model.get_base_model())
        if shared is None:
            index = 0 if index is None else int(index)
            shared = cls(model, lora_config, cls.member_adapter(index, roles[0]))
            _REGISTRY[shared.peft_model] = shared
            _REGISTRY[shared.peft_model.get_base_model()] = shared
            shared.reserve_index(index)
            if shared._inherited is not None:
                shared.copy_adapter(shared._inherited, cls.member_adapter(index, roles[0]), weights_only=True)
            first = roles[1:]
        else:
            index = shared.reserve_index(index)
            first = roles
        for role in first:
            shared.add_adapter(cls.member_adapter(index, role), lora_config)
        return shared, index

    @classmethod
    def find(cls, model: torch.nn.Module) -> "SharedBase | None":
        """The shared base already made for ``model`` (or its PEFT wrapper), if any."""
        shared = _REGISTRY.get(model)
        if shared is None and isinstance(model, PeftModel):
            shared = _REGISTRY.get(model.get_base_model())
        return shared

    def reserve_index(self, index: int | None = None, space: str = "member") -> int:
        """An id never used before on this base in ``space`` (``"member"``: members and the agents of
        teams; ``"team"``: teams), or claim ``index``, which must be new there."""
        used = self._used_ids.setdefault(space, set())
        if index is None:
            index = max(used, default=-1) + 1
        elif index in used:
            raise ValueError(f"{space} id {index} was already used on this shared base; ids are never reused")
        used.add(int(index))
        return int(index)

    def next_index(self, space: str = "member") -> int:
        """The id :meth:`reserve_index` would give next in ``space``."""
        return max(self._used_ids.get(space, ()), default=-1) + 1

    def used_indices(self, space: str = "member") -> list[int]:
        """Every id given in ``space`` on this base, sorted (saved with a population checkpoint)."""
        return sorted(self._used_ids.get(space, ()))

    def mark_used(self, indices, space: str = "member") -> None:
        """Record ``indices`` as given in ``space`` (a restored population's ids: never given again)."""
        self._used_ids.setdefault(space, set()).update(int(i) for i in indices)

    def return_index(self, index: int, space: str = "member") -> None:
        """Let a saved member come back under its own ``index`` (a resumed or loaded member): the id may be
        reserved once more, by that member."""
        self._used_ids.get(space, set()).discard(int(index))

    def computed_once(self, key: str, compute):
        """``compute()`` the first time ``key`` is asked for, then the same value: facts of the frozen base
        (e.g. its fingerprint) that never change."""
        if key not in self._computed:
            self._computed[key] = compute()
        return self._computed[key]

    def is_live(self, adapter: str) -> bool:
        """Whether ``adapter`` exists on this base and was not released."""
        return self.has_adapter(adapter) and adapter not in self._released_kept

    # ------------------------------------------------------------------ adapters
    @property
    def model(self) -> PeftModel:
        return self.peft_model

    @property
    def device(self) -> torch.device:
        return next(self.peft_model.parameters()).device

    def adapters(self) -> list[str]:
        return list(self.peft_model.peft_config)

    def has_adapter(self, name: str) -> bool:
        return name in self.peft_model.peft_config

    def config(self, name: str) -> LoraConfig:
        return self.peft_model.peft_config[name]

    def add_adapter(self, name: str, lora_config: LoraConfig) -> None:
        if self.has_adapter(name) and name in self._released_kept:
            # a released member's adapter kept only because PEFT cannot drop its last one: replace it
            self.peft_model.add_adapter("_evollm_swap", copy.deepcopy(lora_config))
            self.peft_model.set_adapter("_evollm_swap")
            self.peft_model.delete_adapter(name)
            self._released_kept.discard(name)
            self.peft_model.add_adapter(name, copy.deepcopy(lora_config))
            self.peft_model.set_adapter(name)
            self.peft_model.delete_adapter("_evollm_swap")
            self.invalidate()
            return
        if self.has_adapter(name):
            raise ValueError(f"adapter {name!r} already exists on this shared base")
        self.peft_model.add_adapter(name, copy.deepcopy(lora_config))
        self.invalidate()

    def delete_adapter(self, name: str) -> None:
        """Free a member's adapter. The last adapter of a PeftModel cannot be deleted, so it is kept."""
        if not self.has_adapter(name):
            return
        if len(self.adapters()) == 1:
            self._released_kept.add(name)
            return
        if self.peft_model.active_adapter == name:
            other = next(a for a in self.adapters() if a != name)
            self.peft_model.set_adapter(other)
        self.peft_model.delete_adapter(name)
        self.invalidate()

    def invalidate(self) -> None:
        """Forget cached parameter lists (after adding, deleting or resizing an adapter)."""
        self._param_cache.clear()
        self._layers = None
        self._fast_support.clear()

    def parameters(self, name: str) -> list[torch.nn.Parameter]:
        """The trainable tensors of one adapter, in a fixed (name-sorted) order."""
        return [p for _, p in self.named_parameters(name)]

    def named_parameters(self, name: str) -> list[tuple[str, torch.nn.Parameter]]:
        if name not in self._param_cache:
            tag = f".{name}."
            items = [(n, p) for n, p in self.peft_model.named_parameters() if tag in n and "lora_" in n]
            if not items:
                raise KeyError(f"adapter {name!r} has no parameters on this shared base")
            self._param_cache[name] = sorted(items, key=lambda kv: kv[0])
        return list(self._param_cache[name])

    def base_parameters(self) -> Iterator[torch.nn.Parameter]:
        for n, p in self.peft_model.named_parameters():
            if "lora_" not in n:
                yield p

    def copy_adapter(self, src: str, dst: str, weights_only: bool = False) -> None:
        """Make ``dst`` an in-memory copy of ``src`` (created with ``src``'s config if missing)."""
        if not self.has_adapter(dst):
            if weights_only:
                raise KeyError(dst)
            self.add_adapter(dst, self.config(src))
        src_params = dict(self.named_parameters(src))
        with torch.no_grad():
            for n, p in self.named_parameters(dst):
                p.copy_(src_params[n.replace(f".{dst}.", f".{src}.")])

    def state_dict(self, name: str) -> dict[str, torch.Tensor]:
        """The adapter's tensors with PEFT's on-disk key names (adapter name stripped)."""
        sd = get_peft_model_state_dict(self.peft_model, adapter_name=name)
        return {k: v.detach().clone() for k, v in sd.items()}

    def load_state_dict(self, name: str, state: dict[str, torch.Tensor]) -> None:
        result = set_peft_model_state_dict(self.peft_model, state, adapter_name=name)
        missing = [k for k in getattr(result, "unexpected_keys", []) if "lora_" in k]
        if missing:
            raise ValueError(f"adapter state for {name!r} has keys this model does not have: {missing[:3]}")

    # ------------------------------------------------------------------ contexts
    @staticmethod
    def _set_mode(model, train: bool) -> None:
        """``model.train(train)`` only when the mode changes (each call walks every module)."""
        if model.training != train:
            model.train(train)

    def fast_path(self, name: str) -> bool:
        """Whether member adapter ``name`` runs on the fast LoRA forward (see :mod:`.fastlora`) now."""
        layers = [m for _, m in self.lora_layers()]
        if name not in self._fast_support:
            fastlora.install(layers, self._fast)
            self._fast_support[name] = fastlora.support(layers, name)
        verdict = self._fast_support[name]
        if checkpointing(self.peft_model.get_base_model()):
            # backward recomputes the forward after use() has returned: the active adapter must persist,
            # as PEFT's set_adapter does, not be restored on exit as the fast forward's member is
            return False
        return verdict == "yes" or (verdict == "eval" and not self.peft_model.training)

    @contextlib.contextmanager
    def use(self, name: str, train: bool = False):
        """Run the shared model as member ``name`` (only its adapter active).

        The model's train/eval mode is switched (and restored) only when it differs from ``train``.
        Plain LoRA adapters run on :mod:`.fastlora`'s forward: switching members is one assignment
        instead of PEFT's ``set_adapter`` walk; other adapters use PEFT's own forward.
        """
        model = self.peft_model
        was_training = model.training
        self._set_mode(model, train)
        previous = self._fast.mode
        if self.fast_path(name):
            for p in self.parameters(name):
                if not p.requires_grad:
                    p.requires_grad_(True)
            self._fast.mode = name
        else:
            self._fast.mode = None
            if model.active_adapter != name:
                model.set_adapter(name)
        try:
            yield model
        finally:
            self._fast.mode = previous
            self._set_mode(model, was_training)

    @contextlib.contextmanager
    def reference(self):
        """Run the base model alone: every adapter disabled (LoRA layers flagged off directly, the
        fast forward set to the base; no walk of the model as with PEFT's ``disable_adapter()``)."""
        model = self.peft_model
        was_training = model.training
        self._set_mode(model, False)
        layers = [m for _, m in self.lora_layers()]
        fastlora.install(layers, self._fast)
        disabled = [m._disable_adapters for m in layers]
        for m in layers:
            m.__dict__["_disable_adapters"] = True  # a plain attribute: skip Module.__setattr__'s checks
        previous, self._fast.mode = self._fast.mode, fastlora.BASE
        try:
            yield model
        finally:
            self._fast.mode = previous
            for m, flag in zip(layers, disabled):
                m.__dict__["_disable_adapters"] = flag
            self._set_mode(model, was_training)

    def lora_layers(self) -> list[tuple[str, LoraLayer]]:
        if self._layers is None:
            self._layers = [(n, m) for n, m in self.peft_model.named_modules()
                            if isinstance(m, LoraLayer) and hasattr(m, "lora_A")]
        return list(self._layers)

    def __repr__(self) -> str:
        n_base = sum(p.numel() for p in self.base_parameters())
        return f"SharedBase(base_params={n_base}, adapters={self.adapters()})"
