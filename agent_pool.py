"""Agent programs as long-lived worker processes: jobs in on stdin, one line out on stdout per finished job.

agent_train.py trains on what such processes do through the proxy; this file only runs them. The protocol is
all an agent program speaks beyond the chat API and the environment server's:
    started   python PROGRAM ARGS...          (agent_train.py: --base-url URL/v1 --env-url URL --max-turns N)
    stdin     a job per line, SEED:SESSION:SPLIT: play the environment's episode SEED (of SPLIT), chat as SESSION
    stdout    `done SESSION RETURN` when a job ends, in any order (a program may play its jobs concurrently)
A program that exits, prints anything else, or makes the pool wait past its timeout stops the run with an error that
names it, its exit status and the tail of its stderr. Processes start once and live across iterations: starting a
Python program that imports an HTTP client costs about a second of CPU, an iteration's episodes a few.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import tempfile
import threading


def is_number(text: str) -> bool:
    try:
        return math.isfinite(float(text))
    except ValueError:
        return False


class AgentPool:
    """`n` processes of `python program *args`; `play` hands out jobs round-robin and waits for every one."""

    def __init__(self, program: str, n: int, args: list[str], timeout: float):
        self.program, self.timeout = program, timeout
        self.logs = [tempfile.TemporaryFile("w+") for _ in range(n)]  # each one's stderr, for its failure
        self.procs = [subprocess.Popen([sys.executable, program, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       stderr=log, text=True, bufsize=1) for log in self.logs]  # fmt: skip

    def play(self, jobs: list[tuple[int, str]], split: str) -> dict[str, float]:
        """Play (seed, session) jobs; returns each session's RETURN as its program printed it."""
        share, self.timed_out = [jobs[j :: len(self.procs)] for j in range(len(self.procs))], False
        for j, (p, mine) in enumerate(zip(self.procs, share)):
            try:
                p.stdin.write("".join(f"{seed}:{session}:{split}\n" for seed, session in mine))
            except OSError:  # it exited (BrokenPipeError): say which, how, and its stderr
                self.fail(j, p, "")
        timer = threading.Timer(self.timeout, self.kill_all)
        timer.start()  # a hung program is killed: its readline below then ends, and the run stops naming it
        returns = {}
        try:
            for j, (p, mine) in enumerate(zip(self.procs, share)):
                waiting = {session for _, session in mine}
                while waiting:
                    line = p.stdout.readline()  # "": it exited (or the timer killed it)
                    done, session, ret = (line.split() + ["", "", ""])[:3]
                    if done != "done" or session not in waiting or not is_number(ret):
                        self.fail(j, p, line)
                    waiting.discard(session)
                    returns[session] = float(ret)
        finally:
            timer.cancel()
        return returns

    def kill_all(self) -> None:  # the timer's: agent_timeout passed before every job was done
        self.timed_out = True
        for p in self.procs:
            p.kill()

    def fail(self, j: int, p: subprocess.Popen, line: str):
        try:  # a wrong line from a live program: it is killed (close); none: it closed stdout, so it is ending
            code = p.poll() if line else p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            code = None
        state = f"exit {code}" if code is not None else "still running"
        state += f"; killed after agent_timeout {self.timeout} s" if self.timed_out else ""
        self.logs[j].seek(0)
        raise RuntimeError(f"agent {j} ({self.program}) failed ({state}), its last "
                           f"line {line.rstrip(chr(10))!r} is no `done SESSION RETURN` of its jobs; its stderr: "
                           f"{self.logs[j].read()[-2000:]}")  # fmt: skip

    def close(self) -> None:
        for p in self.procs:
            p.kill()
            p.wait()


def main() -> None:
    """`python agent_pool.py`: two processes of a stand-in agent (it returns seed / 10 for each job) play 4 jobs."""
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write("import sys\nfor job in sys.stdin:\n    seed, s, _ = job.strip().split(':')\n"
                "    print('done', s, int(seed) / 10, flush=True)\n")  # fmt: skip
    pool = AgentPool(f.name, 2, [], timeout=60)
    try:
        print(pool.play([(seed, f"s{seed}") for seed in range(4)], "train"))
    finally:
        pool.close()
        os.unlink(f.name)


if __name__ == "__main__":
    main()
