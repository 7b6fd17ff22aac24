"""Benchmark of scheduler.py: speed (events/s) and wall time of the full agentic-160gpu preset, memory growth, and
agreement with closed-form cases. Ratios are against baselines measured in the same run.

    python bench/scheduler_bench.py            # full preset: 160 GPUs x 512 trajectories x <= 100 turns x 20 steps
    python bench/scheduler_bench.py --quick    # a scaled-down preset (seconds; what CI runs)

Targets: the full preset (all three schedules, as `scheduler.compare` runs them: one process per schedule up to
the CPU count) in <= 20 s on this machine's CPU (issue 3), and in <= 3 s of CPU one after another (issue 18; not met:
about two events per turn at ~10 us each); tracemalloc peak <= 2.2x when the number of trajectories doubles. Each
schedule is also timed alone, one after another (events per CPU-second vs a bare heap loop), next to the figure
recorded for the implementation before the rewrite into records. Wall time depends on the machine's load: CPU time
and the load average are printed next to it.
"""

import argparse
import dataclasses
import heapq
import itertools
import os
import random
import sys
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import scheduler as S  # noqa: E402
from experiments.schedules import PRESETS  # noqa: E402
from runlog import format_table, n_processes  # noqa: E402

# The implementation before the rewrite into records (b6ecd88), full preset on this machine (2 cores, idle):
# `python bench/scheduler_bench.py` printed 2,346,836 events in 21.7 s of CPU, 108,263 events per CPU-second =
# 0.123 x the bare heap loop (878,568 events/s in that run). One run: RESULTS.md has runs spread over 0.10-0.14x.
RECORDED = dict(events_per_cpu_s=108_263, vs_bare_loop=0.123, cpu_s=21.7)


def preset(**kw) -> S.Config:
    """The agentic-160gpu preset with the fields kw changed."""
    return dataclasses.replace(S.Config(), **(PRESETS["agentic-160gpu"] | kw))


def bare_event_loop(n: int) -> float:
    """Baseline events/s: a heap of ~1000 pending (time, seq, kind, a, b) events, one pop + one push per event."""
    rng, nxt = random.Random(0), itertools.count().__next__
    ev = [(rng.random(), nxt(), 0, i, 0) for i in range(1000)]
    heapq.heapify(ev)
    t0 = time.perf_counter()
    for _ in range(n):
        t, _, kind, a, b = heapq.heappop(ev)
        heapq.heappush(ev, (t + rng.random(), nxt(), kind, a, b))
    return n / (time.perf_counter() - t0)


def peak_mib(cfg: S.Config) -> float:
    """Peak Python memory (MiB, tracemalloc) of one simulate(cfg)."""
    tracemalloc.start()
    S.simulate(cfg)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak / 2**20


def closed_forms() -> list[dict]:
    """K one-job servers, Q equal jobs of L tokens at 1 s/token: rollout makespan ceil(Q/K)*L (then train + sync)."""
    rows = []
    for K, Q, L in ((4, 9, 7), (8, 64, 3), (5, 23, 11)):
        cfg = S.Config(n_gpus=K, gpus_per_worker=1, max_seqs=1, kv_bytes_per_token=0.0, total_params_b=1.0,
                       active_params_b=1.0,
                       hbm_bw_gbs=2.0, prompt_tokens=0, obs_tokens=0, env_median_s=0.0, env_sigma=0.0, max_turns=1,
                       turns_median=1.0, turns_sigma=0.0, tokens_median=float(L), tokens_sigma=0.0, tail=0.0,
                       schedule="colocated", batch=Q, steps=1, train_gpus=K)  # fmt: skip
        r = S.simulate(cfg)
        rows.append(dict(case=f"K={K} Q={Q} L={L}", closed_form=-(-Q // K) * L, simulated=r["trig"][0]))
    return rows


def main():
    """`python bench/scheduler_bench.py [--quick]`: speed, wall time, memory growth and closed-form agreement."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="scaled-down preset (batch 64, 4 steps)")
    quick = ap.parse_args().quick
    cfg = preset(batch=64, steps=4) if quick else preset()
    load = os.getloadavg()[0]
    base = bare_event_loop(200_000)
    w0, c0 = time.perf_counter(), time.process_time()
    rows = []
    for s in S.SCHEDULES:
        t0, p0 = time.perf_counter(), time.process_time()
        r = S.simulate(dataclasses.replace(cfg, schedule=s))
        wall, cpu = time.perf_counter() - t0, time.process_time() - p0
        rows.append(dict(schedule=s, events=r["events"], wall_s=wall, cpu_s=cpu, events_per_s=r["events"] / cpu,
                         vs_bare_loop=r["events"] / cpu / base, traj_per_s=r["traj_per_s"]))  # fmt: skip
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    events = sum(r["events"] for r in rows)
    w1 = time.perf_counter()  # the preset as scheduler.py runs it: compare() with the schedules in parallel processes
    same = [r["events"] for r in S.compare(cfg)] == [r["events"] for r in rows]
    par = time.perf_counter() - w1
    print(f"agentic-160gpu preset ({'scaled down: batch 64, 4 steps' if quick else 'full: batch 512, 20 steps'}), "
          f"load average {load:.1f} on {os.cpu_count()} CPUs; bare heap loop {base:,.0f} events/s")  # fmt: skip
    print(format_table(rows))
    print(f"total: {events:,} events, one after another: wall {wall:.1f} s, CPU {cpu:.1f} s (target <= 3 s for the "
          f"full preset), {events / cpu:,.0f} events per CPU-second = {events / cpu / base:.3f} x the bare heap loop; "
          f"recorded before the rewrite: {RECORDED['events_per_cpu_s']:,} = {RECORDED['vs_bare_loop']} x "
          f"({RECORDED['cpu_s']} s of CPU, full preset)")  # fmt: skip
    print(f"preset wall (compare, {n_processes(cfg.jobs, 3)} processes): {par:.1f} s (target <= 20 s for the full "
          f"preset); one-after-another wall / this = {wall / par:.2f}; same events: {same}")  # fmt: skip
    # memory: the same run with twice the trajectories (batch doubled, same GPUs and steps)
    small = dataclasses.replace(cfg, schedule="timemux", batch=64 if quick else 128, steps=3)
    m1, m2 = peak_mib(small), peak_mib(dataclasses.replace(small, batch=2 * small.batch))
    print(f"tracemalloc peak (timemux, 3 steps): batch {small.batch}: {m1:.1f} MiB, batch {2 * small.batch}: "
          f"{m2:.1f} MiB, ratio {m2 / m1:.2f} (target <= 2.2)")  # fmt: skip
    print(format_table(closed_forms()))


if __name__ == "__main__":
    main()
