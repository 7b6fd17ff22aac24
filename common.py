"""Plumbing shared by every trainer file: the process group, the DDP / FSDP2 block, collectives that name a dead
rank, masked reductions (the CLI and validation are cli.py's).

    torchrun --standalone --nproc_per_node=2 common.py     # check the process group: ranks, devices, an all-reduce

- `DistArgs`, `setup_dist()` -> (rank, local_rank, world_size, device), `(0, 0, 1, cpu|cuda)` without torchrun;
  `shard_or_replicate` (DDP or FSDP2), `gathered`, `clip_grad_norm`; collective helpers return at once for world
  size 1, so the algorithm never branches on it; `make_autocast`.
- Masked reductions (veRL semantics; `mask` 0/1 like x; `global_=True` all-reduces the sums: statistics of the
  whole batch over the ranks): `masked_sum`, `masked_mean`, `masked_var`, `masked_whiten`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import signal
import socket
from pathlib import Path
from typing import Literal

from cli import check_fields


@dataclasses.dataclass
class DistArgs:
    """Where and in what precision the trainer computes; its Config inherits these fields."""

    dtype: Literal["float32", "bfloat16"] = "float32"
    """Compute dtype (bfloat16 autocasts; weights and optimizer state stay fp32)."""
    device: str = "auto"
    """auto | cpu | cuda | cuda:N."""
    dist_timeout: float = 120.0
    """Seconds before a collective gives up (a dead rank makes the others fail)."""
    fsdp: bool = False
    """Shard weights, gradients and AdamW state over the ranks (FSDP2: each decoder layer, then the root) instead of
    DDP's full replica on each; the same gradient. bf16 weights with fp32 reduction under --dtype bfloat16 on GPU."""

    def __post_init__(self):
        check_fields(self, {"(0.0, inf)": ("dist_timeout",)}, DistArgs)
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ValueError(f"config field 'device' = {self.device!r}: must be auto, cpu, cuda or cuda:N")


def make_autocast(dtype: str, device):
    """A context factory: bf16 autocast for dtype "bfloat16" (weights stay fp32), else a no-op."""
    import torch

    if dtype == "bfloat16":
        return lambda: torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext


def setup_dist(backend: str | None = None, timeout_s: float = 120.0, device: str = "auto", init_method: str = "env://",
               group: bool = False):  # fmt: skip
    """Init the process group if launched by torchrun (or asked for: `group`, a world of one for FSDP2's mesh).
    Returns (rank, local_rank, world_size, device).

    backend defaults to nccl on CUDA and gloo on CPU; every collective inherits `timeout_s`, so a dead rank makes
    the others raise instead of hanging. The rendezvous store (torchrun's agent, or init_method="file://...")
    outlives a dead rank: `collective` counts there who reached which collective, to name the rank that failed."""
    import torch
    import torch.distributed as dist

    world = 1 if _SOLO else int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = 0 if _SOLO else int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available() if device == "auto" else device.startswith("cuda")
    if use_cuda and not torch.cuda.is_available():  # asked for on a machine (or a torch build) without CUDA
        raise ValueError(f"config field 'device' = {device!r}: CUDA is not available here: use --device cpu or auto")
    dev = torch.device(f"cuda:{local_rank}" if use_cuda else "cpu")
    if use_cuda:
        torch.cuda.set_device(dev)
    if (world > 1 or group) and not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.HashStore()  # a world of one (FSDP2 needs a process group): no one to meet
        if world > 1:
            store, rank, world = next(dist.rendezvous(init_method, rank=rank, world_size=world, timeout=timeout))
        store.set_timeout(timeout)
        prefixed = dist.PrefixStore("default_pg", store)  # the prefix init_process_group itself would use
        backend = backend or ("nccl" if use_cuda else "gloo")
        dist.init_process_group(backend, store=prefixed, rank=rank, world_size=world, timeout=timeout)
        _LIVENESS.update(store=dist.PrefixStore("minrl", store), rank=rank, world=world)
        me = f"{_HOST} {os.getpid()} {(proc_state(os.getpid()) or ('', '?'))[1]}"
        _LIVENESS["store"].set(f"pid/{rank}", me)  # host, pid, start time: for stop_silent
    return rank, local_rank, world, dev


def decoder_layers(model) -> list:
    """The outermost transformer blocks (`GradientCheckpointingLayer`) of a Hugging Face model: the unit of FSDP2's
    shards and of activation checkpointing (memory.py)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers, names = [], []
    for name, module in model.named_modules():
        if isinstance(module, GradientCheckpointingLayer) and not any(name.startswith(n + ".") for n in names):
            layers, names = [*layers, module], [*names, name]
    return layers


def shard_or_replicate(model, world: int, fsdp: bool, bf16: bool = False, fp32=()):
    """nanoGPT's DDP block with FSDP2 beside it: the module to train through. With fsdp, `model` itself, sharded in
    place by FSDP2 (`fully_shard` on each decoder layer, then on the root, which keeps embeddings and head; the
    root's weights, gathered in its forward, stay until its backward, so the LM head may run after the forward in
    chunks, rollout.py detail 4). Its parameters become DTensor shards: build the optimizer after this. bf16: bf16
    weights in compute, gradients reduced in fp32 (but fp32 in the modules `fp32`, sharded on their own). Else a
    DDP replica (world > 1; its no_sync skips a micro-batch's all-reduce) or the model."""
    import torch

    if not fsdp:
        return torch.nn.parallel.DistributedDataParallel(model) if world > 1 else model
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(torch.bfloat16, torch.float32) if bf16 else MixedPrecisionPolicy()
    if not (layers := decoder_layers(model)):
        raise ValueError(f"--fsdp: {type(model).__name__} has no decoder layers (GradientCheckpointingLayer) to shard")
    for unit, policy in [*((m, MixedPrecisionPolicy()) for m in fp32), *((layer, mp) for layer in layers)]:
        fully_shard(unit, mp_policy=policy)
    return fully_shard(model, mp_policy=mp)


@contextlib.contextmanager
def gathered(model):
    """Inside, every FSDP2 weight of `model` is whole on every rank, no forward a collective: ranks may run different
    numbers of forwards (sampling, evaluation), as an inference engine's copy would. Else nothing is done."""
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for m in units:
        m.set_reshard_after_forward(False, recurse=False)
        m.unshard()
    try:
        yield model
    finally:
        for m in units:
            m.reshard()
            m.set_reshard_after_forward(m is not model, recurse=False)  # the root keeps its weights to backward


def clip_grad_norm(params, max_norm: float):
    """torch's clip_grad_norm_, with the norm over every rank's shards under FSDP2 (DTensor gradients). Returns it."""
    import torch

    params = list(params)
    total = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    total = total.full_tensor() if hasattr(total, "full_tensor") else total  # DTensor: the ranks' parts combined
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


_LIVENESS: dict = {}  # set by setup_dist: the rendezvous store, this rank, the world size
_SOLO = False  # set by train_alone()
_HOST = socket.gethostname()


def train_alone() -> None:
    """Make this process a world of one for setup_dist and the collectives (async_loop.py's trainer, point to point)."""
    global _SOLO
    _SOLO = True


def collective(fn, *args, **kwargs):
    """Run one collective `fn(*args, **kwargs)` (e.g. dist.all_reduce); if it fails (a peer died, the timeout
    passed), raise naming the ranks that never reached it: each rank counts its collectives in the rendezvous
    store before entering one, so after a failure a rank whose count is lower than ours is dead or stuck."""
    if not _LIVENESS or _SOLO:  # no process group made by setup_dist (no store to count in), or a world of one
        return fn(*args, **kwargs)
    store, me, world = _LIVENESS["store"], _LIVENESS["rank"], _LIVENESS["world"]
    n = store.add(f"reached/{me}", 1)  # this is my n-th collective
    try:
        return fn(*args, **kwargs)
    except Exception as e:  # gloo raises RuntimeError, nccl DistBackendError: both name no rank
        try:
            behind = [r for r in range(world) if r != me and store.add(f"reached/{r}", 0) < n]
            who = f"rank(s) {behind} never reached it (dead or stuck)" if behind else "every rank had reached it"
            who += stop_silent(store, behind or [r for r in range(world) if r != me])  # a rank stopped inside it
        except Exception as store_error:  # the store's host (rank 0 without torchrun) may be the dead one
            who = f"the rendezvous store is unreachable too ({store_error}), so its host may be dead"
        raise RuntimeError(f"rank {me}: collective #{n} ({fn.__name__}) failed: {who}. Cause: {e}") from e


def stop_silent(store, ranks: list[int]) -> str:
    """SIGTERM, then SIGCONT, to each of `ranks` that is SIGSTOPped on this host: such a rank cannot take the SIGTERM
    of torchrun's shutdown and would hold the run for its grace period (30 s). The pid and start time setup_dist
    recorded must match /proc (Linux), so a reused pid, a zombie or a debugger's stop ("t") is never signalled."""
    stopped = []
    try:
        for r in [r for r in ranks if store.check([f"pid/{r}"])]:
            host, pid, start = store.get(f"pid/{r}").decode().split()
            if host == _HOST and proc_state(int(pid)) == ("T", start):
                os.kill(int(pid), signal.SIGTERM), os.kill(int(pid), signal.SIGCONT)  # taken on waking up
                stopped.append(r)
    except Exception as e:  # the blame found so far stands; say why this part could not finish
        return f"; could not look for stopped ranks ({type(e).__name__}: {e})"
    return f"; rank(s) {stopped} stopped (SIGSTOP) on this host: ended them" if stopped else ""


def proc_state(pid: int) -> tuple[str, str] | None:
    """(state letter, start time in clock ticks) of a process, from /proc/PID/stat; None where unknown."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()  # after "(command name)"
        return fields[0], fields[19]
    except (OSError, IndexError):
        return None


def dist_store():
    """The rendezvous key-value store of setup_dist's process group (None without one): small messages, heartbeats."""
    return _LIVENESS.get("store")


def world_size() -> int:
    """The number of ranks the collective helpers reduce over (1 without a process group or after train_alone)."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() and not _SOLO else 1


def all_reduce_sum(t):
    """Sum a tensor over ranks in place (identity for world size 1). Returns it."""
    import torch.distributed as dist

    if world_size() > 1:
        collective(dist.all_reduce, t, op=dist.ReduceOp.SUM)
    return t


def reduce_metrics(metrics: dict[str, float], device=None) -> dict[str, float]:
    """Mean of every metric over ranks (keys ending in '_max' / '_min' take the max / min). Identity for world size 1.
    Exact only for a metric that is global already (token statistics: masked_mean(global_=True)) or a mean over as
    many items on every rank (sequences, micro-batches); a std must be computed global at its source (masked_var)."""
    if world_size() == 1 or not metrics:
        return metrics
    import torch
    import torch.distributed as dist

    out, ops = {}, {"_max": dist.ReduceOp.MAX, "_min": dist.ReduceOp.MIN}
    for end in ("", "_max", "_min"):
        keys = [k for k in sorted(metrics) if k[-4:] == end or (not end and k[-4:] not in ops)]
        if keys:
            t = torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64, device=device)
            collective(dist.all_reduce, t, op=ops.get(end, dist.ReduceOp.SUM))
            out.update({k: v if end else v / world_size() for k, v in zip(keys, t.tolist())})
    return out


def masked_sum(x, mask, dim=None):
    """sum(x * mask); positions where mask == 0 contribute exactly 0 even if x is NaN there."""
    y = (x * mask).where(mask.bool(), x.new_zeros(()))
    return y.sum() if dim is None else y.sum(dim)


def masked_mean(x, mask, dim=None, global_: bool = False):
    """veRL masked_mean: sum(x*mask) / (sum(mask) + 1e-8). Global over ranks when global_ (a scalar, no grad)."""
    if global_ and dim is not None:
        raise ValueError("masked_mean: global_=True reduces over everything; it takes no dim")
    if global_:
        s = all_reduce_sum(x.new_tensor([masked_sum(x.detach(), mask), mask.sum()], dtype=x.dtype))
        return s[0] / (s[1] + 1e-8)
    return masked_sum(x, mask, dim) / (mask.sum() if dim is None else mask.sum(dim)).add(1e-8)


def masked_var(x, mask, unbiased: bool = True, global_: bool = False):
    """Masked variance over all valid entries; Bessel-corrected like veRL; raises on < 2 valid entries."""
    xd = x.double()  # accumulate in fp64: in fp32 the one-pass form cancels catastrophically when |mean| >> std
    s = xd.new_tensor([masked_sum(xd, mask), mask.sum(), masked_sum(xd * xd, mask)])
    if global_:
        all_reduce_sum(s)
    total, n, sq = s[0], s[1], s[2]
    if n < 2:
        raise ValueError(f"masked_var needs at least 2 valid entries, got {int(n)} (batch too small or all masked)")
    mean = total / (n + 1e-8)
    # veRL's masked_mean((x - mean)^2) in one pass (one all-reduce), golden-tested; >= 0: constant x can round below
    var = ((sq - 2 * mean * total + n * mean * mean) / (n + 1e-8)).clamp_min(0.0)
    return (var * n / (n - 1) if unbiased else var).to(x.dtype)


def masked_whiten(x, mask, shift_mean: bool = True, global_: bool = False):
    """(x - mean) * rsqrt(var + 1e-8) over valid entries (veRL); the mean is added back if not shift_mean."""
    mean = masked_mean(x, mask, global_=global_)
    var = masked_var(x, mask, global_=global_)
    out = (x - mean) * (var + 1e-8).rsqrt()
    return out if shift_mean else out + mean


def main() -> None:
    """Every rank prints its rank, device and an all-reduce of the ranks (world * (world - 1) / 2)."""
    import torch

    rank, local_rank, world, device = setup_dist()
    total, want = all_reduce_sum(torch.tensor([float(rank)], device=device)).item(), world * (world - 1) // 2
    where = f"rank {rank} of {world} (local {local_rank}) on {device}"
    print(f"{where}: all-reduce of the ranks {total:.0f}, {want} expected")
    if world > 1:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
