"""The sampler-trainer gap and its corrections: the default recipe sampled by a bf16 copy of the policy.

    python experiments/mismatch.py               # 6 arms x 3 seeds of `python trainer.py` (~20 min, 2 cores)
    python experiments/mismatch.py --seeds 1 --steps 10   # a quick look
    python experiments/mismatch.py --arms "bf16, none" "bf16, IcePop"   # some arms only

Every arm is the default run (`python trainer.py`: PPO with a critic on the embedded task, 90 iterations)
with `--seed S`; all but the first sample with `--rollout-dtype bfloat16` (rollout.inference_copy: the policy's
weights rounded to bf16 and a bf16 forward, as an inference engine holds them; the trainer stays fp32):
  fp32 sampler      the reference: the sampler is the trained policy (gap ~ 0)
  bf16, none        the gap, uncorrected
  bf16, token TIS   --rollout-is token --rollout-is-threshold 2.0           (veRL's decoupled_token_is preset)
  bf16, seq mask    --rollout-rs seq_mean_k1 --rollout-rs-threshold 0.999_1.001  (veRL's decoupled_geo_rs preset)
  bf16, seq mask 1%   the same geometric mask at 0.99_1.01
  bf16, IcePop      --rollout-is token --rollout-is-threshold 0.5_5.0       (veRL's decoupled_token_icepop preset)
Each run is its own subprocess with one thread (two at a time). Printed per arm, mean +- std over seeds: the final
held-out greedy accuracy (eval/acc at the last step), its gain over step 0, the mean over iterations of
stats/rollout_vs_old_logp_diff (mean |log pi_rollout - log pi_old| per token), veRL's rollout_corr/kl and the
rejected shares (rollout_rs_masked_fraction: tokens; rollout_is_oob_ratio: tokens IcePop zeroes).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cli import check_fields, parse_config  # noqa: E402

BF16 = ["--rollout-dtype", "bfloat16"]
ARMS = {
    "fp32 sampler": [],
    "bf16, none": BF16,
    "bf16, token TIS": BF16 + ["--rollout-is", "token", "--rollout-is-threshold", "2.0"],
    "bf16, seq mask": BF16 + ["--rollout-rs", "seq_mean_k1", "--rollout-rs-threshold", "0.999_1.001"],
    "bf16, seq mask 1%": BF16 + ["--rollout-rs", "seq_mean_k1", "--rollout-rs-threshold", "0.99_1.01"],
    "bf16, IcePop": BF16 + ["--rollout-is", "token", "--rollout-is-threshold", "0.5_5.0"],
}
SERIES = {  # column -> metrics key, averaged over a run's iterations
    "logp_diff": "stats/rollout_vs_old_logp_diff",
    "corr_kl": "rollout_corr/kl",
    "rs_masked": "rollout_corr/rollout_rs_masked_fraction",
    "is_oob": "rollout_corr/rollout_is_oob_ratio",
}


@dataclass
class Config:
    """`python experiments/mismatch.py`: the arms, each `python trainer.py ...` per seed."""

    seeds: int = 3
    """Seeds per arm (0 .. seeds - 1)."""
    steps: int = 90
    """Iterations per run (90: the default recipe)."""
    parallel: int = 2
    """Runs at a time (one thread each)."""
    arms: list[str] | None = None
    """Arms to run (None = all of ARMS)."""

    def __post_init__(self):
        check_fields(self, {"[1, inf)": ("seeds", "steps", "parallel")})
        self.arms = self.arms or list(ARMS)
        if unknown := [a for a in self.arms if a not in ARMS]:
            raise ValueError(f"config field 'arms': {unknown} not among {list(ARMS)}")


def run(arm: str, seed: int, steps: int, out: Path) -> dict:
    """One run of the arm; its final accuracy, gain and the per-iteration means of SERIES."""
    cmd = [sys.executable, str(ROOT / "trainer.py"), "--seed", str(seed), "--steps", str(steps)]
    cmd += ["--out-dir", str(out), *ARMS[arm]]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"{arm} seed {seed} failed ({' '.join(cmd)}):\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = json.loads((out / "result.json").read_text())["eval_history"]
    res = {"acc": evals[-1][1], "gain": evals[-1][1] - evals[0][1]}
    for col, key in SERIES.items():
        values = [r[key] for r in rows if key in r]
        res[col] = float(np.mean(values)) if values else None
    return res


def main(argv=None) -> None:
    args = parse_config(Config, argv, description=__doc__)
    jobs = [(arm, seed) for arm in args.arms for seed in range(args.seeds)]
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(args.parallel) as pool:
        futures = {job: pool.submit(run, *job, args.steps, Path(tmp) / f"{i}") for i, job in enumerate(jobs)}
        results = {job: f.result() for job, f in futures.items()}
    cols = ["acc", "gain", *SERIES]
    print(f"| arm ({args.seeds} seeds, {args.steps} steps) | " + " | ".join(cols) + " |")
    print("|" + "---|" * (len(cols) + 1))
    for arm in args.arms:
        cells = []
        for col in cols:
            values = [results[(arm, s)][col] for s in range(args.seeds) if results[(arm, s)][col] is not None]
            cells.append(f"{np.mean(values):.4g} +- {np.std(values):.2g}" if values else "-")
        print(f"| {arm} | " + " | ".join(cells) + " |")
    for arm in args.arms:
        print(arm, "per seed acc:", [round(results[(arm, s)]["acc"], 3) for s in range(args.seeds)])


if __name__ == "__main__":
    main()
