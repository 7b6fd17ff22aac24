"""How far a config object travels: stops, files and climbs back up from a start function (stdlib ast only).

    python bench/cfg_trace.py ppo_minimal.py:train
    python bench/cfg_trace.py trainer.py:train --verbose

Start at FILE:FUNC, whose parameter `cfg` (--param) is the config. A *stop* is a call site in a traced function
where a name bound to the config is an argument (positional or keyword; `partial(f, cfg, ...)` too) of a function
of the repository's top-level .py files: one of the same module, `module.func`, `from module import func` (re-exports
followed), `Class.method` (`MetricsLogger.of(cfg)`), `Class(cfg)` (a stop at `Class.__init__`). Every call site
counts; each callee is traced once, the config bound to the parameters the call fills (none, as for `*args` or a
class without `__init__`: a stop, not traced); nested functions and lambdas count for the function holding them.
*Files*: the distinct files of the callees, plus the start file. *Climbs back up*: stops whose callee's module
imports the caller's, directly or transitively (lazy imports in functions too; also printed: module-level imports
only). A statically resolved call goes through the caller's import of the callee's module, so a climb needs an
import cycle: with an import DAG it is 0 by construction. Not seen (dynamic): a climb through a function object
passed down (callback, hook, `repro.planted` patching trainer's functions), the config as an attribute
(`self.cfg`), renamed or in a container, or passed to an object's method (`mb.micro_batches(cfg)`).
"""

from __future__ import annotations

import argparse
import ast
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FUNCS = (ast.FunctionDef, ast.AsyncFunctionDef)


def load(root: Path) -> dict:
    """module -> {"defs": {qualname: def}, "names": {local: (module, name)}, "mods": {alias: module}, "imports":
    repo modules imported anywhere, "top": at module level} for every top-level .py file of the repository."""
    files = {p.stem: ast.parse(p.read_text(), str(p)) for p in sorted(root.glob("*.py"))}
    out = {}
    for mod, tree in files.items():
        m = out[mod] = {"defs": {}, "names": {}, "mods": {}, "imports": set(), "top": set()}
        for node in tree.body:  # functions, classes, and the methods of classes as Class.method
            for f in [node, *(node.body if isinstance(node, ast.ClassDef) else [])]:
                if isinstance(f, (*FUNCS, ast.ClassDef)):
                    m["defs"][f.name if f is node else f"{node.name}.{f.name}"] = f
        lazy = {id(n) for f in ast.walk(tree) if isinstance(f, (*FUNCS, ast.Lambda)) for n in ast.walk(f)}
        for node in ast.walk(tree):
            found = set()
            if isinstance(node, ast.Import):
                found = {a.name for a in node.names if a.name in files}
                m["mods"].update({a.asname or a.name: a.name for a in node.names if a.name in found})
            elif isinstance(node, ast.ImportFrom) and node.module in files and not node.level:
                found = {node.module}
                m["names"].update({a.asname or a.name: (node.module, a.name) for a in node.names})
            m["imports"] |= found
            m["top"] |= set() if id(node) in lazy else found
    return out


def resolve(mods: dict, mod: str, func: ast.expr) -> tuple[str, str] | None:
    """(module, qualname) of the repository function or class a call's func expression names, else None."""
    if isinstance(func, ast.Name):
        target = (mod, func.id) if func.id in mods[mod]["defs"] else mods[mod]["names"].get(func.id)
    elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
        base = func.value.id
        if base in mods[mod]["mods"]:
            target = (mods[mod]["mods"][base], func.attr)
        else:
            cls = (mod, base) if base in mods[mod]["defs"] else mods[mod]["names"].get(base)
            target = cls and (cls[0], f"{cls[1]}.{func.attr}")
    else:
        return None
    for _ in range(5):  # follow re-exports (`from a import f` in b, then `from b import f`)
        if not target or target[1] in mods[target[0]]["defs"]:
            return target
        target = mods[target[0]]["names"].get(target[1])
    return None


def bound(mods: dict, callee: tuple, pos: list, kws: list) -> tuple[tuple, tuple]:
    """(traced function key, the parameters the config binds to: none where it cannot be traced)."""
    node = mods[callee[0]]["defs"][callee[1]]
    if isinstance(node, ast.ClassDef):
        callee = (callee[0], f"{callee[1]}.__init__")
        if (node := mods[callee[0]]["defs"].get(callee[1])) is None:
            return callee, ()
    params = [a.arg for a in node.args.posonlyargs + node.args.args]
    if "." in callee[1] and "staticmethod" not in {getattr(d, "id", "") for d in node.decorator_list}:
        params = params[1:]  # self or cls
    named = set(params) | {a.arg for a in node.args.kwonlyargs}
    return callee, tuple(params[i] for i in pos if i < len(params)) + tuple(k for k in kws if k in named)


def trace(mods: dict, start: tuple[str, str], param: str) -> list[dict]:
    """Every stop reachable from `start` (config bound to `param`); "via": the start's callee whose chain holds it."""
    stops, queue, via = [], [(start, (param,))], {start: None}
    while queue:
        (mod, qual), names = queue.pop(0)
        calls = [n for n in ast.walk(mods[mod]["defs"][qual]) if isinstance(n, ast.Call)]
        for call in sorted(calls, key=lambda n: (n.lineno, n.col_offset)):
            func, args = call.func, call.args
            if getattr(func, "id", getattr(func, "attr", "")) == "partial" and args:
                func, args = args[0], args[1:]
            pos = [i for i, a in enumerate(args) if isinstance(a, ast.Name) and a.id in names]
            kws = [k.arg for k in call.keywords if isinstance(k.value, ast.Name) and k.value.id in names]
            if not (pos or kws) or not (callee := resolve(mods, mod, func)):
                continue
            key, params = bound(mods, callee, pos, kws)
            stops.append({"caller": (mod, qual), "callee": key, "line": call.lineno, "traced": bool(params)})
            stops[-1]["via"] = via[(mod, qual)] or key
            if params and key not in via and key[1] in mods[key[0]]["defs"]:
                via[key] = stops[-1]["via"]
                queue.append((key, params))
    return stops


def reaches(mods: dict, src: str, dst: str, kind: str = "imports") -> bool:
    """Whether module src imports dst, directly or transitively (kind "top": module-level imports only)."""
    todo, seen = [src], set()
    while todo:
        new = mods[todo.pop()][kind] - seen
        seen |= new
        todo += new
    return dst in seen


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("start", help="FILE:FUNC, e.g. trainer.py:train")
    p.add_argument("--param", default="cfg", help="the start function's config parameter")
    p.add_argument("--verbose", action="store_true", help="list every stop (caller -> callee, file:line)")
    args = p.parse_args(argv)
    file, func = args.start.split(":")
    mods, start = load(ROOT), (Path(file).stem, func)
    stops = trace(mods, start, args.param)
    files = {start[0]} | {s["callee"][0] for s in stops}
    up = lambda s, k="imports": s["caller"][0] != s["callee"][0] and reaches(mods, s["callee"][0], s["caller"][0], k)
    if args.verbose:
        for s in stops:
            note = (" CLIMB" if up(s) else "") + ("" if s["traced"] else " (not traced)")
            print(f"  {'.'.join(s['caller'])} -> {'.'.join(s['callee'])}  {s['caller'][0]}.py:{s['line']}{note}")
        chains = Counter(".".join(s["via"]) for s in stops).most_common()
        print("  stops by chain (the start's callee):", ", ".join(f"{k} {n}" for k, n in chains))
    climbs = [sum(up(s, k) for s in stops) for k in ("imports", "top")]
    cycles = " ".join(m for m in mods if reaches(mods, m, m)) or "none"
    print(
        f"{args.start}: {len(stops)} stops, {len(files)} files, {climbs[0]} climbs back up ({climbs[1]} counting"
        f" module-level imports only)\n  files: {' '.join(sorted(f + '.py' for f in files))}; repo modules in"
        f" import cycles: {cycles}"
    )


if __name__ == "__main__":
    main()
