"""GRPO vs attention-credit GRPO (local, global, coupled) side by side: trainer runs over seeds, a table, curves.

    python experiments/credit.py           # quick: GRPO vs coupled credit, 1 seed, a few steps + the token figure
    python experiments/credit.py --full    # GRPO vs each strategy (local, global, coupled), 5 seeds: tables + PNGs
    python experiments/credit.py --full --task countdown --jobs 2   # the same on Countdown, resumable

The method is attention_credit.py; each run is `python trainer.py ... --credit attention --credit-mode M`.
Setup (our choice): task `chain` (five 2-digit numbers summed step by step, 43-character answers: responses of
>= 40 tokens, docs/design.md 5.3) or `countdown` (4 numbers to a target, worked steps then the expression, 40.5
tokens; the 3A paper's own task), the tiny Qwen2 with 6 layers, 8 query / 4 key-value heads, hidden 64
(attention_credit.MODEL), after an SFT warm start (attention_credit.SFT on the task); every run is the trainer's
default learning recipe (T 0.6, cosine lr 2e-4, 32 x 4, 2 epochs x 2 minibatches) with NEW_TOKENS, GRPO
advantages, and the method's credit on top. OUT_DIR/results.json holds every run's eval history; curves.png and
the start model's token figure (tokens.png) beside it. With --full each run is also one committed file of
experiments/results/credit-TASK[-NAME]/ (experiments/seeds.run_list): a rerun runs only what has no file.
"""

from __future__ import annotations

import json
import re
import shlex
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from attention_credit import SFT, sample_and_plot  # noqa: E402
from cli import check_choice, check_fields, check_range, parse_config  # noqa: E402
from envs import TaskEnv  # noqa: E402
from evaluation import greedy_accuracy  # noqa: E402
from experiments.seeds import differences, final_best, mean_std, run_list, run_trainers, steps_to  # noqa: E402
from runlog import format_table  # noqa: E402
from tasks import load_policy, make_task  # noqa: E402
from warm_start import SFTConfig, sft_warm_start  # noqa: E402

METHODS = ("grpo", "local", "global", "coupled")
NEW_TOKENS = {"chain": 48, "countdown": 64}  # the longest answer + EOS is 44 (chain) and 48-50 (countdown)


@dataclass
class Config:
    """`python experiments/credit.py`: the experiment (each run is `python trainer.py ...`)."""

    full: bool = False
    """Full comparison: all four methods, 5 seeds, the trainer's default iterations, one result file per run."""
    task: Literal["chain", "countdown"] = "chain"
    """The task: chain (step-by-step sums) or countdown (the 3A paper's)."""
    name: str = ""
    """With --full: the result files go to experiments/results/credit-TASK[-NAME]/ (e.g. a pilot's recipe)."""
    methods: list[str] | None = None
    """Methods to compare, from grpo local global coupled (None: grpo coupled quick, all four full)."""
    seeds: int | None = None
    """Seeds per method (None: 1 quick, 5 full)."""
    steps: int | None = None
    """RL iterations per run (None: 8 quick, the trainer's default with --full)."""
    train_args: str = ""
    """Extra trainer flags for every run, e.g. "--lr 1e-4 --prompts-per-step 16" (they win over the recipe)."""
    target_acc: float | None = None
    """Eval accuracy whose first crossing after step 0 is reported as steps-to-target (None: GRPO's mean final
    minus 0.05)."""
    eval_every: int = 10
    """Greedy evaluation every this many iterations (and at the end)."""
    eval_n: int = 200
    """Held-out prompts per evaluation."""
    jobs: int = 1
    """Runs in parallel (worker processes): for a GPU or a many-core machine."""
    model: str | None = None
    """Model folder to start from (None: the SFT warm start of MODEL on the task)."""
    sft_target: float = 0.3
    """Greedy accuracy at which the SFT warm start stops."""
    device: str = "auto"
    """auto | cpu | cuda (SFT warm start and runs)."""
    out_dir: str = "runs/attention_credit"
    """Where the runs, the table, the curves and the token figure go."""

    def __post_init__(self):
        if self.methods is None:
            self.methods = list(METHODS) if self.full else ["grpo", "coupled"]
        if self.seeds is None:
            self.seeds = 5 if self.full else 1
        if self.steps is None:
            self.steps = 0 if self.full else 8  # 0: the trainer's own default
        check_range("methods", len(self.methods), 1)
        check_choice("task", self.task, tuple(NEW_TOKENS))
        for m in self.methods:
            check_choice("methods", m, METHODS)
        if self.target_acc is None and "grpo" not in self.methods:
            raise ValueError("config field 'target_acc' is None (GRPO's final - 0.05) but 'methods' lacks grpo: set it")
        if self.name and not self.full:
            raise ValueError("config field 'name' names the result folder of --full runs: add --full, or drop it")
        if not re.fullmatch(r"[\w.-]*", self.name):
            raise ValueError(f"config field 'name' = {self.name!r}: letters, digits, '.', '-' and '_' only")
        ranges = {"[1, inf)": ("seeds", "eval_every", "eval_n", "jobs"), "[0, inf)": ("steps",)}
        check_fields(self, {**ranges, "(0.0, 1.0]": ("sft_target",), "[0.0, 1.0]": ("target_acc",)})


def run_argv(cfg: Config, method: str, seed: int, model_path: str) -> list[str]:
    """The trainer flags of one run: GRPO on the task at the trainer's default recipe, the method's credit,
    train_args."""
    argv = f"--model {model_path} --task {cfg.task} --adv-estimator grpo --max-new-tokens {NEW_TOKENS[cfg.task]}"
    argv = f"{argv} --seed {seed} --eval-every {cfg.eval_every} --eval-n {cfg.eval_n} --device {cfg.device}".split()
    argv += ["--steps", str(cfg.steps)] if cfg.steps else []
    argv += [] if method == "grpo" else ["--credit", "attention", "--credit-mode", method]
    return argv + shlex.split(cfg.train_args)  # argparse: a flag given twice takes its last value


def run_summary(method: str, seed: int, result: dict, rows: list[dict]) -> dict:
    """One run's eval history, wall time (the whole command) and its mean credit metrics."""
    keys = [k for k in ("perf/credit_overhead", "stats/credit_amplified_frac") if k in rows[0]]
    mean = {k: float(np.mean([r[k] for r in rows])) for k in keys}
    return file_summary(method, seed, {"eval": result["eval_history"], "wall_s": result["wall_s"], "mean": mean})


def file_summary(method: str, seed: int, record: dict) -> dict:
    """One run as the table reads it, from its record (experiments/seeds.run_list's file or run_summary's)."""
    res = {"method": method, "seed": seed, "eval": record["eval"], "wall_s": record["wall_s"]}
    mean = lambda k: record["mean"].get(k, float("nan"))  # noqa: E731
    return {**res, "overhead": mean("perf/credit_overhead"), "amplified": mean("stats/credit_amplified_frac")}


def summarize(results_json) -> list[dict]:
    """The table (final / best held-out accuracy per method, mean ± sample std over seeds, steps to target_acc,
    wall, overhead, amplified share), printed with the bootstrap interval of each difference against GRPO (of each
    pair without it); curves.png next to results.json. Each run's history starts with its step-0 evaluation (the
    start model), which counts for none of them. target_acc None: GRPO's mean final accuracy minus 0.05."""
    import matplotlib.pyplot as plt

    path = Path(results_json)
    res = json.loads(path.read_text())
    target, table, fig = res["config"]["target_acc"], [], plt.figure(figsize=(6, 4))
    if target is None:
        target = round(
            float(np.mean([final_best(r["eval"])[0] for r in res["runs"] if r["method"] == "grpo"])) - 0.05, 3
        )
    for m in res["config"]["methods"]:
        rs = [r for r in res["runs"] if r["method"] == m]
        final, best = zip(*[final_best(r["eval"]) for r in rs])
        hit = [h for h in (steps_to(r["eval"], target) for r in rs) if h is not None]
        row = {"method": m, "final_acc": mean_std(final, ".3f"), "best_acc": mean_std(best, ".3f")}
        row[f"steps_to_{target}"] = f"{mean_std(hit, '.0f')} ({len(hit)}/{len(rs)})"
        table.append({**row, **{k: float(np.mean([r[k] for r in rs])) for k in ("wall_s", "overhead", "amplified")}})
        steps, accs = [s for s, _ in rs[0]["eval"]], np.array([[a for _, a in r["eval"]] for r in rs])  # [seeds, evals]
        plt.plot(steps, accs.mean(0), label=m)
        plt.fill_between(steps, accs.mean(0) - accs.std(0), accs.mean(0) + accs.std(0), alpha=0.2)
    plt.xlabel("RL step"), plt.ylabel("greedy exact match, held out"), plt.legend()
    plt.title(f"{res['config'].get('task', 'chain')} task")
    fig.tight_layout()
    fig.savefig(path.parent / "curves.png", dpi=100)
    plt.close(fig)
    print(format_table(table))
    if len(res["runs"]) > len(table):  # more than one seed: the differences
        grpo = "grpo" if "grpo" in res["config"]["methods"] else None
        print(format_table(differences(res["runs"], baseline=grpo)))
    return table


def main(argv=None):
    """`python experiments/credit.py [flags]`: the start model, the token figure, the runs, the table and curves."""
    import matplotlib

    matplotlib.use("Agg")

    cfg = parse_config(Config, argv)
    out, t0 = Path(cfg.out_dir), time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    device = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    sft = SFTConfig(**{**SFT, "task": cfg.task}, target_acc=cfg.sft_target)
    model_path = cfg.model or str(sft_warm_start(sft, device=device))
    print(f"[attention_credit] {asdict(cfg)}\n[attention_credit] start model {model_path}", flush=True)

    # the start model: held-out accuracy, and one sampled batch for the token figure (coupled credit)
    policy, tok = load_policy(model_path, device)
    task, n = make_task(cfg.task), NEW_TOKENS[cfg.task]
    eval_set = task.sample(cfg.eval_n, "eval", np.random.default_rng(12345))  # trainer's held-out set
    acc0 = greedy_accuracy(policy, tok, [TaskEnv(task, p) for p in eval_set], [None] * len(eval_set), max_new_tokens=n)
    sample_and_plot(policy, tok, eval_set[:16], out / "tokens.png")
    print(f"[attention_credit] start accuracy {acc0:.3f}; {out / 'tokens.png'}", flush=True)

    # the runs (trainer subprocesses, `jobs` at a time), then the table and the curves
    todo = [(m, s) for s in range(cfg.seeds) for m in cfg.methods]  # seed by seed: all methods' first seeds end first
    if cfg.full:  # one thread per run, one committed file per finished run (a rerun skips those)
        experiment = f"credit-{cfg.task}" + (f"-{cfg.name}" if cfg.name else "")
        done = run_list(experiment, {f"{m}-s{s}": run_argv(cfg, m, s, model_path) for m, s in todo}, cfg.jobs)
        results = [file_summary(m, s, done[f"{m}-s{s}"]) for m, s in todo]
    else:
        runs = run_trainers([(run_argv(cfg, m, s, model_path), str(out / f"{m}-s{s}")) for m, s in todo], cfg.jobs)
        results = [run_summary(m, s, *run) for (m, s), run in zip(todo, runs)]
    (out / "results.json").write_text(json.dumps({"config": asdict(cfg), "start_acc": acc0, "runs": results}))
    steps = cfg.steps or "the trainer's default"
    print(f"start accuracy {acc0:.3f}; {cfg.seeds} seed(s) x {steps} steps; {time.perf_counter() - t0:.0f} s")
    return summarize(out / "results.json")


if __name__ == "__main__":
    main()
