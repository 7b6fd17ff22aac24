"""Plumbing shared by every minrl file; nothing algorithmic lives here.

- `parse_config(Config)`: a command line built from a dataclass. The one-line string literal under
  each field is its `--help` text; `--field-name` and `--field_name` both work.
- `check_range` / `check_choice`: the one way config values are validated (named field, allowed range).
- `setup_dist()` -> (rank, local_rank, world_size, device); `(0, 0, 1, cpu|cuda)` without torchrun.
  Collective helpers return at once for world size 1, so the algorithm never branches on it.
- Masked reductions (veRL semantics, global under DDP): `masked_sum`, `masked_mean`, `masked_var`,
  `masked_whiten`.
- `parallel_map(fn, calls, jobs)`: independent runs (experiments, simulations) in spawned processes.

torch is imported inside the functions that need it, so that the torch-free leaves (`scheduler.py`,
`diagnose.py`) can use the CLI on a machine without torch.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import datetime
import inspect
import math
import os
import sys
import textwrap
import typing

# ----------------------------------------------------------------------------------------------
# Config: CLI from a dataclass, and validation helpers


def field_docs(cls) -> dict[str, str]:
    """Map field name -> the string literal written right under it in the class body."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__[:-1]):  # base classes first, so subclasses override
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):  # defined in a notebook / REPL: no source to read
            continue
        body = tree.body[0].body
        for node, nxt in zip(body, body[1:]):
            if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr):
                if isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
                    docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _parser_for(tp):
    """(argparse type, choices, nargs) for a field annotation."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Literal:
        return type(args[0]), list(args), None
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        inner = [a for a in args if a is not type(None)]
        base, choices, nargs = _parser_for(inner[0])
        return (lambda s: None if s.lower() == "none" else base(s)), choices, nargs
    if origin in (list, tuple):
        return args[0], None, "*"
    return tp, None, None


def parse_config(cls, argv: list[str] | None = None, description: str | None = None):
    """Build `cls` (a dataclass) from command-line flags; `--help` lists every field with its default."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    doc = description or (inspect.getdoc(sys.modules[cls.__module__]) or "").split("\n\n")[0]
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        names = [f"--{f.name.replace('_', '-')}"] + ([f"--{f.name}"] if "_" in f.name else [])
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        help_ = docs.get(f.name, "").replace("%", "%%")  # argparse formats help strings with %
        if hints[f.name] is bool:
            p.add_argument(*names, dest=f.name, action=argparse.BooleanOptionalAction, default=default, help=help_)
            continue
        typ, choices, nargs = _parser_for(hints[f.name])
        p.add_argument(*names, dest=f.name, type=typ, choices=choices, nargs=nargs, default=default, help=help_)
    return cls(**vars(p.parse_args(argv)))


def check_range(name: str, value, lo=None, hi=None, *, lo_open: bool = False, hi_open: bool = False) -> None:
    """Raise ValueError naming the field unless lo <= value <= hi (bounds optional, open if asked)."""
    bad = value is None or (isinstance(value, float) and not math.isfinite(value))
    if lo is not None and not bad:
        bad = value <= lo if lo_open else value < lo
    if hi is not None and not bad:
        bad = value >= hi if hi_open else value > hi
    if bad:
        left = "(" if lo_open else "["
        right = ")" if hi_open else "]"
        span = f"{left}{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}{right}"
        raise ValueError(f"config field '{name}' = {value!r} is out of range: allowed {span}")


def check_choice(name: str, value, choices) -> None:
    """Raise ValueError naming the field unless value is one of choices."""
    if value not in choices:
        raise ValueError(f"config field '{name}' = {value!r}: must be one of {list(choices)}")


# ----------------------------------------------------------------------------------------------
# Distributed plumbing (torch.distributed launched by torchrun; world size 1 without it)


def setup_dist(backend: str | None = None, timeout_s: float = 120.0, device: str = "auto", init_method: str = "env://"):
    """Init the process group if launched by torchrun. Returns (rank, local_rank, world_size, device).

    backend defaults to nccl on CUDA and gloo on CPU; every collective inherits `timeout_s`, so a dead
    rank makes the others raise instead of hanging forever. The rendezvous store (held by torchrun's
    agent, or a file with init_method="file://...") outlives a dead rank; `collective` keeps a count
    of who reached which collective there, so the error names the rank that failed.
    """
    import torch
    import torch.distributed as dist

    world = 1 if _SOLO else int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = 0 if _SOLO else int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available() if device == "auto" else device.startswith("cuda")
    dev = torch.device(f"cuda:{local_rank}" if use_cuda else "cpu")
    if use_cuda:
        torch.cuda.set_device(dev)
    if world > 1 and not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        store, rank, world = next(dist.rendezvous(init_method, rank=rank, world_size=world, timeout=timeout))
        store.set_timeout(timeout)
        dist.init_process_group(
            backend or ("nccl" if use_cuda else "gloo"),
            store=dist.PrefixStore("default_pg", store),  # the prefix init_process_group itself would use
            rank=rank,
            world_size=world,
            timeout=timeout,
        )
        _LIVENESS.update(store=dist.PrefixStore("minrl", store), rank=rank, world=world)
    return rank, local_rank, world, dev


_LIVENESS: dict = {}  # set by setup_dist: the rendezvous store, this rank, the world size
_SOLO = False  # set by train_alone()


def train_alone() -> None:
    """From now on this process is a world of one for setup_dist and every collective helper, while the
    process group (all ranks) stays up: async_loop.py's trainer, which meets its rollout ranks only point to point."""
    global _SOLO
    _SOLO = True


def collective(fn, *args, **kwargs):
    """Run one collective `fn(*args, **kwargs)` (e.g. dist.all_reduce). If it fails (a peer died, or the
    timeout passed), raise an error naming the ranks that never reached it.

    Each rank counts its collectives in the rendezvous store before entering one; all ranks run the same
    sequence, so after a failure a rank whose count is lower than ours is dead or stuck.
    """
    if not _LIVENESS:  # process group not made by setup_dist: no store to count in
        return fn(*args, **kwargs)
    store, me, world = _LIVENESS["store"], _LIVENESS["rank"], _LIVENESS["world"]
    n = store.add(f"reached/{me}", 1)  # this is my n-th collective
    try:
        return fn(*args, **kwargs)
    except Exception as e:  # gloo raises RuntimeError, nccl DistBackendError: both name no rank
        try:
            behind = [r for r in range(world) if r != me and store.add(f"reached/{r}", 0) < n]
            who = f"rank(s) {behind} never reached it (dead or stuck)" if behind else "every rank had reached it"
        except Exception as store_error:  # the store's host (rank 0 without torchrun) may be the dead one
            who = f"the rendezvous store is unreachable too ({store_error}), so its host may be dead"
        raise RuntimeError(f"rank {me}: collective #{n} ({fn.__name__}) failed: {who}. Cause: {e}") from e


def dist_store():
    """The rendezvous key-value store of setup_dist's process group (None without one): small messages, heartbeats."""
    return _LIVENESS.get("store")


def world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() and not _SOLO else 1


def all_reduce_sum(t):
    """Sum a tensor over ranks in place (identity for world size 1). Returns it."""
    import torch.distributed as dist

    if world_size() > 1:
        collective(dist.all_reduce, t, op=dist.ReduceOp.SUM)
    return t


def all_gather_cat(t):
    """Concatenate a 1-D tensor of any length from every rank (rank order). Returns (cat, offset of mine)."""
    import torch
    import torch.distributed as dist

    w = world_size()
    if w == 1:
        return t, 0
    n = torch.tensor([t.numel()], device=t.device)
    sizes = [torch.zeros_like(n) for _ in range(w)]
    collective(dist.all_gather, sizes, n)
    sizes = [int(s) for s in sizes]
    padded = torch.zeros(max(sizes), dtype=t.dtype, device=t.device)
    padded[: t.numel()] = t
    parts = [torch.zeros_like(padded) for _ in range(w)]
    collective(dist.all_gather, parts, padded)
    return torch.cat([p[:s] for p, s in zip(parts, sizes)]), sum(sizes[: dist.get_rank()])


def reduce_metrics(metrics: dict[str, float], device=None) -> dict[str, float]:
    """Mean of every metric over ranks (keys ending in '_max' take the max). Identity for world size 1."""
    if world_size() == 1 or not metrics:
        return metrics
    import torch
    import torch.distributed as dist

    keys = sorted(metrics)
    mean_keys = [k for k in keys if not k.endswith("_max")]
    max_keys = [k for k in keys if k.endswith("_max")]
    t = torch.tensor([float(metrics[k]) for k in mean_keys], dtype=torch.float64, device=device)
    collective(dist.all_reduce, t)
    out = {k: v / world_size() for k, v in zip(mean_keys, t.tolist())}
    if max_keys:
        m = torch.tensor([float(metrics[k]) for k in max_keys], dtype=torch.float64, device=device)
        collective(dist.all_reduce, m, op=dist.ReduceOp.MAX)
        out.update(zip(max_keys, m.tolist()))
    return out


def seed_everything(seed: int) -> None:
    import random

    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


# ----------------------------------------------------------------------------------------------
# Masked reductions. `mask` is 0/1 of the same shape as `x`. Under DDP, `global_=True` all-reduces the
# sums so every rank gets statistics over the whole batch (DESIGN.md 7.1: global whitening).


def masked_sum(x, mask, dim=None):
    """sum(x * mask); positions where mask == 0 contribute exactly 0 even if x is NaN there."""
    y = (x * mask).where(mask.bool(), x.new_zeros(()))
    return y.sum() if dim is None else y.sum(dim)


def masked_mean(x, mask, dim=None, global_: bool = False):
    """veRL masked_mean: sum(x*mask) / (sum(mask) + 1e-8). Global over ranks when global_ (a scalar, no grad)."""
    if global_ and dim is not None:
        raise ValueError("masked_mean: global_=True reduces over everything; it takes no dim")
    if global_:
        s = all_reduce_sum(x.new_tensor([masked_sum(x, mask), mask.sum()], dtype=x.dtype))
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
    # veRL: masked_mean((x - mean)^2) = sum(mask (x - mean)^2) / (n + 1e-8), expanded so that one pass (one
    # all-reduce under DDP) suffices; the golden test checks it against veRL, large offsets included.
    var = (sq - 2 * mean * total + n * mean * mean) / (n + 1e-8)
    return (var * n / (n - 1) if unbiased else var).to(x.dtype)


def masked_whiten(x, mask, shift_mean: bool = True, global_: bool = False):
    """(x - mean) * rsqrt(var + 1e-8) over valid entries (veRL); the mean is added back if not shift_mean."""
    mean = masked_mean(x, mask, global_=global_)
    var = masked_var(x, mask, global_=global_)
    out = (x - mean) * (var + 1e-8).rsqrt()
    return out if shift_mean else out + mean


# ----------------------------------------------------------------------------------------------
# Independent runs in parallel processes


def n_processes(jobs: int, n_calls: int) -> int:
    """Processes parallel_map uses: `jobs`, or one per CPU this process may run on (jobs 0); at most one per call."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(n_calls, jobs or cpus))


def parallel_map(fn, calls: list[tuple], jobs: int = 1) -> list:
    """[fn(*args) for args in calls], in order; in n_processes(jobs) spawned processes when more than one.
    fn must be a module-level function; spawn (not fork) is safe next to torch's threads, and a calling script
    needs the `if __name__ == "__main__":` guard."""
    n = n_processes(jobs, len(calls))
    if n == 1:
        return [fn(*args) for args in calls]
    import concurrent.futures as cf
    import multiprocessing as mp

    with cf.ProcessPoolExecutor(n, mp_context=mp.get_context("spawn")) as ex:
        return list(ex.map(fn, *zip(*calls)))
