"""The environment server measured: steps/s at 1, 8 and 64 concurrent sessions, and remote environments with 50 ms
steps overlapping under async_loop.py, next to scheduler.py's prediction.

    python bench/env_service_bench.py                    # both parts (about 4 minutes on 2 cores)
    python bench/env_service_bench.py --part server      # steps/s only
    python bench/env_service_bench.py --part async       # the async runs only

Part 1 (server): `python env_service.py --serve` in its own process; N client threads (N = 1, 8, 64) each open a
RemoteEnv and play episodes back to back for `seconds` with a fixed action (guess: `guess 16`; shell: `ls | wc -l`),
steps/s = all threads' steps / wall. Baseline in the same run: the same N threads stepping local envs, no HTTP.
`guess` is pure Python (the service's own cost per step); `shell` runs a sandboxed process per step (sandbox.py).

Part 2 (async): bench/async_bench.py's latency workload (calc, GRPO) with every episode on an env_service server
(--env-url) whose steps take env_latency (50 ms median, log-normal sigma 0.5): synchronous (async ratio 0) vs async
ratio 1 on the same processes, the measured speedup next to scheduler.py's prediction for the measured request
durations (async_bench.predict). "sequential env s" is the env steps' seconds summed: what the episodes' env time would
be stepped one after another; a turn's remote steps run at once (rollout.step_envs), so the wall is far below it.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import async_bench  # noqa: E402

import envs  # noqa: E402
from cli import check_fields, parse_config  # noqa: E402
from env_client import RemoteEnv  # noqa: E402
from env_service import request  # noqa: E402
from runlog import format_table  # noqa: E402

ACTIONS = {"guess": "guess 16", "shell": "ls | wc -l"}


@dataclass
class BenchConfig:
    """What to measure."""

    part: Literal["both", "server", "async"] = "both"
    """server: steps/s at each concurrency; async: async_loop runs with remote 50 ms environments; both."""
    sessions: list[int] = field(default_factory=lambda: [1, 8, 64])
    """concurrent sessions (client threads) of part 1."""
    envs: list[str] = field(default_factory=lambda: ["guess", "shell"])
    """environments of part 1 (guess: the service's own cost; shell: a sandboxed process per step)."""
    seconds: float = 4.0
    """part 1: seconds each configuration runs."""
    env_latency: float = 0.05
    """part 2: median seconds of a remote environment step."""
    steps: int = 10
    """part 2: trainer steps per run."""
    out_dir: str = "runs/env_service_bench"
    """where part 2's runs write."""

    def __post_init__(self):
        check_fields(self, {"(0.0, inf)": ("seconds", "env_latency"), "[1, inf)": ("steps",)})


def start_server_process() -> tuple[subprocess.Popen, str]:
    """`python env_service.py --serve` on a free port, once its /health answers."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    proc = subprocess.Popen([sys.executable, str(ROOT / "env_service.py"), "--serve", "--port", str(port)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=open(os.devnull, "w"))  # fmt: skip
    url, t0 = f"http://127.0.0.1:{port}", time.monotonic()
    while True:
        try:
            request(url, "GET", "/health", None, 2)
            return proc, url
        except Exception as e:
            if proc.poll() is not None or time.monotonic() - t0 > 60:
                raise RuntimeError(f"env_service.py did not start (exit {proc.poll()})") from e
            time.sleep(0.2)


def steps_per_s(make, action: str, threads: int, seconds: float) -> float:
    """All threads' env steps per second, each thread playing episodes of its own env back to back."""
    counts, stop = [0] * threads, threading.Event()

    def play(k):
        env, seed = make(), k * 1000
        env.reset(seed=seed)
        while not stop.is_set():
            _, _, terminated, truncated, info = env.step(action)
            if info.get("env_error"):
                raise RuntimeError(f"a remote step failed: {info['env_error']}")
            counts[k] += 1
            if terminated or truncated:
                seed += 1
                env.reset(seed=seed)
        env.close() if hasattr(env, "close") else None

    errors = []
    guarded = lambda k: play(k) if not errors else None
    pool = [threading.Thread(target=lambda k=k: _catch(guarded, k, errors)) for k in range(threads)]
    t0 = time.monotonic()
    [t.start() for t in pool]
    time.sleep(seconds)
    stop.set()
    [t.join() for t in pool]
    if errors:
        raise RuntimeError(f"{len(errors)} of {threads} client threads failed: {errors[0]!r}") from errors[0]
    return sum(counts) / (time.monotonic() - t0)


def _catch(fn, k, errors: list) -> None:
    """fn(k), its exception kept in `errors` (a thread's exception would otherwise vanish)."""
    try:
        fn(k)
    except Exception as e:
        errors.append(e)


def part_server(cfg: BenchConfig) -> None:
    """Part 1's table."""
    proc, url = start_server_process()
    rows = []
    try:
        for name in cfg.envs:
            for n in cfg.sessions:
                local = steps_per_s(lambda name=name: envs.make_env(name), ACTIONS[name], n, cfg.seconds)
                remote = steps_per_s(lambda name=name: RemoteEnv(url, name), ACTIONS[name], n, cfg.seconds)
                rows.append({"env": name, "sessions": n, "remote_steps_per_s": remote, "local_steps_per_s": local,
                             "ratio": remote / local})  # fmt: skip
    finally:
        proc.kill()
        proc.wait()
    print(f"\nPart 1: env_service.py in its own process, N client threads, {cfg.seconds:.0f} s each "
          f"(local: the same threads stepping envs in this process)")  # fmt: skip
    print(format_table(rows))


def part_async(cfg: BenchConfig) -> None:
    """Part 2's table: async_bench's latency workload with its episodes on a server."""
    proc, url = start_server_process()
    try:
        acfg = async_bench.BenchConfig(env_latency=cfg.env_latency, ratios=[1], steps=cfg.steps)
        extra = ("--eval-every", "0", "--env-url", url)
        out, rows = Path(cfg.out_dir), []
        sync = async_bench.run_one(acfg, 0, 0, out / "alpha0", extra)
        runs = [(0, sync), (1, async_bench.run_one(acfg, 1, 0, out / "alpha1", extra))]
        predicted = async_bench.predict(acfg, sync, 1)
    finally:
        proc.kill()
        proc.wait()
    for alpha, r in runs:
        rows.append({"config": f"async ratio {alpha}", "wall_s": r["wall_s"], "sequential_env_s": r["env_s"],
                     "samples_per_s": r["samples_per_s"], "speedup": sync["wall_s"] / r["wall_s"],
                     "predicted": 1.0 if alpha == 0 else predicted})  # fmt: skip
    print(f"\nPart 2: calc on env_service ({cfg.env_latency * 1e3:.0f} ms median steps), 1 trainer + 1 rollout proc, "
          f"{cfg.steps} steps x {acfg.prompts_per_step} x {acfg.group_size}; predicted: scheduler.py")  # fmt: skip
    print(format_table(rows))


def main(argv=None) -> None:
    """`python bench/env_service_bench.py [flags]`."""
    cfg = parse_config(BenchConfig, argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if cfg.part in ("both", "server"):
        part_server(cfg)
    if cfg.part in ("both", "async"):
        part_async(cfg)


if __name__ == "__main__":
    main()
