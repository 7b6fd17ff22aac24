"""A command line from a dataclass, and the one way config values are validated (torch-free: every file uses it).

- `parse_config(Config)`: `--help` lists every field once, grouped by the Args class that declares it (the classes
  named in `Config.help_first` first), with its default; the string literal under each field is its help.
  `--field-name`, `--field_name`, `--no-flag` all work; "none" is None for an optional field.
- `check_fields`, `check_range`, `check_choice`: raise ValueError naming the field, its value and what is allowed.
- `choose_threads()`, run by parse_config: torch's CPU threads, as many as the cores other processes leave free,
  unless OMP_NUM_THREADS says how many.
- `sigterm_as_ctrl_c()`: SIGTERM raises KeyboardInterrupt, so that an entry point cleans up on `kill` as on Ctrl-C.

    python cli.py --steps 3 --name run_a --tags x y   # a small dataclass parsed and validated, then printed
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import math
import os
import re
import shutil
import signal
import sys
import textwrap
import threading
import time
import types
import typing
from pathlib import Path
from typing import Literal


def field_docs(cls) -> dict[str, str]:
    """Map field name -> the string literal written right under it in the class body."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__[:-1]):  # base classes first, so subclasses override
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):  # defined in a notebook / REPL: no source to read
            continue
        body = tree.body[0].body
        for node, nxt in zip(body, body[1:]):
            if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr):
                if isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
                    docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _parser_for(tp):
    """(argparse type, choices, nargs) for a field annotation."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Literal:
        return type(args[0]), list(args), None
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        base, choices, nargs = _parser_for(inner[0])
        if choices and "none" in choices:  # "none" is a choice of its own; None stays the unset default
            return base, choices, nargs
        return (lambda s: None if s.lower() == "none" else base(s)), choices and [*choices, None], nargs  # "none"
    if origin in (list, tuple):
        return args[0], None, "*"
    return tp, None, None


class _ListFlag(argparse.Action):
    """A list field: `--x a b` and `--x a --x b` both give [a, b] (the default is replaced, never extended)."""

    def __call__(self, parser, namespace, values, option_string=None):
        so_far = getattr(namespace, self.dest)
        setattr(namespace, self.dest, ([] if so_far is self.default else list(so_far)) + list(values))


def _blurb(text: str, width: int) -> str:
    """Paragraphs filled to `width`; an indented one (example commands) kept as written."""
    paras = [p for p in text.strip("\n").split("\n\n") if p.strip()]
    return "\n\n".join(p if p.startswith("    ") else textwrap.fill(" ".join(p.split()), width) for p in paras)


class _Format(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Each flag's default after its help; descriptions printed as _blurb laid them out."""


def parse_config(cls, argv: list[str] | None = None, description: str | None = None, epilog: str | None = None):
    """Build `cls` (a dataclass) from command-line flags; `--help` lists every field once, with its default: one
    group per Args class, the names in `cls.help_first` first (the everyday ones), then the others in MRO order.
    Without a `description`, the module docstring's first paragraph and its example commands describe it."""
    hints, docs = typing.get_type_hints(cls), field_docs(cls)
    width = max(40, min(shutil.get_terminal_size().columns, 100) - 2)  # a tty may report 0 columns
    paras = (inspect.getdoc(sys.modules[cls.__module__]) or "").split("\n\n")
    doc = description or "\n\n".join(paras[:1] + [e for e in paras[1:2] if e.startswith("    ")])
    fields, seen = [f for f in dataclasses.fields(cls) if f.init], set()
    short = "%(prog)s [-h] [--FLAG VALUE ...]   (flags below, grouped by concern)" if len(fields) > 12 else None
    p = argparse.ArgumentParser(usage=short, description=_blurb(doc, width), epilog=epilog, formatter_class=_Format)
    order = [k for k in cls.__mro__ if dataclasses.is_dataclass(k)]
    first = getattr(cls, "help_first", ())
    for klass in sorted(order, key=lambda k: first.index(k.__name__) if k.__name__ in first else len(first)):
        about = inspect.getdoc(klass)  # @dataclass writes its signature there when a class has no docstring
        about = None if about == klass.__name__ + str(inspect.signature(klass)).replace(" -> None", "") else about
        about = about and _blurb(about, width - 2)
        group = p.add_argument_group(f"{klass.__name__} ({Path(inspect.getfile(klass)).name})", about)
        for f in [f for f in fields if f.name in vars(klass).get("__annotations__", {}) and f.name not in seen]:
            default, seen = f.default if f.default is not dataclasses.MISSING else f.default_factory(), seen | {f.name}
            kind = dict(zip(("type", "choices", "nargs"), _parser_for(hints[f.name])))
            if kind["choices"] and None in kind["choices"]:  # "none" on the command line, None in the config
                kind["metavar"] = "{" + ",".join(str(c) for c in kind["choices"] if c is not None) + ",none}"
            elif f.name.startswith("no_") and not kind["choices"]:  # a value, not the negation of a switch
                base = [t for t in (*typing.get_args(hints[f.name]), hints[f.name]) if t in (int, float, str)][0]
                kind["metavar"] = {int: "INT", float: "NUMBER", str: "TEXT"}[base]
            kind = {"action": argparse.BooleanOptionalAction} if hints[f.name] is bool else kind
            kind = {**kind, "action": _ListFlag} if kind.get("nargs") else kind
            help_ = docs.get(f.name, "").replace("%", "%%")  # argparse formats help strings with %
            group.add_argument(f"--{f.name.replace('_', '-')}", dest=f.name, default=default, help=help_, **kind)
    argv = sys.argv[1:] if argv is None else argv
    flag = re.compile(r"--(no-)?[a-z0-9_]+(=.*)?")  # --field-name, --no-field_name, --field_name=VALUE
    argv = [a.split("=")[0].replace("_", "-") + a[len(a.split("=")[0]) :] if flag.fullmatch(a) else a for a in argv]
    cfg = cls(**vars(p.parse_args(argv)))
    choose_threads()
    return cfg


def busy_cores(seconds: float = 0.2) -> float:
    """Cores that other processes keep busy now: the machine's busy CPU time over `seconds` (/proc/stat) less this
    process's own, in cores. 0.0 where /proc/stat is not there (not Linux)."""

    def machine_busy():  # seconds of CPU time spent working (not idle, not waiting on I/O), all cores together
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
        return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")

    try:
        busy0, own0, t0 = machine_busy(), sum(os.times()[:2]), time.monotonic()
    except (OSError, ValueError, IndexError):
        return 0.0
    time.sleep(seconds)
    busy, own = machine_busy() - busy0, sum(os.times()[:2]) - own0
    return max(0.0, (busy - own) / (time.monotonic() - t0))


def choose_threads() -> int | None:
    """Torch's CPU threads for this process, chosen once at start (every entry point passes here): as many as the
    cores other processes leave free, at least 1. Why: torch's threads spin while they wait for each other; on cores
    shared with busy processes a spinning thread holds the core its partner needs (bench/threads_bench.py: the
    default job 4.9x slower beside two busy processes with 2 threads, 1.5x with 1). An explicit OMP_NUM_THREADS
    always wins (a run is bitwise reproducible for a thread count; torchrun sets 1); a program without torch is left
    alone; a replay or a resume takes its run's count (keep_threads). Returns the number set, or None."""
    if "OMP_NUM_THREADS" in os.environ or "torch" not in sys.modules:
        return None
    torch = sys.modules["torch"]
    busy = busy_cores()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    n = max(1, min(torch.get_num_threads(), round(cores - busy)))
    if n < torch.get_num_threads():
        torch.set_num_threads(n)
        if os.environ.get("RANK", "0") == "0":
            why = f"other processes keep {busy:.1f} of the {cores} cores busy; OMP_NUM_THREADS=N sets it"
            print(f"[minrl] torch threads: {n} ({why})", file=sys.stderr, flush=True)  # a note: stdout is results
    return n


def keep_threads(saved: int | None, what: str) -> None:
    """Redo a run's work (a replay, a resume) with the torch threads it ran with, `saved` (its numbers depend on how
    reductions are split); with OMP_NUM_THREADS set and different, say that the last bits may differ."""
    torch = sys.modules.get("torch")
    if saved is None or torch is None or torch.get_num_threads() == saved:
        return
    if "OMP_NUM_THREADS" in os.environ:
        now = f"OMP_NUM_THREADS gives {torch.get_num_threads()}: the numbers may differ in their last bits"
        print(f"[minrl] {what} ran with {saved} torch threads, {now}", flush=True)
    else:
        torch.set_num_threads(saved)


def sigterm_as_ctrl_c() -> None:
    """SIGTERM (kill, systemd, docker stop) raises KeyboardInterrupt in the main thread, as Ctrl-C does: the entry
    point's `finally` blocks run (a server closes its sessions and their workspaces, a run writes its files)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.default_int_handler)


def json_refusal(e: Exception) -> str:
    """Why json.loads refused a text, in a few words: a JSONDecodeError's message and place, "nested too deep" (its C
    decoder recursing), or int()'s "Exceeds the limit (4300 digits) ..." for a longer integer literal."""
    return "nested too deep" if isinstance(e, RecursionError) else str(e).split(";")[0]


def check_range(name: str, value, lo=None, hi=None, *, lo_open: bool = False, hi_open: bool = False) -> None:
    """Raise ValueError naming the field unless lo <= value <= hi (bounds optional, open if asked)."""
    bad = value is None or (isinstance(value, float) and not math.isfinite(value))
    if lo is not None and not bad:
        bad = value <= lo if lo_open else value < lo
    if hi is not None and not bad:
        bad = value >= hi if hi_open else value > hi
    if bad:
        left = "(" if lo_open or lo is None else "["
        right = ")" if hi_open or hi is None else "]"
        span = f"{left}{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}{right}"
        raise ValueError(f"config field '{name}' = {value!r} is out of range: allowed {span}")


def check_choice(name: str, value, choices) -> None:
    """Raise ValueError naming the field unless value is one of choices."""
    if value not in choices:
        raise ValueError(f"config field '{name}' = {value!r}: must be one of {list(choices)}")


def check_fields(cfg, ranges: dict[str, tuple[str, ...]], owner: type | None = None) -> None:
    """Validate a config dataclass: each Literal-typed field that `owner` (default: cfg's class) declares itself
    against its choices, and each field named in `ranges` (an interval such as "(0, 1]" -> field names) against
    its interval. None passes wherever the annotation allows it. An Args class that Config inherits passes itself
    as `owner`: each class checks its own fields, once."""
    owner = owner or type(cfg)
    hints = typing.get_type_hints(owner)
    optional = {n for n, tp in hints.items() if type(None) in typing.get_args(tp)}
    for name in vars(owner).get("__annotations__", {}):
        literal = [t for t in (hints[name], *typing.get_args(hints[name])) if typing.get_origin(t) is Literal]
        if literal and not (getattr(cfg, name) is None and name in optional):
            check_choice(name, getattr(cfg, name), typing.get_args(literal[0]))
    for interval, names in ranges.items():
        lo, hi = (None if "inf" in x else float(x) if "." in x else int(x) for x in interval[1:-1].split(","))
        for name in names:
            if not (getattr(cfg, name) is None and name in optional):
                check_range(name, getattr(cfg, name), lo, hi, lo_open=interval[0] == "(", hi_open=interval[-1] == ")")


@dataclasses.dataclass
class Demo:
    """`python cli.py`: a command line from this dataclass (try --help, and --steps -1 for a refusal)."""

    steps: int = 10
    """Iterations (>= 1)."""
    name: str = "run"
    """A run's name."""
    tags: list[str] = dataclasses.field(default_factory=list)
    """Any number of words."""
    mode: Literal["fast", "exact"] = "fast"
    """One of two choices."""

    def __post_init__(self):
        check_fields(self, {"[1, inf)": ("steps",)})


def main(argv=None) -> None:
    print(parse_config(Demo, argv))


if __name__ == "__main__":
    main()
