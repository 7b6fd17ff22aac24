"""The schedule simulator (scheduler.py) against reported runs: presets, their calibration, and sweeps of one field.

    python experiments/schedules.py --preset agentic-160gpu           # (or rlvr-async): simulated next to reported
    python experiments/schedules.py --preset rlvr-async --calibrate   # bisect the preset's one free parameter
    python experiments/schedules.py --sweep tail --sweep-values 0 0.5 1 1.5   # any numeric field, 3 seeds; a plot

A preset fixes what a reported run states (PRESETS) and fits one free parameter (CALIBRATION) on one reported figure;
`preset_report` prints every reported figure next to the simulated one, 'fit' for that one and 'prediction' for the
others, then NOTES: what is fixed, what is fitted, why the predictions differ. Without --preset, --calibrate or
--sweep: scheduler.py's comparison of the three schedules on the fields given.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import scheduler  # noqa: E402
from cli import check_choice, parse_config  # noqa: E402
from runlog import format_table, parallel_map  # noqa: E402
from scheduler import compare, plot_results, print_comparison, simulate  # noqa: E402
from scheduler_config import SCHEDULES, print_costs  # noqa: E402

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
SOURCES = {  # where the preset's 'reported' column comes from, printed under its table
    "agentic-160gpu": "a time-multiplexing result from the project's seed description (Qwen3-235B-A22B, 160 GPUs, 3.5x "
    "over a 128 train / 32 rollout split); no public text of it was found, the nearest public code is ROLL's "
    "partial_gpu_mode (docs/design.md 5.5)",
    "rlvr-async": "ROLL Flash, arXiv 2510.11345 (Lu et al. 2025), its RLVR figures (docs/design.md 5.4)",
}
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
class Config(scheduler.Config):
    """scheduler.py's Config, and which preset, calibration or sweep to run on it."""

    preset: Literal["", "agentic-160gpu", "rlvr-async"] = ""
    """agentic-160gpu | rlvr-async: fill the fields left at their defaults; print reported figures"""
    calibrate: bool = False
    """with a preset: bisect its free parameter (CALIBRATION) until its figure is the reported one, print the value"""
    sweep: str = ""
    """numeric Config field to sweep (e.g. tail, n_gpus, alpha, theta) over 3 seeds; writes a plot"""
    sweep_values: list[float] = field(default_factory=lambda: [0.0, 0.4, 0.8, 1.2])
    """values of the swept field"""

    def __post_init__(self):
        super().__post_init__()
        check_choice("preset", self.preset, ("", *PRESETS))
        if self.sweep in ("seed", "jobs") or self.sweep and type(getattr(self, self.sweep, None)) not in (int, float):
            raise ValueError(f"config field 'sweep' = {self.sweep!r}: must name a numeric workload or cluster field")


def traj_per_s(cfg: Config) -> float:
    """simulate(cfg)'s throughput alone (what sweep keeps: no segments travel back from the processes)."""
    return simulate(cfg)["traj_per_s"]


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
    """The reported figures (docs/design.md 5.4) next to the simulated ones (main prints both): 'fit' marks the one
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
    """`python experiments/schedules.py [flags]`: a preset (or its calibration), or a sweep, printed and plotted."""
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
    print_costs(cfg)
    if cfg.sweep:
        print(format_table(rows := sweep(cfg, path := f"{cfg.out_dir}/sweep_{cfg.sweep}.png")), "\nplot:", path)
        return rows
    res = compare(cfg)
    print_comparison(res)
    if cfg.preset:
        print(
            format_table(preset_report(cfg, res)),
            f"\nreported: {SOURCES[cfg.preset]}; simulated: this run",
            f"\nparameters: { {k: getattr(cfg, k) for k in PRESETS[cfg.preset]} }",
        )
        print(NOTES[cfg.preset])
    print("plot:", plot_results(res, f"{cfg.out_dir}/schedules.png"))
    return res


if __name__ == "__main__":
    main()
