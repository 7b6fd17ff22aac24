"""Worker processes for the user's reward functions: every call under a timeout, the first failure stops the batch.

    python reward_workers.py     # two workers: a call that returns, then one that raises, hangs, exits, dies

rewards.RewardSet sends the calls of a user's reward functions here (`--reward-workers N`, N > 0). A reward function
is code the trainer does not control: it may hang (a network call, a solver), exit, or take its process down (a
segfault in a C extension, the OOM killer). Any of these must cost the run seconds and say what happened, not stall
it for the hours a batch of calls may take (128 calls x 60 s each, one at a time).

Implementation details (our choices)
1. Processes: `n` forkserver processes (fresh interpreters, not forks of a trainer holding threads and CUDA), each
   loading the reward files once, then running the calls sent on its own pipe, one at a time. The trainer keeps
   every worker busy with the next call as soon as it answers.
2. A call's timeout is kept twice. In the worker, SIGALRM interrupts the function where it is (a `Timeout` that is
   not an Exception, so a function's own `except Exception` cannot swallow it), and the answer names that line. In
   the trainer, a deadline of timeout + GRACE_S catches a call no signal interrupts (C code that never returns to
   the interpreter): its worker is killed.
3. The first failure stops the batch at once: an exception (the user's line that raised), a timeout, a `sys.exit`, a
   worker that died (its exit code, or the signal that killed it). The calls still running are abandoned, their
   workers killed, and `CallFailed` gives the failed call's index (the caller names the sample) and the cause. A
   worker found dead or killed is replaced when the next batch starts.
4. Ctrl-C is the trainer's: workers ignore SIGINT, and the trainer kills them when it stops (`close`).
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import multiprocessing
import os
import signal
import sys
import sysconfig
import time
import traceback
from multiprocessing.connection import wait
from pathlib import Path

GRACE_S = 5.0  # past its timeout, how long the trainer waits for a call's answer before killing its worker
START_TIMEOUT_S = 120  # a worker imports the main script (torch, transformers: ~10 s on 2 busy cores)


class CallFailed(Exception):
    """Call `index` of a batch failed: `why` says how (raised, timed out, exited, its worker died or was killed)."""

    def __init__(self, index: int, why: str):
        super().__init__(f"call {index} {why}")
        self.index, self.why = index, why


class Timeout(BaseException):
    """The per-call alarm (detail 2): not an Exception, so `except Exception: return 0.0` cannot swallow it."""


LIBRARIES = tuple({os.path.join(sysconfig.get_paths()[k], "") for k in ("stdlib", "platstdlib", "purelib", "platlib")})
_alarm = {"at": None}  # where the last alarm struck: a call that swallowed its Timeout (a bare except) still timed out


def on_alarm(signum, frame):
    """Raise Timeout naming the innermost line of the user's code it interrupts (not a library's line it called)."""
    stack = traceback.extract_stack(frame)
    theirs = [f for f in stack if not f.filename.startswith(LIBRARIES)] or stack
    _alarm["at"] = f"{theirs[-1].filename}:{theirs[-1].lineno} ({theirs[-1].line})"
    raise Timeout(_alarm["at"])


def call(fn, args: tuple, kwargs: dict, timeout: float | None) -> tuple[str, object]:
    """One call of a user's function: ("ok", value) or ("error", why). With a timeout, under SIGALRM (in a worker: the
    main thread of its process); an alarm between the return and the disarm counts as a timeout too, and so does one
    the function caught (`except:` or `except BaseException:`) before it returned."""
    _alarm["at"] = None
    try:
        if timeout is not None:
            signal.setitimer(signal.ITIMER_REAL, timeout)
        try:
            value = fn(*args, **kwargs)
        finally:
            if timeout is not None:
                signal.setitimer(signal.ITIMER_REAL, 0)
    except Timeout:
        pass
    except (Exception, SystemExit) as e:  # the line of the user's file that raised, or called sys.exit
        frame = traceback.extract_tb(e.__traceback__)[-1]
        what = f"called sys.exit({e.code!r})" if isinstance(e, SystemExit) else f"raised {e!r}"
        return "error", f"{what} at {frame.filename}:{frame.lineno} ({frame.line})"
    if _alarm["at"] is not None:
        return "error", f"timed out after {timeout} s (--reward-timeout), in {_alarm['at']}"
    return "ok", value


def load_function(spec: str, default: str = "compute_score"):
    """The function FN of FILE.py[:FN] (FN defaults to `default`), its file executed as a module of its own, as veRL's
    custom_reward_function loads it. A file that calls sys.exit when imported is named, with its line."""
    path, _, name = spec.partition(":")
    name = name or default
    if not Path(path).is_file():
        raise FileNotFoundError(f"--reward {spec!r}: file {path!r} does not exist")
    module_spec = importlib.util.spec_from_file_location(f"reward_{Path(path).stem}", path)
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except SystemExit as e:  # otherwise the trainer would just end, the file unnamed
        at = traceback.extract_tb(e.__traceback__)[-1]
        why = f"called sys.exit({e.code!r}) at line {at.lineno} ({at.line}) when imported"
        raise RuntimeError(f"--reward {spec!r}: {path} {why}: a reward file may only define things at import") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        found = [k for k, v in vars(module).items() if inspect.isfunction(v) and v.__module__ == module.__name__]
        raise AttributeError(f"--reward {spec!r}: {path} has no function {name!r} (functions there: {found})")
    return fn


def serve(conn, specs: list[str]) -> None:
    """A worker's life: load each spec's function, then answer calls until the pipe closes. A call arrives as (spec,
    args, kwargs, timeout) and is answered with call()'s pair. Its own session: a kill takes what it started too."""
    os.setsid()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # detail 4
    signal.signal(signal.SIGALRM, on_alarm)
    fns = {spec: load_function(spec) for spec in specs}
    conn.send(("ready", None))
    while True:
        try:
            spec, args, kwargs, timeout = conn.recv()
        except EOFError:  # the trainer closed its end: done
            return
        status, value = call(fns[spec], args, kwargs, timeout)
        try:
            conn.send((status, value))
        except Exception as e:  # a value that does not pickle
            conn.send(("error", f"returned a value that cannot be sent back ({e!r}): return a float"))


def death(code: int | None) -> str:
    """How a process ended, from its exit code (negative: the signal that killed it)."""
    if code is not None and code < 0:
        name = signal.Signals(-code).name if -code in signal.valid_signals() else f"{-code}"  # (a real-time one)
        return f"was killed by signal {name}" + (" (the OOM killer?)" if code == -9 else "")
    return f"exited with code {code}"


class Workers:
    """`n` worker processes for the functions of `specs` (FILE.py[:FN]); `run` a batch of calls on them."""

    def __init__(self, specs: list[str], n: int, timeout: float):
        self.specs, self.timeout = specs, timeout
        self.ctx = multiprocessing.get_context("forkserver")
        self.procs = [None] * n  # (process, the trainer's end of its pipe), None: to be (re)started
        self.start_missing()

    def start_missing(self) -> None:
        """Start the workers not running (all at first, those killed or found dead later), and wait until each
        has loaded the reward files."""
        new = []
        for k, slot in enumerate(self.procs):
            if slot is not None and not slot[0].is_alive():
                print(f"[minrl] reward worker {k} {death(slot[0].exitcode)} between calls: replaced", file=sys.stderr)
                self.kill(k)
            if self.procs[k] is None:
                here, there = self.ctx.Pipe()
                proc = self.ctx.Process(target=serve, args=(there, self.specs), daemon=True)
                proc.start()
                there.close()
                self.procs[k], new = (proc, here), [*new, k]
        for k in new:
            proc, conn = self.procs[k]
            try:
                ready = conn.poll(START_TIMEOUT_S) and conn.recv() == ("ready", None)
            except (EOFError, OSError):
                proc.join(5)
                self.close()
                raise RuntimeError(f"reward worker {k} {death(proc.exitcode)} while loading {self.specs}") from None
            if not ready:
                self.close()
                why = "a script that builds a RewardSet must run its work under `if __name__ == '__main__':`"
                raise RuntimeError(
                    f"the reward workers did not start within {START_TIMEOUT_S} s: {why} (worker processes "
                    f"import it), or pass --reward-workers 0"
                )

    def run(self, jobs: list[tuple[str, tuple, dict]]) -> list:
        """The value of each (spec, args, kwargs) call, in order; CallFailed at the first failure (detail 3)."""
        self.start_missing()
        results, todo, busy = [None] * len(jobs), list(range(len(jobs)))[::-1], {}  # busy: worker -> (call, deadline)
        try:
            while todo or busy:
                for k in [k for k in range(len(self.procs)) if k not in busy][: len(todo)]:
                    i = todo.pop()
                    busy[k] = (i, time.monotonic() + self.timeout + GRACE_S)
                    try:
                        self.procs[k][1].send((*jobs[i], self.timeout))
                    except OSError:  # it died since the batch started
                        raise self.lost(k, busy.pop(k)[0]) from None
                pipes = {self.procs[k][1]: k for k in busy}
                ends = {self.procs[k][0].sentinel: k for k in busy}  # ready once the process has ended
                first = min(deadline for _, deadline in busy.values())
                for ready in wait([*pipes, *ends], timeout=max(0.0, first - time.monotonic())):
                    if (k := pipes.get(ready, ends.get(ready))) not in busy:
                        continue  # its answer and its end were both ready: answered
                    i, pipe = busy.pop(k)[0], self.procs[k][1]
                    try:  # (an ended worker with nothing sent: lost, even if a child of it holds the pipe open)
                        status, value = pipe.recv() if pipe.poll(0) else (None, None)
                    except (EOFError, OSError):  # ended without an answer
                        status = None
                    if status is None:
                        raise self.lost(k, i)
                    if status == "error":
                        raise CallFailed(i, value)
                    results[i] = value
                for i, deadline in busy.values():
                    if time.monotonic() > deadline:
                        raise CallFailed(
                            i,
                            f"did not return within --reward-timeout {self.timeout} s + {GRACE_S} s: its alarm "
                            f"did not stop it (C code that never returns to Python?), so its worker was killed",
                        )
        except CallFailed:
            for k in busy:  # still running someone's call: killed, replaced at the next batch
                self.kill(k)
            raise
        return results

    def lost(self, k: int, i: int) -> CallFailed:
        """Worker k ended during call i: its slot emptied, and the CallFailed that says how (exit code, signal)."""
        proc = self.procs[k][0]
        proc.join(5)
        self.kill(k)
        return CallFailed(i, f"lost its worker process, which {death(proc.exitcode)}")

    def kill(self, k: int) -> None:
        """Kill worker k and what it started (its session's process group)."""
        if self.procs[k] is not None:
            proc, conn = self.procs[k]
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.kill()  # (if it died before its setsid)
            proc.join(5)
            conn.close()
            self.procs[k] = None

    def close(self) -> None:
        """Kill every worker (a hung reward function must not keep the run alive)."""
        for k in range(len(self.procs)):
            self.kill(k)


def main() -> None:
    """Two workers run a batch that succeeds, then one batch per way a reward function can fail."""
    import tempfile

    source = """import os, sys, time
def ok(solution_str): return float(len(solution_str))
def raises(solution_str): return 1 / 0
def hangs(solution_str): time.sleep(3600)
def exits(solution_str): sys.exit(3)
def dies(solution_str): os.kill(os.getpid(), 9)
"""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp, "rewards_demo.py")
        path.write_text(source)
        specs = [f"{path}:{fn}" for fn in ("ok", "raises", "hangs", "exits", "dies")]
        workers = Workers(specs, n=2, timeout=2.0)
        try:
            print("ok:", workers.run([(specs[0], (), {"solution_str": "x" * n}) for n in range(6)]))
            for spec in specs[1:]:
                t0 = time.perf_counter()
                try:
                    workers.run([(spec, (), {"solution_str": "x"})] * 6)
                except CallFailed as e:
                    print(f"{spec.split(':')[1]}: {time.perf_counter() - t0:.1f} s, call {e.index} {e.why}")
        finally:
            workers.close()


if __name__ == "__main__":
    main()
