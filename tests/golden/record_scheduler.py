"""Record scheduler.simulate's outputs on a set of configs: tests/golden/scheduler_outputs.json.

    python tests/golden/record_scheduler.py        # from the scheduler.py of this checkout

The file in the repository was written by the implementation before the rewrite into records (commit b6ecd88):
`git worktree add /tmp/old b6ecd88`, this script copied to /tmp/old/tests/golden/ and run there, its output
copied back. tests/test_scheduler.py checks that today's simulate() gives the same outputs, float for float.
Running the script here rewrites the file from today's code: `git diff` then shows any output that moved.
"""

import dataclasses
import hashlib
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import scheduler as S  # noqa: E402

OUT = Path(__file__).with_name("scheduler_outputs.json")
LENGTHS = [[120, 40, 300], [800], [60, 60, 60, 60, 60], [2500, 10], [90, 400], [30], [700, 700], [5, 5, 5, 5]]
SMALL = dict(n_gpus=8, train_gpus=4, batch=24, steps=4, turns_median=3.0, max_turns=8, tokens_median=200.0,
             prompt_tokens=1000, obs_tokens=200, gpus_per_worker=1, total_params_b=8.2, active_params_b=8.2,
             kv_bytes_per_token=147456.0)  # fmt: skip
# the two presets as they were when the file was recorded (b6ecd88; experiments/schedules.PRESETS: calibrated since)
AGENTIC = dict(n_gpus=160, gpus_per_worker=8, train_gpus=128, batch=512, steps=20, alpha=1, total_params_b=235.0,
               active_params_b=22.0, kv_bytes_per_token=192512.0, max_turns=100, max_context=65536, prompt_tokens=2000,
               turns_median=30.0, turns_sigma=0.6, tokens_median=300.0, tokens_sigma=0.7, tail=0.5, obs_tokens=500,
               env_sigma=1.0)  # fmt: skip
RLVR = dict(n_gpus=128, gpus_per_worker=1, train_gpus=32, batch=1024, steps=20, alpha=2, max_turns=1,
            total_params_b=8.2, active_params_b=8.2, kv_bytes_per_token=147456.0, turns_median=1.0, turns_sigma=0.0,
            tokens_median=4000.0, tokens_sigma=0.0, tail=1.0, prompt_tokens=500, obs_tokens=0, env_median_s=1.0,
            timeout_s=36000.0)  # fmt: skip
# name: (fields, schedules, seeds); "LENGTHS" in lengths_file is replaced by a file of the rows above
CASES = {
    "agentic-160gpu": (AGENTIC | dict(batch=64, steps=4), S.SCHEDULES, (0, 1, 2)),
    "rlvr-async": (RLVR | dict(batch=64, steps=3), S.SCHEDULES, (0, 1)),
    "small": (SMALL, S.SCHEDULES, (0, 1, 2)),
    "small-alpha2-theta": (SMALL | dict(alpha=2, theta=0.5), ("disagg", "timemux"), (0, 1)),
    "small-batch-dispatch": (SMALL | dict(dispatch="batch"), S.SCHEDULES, (0,)),
    "small-redundant-tail": (SMALL | dict(redundant=8, tail_batching=True), ("colocated",), (0, 1)),
    "small-redundant": (SMALL | dict(redundant=8), S.SCHEDULES, (0,)),
    "small-dedicated": (SMALL | dict(tm_dedicated=True), ("timemux",), (0,)),
    "small-timeouts": (SMALL | dict(timeout_s=40.0, max_seqs=4), S.SCHEDULES, (0,)),
    "small-timeouts-all": (SMALL | dict(timeout_s=25.0, max_seqs=2), S.SCHEDULES, (0,)),  # in every schedule
    "small-expired": (SMALL | dict(theta=0.5, redundant=8), ("timemux",), (0,)),  # done ones too stale: 3
    "small-expired-theta": (SMALL | dict(theta=0.25), ("timemux",), (0, 1)),
    "small-kv-bound": (SMALL | dict(gpu_mem_gb=20.0, max_context=8000, tail=1.2), S.SCHEDULES, (0,)),
    "replay-random": (SMALL | dict(lengths_file="LENGTHS", max_turns=5), S.SCHEDULES, (0,)),
    "replay-once": (SMALL | dict(lengths_file="LENGTHS", replay_order="once", batch=4, steps=2), S.SCHEDULES, (0,)),
}  # fmt: skip


def digest(x) -> str:
    """sha256 of repr(x): segments and per-trajectory arrays, compared without storing them."""
    return hashlib.sha256(repr(x).encode()).hexdigest()[:16]


def summary(r: dict) -> dict:
    """The outputs of one simulate(): every scalar as a float (JSON keeps the exact value), the rest digested."""
    out = {k: float(v) for k, v in r.items() if isinstance(v, (int, float, np.floating, np.integer))}
    out |= dict(staleness=r["staleness"].tolist(), ends=digest(r["ends"]), trig=digest(r["trig"]))
    out |= dict(segments=digest(r["segments"])) | {f"gpu_s_{k}": float(v) for k, v in r["gpu_s"].items()}
    out |= {f"traj_{k}": digest(v.tolist()) for k, v in r["traj"].items()}
    return out


def run_cases(lengths_path: str) -> dict:
    """{case/schedule/seed: summary} over CASES."""
    res = {}
    for name, (fields, schedules, seeds) in CASES.items():
        fields = fields | ({"lengths_file": lengths_path} if fields.get("lengths_file") == "LENGTHS" else {})
        for s in schedules:
            for seed in seeds:
                cfg = dataclasses.replace(S.Config(), **(fields | dict(schedule=s, seed=seed)))
                res[f"{name}/{s}/{seed}"] = summary(S.simulate(cfg))
    return res


def write_lengths(folder: str) -> str:
    """The LENGTHS rows as a lengths_file in folder."""
    path = Path(folder) / "lengths.txt"
    path.write_text("\n".join(" ".join(map(str, r)) for r in LENGTHS) + "\n")
    return str(path)


def main():
    """Write OUT from the current implementation."""
    with tempfile.TemporaryDirectory() as d:
        res = run_cases(write_lengths(d))
    OUT.write_text(json.dumps(res, indent=1, sort_keys=True) + "\n")
    print(f"{len(res)} runs -> {OUT}")


if __name__ == "__main__":
    main()
