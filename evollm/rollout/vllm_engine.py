"""ONE vLLM engine for a whole population on one shared base: every member is a LoRA id.

:class:`VLLMEngine` serves every member of a :class:`~evollm.adapters.shared.SharedBase` from a
single ``vllm.LLM`` built on the frozen base weights with ``enable_lora=True``. A rollout or an
evaluation of all members is ONE ``generate`` call in which every request carries its member's
``LoRARequest``.

Keeping the engine in step with training (:meth:`VLLMEngine.sync`, run before every generate):

* a member whose adapter tensors changed since it was registered (a learn step, a clone, a
  mutation, a LoRA rank change) is saved in PEFT's format and registered under a NEW LoRA id, then
  its old id is removed (never ``load_inplace``, which re-reads the disk at every request);
* a member no longer in the population (released) is removed from the engine;
* an integrity check compares, for every newly registered member, the engine's log-probs of a probe
  sequence with the trainer's forward; a difference above ``integrity_atol`` raises
  :class:`EngineMismatchError` naming the member.

The engine returns the log-probs of the sampled tokens under ITS sampling distribution
(``logprobs_mode="processed_logprobs"``: temperature, top-k and top-p applied) so that the loss can
correct a sampler/trainer mismatch (:func:`evollm.functional.sampler_importance_weights`).

vLLM is an optional dependency (``pip install evollm[vllm]``); importing this module does not
import vLLM, building an engine does.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch

#: LoRA ranks vLLM accepts as ``max_lora_rank``.
VLLM_LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)
MODES = ("colocate", "server")


class EngineMismatchError(RuntimeError):
    """The engine serves something other than what the trainer trained."""


@dataclass
class VLLMSettings:
    """Settings of the vLLM rollout backend (``rollout_backend: vllm`` plus the ``vllm:`` section).

    Attributes:
        mode: ``colocate``: the engine lives in the training process and shares its device.
            ``server``: a running vLLM OpenAI-compatible server at ``server_url`` (runtime LoRA
            loading; see :mod:`evollm.rollout.vllm_server` for how to start it).
        server_url: Base URL of the server in ``server`` mode, e.g. ``http://localhost:8000``. The
            server must read the adapter folders the engine writes (``adapter_dir``; same machine
            or a shared filesystem), serve the same base, and allow ``max_lora_rank``.
        model_path: Folder or hub id of the base weights the engine loads; ``None``: the base's own
            ``name_or_path`` when it is a local folder, else the in-memory base is exported once.
            The integrity check catches a path whose weights differ from the trainer's base.
        dtype: Engine dtype (``auto``: the trainer's). Float32 matches HF + PEFT to ~1e-5 in
            log-probs; bfloat16 does not match token for token, hence the sampler correction.
        max_lora_rank: Largest LoRA rank the engine accepts (rounded up to a rank vLLM supports);
            ``None``: the largest rank the members may mutate to (``hp_config.lora_rank.max``) or
            have now. A member growing past it is a one-line error.
        max_loras: Adapters served in one batch; ``None``: the population size.
        max_model_len: Longest prompt + completion; ``None``: the model's maximum.
        gpu_memory_utilization: Fraction of the GPU the engine may take in colocate mode (the rest
            stays for training). Ignored on CPU (there ``VLLM_CPU_KVCACHE_SPACE`` GiB are used).
        enable_sleep_mode: Colocate on GPU: put the engine to sleep (level 1: weights offloaded to
            CPU, KV cache freed) after every generate and wake it before the next, freeing the GPU
            for the learn step. Ignored where vLLM has no sleep mode (CPU).
        enforce_eager: No CUDA graphs; ``None``: eager on CPU, graphs on GPU.
        tensor_parallel_size: GPUs one engine spans (colocate mode).
        integrity_check_interval: Check every N-th sync (1: every time adapters change; 0: never).
        integrity_atol: Largest tolerated |engine - trainer| log-prob on the probe; ``None``: 1e-3 in
            float32, 0.1 in 16-bit dtypes.
        adapter_dir: Where adapters are written for the engine; ``None``: a temporary folder.
        seed: Seed of the engine itself. Sampling does not depend on it: every sampled request carries
            its own ``SamplingParams.seed`` drawn from torch's global generator (the generator HF
            sampling uses, seeded per step and saved in run checkpoints), so a resumed run, or another
            engine, samples the same tokens.
        engine_kwargs: Further ``vllm.LLM`` keyword arguments.
    """

    mode: str = "colocate"
    server_url: str | None = None
    model_path: str | None = None
    dtype: str = "auto"
    max_lora_rank: int | None = None
    max_loras: int | None = None
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.3
    enable_sleep_mode: bool = False
    enforce_eager: bool | None = None
    tensor_parallel_size: int = 1
    integrity_check_interval: int = 1
    integrity_atol: float | None = None
    adapter_dir: str | None = None
    seed: int = 0
    engine_kwargs: dict = field(default_factory=dict)

    def validate(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"vllm.mode={self.mode!r} is not valid; choose one of {list(MODES)}")
        if (self.mode == "server") != bool(self.server_url):
            raise ValueError("vllm.server_url is required with vllm.mode=server (and only then), e.g. "
                             "http://localhost:8000")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"vllm.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.integrity_check_interval < 0:
            raise ValueError(f"vllm.integrity_check_interval must be >= 0, got {self.integrity_check_interval}")
        if self.max_lora_rank is not None and self.max_lora_rank > VLLM_LORA_RANKS[-1]:
            raise ValueError(f"vllm.max_lora_rank={self.max_lora_rank} is above vLLM's largest {VLLM_LORA_RANKS[-1]}")

    @classmethod
    def from_dict(cls, data: dict | "VLLMSettings" | None) -> "VLLMSettings":
        if isinstance(data, VLLMSettings):
            return data
        data = dict(data or {})
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"vllm: unknown key(s) {unknown}; valid keys: {sorted(names)}")
        settings = cls(**data)
        settings.validate()
        return settings


def vllm_available() -> bool:
    try:
        import vllm
    except Exception:  # ImportError, or a broken install (e.g. CUDA-only torchvision)
        return False
    return getattr(vllm, "__file__", None) is not None  # not a stray namespace folder


def supported_lora_rank(rank: int) -> int:
    for r in VLLM_LORA_RANKS:
        if r >= rank:
            return r
    raise ValueError(f"LoRA rank {rank} is above vLLM's largest max_lora_rank {VLLM_LORA_RANKS[-1]}")


def adapter_fingerprint(shared, name: str) -> tuple:
    """A cheap content fingerprint of one adapter (float64 sum and sum of squares of every tensor,
    plus shapes): it changes when a learn step, a copy or a resize changes the adapter."""
    params = shared.parameters(name)
    with torch.no_grad():
        sums = torch.stack([torch.stack([p.double().sum(), p.double().square().sum()]) for p in params])
    return tuple(tuple(p.shape) for p in params), tuple(sums.flatten().cpu().tolist())


def export_base(shared, directory: Path) -> Path:
    """Write the frozen base (no LoRA tensors) as a plain HF model folder vLLM can load."""
    from safetensors.torch import save_file

    base = shared.model.get_base_model()
    directory.mkdir(parents=True, exist_ok=True)
    state, seen = {}, set()
    for name, tensor in base.state_dict().items():
        if "lora_" in name:
            continue
        key = name.replace(".base_layer.", ".")
        if tensor.data_ptr() in seen:  # tied weights are stored once
            continue
        seen.add(tensor.data_ptr())
        state[key] = tensor.detach().to("cpu").contiguous()
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    base.config.save_pretrained(str(directory))
    if getattr(base, "generation_config", None) is not None:
        base.generation_config.save_pretrained(str(directory))
    return directory


@dataclass
class _Registered:
    lora_id: int
    path: Path
    fingerprint: tuple


_ENGINES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def engine_of(shared) -> "VLLMEngine | None":
    """The vLLM engine serving ``shared``'s members, if the population was given one."""
    return _ENGINES.get(shared)


class VLLMEngine:
    """One vLLM engine for every member on ``shared``. Use :meth:`for_members` to get the engine of a
    population (built on first use, then reused)."""

    def __init__(self, shared, settings: VLLMSettings | dict | None = None, max_rank: int = 8,
                 population_size: int = 8):
        self.settings = VLLMSettings.from_dict(settings)
        self.shared = shared
        s = self.settings
        self._root = Path(s.adapter_dir or tempfile.mkdtemp(prefix="evollm-vllm-"))
        self._root.mkdir(parents=True, exist_ok=True)
        self._own_root = s.adapter_dir is None
        self._registered: dict[str, _Registered] = {}
        self._next_id = 1
        self._syncs = 0
        self.probe: list[int] | None = None
        self.stats = {"start_s": 0.0, "swaps": 0, "swap_s": 0.0, "integrity_checks": 0, "integrity_max_diff": 0.0}
        self.max_lora_rank = supported_lora_rank(s.max_lora_rank or max_rank)
        self.max_loras = int(s.max_loras or population_size)
        t0 = time.perf_counter()
        if s.mode == "server":
            from .vllm_server import ServerBackend
            self.backend = ServerBackend(s.server_url)
        else:
            from .vllm_colocated import ColocatedBackend
            self.backend = ColocatedBackend(self._build_llm())
        self.stats["start_s"] = time.perf_counter() - t0

    # ------------------------------------------------------------------ construction
    @classmethod
    def for_members(cls, members: Sequence, settings: VLLMSettings | dict | None = None) -> "VLLMEngine":
        """The engine of the members' shared base (one per base, built on first use)."""
        shared = members[0].shared
        engine = _ENGINES.get(shared)
        if engine is None:
            engine = cls(shared, settings, max_rank=_max_rank(members), population_size=len(members))
            _ENGINES[shared] = engine
        return engine

    def _model_dtype(self) -> torch.dtype:
        return next(self.shared.base_parameters()).dtype

    def _model_path(self) -> str:
        s = self.settings
        if s.model_path:
            return s.model_path
        name = getattr(self.shared.model.get_base_model().config, "_name_or_path", "") or ""
        if name and Path(name, "config.json").exists():
            return name
        return str(export_base(self.shared, self._root / "base"))

    def _build_llm(self):
        from vllm import LLM

        s = self.settings
        on_gpu = torch.cuda.is_available()
        dtype = s.dtype if s.dtype != "auto" else str(self._model_dtype()).replace("torch.", "")
        kwargs = dict(model=self._model_path(), enable_lora=True, max_loras=self.max_loras,
                      max_cpu_loras=2 * self.max_loras + 1, max_lora_rank=self.max_lora_rank, dtype=dtype,
                      enforce_eager=(not on_gpu) if s.enforce_eager is None else s.enforce_eager,
                      skip_tokenizer_init=True, logprobs_mode="processed_logprobs", seed=s.seed,
                      tensor_parallel_size=s.tensor_parallel_size, gpu_memory_utilization=s.gpu_memory_utilization)
        if s.max_model_len:
            kwargs["max_model_len"] = s.max_model_len
        if s.enable_sleep_mode and on_gpu:
            kwargs["enable_sleep_mode"] = True
        kwargs.update(s.engine_kwargs)
        return LLM(**kwargs)

    # ------------------------------------------------------------------ keeping in step
    def sync(self, members: Sequence, release_others: bool = True) -> list[str]:
        """Register every member whose adapter changed; remove members no longer given (when
        ``release_others``). Returns the adapter names (re)registered."""
        names = {m.adapter_name("actor"): m for m in members}
        changed = []
        for name, member in names.items():
            if member.lora_rank > self.max_lora_rank:
                raise ValueError(f"member {member.index} has LoRA rank {member.lora_rank} but the vLLM engine was "
                                 f"built with max_lora_rank={self.max_lora_rank}; set vllm.max_lora_rank >= the "
                                 "largest rank mutations may reach")
            fp = adapter_fingerprint(self.shared, name)
            old = self._registered.get(name)
            if old is not None and old.fingerprint == fp:
                continue
            self._register(name, fp)
            changed.append(name)
        if release_others:
            for name in [n for n in self._registered if n not in names]:
                self.release(name)
        self._syncs += 1
        interval = self.settings.integrity_check_interval
        if changed and interval and (self._syncs - 1) % interval == 0 and self.probe is not None:
            self.check([names[n] for n in changed])
        return changed

    def _register(self, name: str, fingerprint: tuple) -> None:
        t0 = time.perf_counter()
        lora_id = self._next_id
        self._next_id += 1
        folder = self._root / f"{name}-{lora_id}"
        # PEFT's own format (adapter_config.json + adapter_model.safetensors), in folder/<name>/
        self.shared.model.save_pretrained(str(folder), selected_adapters=[name], safe_serialization=True)
        path = folder / name if (folder / name).is_dir() else folder
        self.backend.add(name, lora_id, path)
        old = self._registered.pop(name, None)
        self._registered[name] = _Registered(lora_id, path, fingerprint)
        if old is not None:
            self.backend.remove(old.lora_id)
            shutil.rmtree(old.path.parent if old.path.parent != self._root else old.path, ignore_errors=True)
        self.stats["swaps"] += 1
        self.stats["swap_s"] += time.perf_counter() - t0

    def release(self, name: str) -> None:
        """Remove a member's adapter from the engine (the member was released)."""
        old = self._registered.pop(name, None)
        if old is not None:
            self.backend.remove(old.lora_id)
            shutil.rmtree(old.path.parent if old.path.parent != self._root else old.path, ignore_errors=True)

    def lora_id(self, name: str) -> int:
        return self._registered[name].lora_id

    def registered(self) -> dict[str, int]:
        return {n: r.lora_id for n, r in self._registered.items()}

    # ------------------------------------------------------------------ integrity
    def probe_logprobs(self, members: Sequence, probe: list[int], tokens: int = 8) -> list[tuple[list[int], list[float]]]:
        """Per member: the engine's greedy continuation of ``probe`` (``tokens`` ids, eos ignored) and
        the engine's log-prob of each continuation token (the sampling path, batched over members)."""
        reqs = [(probe, m.adapter_name("actor")) for m in members]
        params = dict(max_tokens=tokens, n=1, logprobs=0, temperature=0.0, ignore_eos=True, detokenize=False)
        return [samples[0] for samples in self.backend.generate(reqs, self._registered, params)]

    def trainer_logprobs(self, members: Sequence, sequences: Sequence[list[int]], start: int) -> list[torch.Tensor]:
        """Per member: the trainer's log-probs (temperature 1) of ``sequence[start:]``."""
        from .logprobs import forward_logprobs

        rows = []
        for m, seq in zip(members, sequences):
            ids = torch.tensor([seq])
            with torch.no_grad(), self.shared.use(m.adapter_name("actor")) as model:
                model.eval()
                rows.append(forward_logprobs(model, ids, torch.ones_like(ids), 1.0)[0, start - 1:].double().cpu())
        return rows

    def check(self, members: Sequence, probe: list[int] | None = None) -> float:
        """Compare the engine with the trainer on the probe for ``members`` (the engine's greedy
        continuation of the probe; its log-probs vs the trainer's forward of the same tokens); raise
        :class:`EngineMismatchError` above the tolerance. Returns the largest difference."""
        probe = probe or self.probe
        if not probe:
            raise ValueError("the integrity check needs a probe (a prompt of at least one token)")
        served = self.probe_logprobs(members, probe)
        trained = self.trainer_logprobs(members, [probe + tokens for tokens, _ in served], len(probe))
        diff = torch.stack([(torch.tensor(lps, dtype=torch.float64) - t).abs().max()
                            for (_, lps), t in zip(served, trained)])
        atol = self.settings.integrity_atol
        if atol is None:
            atol = 1e-3 if self._model_dtype() == torch.float32 and self.settings.dtype in ("auto", "float32") else 0.1
        self.stats["integrity_checks"] += 1
        self.stats["integrity_max_diff"] = max(self.stats["integrity_max_diff"], float(diff.max()))
        bad = [(m.index, float(d)) for m, d in zip(members, diff) if not d <= atol]
        if bad:
            raise EngineMismatchError(
                f"vLLM engine and trainer disagree: member {bad[0][0]} log-probs differ by {bad[0][1]:.3g} on the probe "
                f"(tolerance {atol:g}; members {[b[0] for b in bad]}); the engine does not serve what was trained")
        return float(diff.max())

    # ------------------------------------------------------------------ sampling
    def generate_for_members(self, members: Sequence, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                             counts: Sequence[int], sampling, pad_token_id: int,
                             eos_token_id) -> tuple[torch.Tensor, torch.Tensor]:
        """Same contract as the HF path (contiguous row blocks, ``counts[i]`` prompt rows for
        ``members[i]``; ``num_return_sequences`` consecutive rows per prompt row), in ONE engine call.

        Returns ``(sequences [R, P + max_new_tokens], sampler_logp [R, P + max_new_tokens - 1])``:
        prompt + completion ids right-padded with ``pad_token_id``, and the engine's log-prob of
        every generated token at the position that predicts it (0 elsewhere).
        """
        return self.generate_jobs([(members, input_ids, attention_mask, counts, sampling, pad_token_id,
                                    eos_token_id)])[0]

    def generate_jobs(self, jobs: Sequence[tuple]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Several :meth:`generate_for_members` jobs (e.g. members with different sampling settings)
        in ONE engine call: every request carries its own ``SamplingParams`` and ``LoRARequest``."""
        first_ids, first_mask = jobs[0][1], jobs[0][2]
        if self.probe is None:  # the first real prompt (padding stripped) becomes the integrity probe
            self.probe = first_ids[0][first_mask[0].bool()].tolist() or None
        self.sync([m for job in jobs for m in job[0]], release_others=False)
        requests, params, spans = [], [], []
        for members, input_ids, attention_mask, counts, sampling, _, eos_token_id in jobs:
            eos = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id or [])
            job_params = _sampling_params(sampling, eos, sampling.num_return_sequences)
            seeds = request_seeds(sum(counts)) if sampling.do_sample else None
            start, row = len(requests), 0
            for member, count in zip(members, counts):
                name = member.adapter_name("actor")
                for r in range(row, row + count):
                    requests.append((input_ids[r][attention_mask[r].bool()].tolist(), name))
                    params.append(job_params if seeds is None else {**job_params, "seed": seeds[r]})
                row += count
            spans.append((start, len(requests)))
        outs = self.backend.generate(requests, self._registered, params)
        results = []
        for (start, stop), (_, input_ids, _, _, sampling, pad_token_id, _) in zip(spans, jobs):
            reps, width = sampling.num_return_sequences, input_ids.shape[1]
            seqs = torch.full(((stop - start) * reps, width + sampling.max_new_tokens), pad_token_id, dtype=torch.long)
            logp = torch.zeros((seqs.shape[0], seqs.shape[1] - 1), dtype=torch.float32)
            for i, samples in enumerate(outs[start:stop]):
                for j, (tokens, lps) in enumerate(samples):
                    k, n = i * reps + j, len(tokens)
                    seqs[k, :width] = input_ids[i]
                    seqs[k, width:width + n] = torch.tensor(tokens, dtype=torch.long)
                    logp[k, width - 1:width - 1 + n] = torch.tensor(lps, dtype=torch.float32)
            results.append((seqs, logp))
        return results

    def close(self) -> None:
        self.backend.close()
        if _ENGINES.get(self.shared) is self:
            _ENGINES.pop(self.shared)
        if self._own_root:
            shutil.rmtree(self._root, ignore_errors=True)


def request_seeds(n: int) -> list[int]:
    """One ``SamplingParams.seed`` per request from torch's global generator (vLLM gives the ``j``-th
    of a request's ``n`` samples ``seed + j``): the engine's own RNG state never decides a sample."""
    return torch.randint(0, 2 ** 31 - 1, (n,)).tolist()


def _max_rank(members: Sequence) -> int:
    rank = max(m.lora_rank for m in members)
    for m in members:
        spec = getattr(getattr(m, "hp_config", None), "lora_rank", None)
        if spec is not None and getattr(spec, "max", None) is not None:
            rank = max(rank, int(spec.max))
    return rank


def _sampling_params(sampling, eos: list[int], reps: int) -> dict:
    """vLLM ``SamplingParams`` keywords for an evollm ``SamplingConfig`` (the policy contract: only
    what evollm decides; opt-in ``extra`` fields pass through under vLLM's name, else a one-line
    error). Stop strings are applied by evollm's action masks (the engine runs without a tokenizer)."""
    from vllm import SamplingParams

    kw = dict(max_tokens=sampling.max_new_tokens, n=reps, logprobs=0, stop_token_ids=list(eos), detokenize=False,
              min_tokens=0, ignore_eos=False)
    if sampling.do_sample:
        kw.update(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k or 0)
    else:
        kw.update(temperature=0.0)
    valid = set(getattr(SamplingParams, "__struct_fields__", ()))  # a msgspec Struct
    for name, value in getattr(sampling, "extra", ()):
        if valid and name not in valid:
            raise ValueError(f"generation setting {name!r} has no vLLM SamplingParams equivalent; remove it or use "
                             "rollout_backend='hf'")
        kw[name] = value
    return kw


def environment_defaults() -> dict[str, str]:
    """Environment settings vLLM's CPU build needs to run well on a small shared machine."""
    return {"OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def apply_environment_defaults() -> None:
    """Set :func:`environment_defaults` where unset, on CPU only (before vLLM is imported)."""
    if not torch.cuda.is_available():
        for k, v in environment_defaults().items():
            os.environ.setdefault(k, v)
