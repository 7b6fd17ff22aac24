"""Model output executed safely: a shell command isolated as far as an unprivileged process can be, and arithmetic.

    python sandbox.py                      # a few hostile commands, each contained, and what each printed

`run(command, workspace, limits, uid)` -> `Result(output, exit_code, timed_out, capped, seconds)`: one untrusted
shell command in a per-episode workspace. envs.ShellEnv calls it once per action; nothing else in the project runs
a shell. `safe_calc(expr)`: the calculator tool's value of an expression by a recursive-descent parser, never eval.

How a command runs (every step a plain util-linux tool, so a reader can replay it by hand):
1. `setpriv --reuid=U --regid=U --clear-groups`: as root (developers, CI) the command drops to an unprivileged uid
   of its own, one per episode (`uid_for`), so RLIMIT_NPROC, which the kernel ignores for root, bounds its processes;
   run as a normal user, it keeps that user's uid (RLIMIT_NPROC then counts the user's other processes too).
2. `unshare --user --map-root-user --net --pid --fork --mount --kill-child`: new user, network, pid and mount
   namespaces. The network namespace has only a loopback interface that is down: no socket reaches any host
   address (127.0.0.1 included). When the namespace's pid 1 (step 3's shell) exits or is killed, the kernel kills
   everything the command started; --kill-child kills pid 1 when unshare dies.
3. `SETUP` (a sh script inside the namespaces) builds a new root on a 1 MiB tmpfs: /usr bind-mounted read-only (and
   the /bin, /lib, /lib64, /sbin symlinks of a merged-/usr system), /dev/null, /dev/zero, /dev/urandom, a fresh
   /proc of the pid namespace, an empty /etc, a private 16 MiB /tmp, and at /work a copy of the workspace on a tmpfs
   of `workspace_bytes` and `workspace_files` inodes: a command that writes more gets "No space left on device"
   while it runs (the host's disk never holds more than that per episode). It `pivot_root`s into the new root,
   detaches the old one and remounts / read-only. The setup shell stays pid 1 (the kernel spares a namespace's init
   the signals it has no handler for) and keeps the host's workspace mounted for step 5.
4. The command runs as pid 1's child, in a mount namespace of its own where only the copy is left (the host's
   workspace unmounted), under `prlimit`: RLIMIT_CPU (seconds of CPU), RLIMIT_AS (bytes of address space),
   RLIMIT_FSIZE (bytes per written file), RLIMIT_NOFILE (open files), RLIMIT_NPROC (processes of that uid),
   inherited by everything it starts (not by the setup's own copying). `setpriv` drops every capability and sets
   no_new_privs before `sh -c COMMAND` runs in /work.
5. When the command exits, pid 1 kills what it left running, copies /work back over the workspace (so files carry
   over to the episode's next command) and exits with the command's status, 128 + N for signal N. The caller reads
   stdout and stderr (merged) up to `output_cap` bytes and waits at most `wall_s` seconds (the copy back included);
   past either it kills the process group (the namespace goes with it, and the command's changes to the workspace
   with it: a killed command leaves the workspace as it found it). The command never sees the caller's stdin. A
   setup that failed (its output lacks the random line SETUP prints just before the command) raises SandboxError
   with what the failing step printed: a broken sandbox never looks like a command's wrong answer. A copy back that
   failed exits 70 (EX_SOFTWARE) if the command had succeeded.

What it isolates: the host's files (only /usr, read-only, and a copy of the workspace are visible; /root, /home,
/tmp and the project are not there); writes outside the workspace; the network; other processes (pid namespace);
runaway CPU, memory, file size, disk bytes and inodes, open files, process count, wall time and output.
What it does NOT isolate (say so before you trust it with more): the kernel itself (a kernel exploit escapes; use a
VM or gVisor for that); /usr is readable (any installed program can run); /proc shows host-wide kernel facts
(cpuinfo, meminfo, uptime); the tmpfs pages of /work and /tmp are memory that no cgroup bounds, nor memory across
its processes (RLIMIT_AS is per process, RLIMIT_NPROC bounds their number); timing side channels. Needs
unprivileged user namespaces (`unshare -Ur true` must work); `check_available()` says why when it does not, and
nothing runs unsandboxed.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from cli import check_fields

# Steps 3-5 inside the namespaces: $1 = the (empty, host-side) directory the new root is mounted on, $2 = the
# workspace, $3 = the command, $4 = a fresh random line, printed by the restricted shell just before it runs the
# command, $5 and $6 = the bytes and inodes of the workspace's tmpfs, $7 = prlimit's options. `set -e`: a failing step
# (setpriv's included) stops before the line is printed, and run() raises SandboxError, never a wrong answer. Its
# stdin is the pipe of its report to run() (the command's is /dev/null): the command's status, then "copied".
SETUP = r"""
set -e
R=$1 W=$2
mount -t tmpfs -o size=1m,mode=755 tmpfs "$R"
cd "$R"
mkdir usr etc dev proc work tmp .old .host
for d in bin lib lib64 sbin; do if [ -L /$d ]; then ln -s usr/$d $d; fi; done
mount --rbind -o ro /usr usr
touch dev/null dev/zero dev/urandom
for f in null zero urandom; do mount --bind /dev/$f dev/$f; done
mount -t proc proc proc
mount --bind "$W" .host
mount -t tmpfs -o "size=$5,nr_inodes=$6,mode=700" tmpfs work
cp -dR --preserve=mode,timestamps,links .host/. work/
mount -t tmpfs -o size=16m,nr_inodes=4096 tmpfs tmp
/usr/sbin/pivot_root . .old
umount -l /.old
mount -o remount,bind,ro /
cd /work
set +e
unshare --mount sh -c 'umount -l /.host && exec "$@"' sh prlimit $7 -- \
    setpriv --inh-caps=-all --bounding-set=-all --no-new-privs sh -c 'echo "$0"; exec sh -c "$1"' "$4" "$3" </dev/null
code=$?
echo "$code" >&0
kill -9 -1 2>/dev/null
cd /
{ find /.host -mindepth 1 -maxdepth 1 -exec rm -rf {} + && cp -dR --preserve=mode,timestamps,links /work/. /.host/ &&
  chmod -R go-w /.host; } >&0 2>&0
echo copied >&0
exit $code
"""
ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/work", "LANG": "C", "LC_ALL": "C"}
SETUP_S = 30.0  # seconds the namespaces and the new root may take to stand (a loaded host); wall_s starts after
UID_BASE = 100_000  # uid_for: 100000 + 1024 * (pid % 2048) + slot, below 2**31 and clear of system users


@dataclass
class Limits:
    """What one command may use (the shell environment's config carries one)."""

    wall_s: float = 5.0  # seconds of wall clock, then the process group is killed
    cpu_s: int = 2  # RLIMIT_CPU per process
    memory_bytes: int = 512 << 20  # RLIMIT_AS per process
    file_bytes: int = 1 << 20  # RLIMIT_FSIZE: largest file it may write
    open_files: int = 64  # RLIMIT_NOFILE
    processes: int = 32  # RLIMIT_NPROC of its uid (as root: the episode's own uid)
    output_cap: int = 4096  # bytes of stdout + stderr kept; past it the command is killed
    workspace_bytes: int = 4 << 20  # the workspace's tmpfs while the command runs: bytes (in 4 KiB pages) ...
    workspace_files: int = 4096  # ... and inodes (files, folders, links; the workspace's own folder is one)

    def __post_init__(self):
        rlimits = ("cpu_s", "memory_bytes", "file_bytes", "open_files", "processes", "output_cap")
        rlimits += ("workspace_bytes", "workspace_files")
        check_fields(self, {"(0.0, inf)": ("wall_s",), "[1, inf)": rlimits})

    def capped(self, ceiling: float) -> Limits:
        """These limits, or a ValueError naming those over `ceiling` times the defaults (envs.ShellConfig.capped)."""
        if over := [k for k, v in vars(self).items() if v > ceiling * getattr(Limits, k)]:
            raise ValueError(f"sandbox limits {over} over {ceiling}x the defaults (ServiceArgs.limit_ceiling)")
        return self


@dataclass
class Result:
    """What one command did."""

    output: str  # stdout and stderr merged, at most output_cap bytes, decoded (invalid bytes replaced)
    exit_code: int  # the command's exit status; -9 when killed (timed out, or over the output cap)
    timed_out: bool  # killed at wall_s
    capped: bool  # killed at output_cap bytes of output
    seconds: float  # wall clock


_slots, _slots_lock = set(), threading.Lock()


def uid_for(slot: int) -> int:
    """The unprivileged uid of slot `slot` (< 1024) of this process: episodes of one server never share one, and two
    servers on one host do not collide unless their pids agree modulo 2048."""
    if not 0 <= slot < 1024:
        raise ValueError(f"sandbox slot {slot} out of range [0, 1024)")
    return UID_BASE + 1024 * (os.getpid() % 2048) + slot


def take_uid() -> int | None:
    """A free uid for a new episode (None when not root: the command keeps the caller's uid); give it back with
    `release_uid` when the episode ends."""
    if os.geteuid() != 0:
        return None
    with _slots_lock:
        slot = next((s for s in range(1024) if s not in _slots), None)
        if slot is None:
            raise RuntimeError("sandbox: 1024 episodes are open in this process; close some (env.close())")
        _slots.add(slot)
    return uid_for(slot)


def release_uid(uid: int | None) -> None:
    """Give an episode's uid back (kill whatever of it still runs first: nothing outlives its command anyway)."""
    if uid is not None:
        with _slots_lock:
            _slots.discard((uid - UID_BASE) % 1024)


@functools.cache  # one probe per process: every ShellEnv checks at construction
def check_available() -> None:
    """Raise RuntimeError naming what is missing when commands cannot be sandboxed on this machine."""
    if sys.platform != "linux":
        raise RuntimeError(f"the shell sandbox needs Linux namespaces; this is {sys.platform}")
    missing = [t for t in ("prlimit", "unshare", "setpriv", "mount") if shutil.which(t) is None]
    if missing or not os.path.exists("/usr/sbin/pivot_root"):
        raise RuntimeError(f"the shell sandbox needs util-linux's {missing or ['/usr/sbin/pivot_root']}")
    probe = subprocess.run(["unshare", "--user", "--map-root-user", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        raise RuntimeError(
            f"the shell sandbox needs unprivileged user namespaces: `unshare -Ur true` failed: {probe.stderr.strip()}"
            " (sysctl user.max_user_namespaces > 0; in a container: allow the unshare and mount syscalls)"
        )


def prepare_workspace(workspace: str, uid: int | None, files: dict[str, str] | None = None) -> str:
    """Create the workspace with `files` ({relative path: text}) in it and its new-root mount point beside it (all
    owned by uid); returns the mount point. Every folder above them must be searchable by others (mode o+x), or the
    command's uid could not reach them."""
    os.makedirs(workspace, exist_ok=True)
    for path, text in (files or {}).items():
        os.makedirs(os.path.join(workspace, os.path.dirname(path)), exist_ok=True)
        with open(os.path.join(workspace, path), "w") as fh:
            fh.write(text)
    parent = os.path.dirname(os.path.abspath(workspace))
    while uid is not None and parent != "/":
        if not os.stat(parent).st_mode & 0o001:
            raise PermissionError(
                f"sandbox: {parent} is not searchable by others (chmod o+x), so the workspace "
                f"{workspace} is out of reach of the sandbox's uid {uid}"
            )
        parent = os.path.dirname(parent)
    root = workspace.rstrip("/") + ".root"
    os.makedirs(root, exist_ok=True)
    os.chmod(root, 0o755)
    if uid is not None:
        for dirpath, dirs, files in os.walk(workspace):
            for name in [dirpath] + [os.path.join(dirpath, n) for n in dirs + files]:
                os.chown(name, uid, uid, follow_symlinks=False)
    return root


def remove_workspace(workspace: str) -> None:
    """Delete a workspace and its mount point: shutil.rmtree (fd-based: never through a symlink the command planted),
    and where that fails (a folder it made 000, a tree deeper than Python's recursion) chmod -R + rm -rf, iterative;
    RuntimeError if anything is left."""
    for path in (workspace, workspace.rstrip("/") + ".root"):
        if shutil.rmtree.avoids_symlink_attacks and not os.path.islink(path):  # the common case, without a process
            with contextlib.suppress(OSError, RecursionError):  # what is left, the fallback removes (or raises)
                shutil.rmtree(path)
        if os.path.lexists(path):
            subprocess.run(["chmod", "-R", "u+rwx", path], capture_output=True)  # a folder the command made 000
            done = subprocess.run(["rm", "-rf", "--one-file-system", path], capture_output=True, text=True)
            if done.returncode or os.path.lexists(path):
                raise RuntimeError(f"sandbox: could not remove {path}: {done.stderr.strip()}")


def run(command: str, workspace: str, limits: Limits, uid: int | None = None) -> Result:
    """Run `command` with `sh -c` in `workspace` (seen as /work) under steps 1-5 of the module docstring."""
    root = workspace.rstrip("/") + ".root"
    if not os.path.isdir(root):
        raise FileNotFoundError(f"sandbox: {root} is missing; call prepare_workspace({workspace!r}, uid) first")
    L = limits
    ready = os.urandom(8).hex().encode() + b"\n"  # SETUP's last line before the command (its $4)
    rlimits = {
        "cpu": L.cpu_s,
        "as": L.memory_bytes,
        "fsize": L.file_bytes,
        "nofile": L.open_files,
        "nproc": L.processes,
    }
    namespaces = ["--user", "--map-root-user", "--net", "--pid", "--fork", "--mount", "--kill-child"]
    tmpfs = [str(L.workspace_bytes), str(L.workspace_files), " ".join(f"--{k}={v}" for k, v in rlimits.items())]
    setup = [SETUP, "sandbox", root, os.path.abspath(workspace), command, ready.decode()[:-1], *tmpfs]  # $0 .. $7
    argv = ["unshare", *namespaces, "sh", "-c", *setup]
    if uid is not None:  # step 1 by setpriv, not Popen(user=): Popen can then vfork (a fork of a process holding
        argv = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--", *argv]  # torch costs ~20 ms)
    t0 = time.monotonic()
    report_r, report_w = os.pipe()  # SETUP's report (its stdin: the command never holds it)
    try:
        pipes = {"stdin": report_w, "stdout": subprocess.PIPE, "stderr": subprocess.STDOUT}
        p = subprocess.Popen(argv, **pipes, env=ENV, start_new_session=True, cwd="/")
    finally:
        os.close(report_w)
    out, report, timed_out, capped, started, ended = bytearray(), bytearray(), False, False, None, None
    poll, live = select.poll(), {p.stdout.fileno(), report_r}  # live: not at their end yet
    for f in live:  # (poll, not select(): a server holding many sockets has fds past select's 1024)
        poll.register(f, select.POLLIN)
    try:
        while p.stdout.fileno() in live:  # until the end of the output: pid 1 has exited
            now = time.monotonic()
            started = started or (now if out.startswith(ready) else None)  # wall_s counts from here to the
            ended = ended or (now if b"\n" in report else None)  # command's end; then SETUP_S for the copy back
            deadline = ended + SETUP_S if ended else started + L.wall_s if started else t0 + SETUP_S
            events = poll.poll(max(0.0, deadline - now) * 1000)
            if not events and time.monotonic() >= deadline:
                timed_out = not ended
                break
            for f, _ in events:
                chunk = os.read(f, 65536)
                (out if f == p.stdout.fileno() else report).extend(chunk)
                if not chunk:
                    poll.unregister(f)
                    live.discard(f)
            if not ended and b"\n" not in report and len(out) > L.output_cap + len(ready):
                capped = True
                break
    finally:  # the command's group dies here in every case (exited already: nothing left to kill)
        with_group_killed(p)
        report += read_to_end(report_r)
    if not out.startswith(ready):  # the setup failed, or did not finish, before the command started
        why = f"did not finish in {SETUP_S} s" if timed_out else f"failed (exit {p.returncode})"
        raise SandboxError(f"sandbox setup {why}: {out.decode('utf-8', 'replace')[:2000]!r}")
    out = out[len(ready) : len(ready) + L.output_cap]
    if timed_out or capped:  # killed before it ended: nothing was copied back
        return Result(out.decode("utf-8", "replace"), -9, timed_out, capped, time.monotonic() - t0)
    if not report.endswith(b"copied\n") or report.count(b"\n") != 2:  # it ended; its files did not all come back
        why = f"over {SETUP_S} s" if ended and time.monotonic() - ended >= SETUP_S else "failed"
        raise SandboxError(f"sandbox: copying the workspace back {why}: {report.decode('utf-8', 'replace')[:2000]!r}")
    code = int(report.split(b"\n")[0])
    return Result(out.decode("utf-8", "replace"), code, timed_out, capped, time.monotonic() - t0)


def read_to_end(fd: int) -> bytes:
    """What is left in a pipe once every writer is gone, and the pipe closed."""
    data = bytearray()
    while chunk := os.read(fd, 65536):
        data += chunk
    os.close(fd)
    return bytes(data)


class SandboxError(RuntimeError):
    """The sandbox could not be built for a command (a mount, pivot_root or setpriv failed): nothing ran."""


def with_group_killed(p: subprocess.Popen) -> None:
    """SIGKILL p's process group (unshare; --kill-child and the pid namespace take the rest), close, reap."""
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:  # already gone with its whole group
        pass
    p.stdout.close()
    p.wait()


# ----------------------------------------------------------------------------------------------
# The calculator's grammar: model output evaluated without eval (envs.CalculatorEnv's tool)


class CalcError(ValueError):
    """An expression the calculator refuses (bad character, too long, too deep, too large, not exact)."""


def safe_calc(expr: str, max_len: int = 24, max_abs: int = 10**9) -> int:
    """Integer value of `expr` (digits, + - * /, parentheses, spaces) by recursive descent; never eval/exec.

    Grammar: expr = term (("+" | "-") term)*; term = unary (("*" | "/") unary)*; unary = "-" unary | atom;
    atom = number | "(" expr ")". Division must be exact. Raises CalcError on anything else.
    """
    if len(expr) > max_len:
        raise CalcError(f"expression longer than {max_len} characters")
    if set(expr) - set("0123456789+-*/() "):
        raise CalcError("invalid characters")
    toks = re.findall(r"\d+|[-+*/()]", expr)
    pos = 0

    def peek():
        """The next token, not consumed (None at the end)."""
        return toks[pos] if pos < len(toks) else None

    def take():
        """Consume and return the next token."""
        nonlocal pos
        pos += 1
        return toks[pos - 1]

    def check(v: int) -> int:
        """v, unless it is larger than max_abs in magnitude."""
        if abs(v) > max_abs:
            raise CalcError(f"a value beyond {max_abs}")
        return v

    def expr_(depth: int) -> int:
        """expr := term (('+' | '-') term)*"""
        v = term(depth)
        while peek() in ("+", "-"):
            v = check(v + term(depth) if take() == "+" else v - term(depth))
        return v

    def term(depth: int) -> int:
        """term := unary (('*' | '/') unary)*, division exact only"""
        v = unary(depth)
        while peek() in ("*", "/"):
            op, w = take(), unary(depth)
            if op == "*":
                v = check(v * w)
            elif w == 0 or v % w:
                raise CalcError("division by zero or not exact")
            else:
                v //= w
        return v

    def unary(depth: int) -> int:
        """unary := '-' unary | number | '(' expr ')', nested at most 8 deep"""
        if depth > 8:
            raise CalcError("parentheses nested too deep")
        if peek() == "-":
            take()
            return -unary(depth + 1)
        t = take() if peek() is not None else None
        if t is None:
            raise CalcError("unexpected end of expression")
        if t == "(":
            v = expr_(depth + 1)
            if peek() != ")":
                raise CalcError("missing )")
            take()
            return v
        if not t.isdigit():
            raise CalcError(f"unexpected {t}")
        if len(t.lstrip("0")) > len(str(max_abs)):  # before int(): Python refuses to convert > 4300 digits
            raise CalcError(f"a value beyond {max_abs}")
        return check(int(t.lstrip("0") or "0"))

    value = expr_(0)
    if pos != len(toks):
        raise CalcError(f"unexpected {toks[pos]}")
    return value


def main() -> None:
    """Run a few hostile commands in a scratch workspace and print what each did."""
    import tempfile

    check_available()
    uid = take_uid()
    with tempfile.TemporaryDirectory() as tmp:
        os.chmod(tmp, 0o711)  # searchable, not listable: the sandbox's uid must reach its workspace
        ws = os.path.join(tmp, "work")
        prepare_workspace(ws, uid)
        reach = ["echo hello > a.txt; cat a.txt; id -u", "cat /etc/passwd; ls /root /tmp", "touch /usr/x"]
        hogs = ["f(){ f|f & }; f", "while :; do :; done", "yes", "head -c 2000000 /dev/zero > big"]
        hogs += ["for i in 1 2 3 4 5; do head -c 1000000 /dev/zero > $i; done", "seq 5000 | xargs touch"]  # disk
        for cmd in reach + hogs:
            r = run(cmd, ws, Limits(wall_s=1.0), uid)  # (the loop: wall_s before its 2 s of RLIMIT_CPU)
            flags = f"exit {r.exit_code:4} timed_out {r.timed_out!s:5} capped {r.capped!s:5}"
            print(f"{cmd!r:45} {flags} {r.seconds:5.2f}s  {r.output[:70]!r}")
        remove_workspace(ws)
    release_uid(uid)


if __name__ == "__main__":
    main()
