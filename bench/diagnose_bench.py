"""The doctor as a benchmark: diagnose.py scored on labelled runs (per-id precision, recall, steps to detection).

    python bench/diagnose_bench.py --seeds 0 1 2        # the tuning seeds (thresholds were set on these)
    python bench/diagnose_bench.py                      # held-out seeds 6-8: the table in RESULTS.md (3-5 were
                                                        # held out once, then tuned reward_decline's persistence)
    python bench/diagnose_bench.py --cases adv_sign --configs sort-grpo --seeds 0   # one look

A labelled run is a short training run (`python trainer.py`, 40 iterations, 8 prompts x 8 samples, one thread,
two runs at a time) in which one failure was caused on purpose: a bug planted with `--inject NAME` (repro.py, its
stated config included), or a config that fails on its own (an entropy bonus of 1.0, a bf16 sampler without a
correction, lr 0). Its label is the failure-mode id diagnose.py must report. Each case runs in two configs
(CONFIGS) and every seed. Every config a case ran in is also run clean: with the case's stated config but no bug
(ent_sign's without its bonus: +1.0 is a case of its own; a config case's: its base config), and must raise
nothing. The diagnosis is diagnose.LiveDiagnoser fed the run's metrics.jsonl row by row, as the trainer feeds it.

Scoring (our definitions)
1. recall(id) = labelled runs of that id in which it was reported / labelled runs of that id.
2. precision(id) = reports of the id in runs with that label / all its reports, except in runs where it is a declared
   symptom of the failure (SYMPTOMS, fixed on the tuning seeds: a policy that unlearns also drifts from its
   reference, kl_blowup) -- those count neither way. Every finding on a clean run is a false positive.
3. steps to detection = the iteration at which the live diagnosis reported the label (the finding is dated earlier,
   to the first step of its streak; both are kept in --json).
4. top-k of an order of a run's findings = a finding among its first k is one of the case's causes (CAUSES: the
   case's label, or another id that names the same cause). Two orders are scored on the labelled runs:
   diagnose.rank's (causes before their symptoms; what `python diagnose.py` prints) and the order in which the
   live diagnosis reported them (what it printed before ranking).
Runs are kept under --out-dir (one folder per case / config / seed, with the flags it ran); a rerun with the same
flags reuses a finished run, so re-scoring after a threshold change costs only the diagnosis.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cli import check_fields, parse_config  # noqa: E402
from diagnose import CHECKS, Finding, LiveDiagnoser, rank  # noqa: E402
from diagnose_logs import load_metrics  # noqa: E402
from repro import INJECTIONS  # noqa: E402

SMALL = {"prompts_per_step": 8, "group_size": 8, "eval_every": 0}
CALC = {"temperature": 0.6, "lr": 1e-4, "lr_schedule": "constant", "warmup_steps": 5, "ppo_epochs": 1, "minibatches": 1}
CONFIGS = {  # the trainer's configs the cases run in (flags over the trainer's defaults)
    "reverse-gae": {"task": "reverse", "temperature": 1.0, "lr": 1e-4, "lr_schedule": "constant", "ppo_epochs": 1,
                    "minibatches": 1, **SMALL},  # tests/test_inject.py's calibrated config: PPO, a critic
    "sort-grpo": {"adv_estimator": "grpo", **SMALL},  # the embedded default task, GRPO, 2 epochs x 2 minibatches
    "sort-gae": SMALL,  # the embedded default (PPO, a critic) at a small batch
    "calc-grpo": {"task": "calc", "adv_estimator": "grpo", **CALC, **SMALL},  # multi-turn tool use
    "calc-gae": {"task": "calc", **CALC, **SMALL},  # the same with PPO and a critic
}  # fmt: skip


class Case(NamedTuple):
    label: str  # the failure-mode id the diagnosis must report
    how: dict  # the trainer flags that cause it: {"inject": name} or a config that fails on its own
    configs: tuple[str, str] = ("reverse-gae", "sort-grpo")
    also: tuple[str, ...] = ()  # ids that follow from the failure (symptoms): neither true nor false positives


CASES = {name: Case(inj.diagnosed_as, {"inject": name}) for name, inj in INJECTIONS.items()}  # default configs
CASES["value_not_detached"] = Case("value_divergence", {"inject": "value_not_detached"}, ("reverse-gae", "sort-gae"))
CASES["retokenized_history"] = Case("template_drift", {"inject": "retokenized_history"}, ("calc-grpo", "calc-gae"))
CASES["ent_sign"] = Case("entropy_collapse", {"inject": "ent_sign"}, ("sort-grpo", "sort-gae"))  # lr 1e-4: too slow
CASES["ent_bonus_too_large"] = Case(
    "entropy_blowup", {"ent_coef": 1.0}, ("sort-grpo", "sort-gae")
)  # outweighs the task
CASES["bf16_sampler"] = Case("sampler_precision_gap", {"rollout_dtype": "bfloat16"})  # no rollout correction
CASES["lr_zero"] = Case("policy_frozen", {"lr": 0.0})  # the optimizer never moves the weights
SYMPTOMS = {  # declared on the tuning seeds: what each failure does to the run besides its own id (scoring 2)
    "answer_format": ("flat_reward",),  # no reward, nothing to learn
    "adv_sign": ("kl_blowup", "high_truncation", "entropy_blowup"),  # the policy unlearns: it drifts, loses its EOS
    "kl_sign": ("reward_decline", "reward_scale", "high_truncation"),  # the KL term outweighs the score, then wins
    "logprob_shift": ("reward_decline", "kl_blowup", "high_truncation"),  # trained on the wrong token probabilities
    "eos_unmasked": ("logprob_mismatch", "kl_blowup"),  # trained padding: no sampler logprob there, the policy drifts
    "wrong_stop_id": ("kl_blowup",),  # trained on what follows the EOS it should have stopped at
    "retokenized_history": ("eos_mask",),  # the end-of-turn tokens it loses: masks no longer end at EOS
    "ent_sign": ("kl_blowup", "reward_decline", "high_truncation"),  # near-greedy, far from its reference, no EOS
    "ent_bonus_too_large": ("kl_blowup", "reward_decline", "high_truncation"),  # noise: far from the reference
}
CASES = {k: c._replace(also=SYMPTOMS.get(k, ())) for k, c in CASES.items()}
# The finding ids that name each case's cause (scoring 4): its label, except where another id points at the same
# fix. kl_sign: reward_scale says that the KL term in the reward outweighs the score, which is that bug's place.
CAUSES = {k: (c.label,) for k, c in CASES.items()} | {"kl_sign": ("kl_blowup", "reward_scale")}
BARE_TWIN = {"ent_sign"}  # its clean run has no entropy bonus: +1.0 is ent_bonus_too_large (a config case: its base)


@dataclass
class Args:
    seeds: list[int] = field(default_factory=lambda: [6, 7, 8])
    """Seeds of every case and clean run (0-5 tuned the thresholds; 6-8 are held out)."""
    steps: int = 40
    """Iterations per run."""
    parallel: int = 2
    """Runs at a time (one thread each)."""
    cases: list[str] | None = None
    """Cases to run (None = all of CASES)."""
    configs: list[str] | None = None
    """Restrict to these configs (None = each case's two)."""
    out_dir: str = "runs/diagnose_bench"
    """Where the runs are kept (and reused when their flags match)."""
    json: str | None = None
    """Also write every run's findings and the scores to this file."""

    def __post_init__(self):
        check_fields(self, {"[1, inf)": ("steps", "parallel")})
        self.cases = self.cases or list(CASES)
        if unknown := [c for c in self.cases if c not in CASES]:
            raise ValueError(f"config field 'cases': {unknown} not among {list(CASES)}")
        if unknown := [c for c in self.configs or () if c not in CONFIGS]:
            raise ValueError(f"config field 'configs': {unknown} not among {list(CONFIGS)}")


def flags(d: dict) -> list[str]:
    """Trainer flags of a dict: --name-with-dashes value; booleans as --name / --no-name."""
    out = []
    for k, v in d.items():
        name = "--" + k.replace("_", "-")
        out += ([name] if v else ["--no-" + k.replace("_", "-")]) if isinstance(v, bool) else [name, str(v)]
    return out


def jobs(args: Args) -> list[tuple[str, str, int, dict]]:
    """(case or 'clean', config, seed, trainer settings) of every run: the labelled ones, then the clean twins."""
    out, twins = [], {}
    for name in args.cases:
        case = CASES[name]
        stated = INJECTIONS[case.how["inject"]].config if "inject" in case.how else {}
        for conf in [c for c in case.configs if args.configs is None or c in args.configs]:
            settings = {**CONFIGS[conf], **stated, **case.how}  # an injection's stated config wins
            out += [(name, conf, s, settings) for s in args.seeds]
            twin = {**CONFIGS[conf], **({} if name in BARE_TWIN else stated)}  # the run without the bug
            twins.setdefault(json.dumps(twin, sort_keys=True), (conf, twin))
    for conf, twin in twins.values():
        out += [("clean", conf, s, twin) for s in args.seeds]
    return out


def run_dir(out_dir: Path, case: str, conf: str, seed: int, settings: dict) -> Path:
    """The folder of one run: case / config / a short name of its extra settings / seed."""
    extra = {k: v for k, v in settings.items() if CONFIGS[conf].get(k, object()) != v}
    tag = "-".join(f"{k}={v}" for k, v in sorted(extra.items())) or "base"
    return out_dir / case / conf / tag / f"seed{seed}"


def train_run(out: Path, seed: int, steps: int, settings: dict) -> Path:
    """Run the trainer (a subprocess, one thread) unless a finished run with these flags is in `out`."""
    cmd = [*flags({**settings, "seed": seed, "steps": steps}), "--out-dir", str(out)]
    done = out / "result.json"
    if done.is_file() and (out / "bench_flags.json").is_file():
        if json.loads((out / "bench_flags.json").read_text()) == cmd:
            return out
    # the trainer refuses an --out-dir holding a run: an unfinished one or one with other flags is replaced
    again = ["--overwrite"] if out.is_dir() and any(out.iterdir()) else []
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "trainer.py"), *cmd, *again], capture_output=True, text=True,
                          env=env, cwd=ROOT)  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"python trainer.py {' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    (out / "bench_flags.json").write_text(json.dumps(cmd))
    return out


def findings_of(path: Path) -> dict[str, tuple[int, int]]:
    """id -> (step its finding is dated to, step at which the live diagnosis reported it), first report only."""
    diag, found = LiveDiagnoser(), {}
    for row in load_metrics(path / "metrics.jsonl"):
        for f in diag.update(row["step"], row):
            found.setdefault(f.id, (f.step, row["step"]))
    return found


def orders(found: dict[str, tuple[int, int]]) -> dict[str, list[str]]:
    """A run's finding ids in diagnose.rank's order and in the order the live diagnosis reported them."""
    ranked = rank([Finding(cid, dated, "", "", "") for cid, (dated, _) in found.items()])
    return {"ranked": [f.id for f in ranked], "reported": list(found)}  # found: in the order they were reported


def top_k(results: list[tuple[str, str, int, dict]], ks=(1, 2)) -> dict[str, dict]:
    """Scoring 4 on the labelled runs: per case and in all, the runs whose first k findings hold one of the case's
    CAUSES, in each order: {case: {"runs": n, "ranked": {k: hits}, "reported": {k: hits}}}, "all" last."""
    out: dict[str, dict] = {}
    for case, _, _, found in results:
        if case == "clean":
            continue
        for row in (out.setdefault(case, {}), out.setdefault("all", {})):
            row["runs"] = row.get("runs", 0) + 1
            for name, ids in orders(found).items():
                hits = row.setdefault(name, {k: 0 for k in ks})
                for k in ks:
                    hits[k] += any(cid in CAUSES[case] for cid in ids[:k])
    return {**{c: r for c, r in out.items() if c != "all"}, **({"all": out["all"]} if out else {})}


def top_k_report(scores: dict) -> str:
    """Scoring 4 as a markdown table: per case, its causes and the top-1 / top-2 hits of both orders."""
    head = "| case | counts as its cause | runs | top-1 ranked | top-1 as reported | top-2 ranked | top-2 as reported |"
    lines = [head, "|---|---|---|---|---|---|---|"]
    for case, r in scores.items():
        causes = " or ".join(CAUSES[case]) if case in CAUSES else "(all labelled runs)"
        cells = [r["ranked"][1], r["reported"][1], r["ranked"][2], r["reported"][2]]
        lines.append(f"| {case} | {causes} | {r['runs']} | " + " | ".join(f"{c}/{r['runs']}" for c in cells) + " |")
    return "\n".join(lines)


def score(results: list[tuple[str, str, int, dict]]) -> tuple[dict, dict]:
    """(per-id {tp, fp, symptom, n, recall, precision, steps}, confusion {case: {found id: runs}}) of (case,
    config, seed, findings) rows; the label of a clean run is 'clean'."""
    ids = [cid for cid, _, _ in CHECKS]
    per = {i: {"tp": 0, "fp": 0, "symptom": 0, "n": 0, "steps": []} for i in ids}
    confusion: dict[str, dict[str, int]] = {}
    for case, _, _, found in results:
        label, also = ("clean", ()) if case == "clean" else (CASES[case].label, CASES[case].also)
        row = confusion.setdefault(case, {"runs": 0})
        row["runs"] += 1
        if label != "clean":
            per[label]["n"] += 1
        for cid in found or {"(none)": None}:
            row[cid] = row.get(cid, 0) + 1
        for cid, (_, reported) in found.items():
            if cid == label:
                per[cid]["tp"] += 1
                per[cid]["steps"].append(reported)
            else:
                per[cid]["symptom" if cid in also else "fp"] += 1
    for p in per.values():
        p["recall"] = p["tp"] / p["n"] if p["n"] else None
        p["precision"] = p["tp"] / (p["tp"] + p["fp"]) if p["tp"] + p["fp"] else None
    return per, confusion


def report(per: dict, confusion: dict, seeds: list[int]) -> str:
    """The two markdown tables: per id, and the confusion of cases (rows, with their label) and reported ids
    (columns; s: a declared symptom of the case)."""
    fmt = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
    head = (
        "| id | labelled runs | recall | precision | reports as a declared symptom | reported at step (median, max) |"
    )
    lines = [f"seeds {seeds}", "", head, "|---|---|---|---|---|---|"]
    for cid, p in per.items():
        if p["n"] or p["fp"] or p["symptom"]:
            st = sorted(p["steps"])
            steps = f"{st[len(st) // 2]}, {st[-1]}" if st else "-"
            cells = [p["n"], fmt(p["recall"]), fmt(p["precision"]), p["symptom"], steps]
            lines.append(f"| {cid} | " + " | ".join(map(str, cells)) + " |")
    cols = sorted({c for row in confusion.values() for c in row} - {"runs"})
    lines += ["", "| case (label) \\ reported | runs | " + " | ".join(cols) + " |", "|---|---|" + "---|" * len(cols)]
    for case, row in confusion.items():
        name, also = ("clean", ()) if case == "clean" else (f"{case} ({CASES[case].label})", CASES[case].also)
        cells = [f"{row[c]}{' s' if c in also else ''}" if c in row else "" for c in cols]
        lines.append(f"| {name} | {row['runs']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse_config(Args, argv, description=__doc__)
    todo = jobs(args)
    out_dir = ROOT / args.out_dir
    with ThreadPoolExecutor(args.parallel) as pool:
        futures = [pool.submit(train_run, run_dir(out_dir, *job), job[2], args.steps, job[3]) for job in todo]
        paths = [f.result() for f in futures]
    results = [(c, conf, s, findings_of(p)) for (c, conf, s, _), p in zip(todo, paths)]
    for (case, conf, seed, found), p in zip(results, paths):
        shown = ", ".join(f"{k}@{v[1]}" for k, v in found.items()) or "-"
        print(f"{case:22s} {conf:12s} seed {seed}: {shown}   ({p})")
    per, confusion = score(results)
    ranking = top_k(results)
    print(report(per, confusion, args.seeds))
    print("\n" + top_k_report(ranking))
    if args.json:
        rows = [{"case": c, "config": conf, "seed": s, "found": f, **orders(f)} for c, conf, s, f in results]
        out = {"runs": rows, "per_id": per, "confusion": confusion, "top_k": ranking}
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
