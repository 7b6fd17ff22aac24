"""What scheduler.py simulates: the cluster, the workload and their costs, every assumption a Config field (no torch).

    python scheduler_config.py                 # the default's per-worker costs and a sample of its workload
    python scheduler_config.py --tail 1.5      # any field (see --help): how turns, tokens and contexts spread

`Config` is the whole simulation's (scheduler.py's event engine reads it; assumptions 5-7 are in its docstring).
Here are the workload it draws (`make_workload`, or `load_lengths` replayed) and the per-worker cost constants
(`cost_model`; `decode_time` / `decode_steps`: decode between two events in closed form).
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
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from cli import check_choice, check_range, parse_config
from runlog import format_table

SCHEDULES = ("colocated", "disagg", "timemux")
TRAIN_FLOPS = 8.0  # training FLOPs per token per active parameter: 6 (forward + backward) + 2 (old-logprob pass)


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
    out_dir: str = "runs/scheduler"
    """where the plots go"""
    jobs: int = 0
    """processes for compare (and experiments/schedules.py's sweep): 0 = one per usable CPU, 1 = in this process
    (spawned processes: a script calling compare needs the `if __name__ == "__main__":` guard)"""

    def __post_init__(self):
        choices = dict(schedule=SCHEDULES, dispatch=("sample", "batch"), replay_order=("random", "once"))
        for f, ok in choices.items():
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


def print_costs(cfg: Config) -> None:
    """One line: the per-worker cost constants of cost_model (assumptions 2-4) in readable units."""
    c = cost_model(cfg)
    print(
        f"per worker: decode step {1e3 * c['step_min']:.3g}-{1e3 * c['step_max']:.3g} ms + {1e9 * c['kv_s']:.3g} ms"
        f"/1M context tokens; KV cache {c['kv_cap']:.4g} tokens; prefill {1e6 * c['prefill_s']:.3g} ms/1K tokens;"
        f" train {1e3 * c['train_gpu_s']:.3g} GPU-ms/token; sync {c['sync_s']:.3g} s"
    )


def main(argv=None) -> dict:
    """`python scheduler_config.py [flags]`: the cost constants, then the first `batch` trajectories' spread."""
    cfg = parse_config(Config, argv)
    print({k: f"{v:.4g}" for k, v in cost_model(cfg).items()})
    rows = load_lengths(cfg.lengths_file) if cfg.lengths_file else None
    work = make_workload(cfg, 0, cfg.batch, rows)  # [(action tokens per turn, env seconds per turn)]
    per_traj = {
        "turns": [len(toks) for toks, _ in work],
        "action_tokens": [sum(toks) for toks, _ in work],
        "final_context": [cfg.prompt_tokens + sum(toks) + cfg.obs_tokens * (len(toks) - 1) for toks, _ in work],
        "env_s": [sum(env) for _, env in work],
    }
    quantiles = (0.5, 0.9, 0.99, 1.0)
    table = [
        {"per trajectory": k, **{f"q{q:g}": float(np.quantile(v, q)) for q in quantiles}} for k, v in per_traj.items()
    ]
    print(f"{len(work)} trajectories (seed {cfg.seed}):")
    print(format_table(table))
    return per_traj


if __name__ == "__main__":
    main()
