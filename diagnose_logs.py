"""Reading a run's metrics (our JSONL, veRL's, CSV, TRL's trainer_state.json), other frameworks' names mapped to ours.

    python diagnose_logs.py runs/a/      # the rows as diagnose.py reads them (our names), and the names mapped

`iter_metrics(path)` streams one row per step (our names, 'step' set); `load_metrics` is its list; `to_ours` renames
one row's veRL / TRL keys; `verl_aliases` gives the trainer's TensorBoard and W&B veRL's names beside ours. diagnose.py
(the live diagnosis) reads runs through them. An unreadable file raises `InputError`, naming the file, the line and
what was expected.

Implementation details (our choices):
1. NAME_MAP maps veRL and TRL GRPOTrainer names onto ours (checked against veRL's metric_utils.py, ray_trainer.py,
   dp_actor.py, TRL's grpo_trainer.py); not TRL's PPOTrainer, whose objective/kl is a sum.
2. Unknown columns are an input error only when NO column is known (veRL logs hundreds we do not use). Numbers
   written as text ("0.5", "nan") are read.
3. Files are streamed (memory: one row, not the file). A step is a whole number, never below the previous one (a
   second run appended to the same file is an input error, not a silent merge).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
from pathlib import Path

from cli import json_refusal
from runlog import format_table

# (their name, our name), the first present wins (ours first). veRL: critic/rewards/mean = score - in-reward KL,
# actor/kl_loss = raw KL loss, training/rollout_probs_diff_* = |p_rollout - p_actor|; TRL GRPOTrainer from `reward` on.
NAME_MAP = (
    ("critic/score/mean", "rollout/reward_mean"), ("critic/score/max", "rollout/score_max"),
    ("critic/score/min", "rollout/score_min"), ("critic/rewards/mean", "rollout/reward_kl_mean"),
    ("critic/advantages/mean", "stats/adv_mean"), ("critic/advantages/max", "stats/adv_max"),
    ("critic/advantages/min", "stats/adv_min"), ("critic/returns/mean", "stats/return_mean"),
    ("critic/vf_explained_var", "critic/explained_var"), ("critic/vf_loss", "loss/value"),
    ("critic/grad_norm", "critic/grad_norm_0"), ("response_length/mean", "rollout/response_len"),
    ("response_length/clip_ratio", "rollout/truncated_frac"), ("actor/pg_clipfrac", "stats/clipfrac"),
    ("actor/ppo_kl", "stats/approx_kl"), ("actor/entropy", "stats/entropy"), ("actor/pg_loss", "loss/policy"),
    ("actor/grad_norm", "stats/grad_norm"), ("actor/kl_loss", "stats/kl"), ("actor/reward_kl_penalty", "stats/kl"),
    ("training/rollout_probs_diff_mean", "stats/rollout_vs_old_prob_diff"),
    ("training/rollout_probs_diff_max", "stats/rollout_vs_old_prob_diff_max"), ("reward", "rollout/reward_mean"),
    ("reward_std", "rollout/reward_std"), ("frac_reward_zero_std", "rollout/zero_std_frac"), ("kl", "stats/kl"),
    ("entropy", "stats/entropy"), ("clip_ratio/region_mean", "stats/clipfrac"),
    ("completions/clipped_ratio", "rollout/truncated_frac"), ("completions/mean_length", "rollout/response_len"),
    ("grad_norm", "stats/grad_norm"), ("loss", "loss/policy"), ("actor/lr", "stats/lr"), ("learning_rate", "stats/lr"),
    ("sampling/sampling_logp_difference/mean", "stats/rollout_vs_old_logp_diff"),
    ("stats/score_std", "rollout/reward_std"),  # our own name for it up to 2026-12 (one name per quantity now)
)  # fmt: skip
# what the trainer's TensorBoard and W&B get beside our names: veRL's (KL: its name depends on where the KL goes)
VERL_PREFIXES = ("critic/", "actor/", "response_length/", "training/")
VERL_ALIASES = {
    ours: theirs for theirs, ours in reversed(NAME_MAP) if theirs.startswith(VERL_PREFIXES) and ours != "stats/kl"
}
VERL_ALIASES.update({"stats/lr": "actor/lr", "time/rollout": "timing_s/gen", "time/reward": "timing_s/reward"})
# what logprob_mismatch reads; the threshold of stats/<x> is logprob_mismatch.<x>
MISMATCH = ("stats/first_mb_clipfrac", "stats/first_mb_ratio_dev", "stats/rollout_vs_old_logp_diff")
MISMATCH += ("stats/rollout_vs_old_prob_diff",)
ONLY_OURS = ("rollout/acc", "stats/token_reward_kl_abs", "stats/adv_abs_mean", "stats/return_std", "stats/lr")
ONLY_OURS += ("critic/grad_norm_0", "stats/eos_mask_err_frac")
CORRECTED = ("rollout_corr/rollout_is_mean", "rollout_corr/rollout_rs_masked_fraction")  # a rollout correction is on
CORRECTED += ("stats/is_weight_mean",)  # ours: --off-policy tis / decoupled / mask
ONLY_OURS += CORRECTED  # (veRL's names, and ours: offpolicy.py logs veRL's)
FIRST_TURN = "stats/rollout_vs_old_logp_diff_first_turn"  # multi-turn: the gap on each episode's first action
ONLY_OURS += (FIRST_TURN,)
KNOWN = frozenset(ONLY_OURS + MISMATCH) | {ours for _, ours in NAME_MAP}  # every name a check reads, and more
FOREIGN = frozenset(theirs for theirs, _ in NAME_MAP)


def verl_aliases(metrics: dict, source: str) -> dict:
    """veRL's names of the metrics that have one; held-out ones as veRL's val-core/<data source>/<var>/<stat>."""
    out = {VERL_ALIASES[k]: v for k, v in metrics.items() if k in VERL_ALIASES}
    for k, v in metrics.items():
        if k == "eval/acc" or k.startswith("eval/mean@"):  # greedy eval/acc: veRL's default validation (n = 1)
            out[f"val-core/{source}/acc/mean@1" if k == "eval/acc" else f"val-core/{source}/reward/{k[5:]}"] = v
    return out


def to_ours(metrics: dict) -> dict:
    """Rename veRL/TRL keys to ours (NAME_MAP); our names and unknown keys pass through unchanged."""
    out = {k: v for k, v in metrics.items() if k not in FOREIGN}
    for theirs, ours in NAME_MAP:
        if metrics.get(theirs) is not None and out.get(ours) is None:
            out[ours] = metrics[theirs]
    return out


class InputError(ValueError):
    """A metrics file that cannot be read; the message names the file, the line and what was expected."""


def _json(p: Path, text: str, where: str):
    """json.loads of one entry; malformed or absurdly nested text is an InputError naming the place."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        where = where if where != "line 1" or e.lineno == 1 else f"line {e.lineno}"
        raise InputError(f"{p}, {where}: not valid JSON ({e.msg}, column {e.colno}): truncated or corrupt?") from None
    except RecursionError:  # json's C decoder recurses: 100k nested brackets exhaust the stack
        raise InputError(f"{p}, {where}: JSON nested too deep to be a metrics row; expected flat objects") from None
    except ValueError as e:  # an integer of over 4300 digits (Python's int_max_str_digits)
        raise InputError(f"{p}, {where}: a number Python will not read ({json_refusal(e)})") from None


def _entries(p: Path, f):
    """(where, raw dict) for each entry of a CSV, TRL trainer_state.json or JSONL file, read from `f` as a stream."""
    if p.suffix == ".csv":
        reader = csv.reader(f)
        header = next(reader)
        for row in reader:
            if len(row) != len(header) and any(c.strip() for c in row):
                msg = f"{len(row)} fields but the header (line 1) has {len(header)}: truncated? expected one per column"
                raise InputError(f"{p}, line {reader.line_num}: {msg}")
            yield f"line {reader.line_num}", {k: v for k, v in zip(header, row) if v.strip()}
    elif p.suffix == ".json":  # one object: read whole
        obj = _json(p, f.read(), "line 1")
        hist = obj.get("log_history") if isinstance(obj, dict) else obj
        if not isinstance(hist, list) or not all(isinstance(e, dict) for e in hist):
            raise InputError(f"{p}, line 1: expected TRL's trainer_state.json (a 'log_history' list of objects)")
        yield from ((f"log_history[{i}] (step {e.get('step', '?')})", e) for i, e in enumerate(hist))
    else:
        for n, line in enumerate(f, 1):
            obj = _json(p, line, f"line {n}") if line.strip() else {}
            if not isinstance(obj, dict):
                raise InputError(f'{p}, line {n}: expected an object like {{"step": 0, "stats/kl": 0.1}}')
            if isinstance(obj.get("data"), dict):  # veRL's file logger: {"step": s, "data": {...}}
                obj.update(obj.pop("data"))
            yield f"line {n}", obj


def _number(p: Path, where: str, key: str, v) -> float:
    """A metric value as a float, or an InputError naming the file, the place and the key."""
    try:
        return float(v) if type(v) in (int, float) else float(v.strip())  # numbers written as text: "0.5", "nan"
    except (AttributeError, ValueError):
        msg = f"column '{key}' = {v!r:.40} is not a number; expected a float (NaN/inf allowed: they are reported)"
        raise InputError(f"{p}, {where}: {msg}") from None


def _step(p: Path, where: str, v, last: int | None) -> int:
    """The step of an entry: a whole number, not below the last one (else two runs would merge silently)."""
    x = _number(p, where, "step", v)
    if not (math.isfinite(x) and x == int(x)):
        raise InputError(f"{p}, {where}: 'step' = {v!r:.40} is not a whole number; expected the step 0, 1, 2, ...")
    if last is not None and x < last:
        raise InputError(f"{p}, {where}: step {int(x)} after step {last}: two runs in one file? one run per file")
    return int(x)


NAMES = KNOWN | FOREIGN


def iter_metrics(path: str | Path):
    """Rows (one dict per step, our names, 'step' set) from a run dir, .jsonl, .csv or trainer_state.json, read as a
    stream: memory is one row (entries of one step are merged), not the file."""
    p = Path(path)
    if p.is_dir():  # a run directory
        p = next((p / n for n in ("metrics.jsonl", "metrics.csv", "trainer_state.json") if (p / n).is_file()), p)
    if not p.is_file():
        raise InputError(f"{p}: no such file (a run dir needs metrics.jsonl, metrics.csv or trainer_state.json)")
    with open(p, encoding="utf-8", errors="replace", newline="") as f:
        if not any(line.strip() for line in f):  # stops at the first non-blank line
            raise InputError(f"{p}, line 1: the file is empty; expected one row of metrics per training step")
        f.seek(0)
        prev, columns, first = None, {}, None
        for i, (where, raw) in enumerate(_entries(p, f)):
            first, columns = first or (where if raw else None), columns if len(columns) > 6 else columns | raw
            row = to_ours({k: _number(p, where, k, v) for k, v in raw.items() if k in NAMES and v is not None})
            if not row:
                continue  # a blank line, an eval-only entry, TRL's final summary (train_runtime, ...)
            row |= {k: float(v) for k, v in raw.items() if k not in NAMES and type(v) in (int, float)}
            last = None if prev is None else prev["step"]
            row["step"] = _step(p, where, raw["step"], last) if raw.get("step") is not None else i
            if prev is not None and prev["step"] == row["step"]:
                prev.update(row)  # one step logged in several entries
                continue
            if prev is not None:
                yield prev
            prev = row
    if prev is None:
        msg = f"none of the columns {list(columns)[:6]} is a known metric; expected ours (rollout/reward_mean, ...)"
        msg = "no rows (only a header or empty objects)" if first is None else msg + " or veRL/TRL names (NAME_MAP)"
        raise InputError(f"{p}, {first or 'line 2'}: {msg}")
    yield prev


def load_metrics(path: str | Path) -> list[dict]:
    """Every row of iter_metrics, as a list."""
    return list(iter_metrics(path))


def main(argv=None) -> list[dict]:
    """`python diagnose_logs.py PATH`: the rows read (a few columns, our names) and the columns that were renamed."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("path", help="run dir, .jsonl (ours, veRL's), .csv, or TRL's trainer_state.json")
    ap.add_argument("--keys", nargs="*", default=["rollout/reward_mean", "stats/kl", "stats/entropy"], help="columns")
    args = ap.parse_args(argv)
    try:
        rows = load_metrics(args.path)
    except InputError as e:
        raise SystemExit(f"diagnose_logs.py: bad input: {e}") from None
    print(format_table(rows, ["step", *[k for k in args.keys if any(k in r for r in rows)]]))
    p = Path(args.path)
    with open(p / "metrics.jsonl" if p.is_dir() else p, encoding="utf-8", errors="replace") as f:
        header = f.readline()  # the first entry's (or CSV header's) names, as written
    renamed = [(theirs, ours) for theirs, ours in NAME_MAP if f'"{theirs}"' in header or f",{theirs}," in f",{header},"]
    print(f"{len(rows)} rows; veRL / TRL columns: " + (", ".join(f"{t} -> {o}" for t, o in renamed) or "none"))
    return rows


if __name__ == "__main__":
    main()
