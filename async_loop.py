"""Asynchronous RL: rollout ranks and a trainer decoupled under a bound on staleness (ROLL Flash, AReaL).

    python async_loop.py                                        # 1 trainer + 1 rollout process, async ratio 1
    python async_loop.py --async-ratio 0 --rollout-workers 1    # the synchronous baseline on the async processes
    torchrun --standalone --nproc_per_node=3 async_loop.py      # rank 0 trains, ranks 1-2 roll out (same code)

Roles. Rank 0 runs `trainer.train` with its sampler (`AsyncSampler`): a dispatcher thread sends requests and
weights to the rollout ranks and buffers their samples, also during updates. Each other rank (`rollout_worker`, a
torch.multiprocessing process without torchrun) runs one request at a time, loading weights only between requests.
Transport (transport.py): weights (a flat fp32 vector) and samples (one fp64 matrix per request) go point to point
over gloo, each announced by a JSON header in the rendezvous store (a receive is posted only once its data is there).

Staleness (docs/design.md 5.4; ROLL Flash arXiv 2510.11345 sec. 3; AReaL arXiv 2505.24298 sec. 5). A request's version v
is the weights version its worker held when it STARTED it, a group's the minimum over its samples; at trainer
version n a group is usable iff n - v <= alpha (the async ratio), older ones are dropped whole and counted.
Admission: groups admitted - dropped <= (n + 1 + alpha) N + redundant (N groups per step), the buffer's bound;
batches take complete groups oldest version first, then first finished. Queue scheduling: a request goes to the
worker with the fewest outstanding (at most queue_depth), refilled as soon as one returns. --replicate: a prompt's
G samples are G requests; --redundant-groups r: r extra groups admitted, the first complete ones trained (kept_len
vs dropped_len shows the length bias); --off-policy (offpolicy.py): tis by default when alpha > 0.

Implementation details and deviations (ours)
1. One trainer rank (DDP among several trainer ranks is not wired here); any number of rollout ranks.
2. A request whose group expires is not aborted (a worker cannot stop a generate call): it runs and is discarded,
   counted in async/dropped (ROLL aborts it). A worker runs one request at a time (a group, or one episode with
   --replicate); a real engine batches requests continuously (as does bench/async_bench.py's prediction).
3. out_dir/timeline.json: each request's (worker, start, end, version, step used), each step's (wait, batch ready).
4. A worker that raises reports its traceback through the store and the trainer raises naming it; one that
   vanishes is named by its exit code, a broken connection or its silent heartbeat (worker_timeout); workers stop
   when the trainer's heartbeat stops; on Ctrl-C or any error the trainer stops, joins, then kills them.
5. On CPU every process takes cores / world torch threads unless OMP_NUM_THREADS is set (torchrun sets 1).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections import deque
from dataclasses import asdict, dataclass
from multiprocessing import resource_tracker
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from cli import check_fields, parse_config
from common import dist_store, make_autocast, setup_dist, train_alone
from data import load_task
from env_client import env_maker
from envs import TaskEnv, env_overrides, multi_turn, rollout_kw
from rollout import Rollout, cat_rollouts, rollout_env
from runlog import format_table, n_processes, read_jsonl, stopping_cleanly
from tasks import load_policy, stop_token_ids
from trainer import Config, train
from transport import Channel, heartbeat, silent_for
from warm_start import sft_config_for, sft_warm_start


@dataclass
class AsyncConfig(Config):
    """The trainer's Config plus the knobs of asynchronous rollouts (docs/design.md 5.4)."""

    help_first = (*Config.help_first[:2], "AsyncConfig", *Config.help_first[2:])

    async_ratio: int = 1
    """alpha: a sample started at weights version v may be trained at version <= v + alpha (0 = synchronous)."""
    rollout_workers: int | None = None
    """Rollout processes without torchrun (None = 1 if async_ratio > 0 else 0: one process); torchrun: ranks 1.."""
    replicate: bool = False
    """Prompt replication: a prompt's group_size samples are independent requests (else one request per group)."""
    redundant_groups: int = 0
    """Extra groups admitted per step; the first complete ones are trained, the rest later or dropped when stale."""
    queue_depth: int = 2
    """Requests outstanding per rollout worker at most (dispatch refills as soon as one returns)."""
    worker_timeout: float = 60.0
    """Seconds of silence (no heartbeat, or no sample while requests are outstanding) before a peer counts as dead."""
    steps: int = 20
    """Number of RL iterations (trainer versions)."""
    prompts_per_step: int = 8
    """Groups (prompts) per iteration."""
    group_size: int = 8
    """Responses sampled per prompt (G)."""
    out_dir: str | None = None
    """The run's folder: metrics.jsonl, timeline.json, plots, checkpoints (default: a new runs/async_loop-DATE-N)."""
    crash_worker_after: int = 0
    """Fault injection for the tests: rollout rank 1 exits abruptly (os._exit) after this many requests (0 = never)."""
    crash_trainer_after: int = 0
    """Fault injection for the tests: the trainer exits abruptly (os._exit) at this step (0 = never)."""

    def __post_init__(self):
        if self.off_policy is None:  # derived once here, printed with the config (--rollout-is: that one instead)
            self.off_policy = "tis" if self.async_ratio > 0 and self.rollout_is is None else "none"
        if self.rollout_workers is None:
            self.rollout_workers = 1 if self.async_ratio > 0 else 0
        super().__post_init__()
        nonneg = ("async_ratio", "rollout_workers", "redundant_groups", "crash_worker_after", "crash_trainer_after")
        check_fields(self, {"[0, inf)": nonneg, "[1, inf)": ("queue_depth",), "(0, inf)": ("worker_timeout",)})
        if self.rollout_workers == 0 and "WORLD_SIZE" not in os.environ and self.async_ratio > 0:
            raise ValueError("config field 'async_ratio' > 0 needs rollout workers (--rollout-workers >= 1)")
        if self.rollout_engine != "hf" and (self.rollout_workers or "WORLD_SIZE" in os.environ):  # vllm_engine.py
            raise ValueError(f"config field 'rollout_engine' = {self.rollout_engine!r}: rollout ranks sample with hf")
        if self.resume and self.rollout_workers:
            raise ValueError("config field 'resume' is not supported with rollout workers (the buffer is not saved)")
        if self.fsdp or self.lora_rank or self.rollout_dtype != "float32":  # the workers load whole fp32 state dicts
            raise ValueError("config fields 'fsdp', 'lora_rank' and 'rollout_dtype' are trainer.py's: the async "
                             "trainer is one rank, its workers sample in fp32")  # fmt: skip


def pack(samples: Rollout) -> torch.Tensor:
    """[n, 2(P+R) + 3R + 1]: ids, attention mask, response mask, behaviour logprobs, token scores, truncated."""
    fields = ("input_ids", "attention_mask", "response_mask", "rollout_logprobs", "token_scores")
    cols = [getattr(samples, f) for f in fields] + [samples.truncated[:, None]]
    return torch.cat([c.detach().cpu().double() for c in cols], 1)


def unpack(x: torch.Tensor, P: int, R: int, version: int) -> Rollout:
    """The Rollout of a packed matrix (pack's inverse) whose samples all started at weights `version`."""
    L = P + R
    ids, attn = x[:, :L].long(), x[:, L : 2 * L].long()  # [n, P+R]
    rm, lp, sc = (x[:, 2 * L + k * R : 2 * L + (k + 1) * R] for k in range(3))  # [n, R] each
    return Rollout(
        prompt_ids=ids[:, :P], response_ids=ids[:, P:], attention_mask=attn, response_mask=rm.long(),
        rollout_logprobs=lp.float(), truncated=x[:, -1].bool(), token_scores=sc.float(),
        policy_version=torch.full((x.shape[0],), version, dtype=torch.long),
    )  # fmt: skip


def request_episodes(cfg: AsyncConfig, task, seed: int, n: int, make_env) -> list:
    """n episodes [(env, seed)] of one prompt (a problem drawn by `seed`, or an env seed: env_maker's envs)."""
    if task is None:
        overrides = env_overrides(cfg.task, cfg.env_latency, "train")
        return [(make_env(cfg.task, "train", **overrides), seed) for _ in range(n)]
    problem = task.sample(1, "train", np.random.default_rng(seed))[0]
    return [(TaskEnv(task, problem), None) for _ in range(n)]


def rollout_worker(cfg: AsyncConfig, rank: int, group, store, source: str) -> None:
    """Serve requests until told to stop: between two requests, take new weights and new requests."""
    _, _, _, device = setup_dist(timeout_s=cfg.dist_timeout, device=cfg.device)
    policy, tokenizer = load_policy(source, device)
    eos_ids, autocast = stop_token_ids(policy, tokenizer), make_autocast(cfg.dtype, device)
    task = None if multi_turn(cfg) else load_task(cfg, tokenizer, device)
    chan, gen = Channel(store, group, rank, 0), torch.Generator(device=device).manual_seed(cfg.seed + rank)
    make_env = env_maker(cfg.env_url, cfg.env_timeout)  # --env-url: this worker's episodes run on those servers
    version, queue, done, last_heard = -1, deque(), 0, time.time()
    while True:
        for header, tensor in chan.poll():  # between two requests only: weights never change inside one
            last_heard = time.time()
            if header["kind"] == "weights":
                torch.nn.utils.vector_to_parameters(tensor.to(device), policy.parameters())
                version = header["version"]
            elif header["kind"] == "requests":
                queue.extend(header["items"])
            elif header["kind"] == "stop":
                return
        if version < 0 or not queue:
            if time.time() - last_heard > cfg.worker_timeout and silent_for(store, 0) > cfg.worker_timeout:
                raise TimeoutError(f"rollout rank {rank}: the trainer (rank 0) is silent for {cfg.worker_timeout}s")
            time.sleep(0.002)
            continue
        rid, seed, n = queue.popleft()
        envs, seeds = zip(*request_episodes(cfg, task, seed, n, make_env))
        t0 = time.time()
        with autocast():
            samples, episodes = rollout_env(policy, tokenizer, envs, seeds, eos_ids, generator=gen, **rollout_kw(cfg))
        keep = ("return", "success", "turns", "malformed", "cut", "context_cut", "reward_info", "action_spans")
        info = [{**{k: e[k] for k in keep}, "env_s": [sum(e["env_s"])]} for e in episodes]
        info = [{**i, "env_error": e["env_error"]} if "env_error" in e else i for i, e in zip(info, episodes)]
        header = {"kind": "samples", "rid": rid, "version": version, "pad": tokenizer.pad_token_id, "episodes": info}
        P, R = samples.prompt_ids.shape[1], samples.response_ids.shape[1]
        chan.send({**header, "P": P, "R": R, "t0": t0, "t1": time.time()}, pack(samples))
        done += 1
        if cfg.crash_worker_after and rank == 1 and done >= cfg.crash_worker_after:
            os._exit(3)  # fault injection: vanish without a word (as an OOM kill would)


class AsyncSampler:
    """`sampler(step, policy)` for trainer.train. A dispatcher thread does all the talking to the rollout ranks
    (weights out, requests out, samples in, expiry), so dispatch goes on while the trainer updates; the call hands
    it the weights of version `step` and waits until N complete groups usable at `step` are buffered."""

    def __init__(self, cfg: AsyncConfig, chans: dict, store, procs: dict, device):
        self.cfg, self.chans, self.store, self.procs, self.device = cfg, chans, store, procs, device
        self.pad_id = None  # the workers' tokenizer's, from their first sample
        self.N, self.G = cfg.prompts_per_step, cfg.group_size
        self.rng = np.random.default_rng(cfg.seed)
        self.groups = {}  # gid -> {"seed", "parts": [(Rollout, episodes, event)], "n": samples in, "version", "done_t"}
        self.todo = deque()  # requests admitted, not yet dispatched: (rid, gid, n)
        self.owner = {}  # rid -> (gid, worker)
        self.outstanding = {w: 0 for w in chans}
        self.admitted = self.dropped_groups = self.next_rid = 0
        self.version, self.publish, self.error = None, None, None  # trainer version; weights to send; thread error
        self.events, self.steps, self.step_stats = [], [], {"dropped": 0, "dropped_len": []}
        self.t_origin = self.last_sample = time.time()
        self.cond, self.halt = threading.Condition(), threading.Event()
        self.thread = threading.Thread(target=self.serve, daemon=True, name="dispatcher")
        self.thread.start()

    def __call__(self, step: int, policy):
        """Publish the weights of version `step`, then wait for N complete groups usable at it: a batch."""
        t_wait = time.time()
        if self.cfg.crash_trainer_after and step >= self.cfg.crash_trainer_after:
            os._exit(3)  # fault injection: the trainer vanishes
        flat = torch.nn.utils.parameters_to_vector(policy.parameters()).detach().float().cpu()
        with self.cond:
            self.version, self.publish = step, (step, flat)  # the thread sends these before any request of `step`
            while True:
                if self.error is not None:
                    raise self.error  # a dead or failed rollout rank, named
                self.expire(step)
                batch = self.take(step)
                if batch is not None:
                    batch[3]["async/wait_s"] = time.time() - t_wait
                    t0, t1 = t_wait - self.t_origin, time.time() - self.t_origin
                    self.steps.append({"step": step, "wait_t0": t0, "ready_t": t1})
                    self.step_stats = {"dropped": 0, "dropped_len": []}
                    return batch
                self.cond.wait(timeout=0.1)

    def serve(self) -> None:
        """The dispatcher thread: publish, collect, expire, dispatch every 5 ms; an error is raised in the caller."""
        try:
            while not self.halt.is_set():
                self.check_peers()
                with self.cond:
                    if self.publish is not None:  # new weights, with their version, to every rollout rank
                        version, flat = self.publish
                        for ch in self.chans.values():
                            ch.send({"kind": "weights", "version": version}, flat)
                        self.publish = None
                    for w, ch in self.chans.items():
                        for header, tensor in ch.poll():
                            self.receive(w, header, tensor)
                            self.cond.notify_all()
                    if self.version is not None:
                        self.expire(self.version)
                        self.dispatch(self.version)
                    if any(self.outstanding.values()) and time.time() - self.last_sample > self.cfg.worker_timeout:
                        busy = [w for w, k in self.outstanding.items() if k]
                        raise TimeoutError(f"rollout rank(s) {busy}: no sample for {self.cfg.worker_timeout}s")
                self.halt.wait(0.005)
        except BaseException as e:
            with self.cond:
                self.error = e
                self.cond.notify_all()

    def check_peers(self) -> None:
        """Raise, naming the rank, if a rollout worker reported an error, exited, or stopped its heartbeat."""
        for w in self.chans:
            if self.store.check([f"async/error/{w}"]):
                raise RuntimeError(f"rollout rank {w} failed:\n{self.store.get(f'async/error/{w}').decode()}")
            proc = self.procs.get(w)
            if proc is not None and proc.exitcode is not None:
                raise RuntimeError(f"rollout rank {w} (pid {proc.pid}) exited with code {proc.exitcode}")
            timeout = self.cfg.worker_timeout
            if silent_for(self.store, w) > timeout and time.time() - self.t_origin > timeout:
                raise RuntimeError(f"rollout rank {w}: no heartbeat for {self.cfg.worker_timeout}s (dead or stuck)")

    def dispatch(self, step: int) -> None:
        """Admit groups while the staleness budget allows, then hand requests to the least-loaded workers."""
        limit = (step + 1 + self.cfg.async_ratio) * self.N + self.cfg.redundant_groups
        while self.admitted - self.dropped_groups < limit:
            gid, seed = self.admitted, int(self.rng.integers(2**31))
            self.groups[gid] = {"seed": seed, "parts": [], "n": 0, "version": math.inf, "done_t": None}
            for n in [1] * self.G if self.cfg.replicate else [self.G]:
                self.todo.append((self.next_rid, gid, n))
                self.next_rid += 1
            self.admitted += 1
        sends = {}
        while self.todo:
            w = min(self.outstanding, key=self.outstanding.get)
            if self.outstanding[w] >= self.cfg.queue_depth:
                break
            rid, gid, n = self.todo.popleft()
            self.owner[rid] = (gid, w)
            self.outstanding[w] += 1
            sends.setdefault(w, []).append([rid, self.groups[gid]["seed"], n])
        for w, items in sends.items():
            self.chans[w].send({"kind": "requests", "items": items})

    def receive(self, w: int, header: dict, tensor) -> None:
        """File a worker's finished request under its group (or count it dropped if the group expired)."""
        gid, _ = self.owner.pop(header["rid"])
        self.outstanding[w] -= 1
        self.last_sample = time.time()
        samples, self.pad_id = unpack(tensor, header["P"], header["R"], header["version"]), header["pad"]
        ev = {"worker": w, "rid": header["rid"], "gid": gid, "version": header["version"], "n": len(header["episodes"])}
        ev.update(t0=header["t0"] - self.t_origin, t1=header["t1"] - self.t_origin, used=-1)
        self.events.append(ev)
        g = self.groups.get(gid)
        if g is None:  # its group was dropped while this request ran: discarded (detail 2)
            self.step_stats["dropped"] += samples.response_ids.shape[0]
            self.step_stats["dropped_len"] += samples.response_mask.sum(-1).tolist()
            return
        g["parts"].append((samples, header["episodes"], ev))
        g["n"] += samples.response_ids.shape[0]
        g["version"] = min(g["version"], header["version"])
        if g["n"] == self.G:
            g["done_t"] = time.time()

    def expire(self, step: int) -> None:
        """Drop whole every group with a sample started before version step - alpha (ROLL gc, AReaL staleness)."""
        for gid in [gid for gid, g in self.groups.items() if step - g["version"] > self.cfg.async_ratio]:
            g = self.groups.pop(gid)
            self.todo = deque(r for r in self.todo if r[1] != gid)
            self.dropped_groups += 1
            for samples, _, _ in g["parts"]:
                self.step_stats["dropped"] += samples.response_ids.shape[0]
                self.step_stats["dropped_len"] += samples.response_mask.sum(-1).tolist()

    def take(self, step: int):
        """The batch of the N oldest complete groups and its async/* metrics, or None before there are N."""
        ready = sorted((g["version"], g["done_t"], gid) for gid, g in self.groups.items() if g["done_t"] is not None)
        if len(ready) < self.N:
            return None
        assert len(self.groups) <= (self.cfg.async_ratio + 1) * self.N + self.cfg.redundant_groups, "buffer bound"
        parts, episodes, versions = [], [], []
        for _, _, gid in ready[: self.N]:  # oldest version first, then first finished
            for samples, eps_part, ev in self.groups.pop(gid)["parts"]:
                parts.append(samples)
                episodes += eps_part
                ev["used"] = step
                versions += [step - ev["version"]] * len(eps_part)
        samples = cat_rollouts(parts, self.pad_id, self.device)
        group_ids = torch.arange(samples.response_ids.shape[0], device=self.device) // self.G  # [B]
        lens = samples.response_mask.sum(-1).float()  # [B]
        s = self.step_stats
        metrics = {"async/staleness_mean": float(np.mean(versions)), "async/staleness_max": float(max(versions))}
        metrics.update({"async/dropped": float(s["dropped"]), "async/kept_len": lens.mean().item()})
        metrics["async/dropped_len"] = float(np.mean(s["dropped_len"])) if s["dropped_len"] else 0.0
        metrics["async/buffer_groups"] = float(len(self.groups))
        return samples, episodes, group_ids, metrics

    def close(self, out_dir: Path | None) -> None:
        """Stop the dispatcher, then the workers (best effort), and write the timeline."""
        self.halt.set()
        self.thread.join(timeout=10)
        for ch in self.chans.values():
            try:
                ch.send({"kind": "stop"})
            except Exception as e:  # a dead worker's keys still take messages; a dead store does not
                print(f"[minrl] could not send stop to rank {ch.peer}: {e}", file=sys.stderr)
        timeline = {"events": self.events, "steps": self.steps, "config": asdict(self.cfg)}
        if out_dir is not None:  # None: stopped before the run's folder was opened
            (out_dir / "timeline.json").write_text(json.dumps(timeline))


def _rank_main(cfg_dict: dict, rank: int, world: int, init_method: str, ready) -> None:
    """Entry of a process started by torch.multiprocessing (spawn): a rollout rank. `ready` is set once its imports
    are done, just before the rendezvous."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the trainer, which stops everyone
    local = rank % torch.cuda.device_count() if torch.cuda.is_available() else 0  # spread over the GPUs
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(local))
    ready.set()
    run(AsyncConfig(**cfg_dict), init_method=init_method)


def run(cfg: AsyncConfig, init_method: str | None = None) -> dict:
    """The async run of `cfg` on every rank; returns the trainer's last metrics (train()'s) on rank 0, {} elsewhere."""
    if "WORLD_SIZE" not in os.environ and cfg.rollout_workers == 0:
        return train(cfg)  # async ratio 0 in one process: trainer's synchronous loop itself
    procs, sampler, stop = {}, None, threading.Event()
    try:
        if "WORLD_SIZE" not in os.environ:  # not under torchrun: this process is rank 0, it starts the others
            import torch.multiprocessing as mp

            with socket.socket() as sock:  # a free port on this host for the rendezvous
                sock.bind(("127.0.0.1", 0))
                world, init_method = cfg.rollout_workers + 1, f"tcp://127.0.0.1:{sock.getsockname()[1]}"
            resource_tracker.ensure_running()  # first: starting it unblocks SIGINT (in Python's own code)
            # blocked, not ignored: the children inherit the mask through exec (immune from their first instruction),
            # and a Ctrl-C that reaches the trainer while it spawns them stays pending, raised right after, not lost
            ctx, ready = mp.get_context("spawn"), {}
            blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
            try:
                for r in range(1, world):
                    ready[r] = ctx.Event()
                    args = (asdict(cfg), r, world, init_method, ready[r])
                    proc = ctx.Process(target=_rank_main, args=args, daemon=False)
                    proc.start()
                    procs[r] = proc  # only once started: the finally below joins what is in procs
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
            # wait here, in Python, for every rank's imports: the rendezvous below blocks in C++ until all ranks join,
            # and a Ctrl-C would only be raised after the slowest start-up
            while not all(e.is_set() for e in ready.values()):
                if gone := {r: p.exitcode for r, p in procs.items() if p.exitcode is not None}:
                    raise RuntimeError(f"rollout rank(s) exited during start-up (rank: exit code): {gone}")
                time.sleep(0.1)
            os.environ.update(RANK="0", WORLD_SIZE=str(world), LOCAL_RANK="0")
        dist_kw = {"timeout_s": cfg.dist_timeout, "device": cfg.device, "init_method": init_method or "env://"}
        rank, _, world, device = setup_dist(**dist_kw)
        if world < 2:
            raise ValueError("async_loop under torchrun needs >= 2 processes: rank 0 trains, the others roll out")
        if device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:  # the processes share the cores (detail 6)
            cores = n_processes(0, 1 << 30)  # the CPUs this process may run on
            torch.set_num_threads(max(1, min(torch.get_num_threads(), cores // world)))
        group, store = dist.new_group(backend="gloo"), dist_store()  # CPU tensors point to point, also beside nccl
        heartbeat(store, rank, stop)
        source = cfg.model or str(sft_warm_start(sft_config_for(cfg.task, cfg.sft_target)))
        if rank > 0:
            try:
                rollout_worker(cfg, rank, group, store, source)
            except Exception as e:
                with contextlib.suppress(Exception):  # the store may be gone with the trainer: nobody to tell
                    store.set(f"async/error/{rank}", traceback.format_exc())
                raise SystemExit(f"rollout rank {rank} stopped: {e!r}") from e
            return {}
        train_alone()  # the trainer is a world of one for train()'s collectives
        sampler = AsyncSampler(cfg, {w: Channel(store, group, 0, w) for w in range(1, world)}, store, procs, device)
        return train(cfg, sampler=sampler)
    finally:  # also on Ctrl-C or an error during start-up: no rank is left behind
        if sampler is not None:  # (cfg.out_dir: the run's folder, once train() has opened it)
            sampler.close(Path(cfg.out_dir) if cfg.out_dir else None)
        stop.set()
        for p in procs.values():
            p.join(timeout=15 if sampler is not None else 1)
            if p.exitcode is None:
                p.kill()
                p.join(timeout=5)


def main(argv=None):
    """`python async_loop.py [flags]`: the run of every rank; rank 0 prints the per-step async metrics."""
    cfg = parse_config(AsyncConfig, argv)
    t0 = time.time()
    with stopping_cleanly(cfg):  # Ctrl-C or SIGTERM: the rollout processes stop, the run's files as far as it got
        out = run(cfg)
    if int(os.environ.get("RANK", "0")) == 0 and cfg.rollout_workers and out:
        keys = "step async/staleness_mean async/staleness_max async/dropped async/kept_len async/wait_s time/train"
        print(format_table(read_jsonl(Path(cfg.out_dir) / "metrics.jsonl"), keys.split()))
        print(f"[minrl] {cfg.steps} steps in {time.time() - t0:.1f}s wall (async ratio {cfg.async_ratio})")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
