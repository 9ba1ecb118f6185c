"""Multi-process data parallel training of a population (``accelerate launch``).

Under ``accelerate launch --num_processes N`` (or ``torchrun``), every process holds the WHOLE
population on its own copy of the frozen base. Per step:

* the prompts of the global batch are split across processes (:func:`shard`; a group of completions
  of one prompt stays on one process, so group-relative advantages are unchanged);
* every member's gradients are averaged over the processes before clipping and the optimizer step
  (:func:`all_reduce_gradients`, called from the agents' step), so every process applies the same
  update to the same adapter;
* fitness and training metrics are reduced over processes (:func:`all_reduce_mean`,
  :func:`all_reduce_sum`) so every process takes the same evaluation, quarantine, selection and
  mutation decisions; the selection and mutation RNGs are taken from process 0
  (:func:`broadcast_object`) and the result is checked to agree on every process (:func:`agree`).

Only the main process writes the run directory and prints. With one process every function here is
a no-op, so single-process code paths are unchanged.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Sequence

import torch
import torch.distributed as dist

_STATE = None


def launched() -> bool:
    """Whether this process was started by a multi-process launcher (accelerate/torchrun/MPI)."""
    for key in ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE"):
        if int(os.environ.get(key, "1")) > 1:
            return True
    return False


def init():
    """Initialise the process group once (through accelerate's ``PartialState``: gloo on CPU, nccl on
    GPU) when launched with several processes; returns the state, or ``None`` in a single process."""
    global _STATE
    if _STATE is None and launched():
        from accelerate import PartialState

        _STATE = PartialState(cpu=not torch.cuda.is_available())
        if torch.cuda.is_available():
            if _STATE.local_process_index >= torch.cuda.device_count():
                raise ValueError(  # a launch setting: `evollm train` prints it as one line
                    f"process {_STATE.local_process_index} of this machine has no GPU of its own: "
                    f"{torch.cuda.device_count()} visible for {_STATE.num_processes} processes; launch at most "
                    "that many processes per machine (accelerate launch --num_processes), or set "
                    "CUDA_VISIBLE_DEVICES= to run them on CPU (gloo)")
            torch.cuda.set_device(_STATE.local_process_index)
    return _STATE


def zero_stage() -> int | None:
    """The DeepSpeed ZeRO stage of an ``accelerate launch --config_file configs/deepspeed/zero*.yaml``
    launch (``None`` without DeepSpeed). :mod:`evollm.parallel.zero` puts every member's optimizer into its own
    DeepSpeed engine at that stage (1 or 2); the frozen base stays outside DeepSpeed."""
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() != "true":
        return None
    return int(os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2"))


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def num_processes() -> int:
    return dist.get_world_size() if is_distributed() else 1


def process_index() -> int:
    return dist.get_rank() if is_distributed() else 0


def is_main_process() -> bool:
    return process_index() == 0


def device() -> torch.device:
    """The device this process trains on (its own GPU under a launcher, else CPU/the only GPU)."""
    if _STATE is not None:
        return _STATE.device
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def shard(items: Sequence, what: str = "prompts") -> list:
    """This process's contiguous slice of ``items`` (the whole list in a single process)."""
    n, rank = num_processes(), process_index()
    if n == 1:
        return list(items)
    if len(items) % n:
        raise ValueError(f"{len(items)} {what} do not split evenly over {n} processes; use a global batch that is "
                         f"a multiple of the number of processes")
    size = len(items) // n
    return list(items[rank * size:(rank + 1) * size])


def all_reduce_gradients(params: Sequence[torch.nn.Parameter]) -> None:
    """Average the gradients of ``params`` over processes (one flat all-reduce). A missing gradient
    counts as zeros, so every process takes part in the same collective."""
    if not is_distributed() or not params:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1).float() for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    flat /= num_processes()
    offset = 0
    for p, g in zip(params, grads):
        n = g.numel()
        p.grad = flat[offset:offset + n].view_as(p).to(p.dtype)
        offset += n


def _reduce(values, op) -> torch.Tensor:
    t = torch.as_tensor(values, dtype=torch.float64)
    if not is_distributed():
        return t
    dev = device() if dist.get_backend() == "nccl" else torch.device("cpu")
    t = t.to(dev)
    dist.all_reduce(t, op=op)
    return t.cpu()


def all_reduce_sum(values) -> torch.Tensor:
    """Elementwise sum over processes (float64)."""
    return _reduce(values, dist.ReduceOp.SUM)


def batch_reduce():
    """The ``reduce`` of the whitening functions (:data:`evollm.functional.masked.Reduce`): in a
    multi-process run each process holds a share of the batch, and advantages are normalised with the
    statistics of all of it, as in one process; None in one process."""
    return all_reduce_sum if is_distributed() else None


def token_divisors(masks: Sequence[torch.Tensor]) -> list[float] | None:
    """Per mask (one member's rows of a minibatch on this process), the mean over processes of its
    valid-token count: the divisor of a token-mean loss (``token_count`` of
    :func:`evollm.functional.policy_loss_with_stats`) that makes the gradients averaged over processes those
    of the token mean over the whole minibatch, whatever each process's share of the tokens. One
    all-reduce for all members; None in one process."""
    if not is_distributed():
        return None
    return all_reduce_mean([float((m != 0).sum()) for m in masks]).tolist()


def all_reduce_mean(values) -> torch.Tensor:
    """Elementwise mean over processes (float64); a NaN anywhere stays NaN (so a non-finite loss on
    one process quarantines the member on all)."""
    return all_reduce_sum(values) / num_processes()


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """``obj`` as held by process ``src``, on every process."""
    if not is_distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def agree(obj: Any, what: str) -> None:
    """Raise if ``obj`` (JSON-able) differs between processes: the population must stay identical."""
    if not is_distributed():
        return
    digest = hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()
    digests = [None] * num_processes()
    dist.all_gather_object(digests, digest)
    if len(set(digests)) > 1:
        raise RuntimeError(f"processes disagree on {what} (digests {digests}); the population is no longer identical "
                           "on every process")


def reduce_metrics(indices: Sequence[int], metrics: dict[int, dict]) -> dict[int, dict]:
    """Every member's numeric step metrics over processes (same keys on every process): float
    metrics are averaged, integer ones (counts such as generated tokens) are summed and stay int."""
    if not is_distributed():
        return metrics
    kinds = {}
    for i in indices:
        for k, v in metrics.get(i, {}).items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                kinds[k] = "float" if isinstance(v, float) or kinds.get(k) == "float" else "int"
    kinds = broadcast_object(sorted(kinds.items()))
    if not kinds or not indices:
        return metrics
    table = [[float(metrics.get(i, {}).get(k, float("nan"))) for k, _ in kinds] for i in indices]
    summed = all_reduce_sum(table).tolist()
    out = {i: dict(metrics.get(i, {})) for i in indices}
    for i, row in zip(indices, summed):
        for (k, kind), total in zip(kinds, row):
            if kind == "int" and total == total:  # not NaN
                out[i][k] = int(round(total))
            else:
                out[i][k] = total / num_processes()
    return out


def sync_rng(*holders) -> None:
    """Give every holder's ``rng`` (numpy Generator) process 0's state: one source of randomness for
    selection and mutation decisions."""
    if not is_distributed():
        return
    states = broadcast_object([h.rng.bit_generator.state if h is not None else None for h in holders])
    for h, state in zip(holders, states):
        if h is not None:
            h.rng.bit_generator.state = state


def population_digest(agents: Sequence) -> list:
    """What must agree between processes after a selection: ids, ranks and hyperparameters."""
    out = []
    for a in agents:
        hp = {k: v for k, v in vars(a.config).items() if isinstance(v, (int, float, str, bool, type(None)))}
        out.append([a.index, a.lora_rank, hp])
    return out


def barrier() -> None:
    if is_distributed():
        dist.barrier()


def shutdown() -> None:
    """End a multi-process run: wait for every process, then destroy the process group (the ``evollm``
    command does this on success, :func:`evollm.recipes.cli.console`). A no-op in a single process.
    It does not prevent the abort in the interpreter's teardown that ZeRO-3 on gloo shows about once in
    ten launches ("terminate called without an active exception", after every output is written)."""
    global _STATE
    if is_distributed():
        dist.barrier()
        dist.destroy_process_group()
    _STATE = None
