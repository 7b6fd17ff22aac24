"""What a run leaves on disk: its folder, the metrics table and JSONL (TensorBoard if asked), plots, checkpoints.

    python runlog.py runs/trainer-20261206-1     # a run's metrics as a table, and its curves.png again
    python runlog.py runs/trainer-20261206-1 --keys stats/kl loss/policy

- The run's folder (checkpoint.run_dir): without --out-dir a fresh `runs/<entry>-<date>-<n>/`; a folder that holds
  a run is refused without --resume or --overwrite; a stopped run still writes result.json and curves.png.
- `MetricsLogger`: one row per step, printed as an aligned table (rank 0) with the progress and an estimate of the
  time left, and appended to `metrics.jsonl`.
- `format_table`, `read_jsonl`, `plot_metrics`: the same rows read back, for experiments and notebooks.
- `parallel_map`: independent runs (simulations) in spawned processes (trainer runs as subprocesses, and the
  statistics over seeds of the experiments: experiments/seeds.py).

torch and matplotlib are imported inside the functions that need them, so that the torch-free leaves
(`scheduler.py`, `diagnose.py`) can write tables on a machine without torch.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

from checkpoint import run_dir
from cli import sigterm_as_ctrl_c


def entry_name(obj) -> str:
    """The entry point a config class belongs to: its module's file name (trainer, model_proxy, ...)."""
    module = sys.modules[type(obj).__module__]
    return Path(getattr(module, "__file__", "run")).stem


@contextlib.contextmanager
def stopping_cleanly(cfg):
    """Around an entry point's train(cfg): SIGTERM (kill, systemd, docker) stops the run as Ctrl-C does, and a
    stopped run still leaves result.json and curves.png from the rows it logged (rank 0); exit status 130."""
    sigterm_as_ctrl_c()
    try:
        yield
    except KeyboardInterrupt:
        print("[minrl] interrupted (Ctrl-C or SIGTERM): the run stops", file=sys.stderr, flush=True)
        rows = Path(cfg.out_dir or "", "metrics.jsonl")  # (out_dir: the run's folder once train() opened it)
        if cfg.out_dir and rows.exists() and os.environ.get("RANK", "0") == "0" and (rows := read_jsonl(rows)):
            history = [(r["step"], r["eval/acc"]) for r in rows if "eval/acc" in r]
            write_result(cfg.out_dir, {**rows[-1], "eval_history": history, "stopped_at": rows[-1]["step"]})
            print(f"[minrl] stopped at step {rows[-1]['step']}: {cfg.out_dir}/result.json and curves.png so far")
        raise SystemExit(130) from None


# ----------------------------------------------------------------------------------------------
# Metrics: aligned table + JSONL (+ TensorBoard, W&B if asked)


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
    """One row per step: printed as an aligned table (rank 0), appended to `metrics.jsonl`. With `total_steps`
    each printed row ends with `step/total` and the time left at the pace of the rows so far (not in the file).

    It opens the run's folder (checkpoint.run_dir, on the rank that logs; `self.dir`). On resume an existing
    metrics.jsonl keeps only its rows up to `start_step`, the checkpoint's, so that no two runs' rows ever mix.
    `aliases(metrics)`: more names for the same values, for TensorBoard and W&B only (diagnose.verl_aliases)."""

    def __init__(self, out_dir: str | Path | None, columns: list[str], enabled: bool = True, tensorboard: bool = False,
                 start_step=0, wandb_project=None, config: dict | None = None, aliases=None, entry: str = "run",
                 overwrite: bool = False, total_steps: int | None = None):  # fmt: skip
        self.columns, self.enabled, self.n, self.aliases, self.wandb = columns, enabled, 0, aliases, None
        self.total, self.first = total_steps, None  # (step, time) of the first row printed: the pace's origin
        self.labels = column_labels(columns)
        self.width = max(10, *(len(c) for c in self.labels))
        # the run's folder (checkpoint.run_dir: None is a fresh one; a run's is refused unless resumed or overwritten)
        self.dir = run_dir(out_dir, entry, overwrite, resuming=start_step > 0) if enabled else out_dir and Path(out_dir)
        self.path, self.tb = self.dir and self.dir / "metrics.jsonl", None
        if enabled:
            rows = self._rows_of_previous_run() if self.path.exists() else []
            kept = [r for r in rows if r["step"] <= start_step]
            if rows:
                dropped = len(rows) - len(kept)
                print(f"[minrl] {self.path}: kept {len(kept)} rows up to step {start_step}, dropped {dropped}")
            self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))
            if tensorboard:
                from torch.utils.tensorboard import SummaryWriter  # needs the `tensorboard` package

                self.tb = SummaryWriter(str(self.path.parent / "tb"))
            if wandb_project:
                try:
                    import wandb
                except ImportError as e:
                    raise ImportError("--wandb-project needs wandb: pip install wandb") from e
                mode = os.environ.get("WANDB_MODE", "offline")  # offline: nothing leaves the machine unless synced
                where = str(self.path.parent.resolve())  # absolute: W&B's service process has a cwd of its own
                self.wandb = wandb.init(
                    project=wandb_project, dir=where, mode=mode, config=config, name=self.path.parent.name
                )  # fmt: skip  (a resume: a new run, from its step)

    @classmethod
    def of(cls, cfg, columns: list[str], enabled: bool, start_step: int, aliases=None) -> MetricsLogger:
        """The logger of a run configured by `cfg` (RunArgs fields: out_dir, overwrite, tensorboard, wandb_project)."""
        more = {"entry": entry_name(cfg), "overwrite": cfg.overwrite, "total_steps": getattr(cfg, "steps", None)}
        return cls(
            cfg.out_dir, columns, enabled, cfg.tensorboard, start_step, cfg.wandb_project, asdict(cfg), aliases, **more
        )

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
        both = {**metrics, **(self.aliases(metrics) if self.aliases else {})}  # + other names (veRL's)
        if self.tb is not None:
            for k, v in both.items():
                self.tb.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.log(both, step=step)
        if self.n % 20 == 0:
            print(" ".join(c.rjust(self.width) for c in self.labels), flush=True)
        print(format_row(row, self.columns, self.width) + self.progress(step), flush=True)
        self.n += 1

    def progress(self, step: int) -> str:
        """`  12/90, 1m05s left`: the steps still to go at the pace of the rows after the first one (whose time
        includes the start-up)."""
        if not self.total:
            return ""
        now = time.monotonic()
        self.first = self.first or (step, now)
        done, took = step - self.first[0], now - self.first[1]
        left = f", {clock(took / done * (self.total - step))} left" if done > 0 and step < self.total else ""
        return f"  {step}/{self.total}{left}"

    def close(self) -> None:
        """Flush and close TensorBoard and W&B (the offline run folder is complete after this)."""
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def clock(seconds: float) -> str:
    """A duration as a person reads it: 42s, 3m05s, 1h12m."""
    s = round(seconds)
    return f"{s}s" if s < 60 else f"{s // 60}m{s % 60:02d}s" if s < 3600 else f"{s // 3600}h{s % 3600 // 60:02d}m"


def read_jsonl(path: str | Path) -> list[dict]:
    """Every row of a JSONL file."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_metrics(metrics_file, keys: list[str], png, points: dict | None = None) -> dict[str, list]:
    """One panel per metric over steps from a metrics.jsonl -> png (Agg backend); `points` {key: [(step, value)]}
    replaces a key's rows (the eval history, which has step 0). Returns what each panel plots."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_jsonl(metrics_file)
    fig, axes = plt.subplots(1, len(keys), figsize=(4.3 * len(keys), 3.5), squeeze=False)
    series = {k: (points or {}).get(k) or [(r["step"], r[k]) for r in rows if k in r] for k in keys}
    for ax, key in zip(axes[0], keys):
        if series[key]:
            ax.plot(*zip(*series[key]), marker="." if len(series[key]) < 50 else None)
        ax.set(title=key, xlabel="step")
    fig.tight_layout()
    fig.savefig(png, dpi=80)
    plt.close(fig)
    return series


# ----------------------------------------------------------------------------------------------
# Independent runs in parallel: functions in spawned processes


def n_processes(jobs: int, n_calls: int) -> int:
    """Processes parallel_map uses: `jobs`, or one per CPU this process may run on (jobs 0); at most one per call."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(n_calls, jobs or cpus))


def parallel_map(fn, calls: list[tuple], jobs: int = 1) -> list:
    """[fn(*args) for args in calls], in order; in n_processes(jobs) spawned processes when more than one.
    fn must be a module-level function; spawn (not fork) is safe next to torch's threads, and a calling script
    needs the `if __name__ == "__main__":` guard."""
    n = n_processes(jobs, len(calls))
    if n == 1:
        return [fn(*args) for args in calls]
    import concurrent.futures as cf
    import multiprocessing as mp

    with cf.ProcessPoolExecutor(n, mp_context=mp.get_context("spawn")) as ex:
        return list(ex.map(fn, *zip(*calls)))


def write_result(out_dir, result: dict, curves: bool = True, saved: bool = False) -> None:
    """A run's result.json (its last metrics row and eval history: what experiments read back), curves.png (the
    eval curve from the history, step 0 included); saved: say where the policy is (checkpoint.save_policy)."""
    out_dir = Path(out_dir)
    (out_dir / "result.json").write_text(json.dumps(result))
    if curves:
        points = {"eval/acc": [tuple(e) for e in result.get("eval_history", [])]}
        plot_metrics(
            out_dir / "metrics.jsonl", ["rollout/reward_mean", "eval/acc", "stats/kl"], out_dir / "curves.png", points
        )
    if saved:
        lora = (out_dir / "policy/adapter_config.json").exists()
        how = "PeftModel.from_pretrained(base, it)" if lora else "AutoModelForCausalLM.from_pretrained"
        print(f"[minrl] final policy: {out_dir / 'policy'} ({how} loads it)")


def main(argv=None) -> None:
    """`python runlog.py RUN_DIR`: print a finished run's metrics table and write its curves.png again."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", help="a run's folder (with metrics.jsonl)")
    ap.add_argument("--keys", nargs="*", default=["rollout/reward_mean", "eval/acc", "stats/kl"], help="metrics")
    args = ap.parse_args(argv)
    run, rows = Path(args.run_dir), read_jsonl(Path(args.run_dir) / "metrics.jsonl")
    print(format_table(rows, ["step", *args.keys]))
    result = json.loads((run / "result.json").read_text()) if (run / "result.json").exists() else {}
    history = result.get("eval_history", [])
    plot_metrics(run / "metrics.jsonl", args.keys, run / "curves.png", {"eval/acc": [tuple(e) for e in history]})
    print(f"[minrl] {Path(args.run_dir) / 'curves.png'}")


if __name__ == "__main__":
    main()
