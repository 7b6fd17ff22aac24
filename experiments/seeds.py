"""Trainer runs over seeds, and their statistics: what the side-by-side experiments share.

- `run_trainer`, `run_trainers`: `python trainer.py ARGS --out-dir D` as subprocesses, `jobs` at a time; each
  returns what the run wrote (result.json, metrics.jsonl), so that nothing below the trainer imports it.
- `final_best`, `steps_to`, `mean_std`: one method's runs summarised as the tables print them.
- `bootstrap_diff`, `differences`: each pair of methods' difference with its 95 % percentile-bootstrap interval.
- `run_list`: an experiment as a list of named runs, resumable: each finished run writes one small JSON file under
  experiments/results/<experiment>/ (committed), and a rerun skips the runs whose file exists.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from itertools import combinations
from pathlib import Path

import numpy as np

from runlog import n_processes, read_jsonl

ROOT = Path(__file__).resolve().parents[1]  # the repository (its importers put it on sys.path: experiments/*.py)


def run_trainer(argv: list[str], out_dir, threads: int | None = None) -> tuple[dict, list[dict]]:
    """`python trainer.py ARGV --out-dir OUT_DIR`, its output in OUT_DIR/log.txt. Returns (its result.json:
    the last metrics row, "eval_history" and "wall_s" of the whole command; its metrics rows). threads sets
    OMP_NUM_THREADS (None: inherited). No final policy folder unless ARGV asks (--save-final). A failed run raises."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    trainer = str(ROOT / "trainer.py")
    cmd = [sys.executable, trainer, "--no-save-final", *argv, "--out-dir", str(out)]  # experiments read metrics
    t0 = time.perf_counter()
    with open(out / "log.txt", "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    if proc.returncode:
        tail = "\n".join((out / "log.txt").read_text().splitlines()[-20:])
        raise RuntimeError(f"trainer run {' '.join(cmd)} exited {proc.returncode}:\n{tail}")
    result = json.loads((out / "result.json").read_text())
    return {**result, "wall_s": time.perf_counter() - t0}, read_jsonl(out / "metrics.jsonl")


def run_trainers(runs: list[tuple[list[str], str]], jobs: int = 1) -> list[tuple[dict, list[dict]]]:
    """run_trainer(argv, out_dir) of each run, `jobs` at a time, in order. With jobs > 1 each run gets
    cores / jobs threads unless OMP_NUM_THREADS is set (runs oversubscribing the cores slow each other down)."""
    threads = None if jobs == 1 or "OMP_NUM_THREADS" in os.environ else max(1, n_processes(0, 1 << 30) // jobs)
    from tqdm.auto import tqdm  # installed with transformers

    with ThreadPoolExecutor(jobs) as ex:
        done = ex.map(lambda run: run_trainer(*run, threads=threads), runs)
        return list(tqdm(done, total=len(runs), desc=f"trainer runs ({jobs} at a time)", disable=len(runs) < 2))


def final_best(curve) -> tuple[float, float]:
    """An eval history [(step, acc)] (step 0 = the start model): the last accuracy and the best after step 0."""
    return curve[-1][1], max((a for s, a in curve if s > 0), default=curve[-1][1])


def steps_to(curve, target: float) -> int | None:
    """The step of the first evaluation [(step, acc)] after the start at >= target (None: never; the start model
    reaches nothing by training, as final_best's best is after step 0)."""
    return next((s for s, a in curve if s > 0 and a >= target), None)


def mean_std(xs, f: str = ".2f") -> str:
    """'mean ± sample std' of xs ('-' when empty), as the experiments' tables print it."""
    return f"{np.mean(xs):{f}} ± {np.std(xs, ddof=int(len(xs) > 1)):{f}}" if len(xs) else "-"


def bootstrap_diff(a, b, n: int = 10_000, seed: int = 0) -> tuple[float, float, float]:
    """mean(a) - mean(b) and its 95 % percentile-bootstrap interval: each method's seeds resampled with replacement."""
    rng, a, b = np.random.default_rng(seed), np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    d = rng.choice(a, (n, a.size)).mean(1) - rng.choice(b, (n, b.size)).mean(1)  # [n] resampled differences
    lo, hi = np.percentile(d, [2.5, 97.5])
    return float(a.mean() - b.mean()), float(lo), float(hi)


def differences(results: list[dict], baseline: str | None = None) -> list[dict]:
    """Each pair of methods (runs {"method", "eval": [(step, acc)]}), or each method against `baseline`: the
    difference of final and of best accuracy with its bootstrap interval (no correction for the number of pairs)."""
    acc = {}  # method -> [(final, best) per seed]
    for r in results:
        acc.setdefault(r["method"], []).append(final_best(r["eval"]))
    names = list(acc)
    if baseline is not None and baseline not in acc:
        raise ValueError(f"differences: baseline {baseline!r} is not among the runs' methods {names}")
    pairs = [(x, baseline) for x in names if x != baseline] if baseline else list(combinations(names, 2))
    rows = []
    for x, y in pairs:
        rows.append({"difference": f"{x} - {y}"})
        for j, key in enumerate(("final_acc", "best_acc")):
            d, lo, hi = bootstrap_diff([v[j] for v in acc[x]], [v[j] for v in acc[y]])
            rows[-1][f"{key} [95% CI]"] = f"{d:+.3f} [{lo:+.3f}, {hi:+.3f}]"
    return rows


RESULTS = ROOT / "experiments" / "results"


def numeric_keys(rows: list[dict]) -> list[str]:
    """The metrics that are numbers (not booleans) in some row, in first-seen order."""
    keys = {}
    for r in rows:
        keys.update({k: None for k, v in r.items() if isinstance(v, (int, float)) and not isinstance(v, bool)})
    return list(keys)


def portable(argv: list[str]) -> list[str]:
    """argv with the paths inside the repository written relative to it (a warm start in .cache/): what a run's file
    records and compares, so that a clone elsewhere resumes the same runs."""
    inside = lambda a: os.path.isabs(a) and Path(os.path.normpath(a)).is_relative_to(ROOT)  # noqa: E731
    return [os.path.relpath(os.path.normpath(a), ROOT) if inside(a) else a for a in argv]  # links not followed


def read_record(path: Path) -> dict:
    """One run's file; a damaged one is an error that names it."""
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not a finished run's record ({e}): delete it to run that run again") from e


def run_list(experiment: str, runs: dict[str, list[str]], jobs: int = 1, threads: int = 1) -> dict[str, dict]:
    """The runs {run id: trainer argv} of one experiment, `jobs` at a time with `threads` each, resumable: a run whose
    file RESULTS/<experiment>/<run id>.json exists is skipped; each run that finishes writes its file at once
    (whole or not at all: a temporary name, then a rename): its argv (`portable`), the final and best held-out
    greedy accuracy, the eval history, the last metrics row, each numeric metric's mean over the iterations, its
    wall seconds, the python that ran it and the command that asked for it (e.g. experiments/credit.py's), the
    commit and whether the tree had uncommitted changes when it started.
    Returns every run's file. A file whose argv is not the run's is an error, never a result mixed in: a changed
    flag, or a changed warm start (its cache folder's name, a key of its sources, is in the argv). The trainer's
    defaults are not in the argv: a file's commit says which ones it ran with."""
    folder = RESULTS / experiment
    folder.mkdir(parents=True, exist_ok=True)
    git = lambda *a: subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()  # noqa: E731

    def one(item):
        run_id, argv = item  # the code it runs: the tree as the run starts (edits during a long list show)
        commit, dirty = git("rev-parse", "HEAD"), bool(git("status", "--porcelain", "--untracked-files=no"))
        with tempfile.TemporaryDirectory() as tmp:
            result, rows = run_trainer(argv, tmp, threads=threads)
        final, best = final_best(result["eval_history"])
        last = {k: v for k, v in result.items() if k not in ("eval_history", "wall_s")}
        record = {"run": run_id, "argv": portable(argv), "final_acc": final, "best_acc": best}
        record.update(eval=result["eval_history"], wall_s=result["wall_s"], python=sys.executable)
        record.update(command=shlex.join(portable(sys.argv)), commit=commit, dirty=dirty, last=last)
        record["mean"] = {k: float(np.mean([r[k] for r in rows if k in r])) for k in numeric_keys(rows)}
        part = folder / f"{run_id}.json.part"
        part.write_text(json.dumps(record, indent=1) + "\n")
        os.replace(part, folder / f"{run_id}.json")

    for k, argv in runs.items():  # a file of another command is never taken for this one
        if (f := folder / f"{k}.json").exists() and portable(had := read_record(f)["argv"]) != portable(argv):
            what = f"{shlex.join(had)}, not {shlex.join(portable(argv))}"
            raise ValueError(
                f"{f} holds run {k!r} of another command: {what}; delete the file to run it again, "
                "or give the experiment another name"
            )
    todo = [(k, v) for k, v in runs.items() if not (folder / f"{k}.json").exists()]
    print(f"[minrl] {experiment}: {len(runs) - len(todo)} of {len(runs)} runs done before, {len(todo)} to run")
    with ThreadPoolExecutor(jobs) as ex:
        list(ex.map(one, todo))
    return {k: read_record(folder / f"{k}.json") for k in runs}
