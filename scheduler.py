"""Discrete-event simulator of GPU schedules for (agentic) RL: colocated sync, async disaggregated, time-multiplexed.

    python scheduler.py                                   # the three schedules on a small default, in seconds
    python scheduler.py --preset agentic-160gpu           # (or rlvr-async): simulated next to reported figures
    python scheduler.py --preset rlvr-async --calibrate   # bisect the preset's one free parameter on its figure
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
from typing import Literal

import numpy as np

from cli import check_choice, check_range, parse_config
from runlog import format_table, parallel_map

SCHEDULES = ("colocated", "disagg", "timemux")
ROLES = ("rollout", "train", "sync", "shrink", "expand")  # segment role codes 0..4; time in no segment is idle
COLORS = ("tab:blue", "tab:orange", "tab:red", "tab:purple", "tab:green")
EV_ENV, EV_TRAINED, EV_STEP = range(3)  # heap event kinds (turn completions and timeouts have their own queues)
RUNNING, DONE, CONSUMED, ABORTED, TIMEOUT, EXPIRED = range(6)  # trajectory status
TRAIN_FLOPS = 8.0  # training FLOPs per token per active parameter: 6 (forward + backward) + 2 (old-logprob pass)
# fmt: off
PRESETS = {  # the reported runs: what they state is fixed, their free parameter calibrated (CALIBRATION, RESULTS.md)
    "agentic-160gpu": dict(n_gpus=160, gpus_per_worker=8, train_gpus=128, batch=512, steps=20, alpha=1,  # stated
                           total_params_b=235.0, active_params_b=22.0, kv_bytes_per_token=192512.0,  # Qwen3-235B-A22B
                           max_turns=100, max_context=65536,  # stated; the per-turn lengths are our guesses
                           prompt_tokens=2000, turns_median=30.0, turns_sigma=0.6, tokens_median=300.0,
                           tokens_sigma=0.7, tail=0.5, obs_tokens=500, env_sigma=1.0,
                           mfu=0.507),  # calibrated on tm/disagg 3.5x in tokens/s (`--calibrate`)
    "rlvr-async": dict(n_gpus=128, gpus_per_worker=1, train_gpus=32, batch=1024, steps=20, alpha=2,  # stated: 128 x 8
                       total_params_b=8.2, active_params_b=8.2, kv_bytes_per_token=147456.0,  # Qwen3-8B; 32K cap
                       max_turns=1, turns_median=1.0, turns_sigma=0.0, tokens_sigma=0.0, obs_tokens=0,  # single turn
                       tokens_median=1600.0, tail=0.8,  # stated: the longest > 20x the median (exp(0.8 sqrt(2 ln
                       # 1024)) = 20 for the longest of 1024), and the longest reaches the cap: 32768 / 20 = 1600
                       prompt_tokens=500, env_median_s=1.0, timeout_s=36000.0,  # our guesses (no timeouts)
                       mfu=0.0197),  # calibrated on async/sync 2.24x (`--preset rlvr-async --calibrate`)
}
CALIBRATION = {  # preset: (its free field, the bracket bisected, the figure it is fitted to); the other rows predict
    "rlvr-async": ("mfu", 0.01, 0.4, "async/sync"),
    "agentic-160gpu": ("mfu", 0.04, 1.0, "tm/disagg tokens/s"),
}
# fmt: on
NOTES = {  # printed under the preset's table: what is fixed, what is fitted, why the predictions differ
    "agentic-160gpu": "Stated: cluster, model, 128/32 split, batch 512, 100 turns, 64K. The per-turn lengths, tail "
    "and alpha 1 are our guesses; mfu is fitted to 3.5x (`--calibrate`): 0.507, while rlvr-async needs 0.0197 (at "
    "0.0197 here tm/disagg is 1.2x, with timeouts), so no one training cost gives both claims. timemux wins by "
    "KV capacity (the 32-GPU pool queues ~1000 live trajectories); traj/s includes the length bias of "
    "bounded staleness. Not modelled: attention FLOPs, KV transfer, partial rollouts, GRPO groups.",
    "rlvr-async": "Stated: 128 GPUs, Qwen3-8B, 128 x 8, 32K, alpha 2, longest > 20x median (-> median 1600, tail "
    "0.8). mfu is fitted to 2.24x (`--calibrate`): training must cost ~20x our nominal FLOPs at 40 %, and then it "
    "takes over 30 % of the sync step, against the stated rollout > 70 %: under our model the two statements "
    "exclude each other. Queue scheduling is unreachable under the stated synchronous step: all 64 samples of 8x8 "
    "decode at once either way and the step ends with the longest; the reported 2.16x must come from stages we do "
    "not model (the reward after the batch, dynamic-sampling rounds). Redundancy counted in samples flatters 3.38x.",
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
    calibrate: bool = False
    """with a preset: bisect its free parameter (CALIBRATION) until its figure is the reported one, print the value"""
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


def traj_per_s(cfg: Config) -> float:
    """simulate(cfg)'s throughput alone (what sweep keeps: no segments travel back from the processes)."""
    return simulate(cfg)["traj_per_s"]


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
    """The reported figures (papers.md 3c, 4a) next to the simulated ones (main prints both): 'fit' marks the one
    the preset's free parameter was calibrated on, the others are predictions."""
    co, dis, tm = res
    fit = CALIBRATION[cfg.preset][3]
    row = lambda fig, rep, sim: dict(figure=fig, reported=rep, simulated=sim, use="fit" if fig == fit else "prediction")
    if cfg.preset == "agentic-160gpu":
        return [
            row("tm/disagg tokens/s", 3.5, tm["tok_per_s"] / dis["tok_per_s"]),
            row("tm/disagg traj/s", 3.5, tm["traj_per_s"] / dis["traj_per_s"]),
            row("timeouts tm (disagg)", "0 (>0)", f"{tm['timeouts']} ({dis['timeouts']})"),
            row("tm sync GPU share", "small", tm["sync"]),
            row("tm shrink s/step", "seconds", tm["shrink_wait_s"] + cfg.shrink_s),
        ]
    split = {k: simulate(dataclasses.replace(cfg, schedule="disagg", train_gpus=k)) for k in (16, 32, 64, 96)}
    best = max(split, key=lambda k: split[k]["traj_per_s"])  # the split is searched (the reported one is not known)
    q = dataclasses.replace(cfg, schedule="colocated", n_gpus=8, train_gpus=8, batch=64, steps=10)  # "8x8"
    b, s0, s16 = (
        simulate(dataclasses.replace(q, **kw))["traj_per_s"] for kw in ({"dispatch": "batch"}, {}, {"redundant": 128})
    )
    return [
        row("async/sync", 2.24, split[best]["traj_per_s"] / co["traj_per_s"]),
        row(f"async/sync tokens/s ({best} train)", 2.24, split[best]["tok_per_s"] / co["tok_per_s"]),
        row("sync rollout share of step", "> 0.7", 1 - co["train"] - co["sync"] - co["overhead"]),  # idle: the tail
        row("queue/batch, 8x8", 2.16, s0 / b),
        row("+16x8 redundant", 3.38, s16 / b),
    ]


def calibrate(cfg: Config, iters: int = 8, target: float | None = None) -> tuple[float, float]:
    """Bisect the preset's free field (CALIBRATION; geometric for mfu) until the fitted figure equals the reported
    one (or target), assuming it is monotone there: (the value of the closest try, its simulated figure). Raises if
    the bracket's ends do not straddle it (the claim is unreachable by that field)."""
    field_, lo, hi, figure = CALIBRATION[cfg.preset]

    def gap(v: float) -> tuple[float, float]:
        c = dataclasses.replace(cfg, **{field_: v})
        r = next(r for r in preset_report(c, compare(c)) if r["figure"] == figure)
        want = r["reported"] if target is None else target
        print(f"[calibrate] {field_} = {v:.4g}: {figure} {r['simulated']:.3f} (want {want})", flush=True)
        return r["simulated"], r["simulated"] - want

    tries = [(lo, gap(lo)), (hi, gap(hi))]
    if tries[0][1][1] * tries[1][1][1] > 0:
        (s_lo, _), (s_hi, _) = tries[0][1], tries[1][1]
        raise ValueError(f"{cfg.preset}: {figure} is {s_lo:.3f} at {field_} = {lo} and {s_hi:.3f} at {hi}: the "
                         f"reported figure is outside, unreachable by '{field_}' in that range")  # fmt: skip
    a, b = tries
    for _ in range(iters):
        mid = math.sqrt(a[0] * b[0]) if field_ == "mfu" else 0.5 * (a[0] + b[0])
        tries.append((mid, gap(mid)))
        a, b = (tries[-1], b) if tries[-1][1][1] * a[1][1] > 0 else (a, tries[-1])
    v, (sim, _) = min(tries, key=lambda t: abs(t[1][1]))
    return v, sim


def main(argv=None):
    """`python scheduler.py [flags]`: simulate the schedules (or a preset, or a sweep), print and plot them."""
    import matplotlib

    matplotlib.use("Agg")
    cfg = parse_config(Config, argv)
    if cfg.preset:  # preset values go into the fields still at their defaults (explicit flags win)
        preset = {k: v for k, v in PRESETS[cfg.preset].items() if getattr(cfg, k) == getattr(Config(), k)}
        cfg = dataclasses.replace(cfg, **preset)
    if cfg.calibrate:
        check_choice("preset", cfg.preset, tuple(CALIBRATION))  # --calibrate needs a preset
        v, sim = calibrate(cfg)
        print(f"{cfg.preset}: {CALIBRATION[cfg.preset][0]} = {v:.4g} gives {CALIBRATION[cfg.preset][3]} {sim:.3f}")
        return v
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
    cols = "schedule steps step_s traj_per_s tok_per_s speedup speedup_tok rollout waste wasted_share train sync"
    print(format_table(res, cols.split() + "overhead idle timeouts aborted migrated stale_mean".split()))
    tm = next(r for r in res if r["schedule"] == "timemux")  # the headline in both units (compare's docstring)
    print(f"{tm['schedule']} vs {res[0]['schedule']}: {tm['speedup']:.3g}x in trajectories/s, "
          f"{tm['speedup_tok']:.3g}x in tokens/s; {tm['wasted_share']:.0%} of its rollout GPU time wasted")  # fmt: skip
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
