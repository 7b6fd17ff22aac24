"""reward_workers.py: a reward function that hangs, spins in C code, exits or dies stops its batch within about one
--reward-timeout, and the error names the call (the sample, through RewardSet), the function and the cause; the
workers killed or dead are replaced for the next batch. Also a reward file that exits at import is named."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from reward_workers import GRACE_S, CallFailed, Workers
from rewards import RewardArgs, RewardSet
from tests.test_user_data import reward_file, row

FUNCTIONS = """import os, re, signal, sys, time
def ok(solution_str): return float(len(solution_str))
def sleeps(solution_str): return time.sleep(3600) if solution_str == "boom" else 0.0
def deaf(solution_str): return signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM}) or time.sleep(3600)
def in_c(solution_str): return float(bool(re.fullmatch(r"(a+)+b", "a" * 64)))
def exits(solution_str): return sys.exit(3) if solution_str == "boom" else 0.0
def hard_exits(solution_str): return os._exit(7) if solution_str == "boom" else 0.0
def killed(solution_str): return os.kill(os.getpid(), signal.SIGKILL) if solution_str == "boom" else 0.0
def swallows(solution_str):
    try:
        time.sleep(3600)
    except Exception:
        return 1.0
def bare(solution_str):
    try:
        time.sleep(3600)
    except:
        return 1.0
def forks(solution_str):
    if os.fork() == 0:  # a child that keeps the worker's pipe open while its parent dies
        time.sleep(3600)
    os._exit(5)
"""


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    path = tmp_path_factory.mktemp("rw") / "fns.py"
    path.write_text(FUNCTIONS)
    names = ("ok", "sleeps", "deaf", "in_c", "exits", "hard_exits", "killed", "swallows", "bare", "forks")
    w = Workers([f"{path}:{fn}" for fn in names], n=2, timeout=1.0)
    yield w, {spec.split(":")[1]: spec for spec in w.specs}
    w.close()


@pytest.mark.parametrize(
    "fn, why, seconds",
    [("sleeps", r"timed out after 1.0 s \(--reward-timeout\), in \S+fns\.py:3 \(.*time\.sleep", 1.0),
     ("swallows", r"timed out after 1.0 s .*fns\.py:11 \(time\.sleep\(3600\)\)", 1.0),  # `except Exception` cannot
     ("in_c", r"timed out after 1.0 s .*fns\.py:5 \(def in_c", 1.0),  # the user's line, not the library's
     ("deaf", r"did not return within --reward-timeout 1.0 s \+ 5.0 s: .* its worker was killed", 1.0 + GRACE_S),
     ("exits", r"called sys.exit\(3\) at \S+fns\.py:6", 0.0),
     ("hard_exits", r"lost its worker process, which exited with code 7", 0.0),
     ("killed", r"lost its worker process, which was killed by signal SIGKILL", 0.0),
     ("bare", r"timed out after 1.0 s .*fns\.py:16 \(time\.sleep\(3600\)\)", 1.0),  # a bare except cannot either
     ("forks", r"lost its worker process, which exited with code 5", 0.0)],
)  # fmt: skip
def test_the_first_failure_stops_the_batch_within_a_timeout_naming_the_call_and_its_cause(workers, fn, why, seconds):
    w, spec = workers
    texts = ["a", "bb", "boom", "ccc"] + ["d"] * 12  # 16 calls on 2 workers: 8 timeouts, where each call hangs
    jobs = [(spec[fn], (), {"solution_str": t}) for t in texts]
    t0 = time.monotonic()
    with pytest.raises(CallFailed, match=why) as e:
        w.run(jobs)
    took = time.monotonic() - t0
    assert seconds <= took < seconds + 5.0, took  # its own timeout (or deadline), not the batch's 16 calls
    every_call = fn in ("deaf", "in_c", "swallows", "bare", "forks")  # fails on each: call 0 or 1, whichever is first
    assert e.value.index in ({0, 1} if every_call else {2}), e.value
    t0 = time.monotonic()  # the workers killed (the failed one, the other one's abandoned call) are replaced
    assert w.run([(spec["ok"], (), {"solution_str": t}) for t in texts]) == [float(len(t)) for t in texts]
    assert time.monotonic() - t0 < 30


def test_a_worker_found_dead_between_batches_is_replaced(workers, capsys):
    w, spec = workers
    jobs = [(spec["ok"], (), {"solution_str": "x" * n}) for n in range(4)]
    assert w.run(jobs) == [0.0, 1.0, 2.0, 3.0]
    os.kill(w.procs[1][0].pid, signal.SIGKILL)
    w.procs[1][0].join(5)
    assert w.run(jobs) == [0.0, 1.0, 2.0, 3.0]
    assert (
        "reward worker 1 was killed by signal SIGKILL (the OOM killer?) between calls: replaced"
        in capsys.readouterr().err
    )


def test_reward_set_names_the_sample_of_a_dying_function_and_a_file_that_exits_at_import(tmp_path):
    head = "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
    dies = reward_file(tmp_path, "import os\n" + head + "    return os._exit(9) if solution_str == 'boom' else 0.0\n")
    rs = RewardSet(RewardArgs(reward=[dies], reward_workers=1, reward_timeout=5.0))
    try:
        want = (
            r"reward '\S+r\.py' lost its worker process, which exited with code 9 on sample 1 \(t\.jsonl:1, .*'boom'\)"
        )
        with pytest.raises(RuntimeError, match=want):
            rs.score([row(), row("456>", "654")], ["ok", "boom"], [[1], [2]])
    finally:
        rs.close()
    exits = reward_file(tmp_path, "import sys\nsys.exit('no GPU here')\n" + head + "    return 0.0\n", "x.py")
    with pytest.raises(RuntimeError, match=re.escape(f"--reward {exits!r}: {exits} called sys.exit('no GPU here') "
                                                     "at line 4 (sys.exit('no GPU here')) when imported")):  # fmt: skip
        RewardSet(RewardArgs(reward=[exits], reward_workers=0))


def test_the_demo_runs():
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "reward_workers.py"], cwd=root, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "ok: [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]", out.stdout
    for fn, words in [("raises", "raised ZeroDivisionError"), ("hangs", "timed out after 2.0 s"),
                      ("exits", "called sys.exit(3)"), ("dies", "killed by signal SIGKILL")]:  # fmt: skip
        assert any(line.startswith(f"{fn}: ") and words in line for line in lines), (fn, out.stdout)
