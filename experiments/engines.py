"""The same training run sampled by rollout.generate (hf) and by vLLM (--rollout-engine vllm), over seeds: does the
engine change what is learned? Resumable runs, one result file each.

    VENV/bin/python experiments/engines.py              # VENV: bash scripts/install_vllm.sh VENV (both sides use it)
    VENV/bin/python experiments/engines.py --seeds 5 --jobs 2

Each run is the trainer's default recipe (the embedded model, sort, its warm start) with `--seed S --rollout-engine
E`, one thread (a run repeats bit for bit for its seed and engine, whatever the machine's load). Its file is
experiments/results/engines/<engine>-s<seed>.json (seeds.run_list: a rerun skips the runs whose file exists); the
table and the bootstrap interval of vllm - hf are printed from the files. Both samplers draw from the policy's
distribution (the engine's logprobs are the trainer's to ~1e-6, and its samples pass tests_vllm's chi-square test
against the policy's probabilities) but not the same tokens (another sampler, other random numbers); RESULTS.md
has what the runs show.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cli import check_fields, parse_config  # noqa: E402
from experiments.seeds import differences, mean_std, run_list  # noqa: E402
from runlog import format_table  # noqa: E402

ENGINES = ("hf", "vllm")


@dataclass
class Config:
    """`python experiments/engines.py`: hf vs vllm sampling, the trainer's default recipe, over seeds."""

    seeds: int = 3
    """Seeds per engine (0, 1, ...)."""
    jobs: int = 1
    """Runs at a time (each on one thread)."""

    def __post_init__(self):
        check_fields(self, {"[1, inf)": ("seeds", "jobs")})


def main(argv=None) -> list[dict]:
    """Run what is missing, then print the table from the result files."""
    cfg = parse_config(Config, argv, description=__doc__)
    runs = {f"{e}-s{s}": ["--seed", str(s), "--rollout-engine", e] for s in range(cfg.seeds) for e in ENGINES}
    done = run_list("engines", runs, jobs=cfg.jobs)
    rows = []
    for e in ENGINES:
        mine = [r for r in done.values() if r["argv"][-1] == e]
        gap = [r["last"]["stats/rollout_vs_old_logp_diff"] for r in mine]
        row = {"engine": e, "seeds": len(mine), "start_acc": mean_std([r["eval"][0][1] for r in mine], ".3f")}
        row["final_acc"] = mean_std([r["final_acc"] for r in mine], ".3f")
        row["best_acc"] = mean_std([r["best_acc"] for r in mine], ".3f")
        row["rollout_vs_old"] = f"{np.mean(gap):.1e}"  # the sampler's logprobs against the trainer's, last iteration
        rows.append({**row, "wall_s": mean_std([r["wall_s"] for r in mine], ".0f")})
    print(f"held-out greedy accuracy, the trainer's default recipe, {cfg.seeds} seeds per engine (mean ± std)")
    print(format_table(rows))
    results = [{"method": r["argv"][-1], "eval": r["eval"]} for r in done.values()]
    print(format_table(differences(sorted(results, key=lambda r: ENGINES.index(r["method"]), reverse=True))))
    return rows


if __name__ == "__main__":
    main()
