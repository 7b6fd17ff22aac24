"""Failure-mode diagnosis of an RL post-training run from its per-step metrics (numpy + stdlib, no torch).

    python diagnose.py runs/a/      # a run dir; or a .jsonl (ours, veRL's), a .csv, TRL's trainer_state.json

One line per failure mode found (stable id, step where it started, evidence, likely cause, what to try), causes
before their symptoms (`FOUND 1. ...`, `FOUND 2. ...`), the one to check first and why (`check first: ...`), then
the checks that ran and those skipped. Exit code 0: nothing flagged; 1: something flagged; 2: unreadable input (the
message names the file and line). Live: `diag = LiveDiagnoser()`; `diag.update(step, metrics)` returns what is new.
The checks and their thresholds: diagnose_checks.py; reading the files and other frameworks' metric names
(veRL's, TRL's): diagnose_logs.py.

Implementation details (our choices):
1. A check is a condition on one step plus a bounded window of the past; a failure is reported once it holds on
   `<id>.persist` consecutive steps where the check could run, dated to the FIRST step of that streak, cleared
   after `clear_steps` steps without it. `diagnose(rows)` is `LiveDiagnoser` fed row by row; an update is O(window).
2. Levels are medians of `baseline_n` values. flat_reward = no progress since the start and no trend in the window
   (a plateau after a rise is convergence). A reward >= 0.9 reward_max (or accuracy >= 0.9) is saturated.
3. Non-finite values raise nan_inf and stay out of windows.
4. Ranking (`rank`): a finding's onset is the step it is dated to (detail 1); EXPLAINS (diagnose_checks.py) lists
   what each failure mode can cause. A comes before B when A explains B and A's onset is at most RANK_LAG steps
   after B's, unless B explains A in the same way and has the earlier onset. The list is built first to last: next
   is the earliest remaining finding (ties in check order) that no remaining one comes before; in a cycle, the
   earliest. So a cause precedes its symptoms, unrelated findings go by onset, and the first is the one to check
   first. RANK_LAG = 20 steps: checks dated where a threshold is crossed (kl_blowup, entropy_*) trail the drift they
   measure, while a symptom dated back to where it began (reward_decline: to its highest reward) does not; 20 steps
   is reward_decline's window, the span its trend is judged on. A cause dated later still did not start it.
"""

from __future__ import annotations

import json
import math
import sys
from collections import deque
from dataclasses import dataclass
from statistics import median  # stdlib: faster than numpy on a window of ~20 values

import numpy as np

from cli import check_fields, parse_config
from diagnose_checks import CHECKS, EXPLAINS, HISTORY, TH
from diagnose_logs import (
    KNOWN,
    iter_metrics,
    to_ours,
    verl_aliases,  # noqa: F401  (trainer.py imports it from here: its TensorBoard / W&B names)
)
from runlog import format_table


@dataclass
class Config:
    path: str = ""
    """run directory (with metrics.jsonl), .jsonl/.csv metrics file, or TRL trainer_state.json (or 1st positional)"""
    reward_max: float = 1.0
    """largest reward the task gives; a reward within a tenth of it counts as saturated"""

    def __post_init__(self):
        check_fields(self, {"(0, inf)": ("reward_max",)})


@dataclass(frozen=True)
class Finding:
    id: str
    step: int
    evidence: str
    cause: str
    fix: str

    def __str__(self) -> str:
        return f"{self.id} @ step {self.step}: {self.evidence} | likely cause: {self.cause} | try: {self.fix}"


class LiveDiagnoser:
    """Feed one metrics row per step (any supported names); `update` returns the findings new at this step."""

    def __init__(self, reward_max: float = 1.0):
        self.reward_max = reward_max
        self.hist: dict[str, deque] = {}  # name -> (step, value): its last HISTORY finite values
        self.first: dict[str, list[float]] = {}  # name -> its first baseline_n finite values
        self.count: dict[str, int] = {}  # name -> finite values seen so far
        self.cur, self.nonfinite = {}, []  # this step's finite known values; its non-finite ones (any column)
        self.streak: dict[str, list] = {}  # id -> [start step, consecutive hits]
        self.active: dict[str, int] = {}  # reported id -> consecutive misses since
        self.evaluated: set[str] = set()

    def update(self, step: int, metrics: dict) -> list[Finding]:
        """Take one metrics row; return the failure modes that start being reported at this step."""
        step, self.cur, self.nonfinite = int(step), {}, []
        for k, v in to_ours(metrics).items():
            if k == "step" or isinstance(v, bool) or not isinstance(v, (int, float, np.number)):
                continue
            if not math.isfinite(v):
                self.nonfinite.append(f"{k}={v}")
            elif k in KNOWN:
                self.cur[k] = float(v)
                self.hist.setdefault(k, deque(maxlen=HISTORY)).append((step, float(v)))
                self.count[k] = self.count.get(k, 0) + 1
                if len(self.first.setdefault(k, [])) < TH["baseline_n"]:
                    self.first[k].append(float(v))
        new = []
        for cid, check, _ in CHECKS:
            if (res := check(self)) is None:  # its metrics are not in this row, or its window is not full yet
                continue
            self.evaluated.add(cid)
            hit, evidence, start = res
            if not hit:
                self.streak.pop(cid, None)
                if cid in self.active:
                    self.active[cid] += 1
                    if self.active[cid] >= TH["clear_steps"]:
                        del self.active[cid]
                continue
            s = self.streak.setdefault(cid, [step if start is None else min(start, step), 0])
            s[1] += 1
            if cid in self.active:
                self.active[cid] = 0
            elif s[1] >= TH.get(f"{cid}.persist", 1):
                self.active[cid] = 0
                cause, fix = " ".join(check.__doc__.split()).split(" Try: ")
                new.append(Finding(cid, s[0], evidence, cause, fix))
        return new

    def state(self) -> str:
        """What update() carries from step to step, as JSON (deques and sets as lists), for a checkpoint."""
        d = {k: v for k, v in vars(self).items() if k not in ("cur", "nonfinite")}
        return json.dumps({**d, "evaluated": sorted(self.evaluated)}, default=list)  # sorted: the same bytes every run

    def load_state(self, text: str) -> None:
        """Continue from state(): the baselines, windows and streaks of the run so far ("{}": from the start)."""
        d = json.loads(text)
        if unknown := sorted(set(d) - set(vars(self))):
            raise ValueError(f"LiveDiagnoser.load_state: unknown field(s) {unknown}: not a state() of this version")
        vars(self).update(d)
        self.hist = {k: deque(map(tuple, v), maxlen=HISTORY) for k, v in self.hist.items()}
        self.evaluated = set(self.evaluated)

    def skipped(self) -> dict[str, str]:
        """Check id -> why it never ran (none of its metrics logged, or too few steps for its window)."""
        seen = lambda needs: any(n in self.count for n in needs)
        out = {cid: "too few steps for its window" if seen(needs) else "needs " + " or ".join(needs)
               for cid, _, needs in CHECKS if cid not in self.evaluated}  # fmt: skip
        if "logprob_mismatch" in out and "stats/clipfrac" in self.count:  # veRL/TRL average over all minibatches
            out["logprob_mismatch"] += "; an all-minibatch clip fraction mixes in the ratio's normal drift"
        return out

    def vals(self, name: str) -> list[float]:
        """The values of one metric in the window (its last window + 1 values), oldest first."""
        return [v for _, v in self.hist.get(name, ())][-int(TH["window"]) - 1 :]

    def prev(self, name: str) -> list[float]:
        """The window's values before this step."""
        v = self.vals(name)
        return v[:-1] if name in self.cur else v

    def base(self, name: str) -> float | None:
        """The starting level of a metric (median of its first values), None before there are enough."""
        f = self.first.get(name, [])
        return median(f) if len(f) >= TH["baseline_n"] else None

    def reward_unit(self) -> float:
        """The scale rewards move on: the median reward std (half of reward_max when the std is not logged)."""
        std = median(self.vals("rollout/reward_std")) if "rollout/reward_std" in self.hist else 0.0
        return std if std > 0 else 0.5 * self.reward_max

    def saturated(self) -> bool:
        """Recent accuracy (or reward) at the ceiling: median of the last baseline_n values."""
        n, f = int(TH["baseline_n"]), TH["saturated_frac"]
        acc, r = self.vals("rollout/acc")[-n:], self.vals("rollout/reward_mean")[-n:]
        return (bool(acc) and median(acc) >= f) or (bool(r) and median(r) >= f * self.reward_max)


def diagnose(rows: list[dict], reward_max: float = 1.0) -> list[Finding]:
    """Every finding of a whole run. rows: one metrics dict per step (any supported names; 'step' optional)."""
    d = LiveDiagnoser(reward_max)
    return [f for i, row in enumerate(rows) for f in d.update(int(row.get("step", i)), row)]


RANK_LAG = int(TH["rank_lag"])
ORDER = {cid: i for i, (cid, _, _) in enumerate(CHECKS)}


def comes_before(a: Finding, b: Finding) -> bool:
    """Detail 4: must finding a rank before finding b, as its likely cause?"""
    a_explains = b.id in EXPLAINS[a.id] and a.step <= b.step + RANK_LAG
    b_explains = a.id in EXPLAINS[b.id] and b.step <= a.step + RANK_LAG
    return a_explains and (not b_explains or (a.step, ORDER[a.id]) < (b.step, ORDER[b.id]))


def rank(findings: list[Finding]) -> list[Finding]:
    """The first finding of each id, the cause before its symptoms (detail 4); the first is the one to check first."""
    left = sorted({f.id: f for f in reversed(findings)}.values(), key=lambda f: (f.step, ORDER[f.id]))
    out = []
    while left:
        free = [f for f in left if not any(comes_before(g, f) for g in left if g is not f)]
        out.append((free or left)[0])  # none free: a cycle, take the earliest
        left.remove(out[-1])
    return out


def why_first(first: Finding, findings: list[Finding]) -> str:
    """Why `first` is checked first (detail 4): the findings it explains, and whether its onset is the earliest."""
    explained = [f.id for f in findings if f is not first and f.id in EXPLAINS[first.id] and comes_before(first, f)]
    earliest = all((first.step, ORDER[first.id]) <= (f.step, ORDER[f.id]) for f in findings)
    reasons = [f"explains {', '.join(explained)}"] if explained else []
    return "; ".join(reasons + ([f"earliest, step {first.step}"] if earliest or not reasons else []))


TABLE = "rollout/reward_mean rollout/zero_std_frac stats/kl stats/entropy stats/grad_norm".split()


def main(argv: list[str] | None = None) -> int:
    """`python diagnose.py PATH`: print the findings and the checks; exit 1 if any, 2 on unreadable input. The
    metrics are streamed: what is kept per step is the table's few columns."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if pos := [i for i, a in enumerate(argv) if not a.startswith("-") and (i == 0 or not argv[i - 1].startswith("--"))]:
        argv.insert(pos[0], "--path")  # the metrics path as a positional argument
    try:
        cfg = parse_config(Config, argv)
        if not cfg.path:
            raise ValueError("give a run directory or a metrics file: python diagnose.py RUN_DIR_OR_METRICS_FILE")
        d, findings, rows, seen = LiveDiagnoser(cfg.reward_max), [], [], set()
        for r in iter_metrics(cfg.path):
            findings += d.update(r["step"], r)
            rows.append({k: r[k] for k in ("step", *TABLE) if k in r})
            seen |= r.keys()
    except ValueError as e:  # InputError included
        print(f"diagnose.py: bad input: {e}", file=sys.stderr)
        return 2
    print(f"{cfg.path}: {len(rows)} steps ({rows[0]['step']}..{rows[-1]['step']})")
    picks = sorted({int(i) for i in np.linspace(0, len(rows) - 1, min(len(rows), 6))})
    print(format_table([rows[i] for i in picks], ["step", *[c for c in TABLE if any(c in r for r in rows)]]))
    ranked = rank(findings)
    for i, f in enumerate(ranked, 1):  # one line per failure mode, the cause first (detail 4)
        more = [g.step for g in findings if g.id == f.id and g is not f]
        print(f"FOUND {i}. {f}" + (f" (again at step {', '.join(map(str, more))})" if more else ""))
    if ranked:
        print(f"check first: {ranked[0].id} ({why_first(ranked[0], ranked)})")
    skipped = d.skipped()
    print("checks run: " + ", ".join(cid for cid, _, _ in CHECKS if cid not in skipped))
    for cid, why in skipped.items():
        print(f"check skipped: {cid}: {why}")
    if unused := sorted(seen - KNOWN - {"step"}):
        print(f"columns not used ({len(unused)}): {', '.join(unused[:8])}{' ...' if len(unused) > 8 else ''}")
    print(f"{len(ranked)} failure mode(s) flagged" if ranked else "no failure mode flagged")
    return 1 if ranked else 0


if __name__ == "__main__":
    sys.exit(main())
