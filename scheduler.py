"""Discrete-event simulator of GPU schedules for (agentic) RL: colocated sync, async disaggregated, time-multiplexed.

    python scheduler.py                                   # the three schedules on a small default, in seconds
    python experiments/schedules.py --preset agentic-160gpu   # (or rlvr-async): simulated next to reported figures
    python experiments/schedules.py --sweep tail --sweep-values 0 0.5 1 1.5   # any numeric field; writes a plot

Version v = training steps done; a trajectory started at v may be trained at version n iff n - v <= alpha (ROLL
Flash; docs/design.md 5.4-5.5). colocated: all GPUs roll out until `batch` trajectories are done, then all
train and sync (alpha 0). disagg: GPUs [0, train_gpus) only train, the others only roll out. timemux: all roll out;
once ceil(theta*batch) usable trajectories are done, GPUs [0, train_gpus) shrink away, train, every GPU syncs, they
expand back (alpha >= 1, as ROLL requires); the unfinished work carries over.
Modelling assumptions 1-4 (the workload, decode, KV cache, prefill / train / sync costs) are scheduler_config.py's,
with `Config` (every default is a field, see --help); 5-7, the schedule's decisions, are here:
5. Dispatch `sample` (queue scheduling): a turn goes to the worker caching its prefix if it has room, else to the
   least-loaded worker with room, else waits at its worker (ROLL env->rank affinity) or in a global FIFO queue.
   `batch`: a block is admitted when nothing is in flight, assigned round-robin, and waits for its workers. Shrink:
   running turns migrate (restart + re-prefill); expand: len(train set)/W of the placed trajectories move (ROLL).
6. Admission (AReaL-style): admitted - dropped <= (v + 1 + alpha)*n_train + redundant + batch - n_train, n_train =
   ceil(theta*batch) for timemux, else batch. The trainer takes the oldest versions first; then the trajectories
   started at v - alpha or earlier are dropped: running ones aborted (ROLL gc; alpha 0: the redundant ones), done
   ones expire. Waste = GPU-time of dropped (also timed-out: timeout_s after admission) and migrated turns.
7. Tail batching (RollPacker; colocated, redundant > 0): aborted prompts are deferred; once `batch` of them wait,
   the next step admits exactly them (no redundancy) and waits for all. No GRPO groups: trajectories are independent.
Code: `simulate(cfg)` runs `Sim(cfg)`: records of the trajectories (`Traj`) and the workers (`Worker`), and a
method per event and per decision, its docstring naming the assumption it implements; decode between two events
is solved in closed form (decode_time / decode_steps), so the cost is per event (two per turn), never per token.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import operator
from collections import deque
from dataclasses import dataclass, field
from heapq import heappop, heappush
from pathlib import Path

import numpy as np

import scheduler_config
from cli import parse_config
from runlog import format_table, parallel_map
from scheduler_config import SCHEDULES, Config, cost_model, decode_steps, decode_time, load_lengths, make_workload

ROLES = ("rollout", "train", "sync", "shrink", "expand")  # segment role codes 0..4; time in no segment is idle
COLORS = ("tab:blue", "tab:orange", "tab:red", "tab:purple", "tab:green")
EV_ENV, EV_TRAINED, EV_STEP = range(3)  # heap event kinds (turn completions and timeouts have their own queues)
RUNNING, DONE, CONSUMED, ABORTED, TIMEOUT, EXPIRED = range(6)  # trajectory status


@dataclass(slots=True, eq=False)
class Traj:
    """A trajectory, by admission order `id`. toks / envs (its workload row) are None once it has left for good."""

    id: int
    toks: list | None  # action tokens of each turn
    envs: list | None  # environment seconds after each turn (the last one is the reward)
    ver: int  # policy version at admission
    ctx: int  # context before the current turn
    need: int  # KV tokens the current turn reserves: its final context (assumption 3)
    gen: int  # generated tokens of all its turns
    ctxf: int  # final context: the tokens training reads
    turn: int = 0  # current turn
    wk: int = -1  # worker caching its prefix (-1: none)
    at: int = -1  # worker decoding its current turn (-1: none, -2: queued)
    ep: int = 0  # epoch: bumped when its current turn is cancelled, so heap and queue entries of that turn go stale
    st: int = RUNNING  # status
    vj: float = 0.0  # its worker's `steps` when the current turn joined
    sj: float = 0.0  # its worker's `share` when the current turn joined, less its own prefill
    charge: float = 0.0  # GPU-seconds of its finished and cancelled turns
    nfin: int = 0  # times it finished (1 at most: a check of the bookkeeping)


@dataclass(slots=True, eq=False)
class Worker:
    """An inference engine. At time `t` each of its `n` running sequences has done `steps` decode steps (from an
    arbitrary origin), their contexts sum to `ctx`, and each has been charged `share` GPU-seconds so far."""

    k: int  # its index: trajectories name their worker by it
    inpool: bool  # serves rollout now
    t: float = 0.0
    steps: float = 0.0
    ctx: float = 0.0
    share: float = 0.0
    n: int = 0
    resv: float = 0.0  # KV tokens reserved by its running turns
    busy: float | None = None  # start of the busy stretch under way (None: idle)
    heap: list = field(default_factory=list)  # (`steps` at which a turn completes, traj id, epoch, traj)
    queue: deque = field(default_factory=deque)  # (traj, epoch) waiting for this worker (prefix affinity)
    segs: list = field(default_factory=list)  # [t0, t1, role] of its GPUs, touching same-role stretches merged


RESV = operator.attrgetter("resv")  # a worker's reserved KV tokens (dispatch's least-loaded key)


def add_segment(segs: list, t0: float, t1: float, role: int) -> None:
    """Record [t0, t1) of role, merged into the last segment if it has that role and touches t0."""
    if segs and segs[-1][2] == role and segs[-1][1] >= t0 - 1e-9:
        segs[-1][1] = max(segs[-1][1], t1)
    elif t1 > t0:
        segs.append([t0, t1, role])


class Sim:
    """One schedule's run: the trajectories, the workers, the queues and the event heap (assumptions 1-7).
    Events: a turn completion (the earliest of the workers' `fin`), a timeout (FIFO `tmo`), or a heap event
    (EV_ENV: a turn's environment step is over; EV_TRAINED; EV_STEP). simulate() is its public face."""

    def __init__(self, cfg: Config):
        c, g, B = cost_model(cfg), cfg.gpus_per_worker, cfg.batch
        rows = load_lengths(cfg.lengths_file) if cfg.lengths_file else None  # replayed lengths (assumption 1)
        self.cfg, self.c, self.g, self.mx, self.obs = cfg, c, g, cfg.max_seqs, cfg.obs_tokens
        keys = ("step_min", "step_max", "kv_s", "kv_cap", "prefill_s")  # the cost model, read on every event
        self.a1, self.amax, self.kv_s, self.kv_cap, self.pre_s = (c[k] for k in keys)
        # the schedule: who trains, when a step triggers, how stale a trajectory may be
        co, self.tm = cfg.schedule == "colocated", cfg.schedule == "timemux"
        W, self.alpha = cfg.n_gpus // g, 0 if co else cfg.alpha
        self.n_train = math.ceil(cfg.theta * B) if self.tm else B  # trajectories per training step
        self.chunk = B + cfg.redundant  # admitted per version beyond the cap's base; the workload's chunk size
        self.release = list(range(W if co else cfg.train_gpus // g))  # the workers that also (or only) train
        self.expands = co or (self.tm and not cfg.tm_dedicated)  # the release set rolls out between steps
        dedicated = cfg.schedule == "disagg" or cfg.tm_dedicated
        self.workers = [Worker(k, inpool=not (k in self.release and dedicated)) for k in range(W)]
        self.pool = [w for w in self.workers if w.inpool]  # the workers serving rollout, by index
        self.fin = [math.inf] * W  # fin[k]: when worker k's next turn completes (a list: the event loop's min)
        # the trajectories: all by admission order (= id), the ids running, the done ids by start version; ids, not
        # records, in `running` and `buf`: their iteration order fixes the order of float sums (inflight_s)
        self.trajs, self.running, self.buf = [], set(), {}
        self.gq, self.deferred = deque(), deque()  # global FIFO queue of (traj, epoch); aborted rows (assumption 7)
        self.tmo, self.ev, self.nxt = deque(), [], itertools.count().__next__  # (deadline, id) FIFO; event heap
        # the run so far: version, steps, admitted - left, migrations; a step under way; a long round (RollPacker)
        self.v = self.step = self.live = self.mig = 0
        self.training = self.long = False
        self.waste = self.useful = self.drain = 0.0  # GPU-s of dropped and of trained trajectories; shrink drain s
        self.stale, self.ends, self.trig = [], [], []  # staleness of each trained one; step end and trigger times
        chunks = itertools.takewhile(len, (make_workload(cfg, k, self.chunk, rows) for k in itertools.count()))
        self.source = itertools.chain.from_iterable(chunks)  # drawn lazily, seeded per chunk; ends if read once

    def step_s(self, w: Worker) -> float:
        """Seconds of w's next decode step: the weights its batch touches, then its sequences' KV cache."""
        return (self.amax if self.a1 * w.n > self.amax else self.a1 * w.n) + self.kv_s * w.ctx

    def adv(self, w: Worker, t: float) -> None:
        """Decode on w from w.t up to t (no progress while paused: w.t > t)."""
        d, n = t - w.t, w.n
        if d > 0 and n:
            u = decode_steps(d, self.step_s(w), self.kv_s * n)  # each step is kv_s * n longer than the last
            w.steps, w.ctx, w.share = w.steps + u, w.ctx + n * u, w.share + self.g * d / n
        w.t = t if t > w.t else w.t

    def resched(self, w: Worker) -> None:
        """fin[w.k] = when w's next turn completes (entries of cancelled turns are dropped first)."""
        h = w.heap
        while h and h[0][3].ep != h[0][2]:
            heappop(h)
        if not h:
            self.fin[w.k] = math.inf
            return
        u = h[0][0] - w.steps  # decode steps left to the first completion
        self.fin[w.k] = w.t + decode_time(u if u > 0 else 0.0, self.step_s(w), self.kv_s * w.n)

    def room(self, w: Worker, x: Traj) -> bool:
        """w can start x's turn now (assumption 3)."""
        return w.n < self.mx and w.resv + x.need <= self.kv_cap

    def place(self, x: Traj, w: Worker, t: float) -> None:
        """Start x's current turn on w: prefill (stalls w's decode, charged to x alone), then decode."""
        self.adv(w, t)
        p = self.pre_s * (self.obs if x.wk == w.k and x.turn else x.ctx)  # the prefix is cached on w
        w.busy = w.t if w.busy is None else w.busy
        w.t += p
        x.vj, x.sj, x.wk, x.at = w.steps, w.share - self.g * p, w.k, w.k
        w.n, w.ctx, w.resv = w.n + 1, w.ctx + x.ctx, w.resv + x.need
        heappush(w.heap, (w.steps + x.toks[x.turn], x.id, x.ep, x))  # the id breaks ties: x is never compared

    def leave(self, x: Traj, w: Worker) -> float:
        """Take x off w (after adv): the GPU-seconds its current turn used."""
        w.n, w.resv, x.at = w.n - 1, w.resv - x.need, -1
        w.ctx = w.ctx - x.ctx - (w.steps - x.vj) if w.n else 0.0
        if not w.n:  # idle once the current pause (a prefill) is over
            add_segment(w.segs, w.busy, w.t, 0)
            w.busy = None
        return w.share - x.sj

    def fill(self, w: Worker, t: float) -> None:
        """w has room: serve its own (affinity) queue, then the global FIFO queue."""
        for q in (w.queue, self.gq) if w.inpool and (w.queue or self.gq) else ():
            while q and (q[0][0].ep != q[0][1] or self.room(w, q[0][0])):
                x, e = q.popleft()
                if e == x.ep:
                    self.place(x, w, t)
            if q:
                break
        self.resched(w)

    def dispatch(self, x: Traj, t: float) -> None:
        """Route x's next turn: its prefix's worker if it has room, else the least-loaded one, else a queue."""
        w = self.workers[x.wk] if x.wk >= 0 and self.workers[x.wk].inpool else None
        y = w if w is not None and not w.queue and self.room(w, x) else None
        if y is None and self.pool and not self.gq and (w is None or self.cfg.dispatch == "sample"):  # re-prefill
            y = z if self.room(z := min(self.pool, key=RESV), x) else None  # the least-loaded worker
        if y is not None:
            self.place(x, y, t)
            return self.resched(y)
        (w.queue if w is not None else self.gq).append((x, x.ep))  # its own worker's queue, or any
        x.at = -2

    def admit(self, t: float) -> None:
        """Admit trajectories up to the cap of assumption 6 (a long round: the deferred ones, assumption 7)."""
        cfg, p0, batch = self.cfg, self.cfg.prompt_tokens, self.cfg.dispatch == "batch"
        cap, j = (self.v + 1 + self.alpha) * self.n_train + (0 if self.long else self.chunk - self.n_train), 0
        while self.live < cap and not (batch and (self.running and not j or not self.pool)):
            if (r := self.deferred.popleft() if self.long and self.deferred else next(self.source, None)) is None:
                return  # a replay file read "once" is exhausted
            n = sum(r[0])
            x = Traj(
                len(self.trajs), r[0], r[1], self.v, p0, p0 + r[0][0], n, p0 + n + cfg.obs_tokens * (len(r[0]) - 1)
            )
            self.trajs.append(x)
            self.running.add(x.id)
            self.tmo.append((t + cfg.timeout_s, x.id))  # deadlines in admission order are sorted: a FIFO
            self.live, j = self.live + 1, j + 1
            if batch:
                x.wk = self.pool[j % len(self.pool)].k  # static round-robin assignment
            self.dispatch(x, t)

    def drop(self, x: Traj, code: int, t: float) -> None:
        """x leaves for good without being trained on: its work is waste; admission replaces it."""
        if x.at >= 0:
            w = self.workers[x.at]
            self.adv(w, t)
            x.charge += self.leave(x, w)
            self.fill(w, t)
        if code == ABORTED and self.cfg.tail_batching:
            self.deferred.append((x.toks, x.envs))
        self.running.discard(x.id)
        x.ep, x.st, x.toks, x.envs = x.ep + 1, code, None, None
        self.waste, self.live = self.waste + x.charge, self.live - 1

    def finish(self, w: Worker, t: float) -> None:
        """Every sequence on w whose turn is done goes to its environment step."""
        self.adv(w, t)
        h, lim = w.heap, w.steps + 1e-6
        while h:
            vf, _, e, x = h[0]
            if e == x.ep:  # (entries of cancelled turns are skipped)
                if vf > lim:
                    break
                x.charge += self.leave(x, w)
                heappush(self.ev, (t + x.envs[x.turn], self.nxt(), EV_ENV, x, e))
            heappop(h)
        self.fill(w, t)

    def env_done(self, x: Traj, t: float) -> None:
        """EV_ENV: x's next turn, or x is done."""
        x.turn += 1
        if x.turn < len(x.toks):
            x.ctx += x.toks[x.turn - 1] + self.obs
            x.need = x.ctx + x.toks[x.turn]
            return self.dispatch(x, t)
        self.running.discard(x.id)
        x.st, x.nfin = DONE, x.nfin + 1
        self.buf.setdefault(x.ver, deque()).append(x.id)
        self.try_train(t)

    def try_train(self, t: float) -> None:
        """The trigger: n_train usable done trajectories and an idle trainer; starts a training step."""
        v, trajs = self.v, self.trajs
        for i in [i for ver in [ver for ver in self.buf if ver < v - self.alpha] for i in self.buf.pop(ver)]:  # stale
            self.drop(trajs[i], EXPIRED, t)
        self.admit(t)
        if self.training or self.step >= self.cfg.steps or sum(map(len, self.buf.values())) < self.n_train:
            return
        self.training, batch = True, []
        for ver in sorted(self.buf):  # oldest version first, then finishing order
            while self.buf[ver] and len(batch) < self.n_train:
                batch.append(trajs[self.buf[ver].popleft()])
        for x in batch:
            x.st, x.toks, x.envs, self.useful = CONSUMED, None, None, self.useful + x.charge
            self.stale.append(v - x.ver)
        for i in sorted(i for i in self.running if trajs[i].ver <= v - self.alpha):  # no later step may use them
            self.drop(trajs[i], ABORTED, t)
        self.trig.append(t)
        t0 = t if self.cfg.schedule == "disagg" else self.shrink(t)
        dt = self.c["train_gpu_s"] * sum(x.ctxf for x in batch) / (len(self.release) * self.g)
        for k in self.release:
            add_segment(self.workers[k].segs, t0, t0 + dt, 1)
        heappush(self.ev, (t0 + dt, self.nxt(), EV_TRAINED, 0, 0))

    def shrink(self, t: float) -> float:
        """The train set leaves rollout: its turns migrate (restart + re-prefill elsewhere), drain, offload."""
        moved, t0 = [], t
        for w in [self.workers[k] for k in self.release if self.workers[k].inpool]:
            self.adv(w, t)
            w.inpool, t0 = False, max(t0, w.t)
            moved += [x for _, _, e, x in w.heap if e == x.ep] + [x for x, e in w.queue if e == x.ep]
        moved = [x for x in moved if self.evict(x, t)]
        for k in self.release:
            w = self.workers[k]
            w.heap, self.fin[k] = [], math.inf
            w.queue.clear()
            add_segment(w.segs, t0, t0 + self.cfg.shrink_s, 3)
        self.pool, self.drain = [w for w in self.workers if w.inpool], self.drain + t0 - t
        for x in moved:
            self.dispatch(x, t)
        return t0 + self.cfg.shrink_s

    def evict(self, x: Traj, t: float) -> bool:
        """Migration: x's turn leaves its worker or queue to restart elsewhere (False: x is in its env step)."""
        k, x.wk = x.at, -1  # the prefix-cache affinity is lost
        if k >= 0:
            self.adv(self.workers[k], t)
            self.waste += self.leave(x, self.workers[k])
        if k != -1:  # on a worker or queued (-2)
            x.ep, self.mig = x.ep + 1, self.mig + 1
        return k != -1

    def trained(self, t: float) -> None:
        """EV_TRAINED: weight sync on every GPU (rollout pauses for it), then the train set expands."""
        s, e = self.c["sync_s"], self.cfg.expand_s if self.expands else 0.0
        for w in self.workers:
            self.adv(w, t)
            if w.busy is not None:  # split the busy stretch around the sync
                add_segment(w.segs, w.busy, w.t, 0)
                w.busy = w.t + s if w.n else None
            add_segment(w.segs, w.t, w.t + s, 2)
            add_segment(w.segs, w.t + s, w.t + s + (0.0 if w.inpool else e), 4)
            w.t += s
            self.resched(w)
        heappush(self.ev, (t + s + e, self.nxt(), EV_STEP, 0, 0))

    def step_end(self, t: float) -> None:
        """EV_STEP: a new policy version; the train set rejoins rollout (colocated, timemux)."""
        self.v, self.step, self.training = self.v + 1, self.step + 1, False
        self.long = self.cfg.tail_batching and len(self.deferred) >= self.cfg.batch  # a RollPacker long round
        self.ends.append(t)
        for k in self.release if self.expands else ():
            self.workers[k].inpool, self.workers[k].t = True, t
        self.pool = [w for w in self.workers if w.inpool]
        trajs = self.trajs
        placed = [i for i in sorted(self.running) if trajs[i].wk >= 0] if self.tm and self.expands else []
        moved = placed[: len(placed) * len(self.release) // len(self.workers)]  # ROLL rebalance_on_expand
        for i in [i for i in moved if self.evict(trajs[i], t)]:
            self.dispatch(trajs[i], t)
        self.admit(t)
        for w in sorted(self.pool, key=lambda w: w.k not in self.release):  # the returning workers first
            self.fill(w, t)
        self.try_train(t)

    def run(self) -> dict:
        """Events until cfg.steps training steps are done, then the metrics."""
        self.admit(0.0)
        t, nev, fin, ev, tmo, trajs, workers = 0.0, 0, self.fin, self.ev, self.tmo, self.trajs, self.workers
        while self.step < self.cfg.steps:  # the earliest of: a turn completion, a timeout, a heap event
            m, te, td, nev = min(fin), ev[0][0] if ev else math.inf, tmo[0][0] if tmo else math.inf, nev + 1
            if m <= te and m <= td and m < math.inf:
                t = m
                self.finish(workers[fin.index(m)], t)
            elif td < te:
                t, i = tmo.popleft()
                if trajs[i].st == RUNNING:
                    self.drop(trajs[i], TIMEOUT, t)
                    self.admit(t)
            elif ev:
                t, _, kind, x, e = heappop(ev)
                if kind == EV_ENV:
                    if e == x.ep:  # (the env event of a cancelled turn is stale)
                        self.env_done(x, t)
                else:
                    (self.trained if kind == EV_TRAINED else self.step_end)(t)
            else:
                break
        return self.metrics(self.ends[-1] if self.ends else t, nev)

    def metrics(self, wall: float, nev: int) -> dict:
        """Throughput, GPU shares by role within [0, wall], staleness and the per-trajectory arrays."""
        cfg, g, trajs = self.cfg, self.cfg.gpus_per_worker, self.trajs
        for w in self.workers:  # close the busy stretches still open
            self.adv(w, wall)
            if w.busy is not None:
                add_segment(w.segs, w.busy, w.t, 0)
        gpu_s, raw = np.zeros(len(ROLES)), 0.0  # GPU-seconds by role within [0, wall]; all rollout GPU-seconds
        for w in self.workers:
            a = np.array(w.segs, dtype=float).reshape(-1, 3)  # [segments, (t0, t1, role)]
            np.add.at(gpu_s, a[:, 2].astype(int), g * np.clip(np.minimum(a[:, 1], wall) - a[:, 0], 0, None))
            raw += g * np.sum((a[:, 1] - a[:, 0])[a[:, 2] == 0])
        share = lambda x: self.workers[x.at].share - x.sj if x.at >= 0 else 0.0  # of the turn under way
        inflight = sum(trajs[i].charge + share(trajs[i]) for i in self.running)
        inflight += sum(trajs[i].charge for q in self.buf.values() for i in q)
        sts, gens, den = (
            np.array([x.st for x in trajs]),
            np.array([x.gen for x in trajs]),
            max(wall, 1e-12) * cfg.n_gpus,
        )
        ok, n_of, stale = sts == CONSUMED, lambda code: int(np.sum(sts == code)), self.stale
        return dict(
            schedule=cfg.schedule, steps=self.step, wall_s=wall, step_s=wall / max(self.step, 1),
            traj_per_s=ok.sum() * cfg.n_gpus / den, tok_per_s=gens[ok].sum() * cfg.n_gpus / den,
            rollout=(gpu_s[0] - self.waste) / den, waste=self.waste / den, train=gpu_s[1] / den, sync=gpu_s[2] / den,
            overhead=(gpu_s[3] + gpu_s[4]) / den, idle=round(1 - gpu_s.sum() / den, 12), timeouts=n_of(TIMEOUT),
            aborted=n_of(ABORTED), expired=n_of(EXPIRED), migrated=self.mig, events=nev,
            stale_mean=float(np.mean(stale)) if stale else 0.0, shrink_wait_s=self.drain / max(len(self.trig), 1),
            staleness=np.bincount(np.array(stale, dtype=int), minlength=self.alpha + 1),
            segments=[w.segs for w in self.workers], ends=self.ends, trig=self.trig, gpus_per_worker=g,
            gpu_s=dict(zip(ROLES, gpu_s)), useful_s=self.useful, waste_s=self.waste, inflight_s=inflight,
            rollout_raw_s=raw, traj=dict(ver=np.array([x.ver for x in trajs]), status=sts,
                                         nfin=np.array([x.nfin for x in trajs]), gen=gens),
        )  # fmt: skip


def simulate(cfg: Config) -> dict:
    """Run one schedule for cfg.steps training steps: metrics, Gantt segments, staleness, per-trajectory arrays."""
    return Sim(cfg).run()


def compare(cfg: Config, schedules=SCHEDULES) -> list[dict]:
    """simulate() each schedule on the same workload (same seed); 'speedup' = throughput vs the first one, in
    consumed trajectories/s and in their tokens/s ('speedup_tok': a schedule that aborts the longest trajectories
    gains much less in the second); 'wasted_share' = the share of its rollout GPU time that was wasted (dropped:
    aborted, timed out, expired; and migrated turns)."""
    res = parallel_map(simulate, [(dataclasses.replace(cfg, schedule=s),) for s in schedules], cfg.jobs)
    return [r | {"speedup": r["traj_per_s"] / res[0]["traj_per_s"], "speedup_tok": r["tok_per_s"] / res[0]["tok_per_s"],
                 "wasted_share": r["waste"] / max(r["rollout"] + r["waste"], 1e-12)} for r in res]  # fmt: skip


def plot_results(results: list[dict], path: str) -> Path:
    """One PNG: per schedule a Gantt chart (GPUs over time by role; white = idle) and the GPU share by role."""
    import matplotlib.pyplot as plt
    from matplotlib.collections import PolyCollection

    fig, axes = plt.subplots(len(results), 2, figsize=(16, 2.4 * len(results)), squeeze=False)
    for (gantt, util), r in zip(axes, results):
        g, wall, n_gpu = r["gpus_per_worker"], r["wall_s"], len(r["segments"]) * r["gpus_per_worker"]
        a = np.array([(w * g, *s) for w, ss in enumerate(r["segments"]) for s in ss]).reshape(-1, 4)  # [n, 4]
        x, stack = np.linspace(0, wall, 301), []  # [301] bin edges
        for role, col in enumerate(COLORS):
            y, t0, t1 = a[a[:, 3] == role, :3].T  # [m] each
            box = np.stack([t0, y, t1, y, t1, y + g, t0, y + g], 1).reshape(-1, 4, 2)  # [m, 4, 2] rectangles
            gantt.add_collection(PolyCollection(box, facecolors=col, linewidths=0))
            s0, s1 = np.sort(t0), np.sort(t1)  # busy time in [0, x] = sum over segments of clip(x - t0, 0, t1 - t0)
            c0, c1, i0, i1 = np.r_[0, np.cumsum(s0)], np.r_[0, np.cumsum(s1)], s0.searchsorted(x), s1.searchsorted(x)
            stack.append(np.diff(i0 * x - c0[i0] - i1 * x + c1[i1]) * g / np.diff(x) / n_gpu)  # [300]
        util.stackplot(x[1:], stack, colors=COLORS, labels=ROLES)
        gantt.set(xlim=(0, wall), ylim=(0, n_gpu), ylabel="GPU", title=f"{r['schedule']}: {r['traj_per_s']:.3g} traj/s")
        util.set(xlim=(0, wall), ylim=(0, 1), ylabel="share of GPUs", title=f"{r['schedule']} utilisation")
    axes[0, 1].legend(loc="upper right", ncol=5, fontsize=8)
    for ax in axes[-1]:
        ax.set_xlabel("time (s)")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return Path(path)


UNITS = """\
units: step_s seconds per training step; traj_per_s, tok_per_s: trained trajectories, their tokens, per second; speedup
  (_tok): that over the first schedule's; rollout waste train sync overhead idle: shares of all GPU time (n_gpus x
  wall-clock seconds) summing to 1 (waste: rollout time on work never trained on, i.e. aborted, timed-out, expired
  trajectories and migrated turns; overhead: timemux's shrink and expand; idle: in no role); wasted_share = waste /
  (rollout + waste); timeouts aborted: trajectories; migrated: turns; stale_mean: policy versions between a
  trajectory's start and its training"""


def print_comparison(res: list[dict]) -> None:
    """compare()'s table and its units, the headline in both units, and each schedule's staleness histogram."""
    cols = "schedule steps step_s traj_per_s tok_per_s speedup speedup_tok rollout waste wasted_share train sync"
    print(format_table(res, cols.split() + "overhead idle timeouts aborted migrated stale_mean".split()))
    print(UNITS)
    tm = next(r for r in res if r["schedule"] == "timemux")  # the headline in both units (compare's docstring)
    print(f"{tm['schedule']} vs {res[0]['schedule']}: {tm['speedup']:.3g}x in trajectories/s, "
          f"{tm['speedup_tok']:.3g}x in tokens/s; {tm['wasted_share']:.0%} of its rollout GPU time wasted")  # fmt: skip
    for r in res:
        print(f"{r['schedule']}: staleness histogram {r['staleness'].tolist()}, {r['events']} events")


def main(argv=None):
    """`python scheduler.py [flags]`: simulate the three schedules on one workload, print and plot them."""
    import matplotlib

    matplotlib.use("Agg")
    cfg = parse_config(Config, argv, description=__doc__.split("\n\n")[0])  # (Config's module is scheduler_config)
    scheduler_config.print_costs(cfg)  # the cost model in readable units
    res = compare(cfg)
    print_comparison(res)
    print("plot:", plot_results(res, f"{cfg.out_dir}/schedules.png"))
    return res


if __name__ == "__main__":
    main()
