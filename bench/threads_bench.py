"""Torch threads on a shared CPU: seconds per iteration of the README's main job, idle and beside busy processes.

    python bench/threads_bench.py                  # 1 / 2 threads / the default, idle and beside two busy loops
    python bench/threads_bench.py --steps 4 --settings 1 default

Why: torch's intra-op threads wait for each other by spinning. When the machine's cores are also used by other
processes, a thread that spins holds a core its partner needs, and an iteration can cost several times what it costs
on an idle machine. This bench measures it the way a user meets it: `python3 ppo_minimal.py` (the warm start is
cached first, outside the timing) for a few iterations, its per-iteration seconds read from the rows it writes
(time/rollout + time/train: start-up excluded), with OMP_NUM_THREADS set to each setting or left unset ("default":
what cli.parse_config chooses), idle and beside `--busy` processes that each spin on a core (`yes > /dev/null`'s
load). It prints the median seconds per iteration and, per setting, the loaded / idle ratio (the target: <= 2x,
without losing the idle speed of the fastest setting). The numbers are this machine's, measured in this run.
"""

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cli import parse_config  # noqa: E402


@dataclass
class BenchArgs:
    steps: int = 6
    """Iterations per run (the median of their seconds is reported)."""
    settings: tuple[str, ...] = ("1", "2", "default")
    """OMP_NUM_THREADS values to compare; `default`: unset (the project's own choice); `2/passive`: with
    OMP_WAIT_POLICY=PASSIVE."""
    busy: int = 2
    """Busy processes beside the loaded runs (each spins on a core, as `yes > /dev/null` does)."""


def seconds_per_iteration(setting: str, steps: int) -> float:
    """Median time/rollout + time/train of a ppo_minimal run with OMP_NUM_THREADS = setting (unset: default);
    `N/passive` also sets OMP_WAIT_POLICY=PASSIVE (threads sleep instead of spinning while they wait)."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")}
    threads, _, policy = setting.partition("/")
    env.update({} if threads == "default" else {"OMP_NUM_THREADS": threads})
    env.update({"OMP_WAIT_POLICY": policy.upper()} if policy else {})
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "ppo_minimal.py", "--steps", str(steps), "--eval-every", "0", "--out-dir", out]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
        rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return float(np.median([r["time/rollout"] + r["time/train"] for r in rows]))


def main(argv=None) -> None:
    args = parse_config(BenchArgs, argv)
    seconds_per_iteration("1", 1)  # the warm start, built and cached once, outside the timing
    table = {}
    for load in ("idle", f"beside {args.busy} busy"):
        hogs = [subprocess.Popen(["yes"], stdout=subprocess.DEVNULL) for _ in range(args.busy * (load != "idle"))]
        try:
            time.sleep(0.5 if hogs else 0)
            for setting in args.settings:
                table[setting, load] = seconds_per_iteration(setting, args.steps)
                print(f"OMP_NUM_THREADS={setting:10s} {load:16s} {table[setting, load]:.3f} s / iteration", flush=True)
        finally:
            for h in hogs:
                h.kill()
                h.wait()
    fastest_idle = min(table[s, "idle"] for s in args.settings)
    print(f"\n{'setting':>10} {'idle s/it':>10} {'loaded s/it':>12} {'loaded/idle':>12} {'idle/fastest idle':>18}")
    for s in args.settings:
        idle, loaded = table[s, "idle"], table[s, f"beside {args.busy} busy"]
        print(f"{s:>10} {idle:10.3f} {loaded:12.3f} {loaded / idle:12.2f} {idle / fastest_idle:18.2f}")


if __name__ == "__main__":
    main()
