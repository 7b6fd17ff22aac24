"""Discrete-event simulator of GPU schedules for (agentic) RL: colocated sync, async disaggregated, time-multiplexed.

    python scheduler.py                                   # the three schedules on a small default, in seconds
    python scheduler.py --preset agentic-160gpu           # (or rlvr-async): simulated next to reported figures
    python scheduler.py --sweep tail --sweep-values 0 0.5 1 1.5   # any numeric field; writes a plot

Version v = training steps done; a trajectory started at v may be trained at version n iff n - v <= alpha (ROLL
Flash; papers.md 3-4; DESIGN.md 7.4-7.5). colocated: all GPUs roll out until `batch` trajectories are done, then all
train and sync (alpha 0). disagg: GPUs [0, train_gpus) only train, the others only roll out. timemux: all roll out;
once ceil(theta*batch) usable trajectories are done, GPUs [0, train_gpus) shrink away, train, every GPU syncs, they
expand back (alpha >= 1, as ROLL requires); the unfinished work carries over.
Modelling assumptions (our choices unless cited; every default is a Config field, see --help):
1. Workload: turns = clip(round(turns_median*exp(turns_sigma*z1 + tail*zf)), 1, max_turns); turn k decodes
   round(tokens_median*exp(tokens_sigma*z2_k + tail*zf)) tokens, then its environment takes env_median_s*exp(
   env_sigma*z3_k) s (the last wait is the reward); zf is per trajectory (`tail` = heavy-tail knob). Context = prompt
   + sum(action + obs_tokens); the turn reaching max_context is cut and ends it. Normals are drawn for max_turns
   turns whatever the knobs: a seed gives common random numbers across schedules and knob values. lengths_file
   replays per-turn action tokens (a line per trajectory), drawn at random or once in file order.
2. Worker = gpus_per_worker GPUs with a bf16 weight copy. Decode is memory-bound continuous batching: a step (a
   token for each of n running sequences) reads 2*min(total, n*active) GB of weights (a MoE batch touches ~n*active
   expert weights) plus kv_bytes_per_token per context token at hbm_bw_gbs per GPU; decode compute is ignored.
   Contexts grow a token per step: time vs steps is quadratic between events (solved exactly).
3. KV capacity per worker = (gpus*gpu_mem_gb - weights)/kv_bytes_per_token; a turn reserves its final context when
   it starts (no preemption); at most max_seqs sequences. A prefix stays cached on its worker between turns.
4. Prefill: 2*active FLOPs/token at peak_tflops*mfu, stalling the worker (obs_tokens on the worker caching the
   prefix, else the whole context). Train: TRAIN_FLOPS*active FLOPs per token of the final contexts / (GPUs*peak*
   mfu); attention FLOPs are ignored in both. Sync: sync_latency_s + weights/sync_bw_gbs on every GPU; rollout
   pauses, then resumes on the new weights. shrink_s / expand_s: offload / reload (colocated pays them too); a
   shrink first drains running prefills. Idle = GPU-time in no role; "waste" is part of the rollout time.
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
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np

from common import check_choice, check_range, parse_config
from runlog import format_table, parallel_map

SCHEDULES = ("colocated", "disagg", "timemux")
ROLES = ("rollout", "train", "sync", "shrink", "expand")  # segment role codes 0..4; time in no segment is idle
COLORS = ("tab:blue", "tab:orange", "tab:red", "tab:purple", "tab:green")
EV_ENV, EV_TRAINED, EV_STEP = range(3)  # heap event kinds (turn completions and timeouts have their own queues)
RUNNING, DONE, CONSUMED, ABORTED, TIMEOUT, EXPIRED = range(6)  # trajectory status
TRAIN_FLOPS = 8.0  # training FLOPs per token per active parameter: 6 (forward + backward) + 2 (old-logprob pass)
# fmt: off
PRESETS = {  # our parameter choices: the length distributions behind the reported runs are not public
    "agentic-160gpu": dict(n_gpus=160, gpus_per_worker=8, train_gpus=128, batch=512, steps=20, alpha=1,
                           total_params_b=235.0, active_params_b=22.0, kv_bytes_per_token=192512.0,  # Qwen3-235B-A22B
                           max_turns=100, max_context=65536, prompt_tokens=2000, turns_median=30.0, turns_sigma=0.6,
                           tokens_median=300.0, tokens_sigma=0.7, tail=0.5, obs_tokens=500, env_sigma=1.0),
    "rlvr-async": dict(n_gpus=128, gpus_per_worker=1, train_gpus=32, batch=1024, steps=20, alpha=2, max_turns=1,
                       total_params_b=8.2, active_params_b=8.2, kv_bytes_per_token=147456.0,  # Qwen3-8B
                       turns_median=1.0, turns_sigma=0.0, tokens_median=4000.0, tokens_sigma=0.0, tail=1.0,
                       prompt_tokens=500, obs_tokens=0, env_median_s=1.0, timeout_s=36000.0),
}
# fmt: on
NOTES = {  # printed under the preset's table: why the simulated and reported figures differ
    "agentic-160gpu": "Lengths, timeout (1 h), alpha (1, ROLL's example) are our guesses. timemux wins by KV capacity: "
    "the 32-GPU pool has 4 engines x 0.55M KV tokens for ~1000 live trajectories, so turns queue and time out. The "
    "traj/s ratio includes the length bias of bounded staleness (timemux aborts the longest: its waste column); "
    "tokens/s is the fairer ratio. Not modelled: attention FLOPs, KV transfer, partial rollouts, GRPO groups.",
    "rlvr-async": "Lengths (median 4000, tail 1.0, 32K cap), batch and alpha 2 are our guesses; the split is searched. "
    "Our sync baseline waits for the 32K tail and ignores attention FLOPs, so async gains exceed the reported 2.24x. "
    "Static per-batch placement alone costs little here; the reported 2.16x likely includes stages we do not model "
    "(dynamic-sampling rounds, rewards); redundancy counted in samples (no GRPO groups) flatters the 3.38x.",
}


@dataclass
class Config:
    """The cluster, the workload and the schedule to simulate; every modelling assumption is a field."""

    schedule: Literal["colocated", "disagg", "timemux"] = "timemux"
    """schedule that simulate() runs (main compares all three): colocated | disagg | timemux"""
    n_gpus: int = 16
    """GPUs in the cluster"""
    gpus_per_worker: int = 2
    """GPUs per inference worker (an engine with a whole weight copy); the unit of shrink/expand"""
    train_gpus: int = 12
    """disagg: GPUs dedicated to training; timemux: size of the released set; colocated: unused (all train)"""
    alpha: int = 1
    """staleness bound: started at version v, trainable at version <= v + alpha (colocated: 0; timemux: >= 1)"""
    theta: float = 1.0
    """timemux trigger: shrink once ceil(theta*batch) usable trajectories are done, and train on them"""
    dispatch: Literal["sample", "batch"] = "sample"
    """sample: queue scheduling (greedy per-trajectory dispatch, refill at once); batch: static blocks"""
    redundant: int = 0
    """extra trajectories admitted beyond the batch (redundant prompts/envs); the slowest get aborted"""
    tail_batching: bool = False
    """colocated with redundant > 0: defer aborted prompts, run them together in a long round (RollPacker)"""
    batch: int = 128
    """trajectories per training step"""
    steps: int = 8
    """training steps simulated"""
    seed: int = 0
    """workload seed (same seed = same trajectories in every schedule)"""
    prompt_tokens: int = 1500
    """prompt tokens of every trajectory"""
    turns_median: float = 6.0
    """median number of turns (log-normal)"""
    turns_sigma: float = 0.5
    """log-space sigma of the number of turns"""
    tokens_median: float = 400.0
    """median generated (action) tokens per turn (log-normal)"""
    tokens_sigma: float = 0.6
    """log-space sigma of the tokens of each turn (independent per turn)"""
    tail: float = 0.8
    """heavy-tail knob: sigma of a per-trajectory log-normal factor on its turns and tokens (0 = no tail)"""
    obs_tokens: int = 400
    """environment observation tokens appended to the context after each turn"""
    env_median_s: float = 2.0
    """median environment latency per turn, seconds (log-normal; the last one is the reward)"""
    env_sigma: float = 0.5
    """log-space sigma of the environment latency"""
    max_turns: int = 24
    """maximum turns per trajectory"""
    max_context: int = 32768
    """maximum context tokens; the turn reaching it is cut and ends the trajectory"""
    timeout_s: float = 3600.0
    """a trajectory still running this long after admission is aborted (a timeout)"""
    lengths_file: str = ""
    """replay per-turn action token counts from this file (one trajectory per line) instead of log-normals"""
    replay_order: Literal["random", "once"] = "random"
    """random: lines drawn with replacement (seeded); once: file order, each line once"""
    total_params_b: float = 32.8
    """model parameters, billions (Qwen3-32B-like; bf16 weights: read by decode, moved by sync)"""
    active_params_b: float = 32.8
    """active parameters per token, billions (MoE: < total)"""
    kv_bytes_per_token: float = 262144.0
    """KV-cache bytes per context token: 2 * layers * kv_heads * head_dim * 2 bytes (Qwen3-32B: 64 * 8 * 128)"""
    gpu_mem_gb: float = 72.0
    """GPU memory usable for weights + KV cache, GB (80 GB H800 at 90%)"""
    hbm_bw_gbs: float = 2600.0
    """achieved HBM bandwidth per GPU, GB/s (H800 peak 3350)"""
    peak_tflops: float = 989.0
    """dense bf16 peak per GPU, TFLOP/s"""
    mfu: float = 0.4
    """model-FLOPs utilisation of prefill and training"""
    sync_bw_gbs: float = 50.0
    """weight-sync bandwidth from trainer to inference engines, GB/s"""
    sync_latency_s: float = 2.0
    """fixed weight-sync cost, seconds (suspend, barrier, resume)"""
    shrink_s: float = 3.0
    """seconds to hand rollout GPUs to training (offload KV cache and weights, load train state)"""
    expand_s: float = 2.0
    """seconds to hand trained GPUs back to rollout (weights already synced)"""
    max_seqs: int = 256
    """maximum concurrent sequences per worker (engine max_num_seqs)"""
    tm_dedicated: bool = False
    """timemux: the released set never rolls out (a permanently dedicated train set: must equal disagg)"""
    preset: Literal["", "agentic-160gpu", "rlvr-async"] = ""
    """agentic-160gpu | rlvr-async: fill the fields left at their defaults; print reported figures"""
    sweep: str = ""
    """numeric Config field to sweep (e.g. tail, n_gpus, alpha, theta) over 3 seeds; writes a plot"""
    sweep_values: list[float] = field(default_factory=lambda: [0.0, 0.4, 0.8, 1.2])
    """values of the swept field"""
    out_dir: str = "runs/scheduler"
    """where the plots go"""
    jobs: int = 0
    """processes for compare and sweep: 0 = one per usable CPU, 1 = in this process (spawned processes: a script
    calling compare or sweep needs the `if __name__ == "__main__":` guard)"""

    def __post_init__(self):
        choices = dict(schedule=SCHEDULES, dispatch=("sample", "batch"), replay_order=("random", "once"))
        for f, ok in (choices | {"preset": ("", *PRESETS)}).items():
            check_choice(f, getattr(self, f), ok)
        for names, lo, lo_open, hi in (
            ("n_gpus gpus_per_worker batch steps max_turns max_seqs", 1, False, None),
            ("redundant prompt_tokens obs_tokens tail turns_sigma tokens_sigma env_sigma env_median_s", 0, False, None),
            ("jobs kv_bytes_per_token sync_latency_s shrink_s expand_s", 0, False, None),
            ("turns_median tokens_median timeout_s total_params_b gpu_mem_gb hbm_bw_gbs peak_tflops", 0, True, None),
            ("sync_bw_gbs", 0, True, None),
            ("theta mfu", 0, True, 1),
        ):
            for f in names.split():
                check_range(f, getattr(self, f), lo, hi, lo_open=lo_open)
        check_range("active_params_b", self.active_params_b, 0, self.total_params_b, lo_open=True)
        check_range("max_context", self.max_context, self.prompt_tokens + 1)
        check_range("alpha", self.alpha, 1 if self.schedule == "timemux" else 0)  # alpha = 0: ROLL refuses timemux
        top = self.n_gpus - self.gpus_per_worker if self.schedule == "disagg" else self.n_gpus
        check_range("train_gpus", self.train_gpus, self.gpus_per_worker, top)  # the released set fits the cluster
        for f in ("n_gpus", "train_gpus"):
            if getattr(self, f) % self.gpus_per_worker:
                raise ValueError(f"config field '{f}' = {getattr(self, f)} must be a multiple of gpus_per_worker")
        if (cap := cost_model(self)["kv_cap"]) < self.max_context:
            raise ValueError(f"config field 'max_context' = {self.max_context}: above a worker's KV cache {cap:.0f}")
        if self.tail_batching and (self.schedule != "colocated" or self.redundant == 0):
            raise ValueError("config field 'tail_batching' needs schedule colocated and redundant > 0")
        if self.lengths_file:
            load_lengths(self.lengths_file)  # raises naming the field if missing or empty
        if self.sweep in ("seed", "jobs") or self.sweep and type(getattr(self, self.sweep, None)) not in (int, float):
            raise ValueError(f"config field 'sweep' = {self.sweep!r}: must name a numeric workload or cluster field")


def load_lengths(path: str) -> list[list[int]]:
    """Rows of per-turn action token counts (whitespace or comma separated); raises naming lengths_file."""
    try:
        rows = [[int(x) for x in ln.replace(",", " ").split()] for ln in Path(path).read_text().splitlines()]
    except (OSError, ValueError) as e:
        raise ValueError(f"config field 'lengths_file' = {path!r}: cannot read integers ({e})") from e
    if not (rows := [r for r in rows if r]) or min(map(min, rows)) < 1:
        raise ValueError(f"config field 'lengths_file' = {path!r}: needs >= 1 line of positive integers")
    return rows


def cost_model(cfg: Config) -> dict:
    """Per-worker cost constants (seconds, tokens) of assumptions 2-4."""
    g, wbytes = cfg.gpus_per_worker, 2e9 * cfg.total_params_b  # bf16: 2 bytes per parameter
    bw, flops = g * cfg.hbm_bw_gbs * 1e9, cfg.peak_tflops * 1e12 * cfg.mfu  # bytes/s of a worker, FLOP/s of a GPU
    kv_free = g * cfg.gpu_mem_gb * 1e9 - wbytes
    return dict(
        step_min=2e9 * cfg.active_params_b / bw,  # decode step of 1 sequence: reads the active weights
        step_max=wbytes / bw,  # decode step of many: reads every weight (all experts)
        kv_s=cfg.kv_bytes_per_token / bw,  # decode step time per context token in the batch
        kv_cap=kv_free / cfg.kv_bytes_per_token if cfg.kv_bytes_per_token else (math.inf if kv_free > 0 else 0.0),
        prefill_s=2e9 * cfg.active_params_b / (g * flops),  # per prefilled token
        train_gpu_s=TRAIN_FLOPS * 1e9 * cfg.active_params_b / flops,  # GPU-seconds per trained token
        sync_s=cfg.sync_latency_s + wbytes / (cfg.sync_bw_gbs * 1e9),
    )


def decode_time(u: float, a: float, b: float) -> float:
    """Seconds for u decode steps when step x takes a + b*x seconds (b = kv_s * n: contexts grow): a*u + b*u^2/2."""
    return a * u + 0.5 * b * u * u


def decode_steps(dt: float, a: float, b: float) -> float:
    """Inverse of decode_time: steps done in dt seconds (the stable root of b/2 u^2 + a u - dt = 0)."""
    return 2.0 * dt / (a + math.sqrt(a * a + 2.0 * b * dt))


def make_workload(cfg: Config, chunk: int, n: int, rows=None) -> list[tuple]:
    """Trajectories [chunk*n, chunk*n + n) as (per-turn action tokens, per-turn environment seconds)."""
    rng, T = np.random.default_rng([cfg.seed, chunk]), cfg.max_turns
    zf, zt, ztok, zenv = rng.standard_normal(n), rng.standard_normal(n), *rng.standard_normal((2, n, T))  # [n], [n, T]
    if rows is None:
        turns = np.clip(np.rint(cfg.turns_median * np.exp(cfg.turns_sigma * zt + cfg.tail * zf)), 1, T)  # [n]
        tok = np.maximum(1, np.rint(cfg.tokens_median * np.exp(cfg.tokens_sigma * ztok + cfg.tail * zf[:, None])))
    else:
        pick = rng.integers(len(rows), size=n) if cfg.replay_order == "random" else range(chunk * n, chunk * n + n)
        pick = [rows[j] for j in pick if j < len(rows)]
        turns = np.array([min(len(r), T) for r in pick], dtype=np.int64)  # [n']
        tok = np.array([(r + [0] * T)[:T] for r in pick], dtype=np.int64).reshape(-1, T)  # [n', T]
    k = np.arange(T)
    grow = np.where(k < turns[:, None], tok + cfg.obs_tokens, 0)  # [n, T] context growth of each turn
    before = cfg.prompt_tokens + np.cumsum(grow, axis=1) - grow  # [n, T] context when turn k starts
    live = (k < turns[:, None]) & (before < cfg.max_context)  # [n, T]
    tok = np.where(live, np.minimum(tok, cfg.max_context - before), 0).astype(np.int64)  # [n, T] cut at the cap
    env = cfg.env_median_s * np.exp(cfg.env_sigma * zenv)  # [n, T]
    return [(t[:m], e[:m]) for t, e, m in zip(tok.tolist(), env.tolist(), live.sum(1).tolist())]


def simulate(cfg: Config) -> dict:
    """Run one schedule for cfg.steps training steps: metrics, Gantt segments, staleness, per-trajectory arrays."""
    c, rows = cost_model(cfg), load_lengths(cfg.lengths_file) if cfg.lengths_file else None
    g, B, co, tm = cfg.gpus_per_worker, cfg.batch, cfg.schedule == "colocated", cfg.schedule == "timemux"
    W, alpha, n_train = cfg.n_gpus // g, 0 if co else cfg.alpha, math.ceil(cfg.theta * B) if tm else B
    release, expands = list(range(W if co else cfg.train_gpus // g)), co or (tm and not cfg.tm_dedicated)
    a1, amax, kv_s, kv_cap, pre_s = (c[k] for k in ("step_min", "step_max", "kv_s", "kv_cap", "prefill_s"))
    mx, obs, p0, inf, chunk = cfg.max_seqs, cfg.obs_tokens, cfg.prompt_tokens, math.inf, B + cfg.redundant
    # workers: at time tA[w] each running sequence has done vA[w] decode steps; cA[w] = their context sum;
    # share[w] = GPU-seconds charged so far to each running sequence; fin[w] = time of the next turn completion
    tA, vA, cA, share, nA, resv, fin = *([0.0] * W for _ in range(6)), [inf] * W
    heaps, wq, segs, busy = [[] for _ in range(W)], [deque() for _ in range(W)], [[] for _ in range(W)], [None] * W
    inpool = [not (w in release and (cfg.schedule == "disagg" or cfg.tm_dedicated)) for w in range(W)]
    pool = [w for w in range(W) if inpool[w]]
    # trajectories, by admission order: workload row, start version, context before the current turn, its KV
    # reservation, generated tokens, final context, turn, worker caching its prefix (wk) / decoding it (at: -1
    # none, -2 queued), epoch (bumped when a turn is cancelled), status, vA and share at join, GPU-seconds used
    row, ver, ctx, need, gen, ctxf, turn, wk, at, ep, st, vj, sj, charge, nfin = ([] for _ in range(15))
    fixed = ((turn, 0), (wk, -1), (at, -1), (ep, 0), (st, RUNNING), (vj, 0.0), (sj, 0.0), (charge, 0.0), (nfin, 0))
    tmo, running, gq, deferred, buf, stale, ends, trig, ev = deque(), set(), deque(), deque(), {}, [], [], [], []
    nxt, hpush, hpop = itertools.count().__next__, heapq.heappush, heapq.heappop
    S = dict(v=0, step=0, live=0, busy=False, long=False, waste=0.0, useful=0.0, mig=0, drain=0.0)
    room = lambda w, i: nA[w] < mx and resv[w] + need[i] <= kv_cap  # worker w can start i's turn now
    chunks = itertools.takewhile(len, (make_workload(cfg, k, chunk, rows) for k in itertools.count()))
    source = itertools.chain.from_iterable(chunks)  # drawn lazily, seeded per chunk; ends if a file is read once

    def seg(w, t0, t1, role):  # record [t0, t1) of role on worker w, merged into a touching same-role segment
        s = segs[w]
        if s and s[-1][2] == role and s[-1][1] >= t0 - 1e-9:
            s[-1][1] = max(s[-1][1], t1)
        elif t1 > t0:
            s.append([t0, t1, role])

    def adv(w, t):  # decode on w from tA[w] up to t (no progress while paused: tA[w] > t)
        d, n = t - tA[w], nA[w]
        if d > 0 and n:
            u = decode_steps(d, (amax if a1 * n > amax else a1 * n) + kv_s * cA[w], kv_s * n)
            vA[w], cA[w], share[w] = vA[w] + u, cA[w] + n * u, share[w] + g * d / n
        tA[w] = t if t > tA[w] else tA[w]

    def resched(w):  # fin[w] = when w's next turn completes (assumption 2)
        h = heaps[w]
        while h and ep[h[0][1]] != h[0][2]:  # drop cancelled turns
            hpop(h)
        if not h:
            fin[w] = inf
            return
        n, u = nA[w], h[0][0] - vA[w]
        fin[w] = tA[w] + decode_time(u if u > 0 else 0.0, (amax if a1 * n > amax else a1 * n) + kv_s * cA[w], kv_s * n)

    def place(i, w, t):  # start i's current turn on w: prefill (stalls w's decode), then decode
        adv(w, t)
        p = pre_s * (obs if wk[i] == w and turn[i] else ctx[i])  # the prefix is cached on the same worker
        busy[w] = tA[w] if busy[w] is None else busy[w]
        tA[w] += p
        vj[i], sj[i], wk[i], at[i] = vA[w], share[w] - g * p, w, w  # the prefill is charged to i alone
        nA[w], cA[w], resv[w] = nA[w] + 1, cA[w] + ctx[i], resv[w] + need[i]
        hpush(heaps[w], (vA[w] + row[i][0][turn[i]], i, ep[i]))

    def leave(i, w):  # take i off w (after adv); returns the GPU-seconds its current turn used
        nA[w], resv[w], at[i] = nA[w] - 1, resv[w] - need[i], -1
        cA[w] = cA[w] - ctx[i] - (vA[w] - vj[i]) if nA[w] else 0.0
        if not nA[w]:  # idle once the current pause (a prefill) is over
            seg(w, busy[w], tA[w], 0)
            busy[w] = None
        return share[w] - sj[i]

    def fill(w, t):  # w has room: serve its own (affinity) queue, then the global FIFO queue
        for q in (wq[w], gq) if inpool[w] and (wq[w] or gq) else ():
            while q and (ep[q[0][0]] != q[0][1] or room(w, q[0][0])):
                i, e = q.popleft()
                if e == ep[i]:
                    place(i, w, t)
            if q:
                break
        resched(w)

    def dispatch(i, t):  # route i's next turn (assumption 5)
        w = wk[i] if wk[i] >= 0 and inpool[wk[i]] else -1  # the worker caching its prefix
        x = w if w >= 0 and not wq[w] and room(w, i) else -1
        if x < 0 and pool and not gq and (w < 0 or cfg.dispatch == "sample"):  # else least-loaded (re-prefill)
            x = y if room(y := min(pool, key=resv.__getitem__), i) else -1
        if x >= 0:
            place(i, x, t)
            return resched(x)
        (wq[w] if w >= 0 else gq).append((i, ep[i]))  # wait for its own worker, or for any (global queue)
        at[i] = -2

    def admit(t):  # admission cap (assumption 6)
        cap, j = (S["v"] + 1 + alpha) * n_train + (0 if S["long"] else chunk - n_train), 0
        while S["live"] < cap and not (cfg.dispatch == "batch" and (running and not j or not pool)):
            if (r := deferred.popleft() if S["long"] and deferred else next(source, None)) is None:
                return  # a replay file read "once" is exhausted
            i, n = len(row), sum(r[0])
            for lst, x in (*fixed, (row, r), (ver, S["v"]), (ctx, p0), (need, p0 + r[0][0]), (gen, n)):
                lst.append(x)
            ctxf.append(p0 + n + obs * (len(r[0]) - 1))
            running.add(i)
            tmo.append((t + cfg.timeout_s, i))  # deadlines in admission order are sorted: a FIFO, not the heap
            S["live"], j = S["live"] + 1, j + 1
            if cfg.dispatch == "batch":
                wk[i] = pool[j % len(pool)]  # static round-robin assignment
            dispatch(i, t)

    def drop(i, code, t):  # i leaves for good without being trained on: its work is waste; it gets replaced
        if (w := at[i]) >= 0:
            adv(w, t)
            charge[i] += leave(i, w)
            fill(w, t)
        if code == ABORTED and cfg.tail_batching:
            deferred.append(row[i])
        running.discard(i)
        ep[i], st[i], row[i], S["waste"], S["live"] = ep[i] + 1, code, None, S["waste"] + charge[i], S["live"] - 1

    def finish(w, t):  # every sequence on w whose turn is done goes to its environment step
        adv(w, t)
        h, lim = heaps[w], vA[w] + 1e-6
        while h:
            vf, i, e = h[0]
            if e == ep[i]:  # (entries of cancelled turns are skipped)
                if vf > lim:
                    break
                charge[i] += leave(i, w)
                hpush(ev, (t + row[i][1][turn[i]], nxt(), EV_ENV, i, e))
            hpop(h)
        fill(w, t)

    def env_done(i, t):  # EV_ENV: the next turn, or the trajectory is done
        k, toks = turn[i] + 1, row[i][0]
        turn[i] = k
        if k < len(toks):
            ctx[i] += toks[k - 1] + obs
            need[i] = ctx[i] + toks[k]
            return dispatch(i, t)
        running.discard(i)
        st[i], nfin[i] = DONE, nfin[i] + 1
        buf.setdefault(ver[i], deque()).append(i)
        try_train(t)

    def try_train(t):  # the trigger: n_train usable done trajectories and an idle trainer
        v = S["v"]
        for i in [i for x in [x for x in buf if x < v - alpha] for i in buf.pop(x)]:  # too stale for version v
            drop(i, EXPIRED, t)
        admit(t)
        if S["busy"] or S["step"] >= cfg.steps or sum(map(len, buf.values())) < n_train:
            return
        S["busy"], batch = True, []
        for x in sorted(buf):  # oldest version first, then finishing order
            while buf[x] and len(batch) < n_train:
                batch.append(buf[x].popleft())
        for i in batch:
            st[i], row[i], S["useful"] = CONSUMED, None, S["useful"] + charge[i]
            stale.append(v - ver[i])
        for i in sorted(i for i in running if ver[i] <= v - alpha):  # no later step may use them (ROLL gc)
            drop(i, ABORTED, t)
        trig.append(t)
        t0 = t if cfg.schedule == "disagg" else shrink(t)
        dt = c["train_gpu_s"] * sum(ctxf[i] for i in batch) / (len(release) * g)
        for w in release:
            seg(w, t0, t0 + dt, 1)
        hpush(ev, (t0 + dt, nxt(), EV_TRAINED, 0, 0))

    def shrink(t):  # the train set leaves rollout: its turns migrate (restart + re-prefill elsewhere), drain, offload
        moved, t0 = [], t
        for w in [w for w in release if inpool[w]]:
            adv(w, t)
            inpool[w], t0 = False, max(t0, tA[w])
            moved += [i for _, i, e in heaps[w] if e == ep[i]] + [i for i, e in wq[w] if e == ep[i]]
        moved = [i for i in moved if evict(i, t)]
        for w in release:
            heaps[w], fin[w] = [], inf
            wq[w].clear()
            seg(w, t0, t0 + cfg.shrink_s, 3)
        pool[:], S["drain"] = [w for w in range(W) if inpool[w]], S["drain"] + t0 - t
        for i in moved:
            dispatch(i, t)
        return t0 + cfg.shrink_s

    def evict(i, t):  # migration: i's turn leaves its worker or queue to restart elsewhere (False: in its env step)
        w, wk[i] = at[i], -1  # the prefix-cache affinity is lost
        if w >= 0:
            adv(w, t)
            S["waste"] += leave(i, w)
        if w != -1:
            ep[i], S["mig"] = ep[i] + 1, S["mig"] + 1
        return w != -1

    def trained(_, t):  # EV_TRAINED: weight sync on every GPU (rollout pauses for it), then the expand
        s, e = c["sync_s"], cfg.expand_s if expands else 0.0
        for w in range(W):
            adv(w, t)
            if busy[w] is not None:  # split the busy stretch around the sync
                seg(w, busy[w], tA[w], 0)
                busy[w] = tA[w] + s if nA[w] else None
            seg(w, tA[w], tA[w] + s, 2)
            seg(w, tA[w] + s, tA[w] + s + (0.0 if inpool[w] else e), 4)  # the train set expands
            tA[w] += s
            resched(w)
        hpush(ev, (t + s + e, nxt(), EV_STEP, 0, 0))

    def step_end(_, t):  # EV_STEP: new policy version; the train set rejoins rollout (colocated, timemux)
        S["v"], S["step"], S["busy"] = S["v"] + 1, S["step"] + 1, False
        S["long"] = cfg.tail_batching and len(deferred) >= B  # RollPacker long round
        ends.append(t)
        for w in release if expands else ():
            inpool[w], tA[w] = True, t
        pool[:] = [w for w in range(W) if inpool[w]]
        placed = [i for i in sorted(running) if wk[i] >= 0] if tm and expands else []
        for i in [i for i in placed[: len(placed) * len(release) // W] if evict(i, t)]:  # ROLL rebalance_on_expand
            dispatch(i, t)
        admit(t)
        for w in sorted(pool, key=lambda w: w not in release):  # the returning workers first
            fill(w, t)
        try_train(t)

    admit(0.0)
    t, nev = 0.0, 0
    while S["step"] < cfg.steps:  # next event: a turn completion, a timeout, or a heap event (env, train, step)
        m, te, td, nev = min(fin), ev[0][0] if ev else inf, tmo[0][0] if tmo else inf, nev + 1
        if m <= te and m <= td and m < inf:
            t = m
            finish(fin.index(m), t)
        elif td < te:
            t, i = tmo.popleft()
            if st[i] == RUNNING:
                drop(i, TIMEOUT, t)
                admit(t)
        elif ev:
            t, _, kind, x, y = hpop(ev)
            if kind != EV_ENV or y == ep[x]:  # (the env event of a cancelled turn is stale)
                (env_done, trained, step_end)[kind](x, t)
        else:
            break
    wall = ends[-1] if ends else t
    for w in range(W):  # close the busy stretches still open
        adv(w, wall)
        if busy[w] is not None:
            seg(w, busy[w], tA[w], 0)
    gpu_s, raw = np.zeros(len(ROLES)), 0.0  # GPU-seconds by role within [0, wall]; all rollout GPU-seconds
    for s in segs:
        a = np.array(s, dtype=float).reshape(-1, 3)  # [segments, (t0, t1, role)]
        np.add.at(gpu_s, a[:, 2].astype(int), g * np.clip(np.minimum(a[:, 1], wall) - a[:, 0], 0, None))
        raw += g * np.sum((a[:, 1] - a[:, 0])[a[:, 2] == 0])
    inflight = sum(charge[i] + (share[at[i]] - sj[i] if at[i] >= 0 else 0.0) for i in running)
    inflight += sum(charge[i] for q in buf.values() for i in q)
    sts, gens, den = np.array(st), np.array(gen), max(wall, 1e-12) * cfg.n_gpus
    ok, n_of = sts == CONSUMED, lambda code: int(np.sum(sts == code))
    return dict(
        schedule=cfg.schedule, steps=S["step"], wall_s=wall, step_s=wall / max(S["step"], 1),
        traj_per_s=ok.sum() * cfg.n_gpus / den, tok_per_s=gens[ok].sum() * cfg.n_gpus / den,
        rollout=(gpu_s[0] - S["waste"]) / den, waste=S["waste"] / den, train=gpu_s[1] / den, sync=gpu_s[2] / den,
        overhead=(gpu_s[3] + gpu_s[4]) / den, idle=round(1 - gpu_s.sum() / den, 12), timeouts=n_of(TIMEOUT),
        aborted=n_of(ABORTED), expired=n_of(EXPIRED), migrated=S["mig"], events=nev,
        stale_mean=float(np.mean(stale)) if stale else 0.0, shrink_wait_s=S["drain"] / max(len(trig), 1),
        staleness=np.bincount(np.array(stale, dtype=int), minlength=alpha + 1), segments=segs, ends=ends, trig=trig,
        gpus_per_worker=g, gpu_s=dict(zip(ROLES, gpu_s)), useful_s=S["useful"], waste_s=S["waste"],
        inflight_s=inflight, rollout_raw_s=raw, traj=dict(ver=np.array(ver), status=sts, nfin=np.array(nfin), gen=gens),
    )  # fmt: skip


def traj_per_s(cfg: Config) -> float:
    """simulate(cfg)'s throughput alone (what sweep keeps: no segments travel back from the processes)."""
    return simulate(cfg)["traj_per_s"]


def compare(cfg: Config, schedules=SCHEDULES) -> list[dict]:
    """simulate() each schedule on the same workload (same seed); 'speedup' = throughput vs the first one."""
    res = parallel_map(simulate, [(dataclasses.replace(cfg, schedule=s),) for s in schedules], cfg.jobs)
    return [r | {"speedup": r["traj_per_s"] / res[0]["traj_per_s"]} for r in res]


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


def sweep(cfg: Config, path: str | None = None, seeds: int = 3) -> list[dict]:
    """Mean throughput (traj/s) of each schedule per value of cfg.sweep over `seeds` seeds (CRN); optional plot."""
    import matplotlib.pyplot as plt

    rows, vals = [], list(map(type(getattr(cfg, cfg.sweep)), cfg.sweep_values))
    cfgs = [dataclasses.replace(cfg, schedule=s, seed=cfg.seed + k, **{cfg.sweep: v})
            for v in vals for s in SCHEDULES for k in range(seeds)]  # fmt: skip
    tput = np.array(parallel_map(traj_per_s, [(c,) for c in cfgs], cfg.jobs)).reshape(len(vals), len(SCHEDULES), seeds)
    for val, m in zip(vals, tput.mean(-1)):  # m: [schedules] mean over seeds
        rows.append({cfg.sweep: val, **dict(zip(SCHEDULES, m)), "tm_vs_co": m[2] / m[0], "tm_vs_dis": m[2] / m[1]})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, keys, yl in zip(
        axes, (SCHEDULES, ("tm_vs_co", "tm_vs_dis")), ("trajectories / s", "timemux throughput ratio")
    ):
        for k in keys:
            ax.plot([r[cfg.sweep] for r in rows], [r[k] for r in rows], "o-", label=k)
        ax.set(xlabel=cfg.sweep, ylabel=yl)
        ax.legend()
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.tight_layout()
        fig.savefig(path, dpi=80)
    plt.close(fig)
    return rows


def preset_report(cfg: Config, res: list[dict]) -> list[dict]:
    """The reported figures (papers.md 3c, 4a) next to the simulated ones (main prints both)."""
    co, dis, tm = res
    row = lambda fig, rep, sim: dict(figure=fig, reported=rep, simulated=sim)
    if cfg.preset == "agentic-160gpu":
        return [
            row("tm/disagg traj/s", 3.5, tm["traj_per_s"] / dis["traj_per_s"]),
            row("tm/disagg tokens/s", 3.5, tm["tok_per_s"] / dis["tok_per_s"]),
            row("timeouts tm (disagg)", "0 (>0)", f"{tm['timeouts']} ({dis['timeouts']})"),
            row("tm sync GPU share", "small", tm["sync"]),
            row("tm shrink s/step", "seconds", tm["shrink_wait_s"] + cfg.shrink_s),
        ]
    split = {k: simulate(dataclasses.replace(cfg, schedule="disagg", train_gpus=k))["traj_per_s"] for k in (16, 32, 64)}
    best = max(split, key=split.get)  # the split is searched over 3 points (the reported one is not known)
    q = dataclasses.replace(cfg, schedule="colocated", n_gpus=8, train_gpus=8, batch=64, steps=10)  # "8x8"
    b, s0, s16 = (
        simulate(dataclasses.replace(q, **kw))["traj_per_s"] for kw in ({"dispatch": "batch"}, {}, {"redundant": 128})
    )
    return [
        row(f"async/sync ({best} train)", 2.24, split[best] / co["traj_per_s"]),
        row("queue/batch, 8x8", 2.16, s0 / b),
        row("+16x8 redundant", 3.38, s16 / b),
    ]


def main(argv=None):
    """`python scheduler.py [flags]`: simulate the schedules (or a preset, or a sweep), print and plot them."""
    import matplotlib

    matplotlib.use("Agg")
    cfg = parse_config(Config, argv)
    if cfg.preset:  # preset values go into the fields still at their defaults (explicit flags win)
        preset = {k: v for k, v in PRESETS[cfg.preset].items() if getattr(cfg, k) == getattr(Config(), k)}
        cfg = dataclasses.replace(cfg, **preset)
    c = cost_model(cfg)
    print(
        f"per worker: decode step {1e3 * c['step_min']:.3g}-{1e3 * c['step_max']:.3g} ms + {1e9 * c['kv_s']:.3g} ms"
        f"/1M context tokens; KV cache {c['kv_cap']:.4g} tokens; prefill {1e6 * c['prefill_s']:.3g} ms/1K tokens;"
        f" train {1e3 * c['train_gpu_s']:.3g} GPU-ms/token; sync {c['sync_s']:.3g} s"
    )
    if cfg.sweep:
        print(format_table(rows := sweep(cfg, path := f"{cfg.out_dir}/sweep_{cfg.sweep}.png")), "\nplot:", path)
        return rows
    res = compare(cfg)
    cols = "schedule steps step_s traj_per_s tok_per_s speedup rollout waste train sync overhead idle timeouts aborted"
    print(format_table(res, cols.split() + ["migrated", "stale_mean"]))
    for r in res:
        print(f"{r['schedule']}: staleness histogram {r['staleness'].tolist()}, {r['events']} events")
    if cfg.preset:
        print(
            format_table(preset_report(cfg, res)),
            f"\nparameters: { {k: getattr(cfg, k) for k in PRESETS[cfg.preset]} }",
        )
        print(NOTES[cfg.preset])
    print("plot:", plot_results(res, f"{cfg.out_dir}/schedules.png"))
    return res


if __name__ == "__main__":
    main()
