"""AsyPPO vs PPO side by side: trainer runs (`python trainer.py ...` subprocesses) over seeds, a table, curves.

    python experiments/asyppo.py          # quick (20 iterations, 8 prompts): PPO (actor-sized critic) vs AsyPPO
    python experiments/asyppo.py --full   # GRPO, PPO (actor-sized / mini critic), AsyPPO (2 mini) x 5 seeds

The concept (value models, the partition into shares, AsyPPO's masks, the footprint) is critics.py; each method
here is only trainer flags (METHODS), every other flag the trainer's default recipe. Per run: the eval history,
the last metrics and the per-step CURVES, in OUT_DIR/{quick,full}/summary.json; curves.png beside it; with more
than one seed, the bootstrap interval of each difference.
"""

from __future__ import annotations

import json
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cli import check_fields, parse_config  # noqa: E402
from experiments.seeds import differences, final_best, mean_std, run_trainers, steps_to  # noqa: E402
from runlog import format_table  # noqa: E402


@dataclass
class Config:
    """`python experiments/asyppo.py`: the side-by-side experiment (each run is `python trainer.py ...`)."""

    full: bool = False
    """Run the full comparison (GRPO, PPO actor-sized critic, PPO mini critic, AsyPPO) over `seeds` seeds."""
    seeds: int = 5
    """Seeds per method with --full (the quick run uses seed 0)."""
    steps: int = 0
    """RL iterations per run (0 = 20 quick, the trainer's default with --full)."""
    target_acc: float = 0.5
    """Eval accuracy whose first crossing is reported as steps-to-target."""
    train_args: str = ""
    """Extra trainer flags for every run, e.g. "--device cuda --eval-every 5 --critic-warmup-steps 5"."""
    jobs: int = 1
    """Runs in parallel (trainer processes; each run is still single-process training)."""
    out_dir: str = "runs/critics"
    """Where each run's folder, the summary JSON and curves.png go."""

    def __post_init__(self):
        check_fields(self, {"[1, inf)": ("seeds", "jobs"), "[0, inf)": ("steps",), "[0.0, 1.0]": ("target_acc",)})


METHODS = {  # trainer flags per method; only the advantage estimator and the critic differ
    "grpo": ["--adv-estimator", "grpo"],
    "ppo_1_full": ["--critic", "value", "--critic-depth", "1.0"],  # one actor-sized critic
    "ppo_1_mini": ["--critic", "value", "--critic-depth", "0.5"],  # one mini critic (half the layers)
    "asyppo_2_mini": ["--critic", "asyppo", "--n-critics", "2", "--critic-depth", "0.5"],
}
CURVES = ("rollout/reward_mean", "critic/explained_var", "stats/sigma_rel")  # per-step curves plotted
# The runs use the trainer's default recipe (sort, T 0.6, cosine lr, 32 x 4, 2 epochs x 2 minibatches), where PPO with
# a critic learns. The earlier comparison on `reverse` (RESULTS.md) is --train-args "--task reverse --temperature 1
# --lr 1e-4 --lr-schedule constant --ppo-epochs 1 --minibatches 1 --prompts-per-step 16 --group-size 16 --steps 150".


def run_result(spec: dict, result: dict, rows: list[dict]) -> dict:
    """One run of the experiment: eval history, last metrics, per-step curves, wall time of the whole command."""
    curves = {k: [r.get(k) for r in rows] for k in CURVES}
    history = [tuple(e) for e in result.pop("eval_history")]
    return {**spec, "wall_s": result.pop("wall_s"), "eval": history, "last": result, "curves": curves}


def summarize(results: list[dict], target: float) -> list[dict]:
    """One row per method: mean ± std over seeds of final/best accuracy, steps to target, time, memory."""
    pm = mean_std
    rows = []
    for name in dict.fromkeys(r["method"] for r in results):
        rs = [r for r in results if r["method"] == name]
        last = {k: [r["last"][k] for r in rs if k in r["last"]] for k in rs[0]["last"]}  # metric -> over seeds
        hit = [s for s in (steps_to(r["eval"], target) for r in rs) if s is not None]
        rows.append(
            {
                "method": name,
                "final_acc": pm([final_best(r["eval"])[0] for r in rs]),
                "best_acc": pm([final_best(r["eval"])[1] for r in rs]),  # after step 0
                f"steps_to_{target}": f"{pm(hit, '.0f')} ({len(hit)}/{len(rs)})",
                "wall_s": pm([r["wall_s"] for r in rs], ".0f"),
                "critic_params": f"{last['critic/params'][0] / 1e3:.0f}K" if "critic/params" in last else "-",
                "critic_mem_mb": f"{last['critic/mem_mb'][0]:.1f}" if "critic/mem_mb" in last else "-",
                "gpu_peak_mb": pm(last.get("perf/max_mem_allocated_mb", []), ".0f"),
                "explained_var": pm(last.get("critic/explained_var", [])),
                "sigma_rel": pm(last.get("stats/sigma_rel", [])),
            }
        )
    return rows


def plot(results: list[dict], path: Path) -> None:
    """Eval accuracy (mean ± std over seeds), rollout reward, critic fit and AsyPPO's sigma, per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(18, 4))
    for i, name in enumerate(dict.fromkeys(r["method"] for r in results)):
        rs = [r for r in results if r["method"] == name]
        steps, acc = [s for s, _ in rs[0]["eval"]], np.array([[a for _, a in r["eval"]] for r in rs])  # [seeds, n]
        axes[0].plot(steps, acc.mean(0), marker=".", label=name, color=f"C{i}")
        axes[0].fill_between(steps, acc.mean(0) - acc.std(0), acc.mean(0) + acc.std(0), alpha=0.2, color=f"C{i}")
        for ax, key in zip(axes[1:], CURVES):
            if rs[0]["curves"][key][-1] is not None:
                y = np.mean([r["curves"][key] for r in rs], 0)  # [steps] mean over seeds
                ax.plot(np.arange(1, len(y) + 1), y, label=name, color=f"C{i}")
    for ax, title in zip(axes, ["eval/acc (greedy, held out)", *CURVES]):
        ax.set(title=title, xlabel="step")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv=None):
    """Run the experiment's trainer runs (subprocesses), then print the table and write summary.json, curves.png."""
    cfg = parse_config(Config, argv)
    steps = cfg.steps or (0 if cfg.full else 20)  # 0: the trainer's own default
    methods = list(METHODS) if cfg.full else ["ppo_1_full", "asyppo_2_mini"]
    seeds = list(range(cfg.seeds)) if cfg.full else [0]
    out = Path(cfg.out_dir) / ("full" if cfg.full else "quick")
    quick = "" if cfg.full else "--prompts-per-step 8 --eval-n 200"  # a quarter of the batch
    shared = shlex.split(f"{f'--steps {steps}' * bool(steps)} --ent-coef 1e-3 {quick} {cfg.train_args}")  # bonus: all
    specs = [
        {"method": m, "seed": s, "argv": [*METHODS[m], *shared, "--seed", str(s)], "out_dir": str(out / f"{m}-s{s}")}
        for m in methods
        for s in seeds
    ]
    runs = run_trainers([(spec["argv"], spec["out_dir"]) for spec in specs], cfg.jobs)
    results = [run_result(spec, *run) for spec, run in zip(specs, runs)]
    (out / "summary.json").write_text(json.dumps(results, indent=1))
    plot(results, out / "curves.png")
    print(
        f"\n{len(seeds)} seed(s) x {steps or 'the trainer default'} steps, flags {shared}; curves: {out / 'curves.png'}"
    )
    print(format_table(summarize(results, cfg.target_acc)))
    if len(seeds) > 1:
        print(format_table(differences(results)))


if __name__ == "__main__":
    main()
