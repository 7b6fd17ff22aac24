"""Torch's threads on a shared CPU (cli.choose_threads): one per core that other processes leave free, unless
OMP_NUM_THREADS says how many. The speed it buys is measured by bench/threads_bench.py, not timed here."""

import subprocess
import sys

import pytest
import torch

import cli


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="busy_cores reads /proc/stat (Linux); elsewhere 0")
def test_busy_cores_sees_a_process_that_spins():
    spinner = subprocess.Popen(["yes"], stdout=subprocess.DEVNULL)
    try:
        assert cli.busy_cores(0.5) >= 0.7  # one core kept busy (more if the machine has other work)
    finally:
        spinner.kill()
        spinner.wait()


def test_threads_follow_the_free_cores_and_an_explicit_setting_wins(monkeypatch, capsys):
    before = torch.get_num_threads()
    monkeypatch.setattr(cli.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    try:
        monkeypatch.setenv("OMP_NUM_THREADS", "3")
        torch.set_num_threads(4)
        assert cli.choose_threads() is None and torch.get_num_threads() == 4  # the user's number stands
        monkeypatch.delenv("OMP_NUM_THREADS")
        monkeypatch.setattr(cli, "busy_cores", lambda: 2.6)  # 1.4 cores free
        assert cli.choose_threads() == 1 and torch.get_num_threads() == 1
        assert "[minrl] torch threads: 1 (other processes keep 2.6 of the 4 cores busy" in capsys.readouterr().err
        torch.set_num_threads(4)
        monkeypatch.setattr(cli, "busy_cores", lambda: 0.2)  # an idle machine: torch's own number
        assert cli.choose_threads() == 4 and torch.get_num_threads() == 4 and capsys.readouterr().err == ""
        monkeypatch.setattr(cli, "busy_cores", lambda: 5.0)  # every core busy: still one thread
        assert cli.choose_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_a_replay_or_resume_takes_its_runs_thread_count_unless_omp_num_threads_says_otherwise(monkeypatch, capsys):
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        cli.keep_threads(1, "runs/b/batch-7.pt")
        assert torch.get_num_threads() == 1 and capsys.readouterr().out == ""
        cli.keep_threads(None, "an older dump")  # no count saved: nothing to keep
        assert torch.get_num_threads() == 1
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        cli.keep_threads(3, "runs/a/ckpt-3")  # the user's number stands, and the difference is said
        assert torch.get_num_threads() == 1
        assert "runs/a/ckpt-3 ran with 3 torch threads, OMP_NUM_THREADS gives 1" in capsys.readouterr().out
    finally:
        torch.set_num_threads(before)
