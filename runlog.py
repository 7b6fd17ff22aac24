"""What a run leaves on disk: the metrics table and JSONL (TensorBoard if asked), plots, checkpoints.

    python runlog.py runs/ppo                 # a finished run's metrics as a table, and its curves.png again
    python runlog.py runs/ppo --keys stats/kl loss/policy

- `MetricsLogger`: one row per step, printed as an aligned table (rank 0) and appended to `metrics.jsonl`.
- `format_table`, `read_jsonl`, `plot_metrics`: the same rows read back, for experiments and notebooks.
- `run_trainers`: trainer runs as subprocesses (`python ppo_minimal.py ARGS --out-dir D`), for the concept
  files' experiments, which read back what each run wrote (so that nothing below the trainer imports it).
- Checkpoints: models through `save_pretrained` (safetensors), the rest (optimizer, counters) in a
  `weights_only`-loadable `state.pt` written by rank 0, and every rank's own random streams in `rank{r}.pt`,
  so that a resumed data-parallel run keeps distinct per-rank sampling.

torch and matplotlib are imported inside the functions that need them, so that the torch-free leaves
(`scheduler.py`, `diagnose.py`) can write tables on a machine without torch.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from common import n_processes

# ----------------------------------------------------------------------------------------------
# Metrics: aligned table + JSONL (+ TensorBoard if asked)


def format_row(values: dict, columns: list[str], width: int = 10) -> str:
    """One table row: each column's value right-aligned, floats with 4 significant digits."""
    cells = []
    for c in columns:
        v = values.get(c, "")
        if isinstance(v, float):
            v = f"{v:.4g}" if abs(v) >= 1e-3 or v == 0 else f"{v:.2e}"
        cells.append(str(v).rjust(width))
    return " ".join(cells)


def column_labels(columns: list[str]) -> list[str]:
    """Short column names: the part after the last '/', or the whole name with '_' where that clashes."""
    short = [c.split("/")[-1] for c in columns]
    return [s if short.count(s) == 1 else c.replace("/", "_") for s, c in zip(short, columns)]


def format_table(rows: list[dict], columns: list[str] | None = None) -> str:
    """Rows of dicts as an aligned text table with short column names."""
    columns = columns or list(rows[0])
    labels = column_labels(columns)
    width = max(10, *(len(c) for c in labels))
    return "\n".join([" ".join(c.rjust(width) for c in labels)] + [format_row(r, columns, width) for r in rows])


class MetricsLogger:
    """One row per step: printed as an aligned table (rank 0), appended to `metrics.jsonl`.

    An existing metrics.jsonl keeps only its rows up to `start_step` (0 for a fresh run, the checkpoint's
    step on resume), so a rerun or a resume never mixes two runs' rows in one file."""

    def __init__(
        self, out_dir: str | Path, columns: list[str], enabled: bool = True, tensorboard: bool = False, start_step=0
    ):
        self.columns, self.enabled, self.n = columns, enabled, 0
        self.labels = column_labels(columns)
        self.width = max(10, *(len(c) for c in self.labels))
        self.path = Path(out_dir) / "metrics.jsonl"
        self.tb = None
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            rows = self._rows_of_previous_run() if self.path.exists() else []
            kept = [r for r in rows if r["step"] <= start_step]
            if rows:
                dropped = len(rows) - len(kept)
                print(f"[minrl] {self.path}: kept {len(kept)} rows up to step {start_step}, dropped {dropped}")
            self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))
            if tensorboard:
                from torch.utils.tensorboard import SummaryWriter  # needs the `tensorboard` package

                self.tb = SummaryWriter(str(self.path.parent / "tb"))

    def _rows_of_previous_run(self) -> list[dict]:
        """The existing file's rows; a half-written last line (a killed run) is dropped, other damage raises."""
        lines = self.path.read_text().splitlines()
        rows = []
        for n, line in enumerate(lines, 1):
            try:
                row = json.loads(line) if line.strip() else None
            except json.JSONDecodeError:
                if n == len(lines):  # the run was killed while writing it
                    print(f"[minrl] {self.path}, line {n}: dropping a half-written last row")
                    break
                raise ValueError(f"{self.path}, line {n}: not a JSON metrics row; move the file away") from None
            if row is not None:
                if not isinstance(row, dict) or "step" not in row:
                    raise ValueError(f"{self.path}, line {n}: a metrics row needs a 'step'; move the file away")
                rows.append(row)
        return rows

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Append one row to metrics.jsonl (and TensorBoard) and print it; the header every 20 rows."""
        if not self.enabled:
            return
        row = {"step": step, **metrics}
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if self.tb is not None:
            for k, v in metrics.items():
                self.tb.add_scalar(k, v, step)
        if self.n % 20 == 0:
            print(" ".join(c.rjust(self.width) for c in self.labels), flush=True)
        print(format_row(row, self.columns, self.width), flush=True)
        self.n += 1


def read_jsonl(path: str | Path) -> list[dict]:
    """Every row of a JSONL file."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_metrics(metrics_file, keys: list[str], png) -> None:
    """One panel per metric over steps from a metrics.jsonl -> png (Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_jsonl(metrics_file)
    fig, axes = plt.subplots(1, len(keys), figsize=(4.3 * len(keys), 3.5), squeeze=False)
    for ax, key in zip(axes[0], keys):
        pts = [(r["step"], r[key]) for r in rows if key in r]
        if pts:
            ax.plot(*zip(*pts), marker="." if len(pts) < 50 else None)
        ax.set(title=key, xlabel="step")
    fig.tight_layout()
    fig.savefig(png, dpi=80)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------
# Trainer runs as subprocesses (the experiments of critics.py and attention_credit.py)


def run_trainer(argv: list[str], out_dir, threads: int | None = None) -> tuple[dict, list[dict]]:
    """`python ppo_minimal.py ARGV --out-dir OUT_DIR`, its output in OUT_DIR/log.txt. Returns (its result.json:
    the last metrics row, "eval_history" and "wall_s" of the whole command; its metrics rows). threads sets
    OMP_NUM_THREADS (None: inherited). A failed run raises with the tail of its log."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    cmd = [sys.executable, str(Path(__file__).resolve().parent / "ppo_minimal.py"), *argv, "--out-dir", str(out)]
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
    with ThreadPoolExecutor(jobs) as ex:
        return list(ex.map(lambda run: run_trainer(*run, threads=threads), runs))


# ----------------------------------------------------------------------------------------------
# Checkpoints: models as save_pretrained (safetensors), the rest in weights_only-loadable .pt files


def save_checkpoint(path, rank: int, models: dict, state: dict, streams: dict, tokenizer=None) -> None:
    """Every rank writes its random streams (rank{r}.pt); rank 0 also writes each model of `models` (name ->
    module with save_pretrained) to path/name, the tokenizer next to "policy", and `state` to state.pt."""
    import torch

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    torch.save(streams, path / f"rank{rank}.pt")
    if rank != 0:
        return
    for name, m in models.items():
        m.save_pretrained(path / name)
    torch.save(state, path / "state.pt")
    if tokenizer is not None:
        tokenizer.save_pretrained(path / "policy")


def load_checkpoint(path, rank: int) -> tuple[dict, dict]:
    """(state, this rank's random streams) of a checkpoint folder written by save_checkpoint."""
    import torch

    path = Path(path)
    state = torch.load(path / "state.pt", weights_only=True, map_location="cpu")
    return state, torch.load(path / f"rank{rank}.pt", weights_only=True)


def stream_states(rng, gens: dict) -> dict:
    """The states of the global torch RNG, a numpy Generator and named torch Generators (for rank{r}.pt)."""
    import torch

    return {
        "torch_rng": torch.get_rng_state(),
        "task_rng": rng.bit_generator.state,
        **{n: g.get_state() for n, g in gens.items()},
    }


def restore_streams(states: dict, rng, gens: dict) -> None:
    """Put back what stream_states saved: the global torch RNG, the numpy Generator, each named Generator."""
    import torch

    torch.set_rng_state(states["torch_rng"])
    for name, g in gens.items():
        g.set_state(states[name])
    rng.bit_generator.state = states["task_rng"]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", help="a run's folder (with metrics.jsonl)")
    ap.add_argument("--keys", nargs="*", default=["rollout/reward_mean", "eval/acc", "stats/kl"], help="metrics")
    args = ap.parse_args(argv)
    rows = read_jsonl(Path(args.run_dir) / "metrics.jsonl")
    print(format_table(rows, ["step", *args.keys]))
    plot_metrics(Path(args.run_dir) / "metrics.jsonl", args.keys, Path(args.run_dir) / "curves.png")
    print(f"[minrl] {Path(args.run_dir) / 'curves.png'}")


if __name__ == "__main__":
    main()
