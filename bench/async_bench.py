"""Async vs synchronous RL, measured in one run, next to scheduler.py's prediction for the measured parameters.

    python bench/async_bench.py                      # latency workload: calc env, log-normal env latency, 1 worker
    python bench/async_bench.py --workload compute   # compute-bound: reverse task, no latency (2 cores bound it)
    python bench/async_bench.py --full               # + final greedy accuracy, sync vs async, 3 seeds

Every configuration runs `async_loop.py` in its own subprocess with the same processes (1 trainer + K rollout
ranks), threads, workload and number of consumed samples (steps x prompts x G): sync is async ratio 0 on the same
processes, so the only difference is the staleness bound. Wall time is the sum of the trainer's step times
(waiting for a batch + scoring + update; startup and evaluation excluded); throughput = consumed samples / wall.

Prediction: scheduler.simulate's `disagg` schedule with K rollout workers of one request at a time (max_seqs 1)
and one training GPU, replaying the request durations measured in the sync run (encoded as decode tokens of
1 ms each) and a training time per step equal to the measured mean (peak FLOP/s calibrated to it); the
predicted speedup is simulated sync makespan / simulated async makespan for the same steps and admission rule.
Target (issue 8): on the latency workload the measured speedup is within +-25% of the prediction.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import scheduler  # noqa: E402
import scheduler_config  # noqa: E402
from cli import check_fields, check_range, parse_config  # noqa: E402
from runlog import format_table  # noqa: E402


@dataclass
class BenchConfig:
    """Which workload, which async ratios and how large a run (defaults: the latency workload, 12 steps)."""

    workload: Literal["latency", "compute"] = "latency"
    """latency: calc environment with log-normal env latency; compute: reverse task, no latency."""
    env_latency: float = 0.02
    """latency workload: median seconds per environment step (log-normal, sigma 0.5)."""
    ratios: list[int] = field(default_factory=lambda: [1, 2])
    """async ratios compared with 0 (default 1 2)."""
    rollout_workers: int = 1
    """rollout processes (the trainer is one more)."""
    threads: int = 1
    """torch threads per process (OMP_NUM_THREADS): 1 keeps the trainer and a worker off each other's core."""
    steps: int = 12
    """trainer steps per configuration."""
    prompts_per_step: int = 4
    """groups per step."""
    group_size: int = 8
    """samples per group."""
    seed: int = 0
    """seed of every run."""
    full: bool = False
    """also compare final greedy accuracy of sync and async (largest ratio) over 3 seeds."""
    out_dir: str = "runs/async_bench"
    """where each run writes."""

    def __post_init__(self):
        positive = ("rollout_workers", "threads", "steps", "prompts_per_step", "group_size")
        check_fields(self, {"[1, inf)": positive, "[0.0, inf)": ("env_latency",)})
        if not self.ratios:
            raise ValueError("config field 'ratios' is empty: give at least one async ratio, e.g. --ratios 1 2")
        for ratio in self.ratios:  # each is compared with the synchronous run (alpha 0)
            check_range("ratios", ratio, 1)


def run_one(cfg: BenchConfig, alpha: int, seed: int, out: Path, extra=("--eval-every", "0")) -> dict:
    """One async_loop.py run in a subprocess; its per-step metrics and timeline."""
    args = [sys.executable, str(ROOT / "async_loop.py"), "--async-ratio", str(alpha), "--seed", str(seed)]
    args += ["--rollout-workers", str(cfg.rollout_workers), "--steps", str(cfg.steps), "--out-dir", str(out)]
    args += ["--overwrite"]  # the bench's own folder: a rerun's measurement replaces the one before it
    args += ["--prompts-per-step", str(cfg.prompts_per_step), "--group-size", str(cfg.group_size), *extra]
    args += ["--lr", "1e-4", "--lr-schedule", "constant", "--ppo-epochs", "1", "--minibatches", "1"]  # as measured
    if cfg.workload == "latency":
        args += ["--task", "calc", "--env-latency", str(cfg.env_latency), "--adv-estimator", "grpo"]
        args += ["--temperature", "0.6"]
    else:
        args += ["--task", "reverse", "--temperature", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": str(cfg.threads)}  # the same threads per process in every run
    proc = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, env=env, timeout=3600)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    timeline = json.loads((out / "timeline.json").read_text())
    wall = sum(r["time/rollout"] + r["time/reward"] + r["time/train"] for r in rows)
    used = [e for e in timeline["events"] if e["used"] >= 0]
    return {
        "alpha": alpha,
        "wall_s": wall,
        "samples_per_s": sum(e["n"] for e in used) / wall,
        "train_s": float(np.mean([r["time/train"] for r in rows])),
        "env_s": float(sum(r["time/env"] for r in rows)),  # env steps' seconds, summed over episodes
        "durations": [e["t1"] - e["t0"] for e in timeline["events"]],
        "staleness": np.bincount(
            [e["used"] - e["version"] for e in used], weights=[e["n"] for e in used], minlength=alpha + 1
        )
        .astype(int)
        .tolist(),  # samples by staleness
        "dropped": int(sum(r["async/dropped"] for r in rows)),
        "eval_acc": rows[-1].get("eval/acc"),
    }


def predict(cfg: BenchConfig, sync: dict, alpha: int) -> float:
    """scheduler.py's speedup of async ratio `alpha` over 0 for the measured durations and training time."""
    with tempfile.TemporaryDirectory() as d:
        ms = [max(1, round(1000 * s)) for s in sync["durations"]]  # one decode token = 1 ms
        (Path(d) / "lengths.txt").write_text("\n".join(map(str, ms)))
        tokens_per_step = cfg.prompts_per_step * (1 + float(np.mean(ms)))  # prompt token + decode tokens
        common = dict(
            schedule="disagg", n_gpus=cfg.rollout_workers + 1, gpus_per_worker=1, train_gpus=1,
            batch=cfg.prompts_per_step, steps=cfg.steps, dispatch="sample", seed=cfg.seed,
            lengths_file=str(Path(d) / "lengths.txt"), prompt_tokens=1, obs_tokens=0, max_turns=1, turns_median=1.0,
            turns_sigma=0.0, tail=0.0, env_median_s=0.0, env_sigma=0.0, max_context=10**8, timeout_s=1e9,
            total_params_b=0.5, active_params_b=0.5, kv_bytes_per_token=0.0, gpu_mem_gb=80.0, hbm_bw_gbs=1000.0,
            mfu=1.0, peak_tflops=scheduler_config.TRAIN_FLOPS * 0.5e9 * tokens_per_step / sync["train_s"] / 1e12,
            sync_bw_gbs=1e9, sync_latency_s=0.0, max_seqs=1,
        )  # fmt: skip
        walls = [scheduler.simulate(scheduler.Config(**common, alpha=a))["wall_s"] for a in (0, alpha)]
    return walls[0] / walls[1]


def main(argv=None):
    """`python bench/async_bench.py [flags]`: sync vs async runs, their measured and predicted speedups."""
    cfg = parse_config(BenchConfig, argv)
    out = Path(cfg.out_dir) / cfg.workload
    sync = run_one(cfg, 0, cfg.seed, out / "alpha0")
    rows = [
        {"config": "sync (alpha 0)", "wall_s": sync["wall_s"], "samples_per_s": sync["samples_per_s"], "speedup": 1.0}
    ]
    for a in cfg.ratios:
        r = run_one(cfg, a, cfg.seed, out / f"alpha{a}")
        rows.append(
            {
                "config": f"async alpha {a}",
                "wall_s": r["wall_s"],
                "samples_per_s": r["samples_per_s"],
                "speedup": sync["wall_s"] / r["wall_s"],
                "predicted": predict(cfg, sync, a),
                "staleness": "/".join(map(str, r["staleness"])),
                "dropped": r["dropped"],
            }
        )
        rows[-1]["meas_over_pred"] = rows[-1]["speedup"] / rows[-1]["predicted"]
    print(f"workload {cfg.workload}: {cfg.rollout_workers} rollout worker(s) + 1 trainer, {cfg.steps} steps x "
          f"{cfg.prompts_per_step} groups x {cfg.group_size}; request seconds in sync: median "
          f"{np.median(sync['durations']):.2f}, p90 {np.quantile(sync['durations'], 0.9):.2f}, max "
          f"{max(sync['durations']):.2f}; train {sync['train_s']:.2f}s/step")  # fmt: skip
    print(format_table(rows, list(rows[1])))
    print("staleness: samples trained at staleness 0/1/2... (version used - version started)")
    if cfg.full:
        a, acc = max(cfg.ratios), {0: [], max(cfg.ratios): []}
        for seed in range(3):
            for alpha in acc:
                extra = ["--eval-every", str(cfg.steps), "--eval-n", "200"]
                acc[alpha].append(run_one(cfg, alpha, seed, out / f"acc-a{alpha}-s{seed}", extra)["eval_acc"])
        diff = np.mean(acc[a]) - np.mean(acc[0])
        sd = np.sqrt((np.var(acc[0], ddof=1) + np.var(acc[a], ddof=1)) / 2)  # pooled within-config seed spread
        print(
            f"final greedy accuracy, 3 seeds: sync {acc[0]}, alpha {a} {acc[a]}; difference {diff:+.3f} = "
            f"{abs(diff) / max(sd, 1e-9):.2f} pooled seed standard deviations ({sd:.3f}; target <= 2)"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
