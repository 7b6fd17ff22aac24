"""A run's folder: nothing a user saved is overwritten or mixed (checkpoint.run_dir, runlog.stopping_cleanly).

Without --out-dir every run gets a fresh runs/<entry>-<date>-<n>; an --out-dir that holds a run is refused (naming
--resume and --overwrite) before anything loads; --overwrite removes that run's files and only those; --resume goes
on in the checkpoint's folder; a run stopped by SIGTERM leaves result.json and curves.png as far as it got.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import runlog
from checkpoint import check_out_dir, run_dir
from runlog import read_jsonl

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
SMALL = ["--steps", "3", "--eval-every", "0", "--prompts-per-step", "2", "--group-size", "2", "--task", "reverse"]


def test_run_dir_picks_fresh_folders_and_refuses_or_replaces_a_run(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    today = time.strftime("%Y%m%d")
    first, second = run_dir(None, "trainer"), run_dir(None, "trainer")
    assert (first, second) == (Path(f"runs/trainer-{today}-1"), Path(f"runs/trainer-{today}-2"))
    assert first.is_dir() and f"this run's folder: runs/trainer-{today}-2" in capsys.readouterr().out
    (first / "metrics.jsonl").write_text('{"step": 1}\n')
    (first / "ckpt-3").mkdir()
    (first / "notes.txt").write_text("mine")  # not a run's file: never touched
    with pytest.raises(FileExistsError, match=r"holds a run \(ckpt-3, metrics.jsonl\): --resume .* --overwrite"):
        run_dir(str(first), "trainer")
    assert run_dir(str(first), "trainer", resuming=True) == first and (first / "ckpt-3").is_dir()
    assert run_dir(str(first), "trainer", overwrite=True) == first
    assert sorted(p.name for p in first.iterdir()) == ["notes.txt"]
    assert "removed ckpt-3, metrics.jsonl of the previous run" in capsys.readouterr().out
    assert check_out_dir(str(tmp_path / "new"), False, False) == [] and run_dir(str(tmp_path / "new"), "x").is_dir()


def test_the_trainer_never_mixes_two_runs(tmp_path, tiny_model_dir, monkeypatch, capsys):
    """The reported sequence: a 3-step run saving every step, then a second run into the same folder. Refused
    before any model loads; with --overwrite the first run's ckpt-3 is gone, so that --resume takes the second
    run's newest checkpoint and its rows are the second run's alone, in the same folder."""
    import trainer

    monkeypatch.chdir(tmp_path)
    small = ["--model", str(tiny_model_dir), *SMALL, "--save-every", "1"]
    trainer.main(small)
    run = Path("runs") / f"trainer-{time.strftime('%Y%m%d')}-1"
    assert f"this run's folder: {run}" in capsys.readouterr().out and (run / "ckpt-3").is_dir()
    with pytest.raises(FileExistsError, match="holds a run .* --resume .* --overwrite"):
        trainer.main([*small, "--out-dir", str(run), "--lr", "1e-3"])
    assert "params" not in capsys.readouterr().out  # refused before loading anything
    trainer.main([*small, "--out-dir", str(run), "--lr", "1e-3", "--overwrite", "--steps", "2"])
    assert sorted(p.name for p in run.glob("ckpt-*")) == ["ckpt-1", "ckpt-2"]
    assert "removed ckpt-1, ckpt-2, ckpt-3" in capsys.readouterr().out
    trainer.main([*small, "--lr", "1e-3", "--resume", str(run), "--resume-allow", "steps"])
    assert "kept 2 rows up to step 2, dropped 0" in capsys.readouterr().out  # the second run's ckpt-2
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [1, 2, 3]
    assert json.loads((run / "config.json").read_text())["lr"] == 1e-3
    assert sorted(p.name for p in Path("runs").iterdir()) == [run.name]  # the resume went on in its own folder


def test_sigterm_stops_a_run_leaving_result_and_curves_as_far_as_it_got(tmp_path, tiny_model_dir):
    out = tmp_path / "run"
    cmd = [sys.executable, str(ROOT / "trainer.py"), "--model", str(tiny_model_dir), *SMALL, "--out-dir", str(out)]
    proc = subprocess.Popen([*cmd, "--steps", "500"], cwd=tmp_path, env=ENV, stdout=subprocess.PIPE, text=True)
    t0 = time.monotonic()
    while not ((out / "metrics.jsonl").exists() and len(read_jsonl(out / "metrics.jsonl")) >= 2):
        assert proc.poll() is None and time.monotonic() - t0 < 240, "the run ended or never logged two rows"
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    stdout, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, stdout[-2000:]
    result, rows = json.loads((out / "result.json").read_text()), read_jsonl(out / "metrics.jsonl")
    assert result["stopped_at"] == rows[-1]["step"] == result["step"] >= 2 and (out / "curves.png").stat().st_size
    assert f"stopped at step {rows[-1]['step']}" in stdout


def test_printed_rows_show_the_progress_and_the_time_left_at_the_pace_after_the_first(tmp_path, monkeypatch, capsys):
    """The first row's time holds the start-up (100 s here): the pace (10 s per step) is measured from that row on;
    the file keeps only the metrics."""
    clock = iter([100.0, 110.0, 120.0, 130.0])
    monkeypatch.setattr(runlog.time, "monotonic", lambda: next(clock))
    logger = runlog.MetricsLogger(tmp_path / "run", ["a"], total_steps=4)
    for step in range(1, 5):
        logger.log(step, {"a": 0.5})
    rows = capsys.readouterr().out.splitlines()[1:]
    assert [r.split("  ")[-1].strip() for r in rows] == ["1/4", "2/4, 20s left", "3/4, 10s left", "4/4"]
    assert read_jsonl(tmp_path / "run" / "metrics.jsonl")[0] == {"step": 1, "a": 0.5}
    assert [runlog.clock(s) for s in (0.4, 59.4, 125, 3600 * 2 + 61)] == ["0s", "59s", "2m05s", "2h01m"]
