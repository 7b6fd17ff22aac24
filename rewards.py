"""Rewards: the built-in ones, the user's reward functions (veRL's or TRL's signature) and a reward model.

    python rewards.py                                    # the built-in rewards and the example files on 4 answers
    python rewards.py --reward examples/rewards_verl.py  # one reward of yours on the same answers

What lives here
1. Built-in rewards by name (`REWARDS`): `exact` (stripped strings equal), `math_exact` (the last number of the
   response, as `NUMBER` reads one, equals the ground truth exactly, as fractions), `digits` (partial credit, the
   procedural tasks').
2. The user's reward functions, `--reward path/to/file.py[:fn]` (fn defaults to `compute_score`, veRL's
   `custom_reward_function.name`). Their style is told by their parameters:
   - a `solution_str` parameter: veRL's per-sample `compute_score(data_source, solution_str, ground_truth,
     extra_info=None)` -> float, or a dict whose "score" is the reward (its other numeric keys are logged as
     `reward/<fn>/<key>`);
   - a `completions` parameter: TRL's batch signature `fn(prompts, completions, completion_ids, **columns) ->
     list[float | None]`; completions are strings for plain prompts and [{"role": "assistant", "content": ...}]
     for chat prompts, as TRL passes them; every other column of the row arrives as a keyword list.
3. A reward model, `--reward-model PATH`: an HF `AutoModelForSequenceClassification` folder (one label) scoring
   prompt + response, batched, in eval mode, on the trainer's device (classic RLHF PPO, Ouyang et al. 2022).
4. `RewardSet`: the weighted sum r = sum_i w_i r_i of every term (`--reward-weights`, TRL's reward_weights), with
   each term's mean logged as `reward/<name>` and the time spent as `time/reward`. A response counts as solved
   (rollout/acc, eval/acc, pass@k) when the FIRST term's own value is >= 1: list the correctness reward first and
   the shaping terms (length, format, a reward model) after it.

Implementation details (our choices)
1. The user's functions run in `--reward-workers` processes (reward_workers.py: fresh processes, each call under
   `--reward-timeout`; the first failure stops the batch at once, a dead worker is named by its exit code or signal).
   0 workers runs them in the trainer's process, without a timeout. A per-sample function's samples are spread over
   the workers; a batch function gets the whole batch in one call, as in TRL.
2. Never a silent 0: a reward that raises, times out, exits, kills its worker, returns a non-number, the wrong number
   of values or a non-finite one stops the run, naming the function, the sample, its prompt and its response. TRL's None
   ("does not apply to this sample") is skipped in the weighted sum, as in TRL; a sample that no term scores is
   an error (TRL would give it 0 with a warning).
3. Nothing from a model reaches eval/exec: the built-in rewards compare strings and exact numbers, and the
   countdown task's reward (`countdown_score`, TinyZero's rule) reads an expression with `ast` and computes it in
   Fractions itself (`arithmetic_value`: integers, + - * / and parentheses only, at most 200 characters).
"""

from __future__ import annotations

import argparse
import ast
import inspect
import math
import re
import time
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

from cli import check_fields
from reward_workers import CallFailed, Workers, call, load_function

# ----------------------------------------------------------------------------------------------
# The knobs; the trainer's Config inherits them


@dataclass
class RewardArgs:
    """How responses to --data rows are scored; the trainer's Config inherits these fields."""

    reward: list[str] | None = None
    """Reward(s) for --data: math_exact | exact | digits | FILE.py[:FN] (veRL compute_score or a TRL reward function,
    FN defaults to compute_score); several: repeat the flag. None = math_exact (or only --reward-model if given)."""
    reward_weights: list[float] | None = None
    """One weight per --reward, then one for --reward-model (TRL's reward_weights); None = all 1."""
    reward_workers: int = 1
    """Processes running the user's reward functions (0 = in the trainer's process, without a timeout)."""
    reward_timeout: float = 60.0
    """Seconds one call of a user's reward function may take before the run stops, naming the sample."""
    reward_model: str | None = None
    """HF AutoModelForSequenceClassification folder (one label) scoring prompt + response; a term after --reward."""

    def __post_init__(self):
        if isinstance(self.reward, str):  # one name, as configs saved before 2026-12-02 spell it
            self.reward = [self.reward]
        check_fields(self, {"[0, inf)": ("reward_workers",), "(0, inf)": ("reward_timeout",)}, RewardArgs)
        for spec in self.reward or []:
            if spec not in REWARDS and not spec.split(":")[0].endswith(".py"):
                raise ValueError(f"config field 'reward' = {spec!r}: must be one of {list(REWARDS)} or FILE.py[:FN]")
        n = len(self.reward_terms())
        if any(not math.isfinite(w) for w in self.reward_weights or []):
            raise ValueError(f"config field 'reward_weights' = {self.reward_weights}: every weight must be finite")
        if self.reward_weights is not None and len(self.reward_weights) != n:
            raise ValueError(
                f"config field 'reward_weights' has {len(self.reward_weights)} values for {n} reward "
                f"terms ({', '.join(self.reward_terms())}): give one weight per term"
            )

    def reward_terms(self) -> list[str]:
        """Every term's spec in order: --reward (default math_exact unless a reward model is given), the model."""
        specs = self.reward or ([] if self.reward_model else ["math_exact"])
        return specs + ([f"model:{self.reward_model}"] if self.reward_model else [])


# ----------------------------------------------------------------------------------------------
# Built-in rewards (safe parsing only)

# What a number is, for math_exact's responses and its ground truths alike: an optional sign, digits (thousands may
# be grouped by commas, three digits a group: "1,000"), an optional decimal part, an optional exponent ("1e-12",
# "2.5E3"). A number never starts right after a digit or a point: "3-5" reads 3 and 5, "1,2,3" three numbers.
NUMBER = re.compile(r"(?<![\d.])[-+]?(?:(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+)(?:[eE][-+]?\d+)?")


def digits_score(solution_str: str, ground_truth: str) -> float:
    """Partial credit: characters equal at equal positions / max(len(solution), len(truth))."""
    sol, gt = solution_str.strip(), ground_truth.strip()
    if not gt:
        raise ValueError("digits_score: empty ground truth")
    hits = sum(a == b for a, b in zip(sol, gt))
    return hits / max(len(sol), len(gt))


def exact_score(solution_str: str, ground_truth: str) -> float:
    """1.0 iff the stripped strings are equal."""
    return float(solution_str.strip() == ground_truth.strip())


def exact_number(text: str) -> Fraction:
    """One NUMBER ("42", "-0.5", "1,000", "1e-12") as an exact Fraction: no float rounding, no size limit. ValueError
    for anything else ("nan", "inf", "1/2", "1,00")."""
    if not NUMBER.fullmatch(text.strip()):
        raise ValueError(f"{text[:40]!r} is not a number (rewards.NUMBER)")
    return Fraction(text.strip().replace(",", ""))


def math_exact_score(solution_str: str, ground_truth: str) -> float:
    """1.0 iff the last number in the solution equals the ground-truth number exactly ("0.50" equals "0.5"; "0" is
    not "1e-12"; 20-digit integers compare digit for digit)."""
    found = NUMBER.findall(solution_str)
    return float(bool(found) and exact_number(found[-1]) == exact_number(ground_truth))


def arithmetic_value(expr: str) -> Fraction | None:
    """The exact value of an expression of non-negative integers, + - * / and parentheses, read by `ast` (nothing
    is evaluated by Python: no names, no calls, no powers); None if it is anything else or divides by zero."""
    ops = {
        ast.Add: Fraction.__add__,
        ast.Sub: Fraction.__sub__,
        ast.Mult: Fraction.__mul__,
        ast.Div: Fraction.__truediv__,
    }

    def value(node) -> Fraction:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return Fraction(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in ops:
            return ops[type(node.op)](value(node.left), value(node.right))
        raise ValueError(f"not + - * / of integers: {ast.dump(node)[:60]}")

    expr = expr.strip()  # the parser reads a leading space as an indent
    if len(expr) > 200 or not re.fullmatch(r"[0-9+\-*/() ]+", expr) or "**" in expr:
        return None  # only these characters, so that a 2-character power never reaches the parser
    try:
        return value(ast.parse(expr, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError):
        return None


def countdown_score(solution_str: str, ground_truth: str, format_score: float = 0.1) -> float:
    """TinyZero's Countdown reward: the expression after the last "=>" (the worked steps before it are not scored)
    must use every number of the ground truth "TARGET|N1,N2,..." exactly once and equal TARGET: 1.0; an expression
    that does not: format_score (0.1); no "=>" followed by text: 0."""
    target, numbers = ground_truth.split("|")
    if "=>" not in solution_str or not (expr := solution_str.rsplit("=>", 1)[1].strip()):
        return 0.0
    if len(expr) > 200:  # before any int(): a model's 5000-digit run must not stop the run (int() refuses it)
        return format_score
    used = sorted(int(n) for n in re.findall(r"[0-9]+", expr))
    if used != sorted(int(n) for n in numbers.split(",")):
        return format_score
    return 1.0 if arithmetic_value(expr) == Fraction(int(target)) else format_score


REWARDS = {"digits": digits_score, "exact": exact_score, "math_exact": math_exact_score}


def as_text(ground_truth):
    """A ground truth as the built-in rewards compare it: numbers (not booleans) as their text; anything else as is
    (veRL and TRL functions get the value as stored)."""
    number = isinstance(ground_truth, (int, float)) and not isinstance(ground_truth, bool)
    return str(ground_truth) if number else ground_truth


def user_text(prompt) -> str:
    """A prompt as plain text: itself, or the contents of its user messages joined by newlines (chat messages read
    by a tokenizer or a reward model without a chat template)."""
    return prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in prompt if m["role"] == "user")


def check_ground_truth(reward: str, ground_truth, where: str) -> None:
    """At load, not at the step that samples it: a ground truth a built-in reward cannot score is an error."""
    ground_truth = as_text(ground_truth)
    if not isinstance(ground_truth, str):
        raise ValueError(
            f"{where}: ground_truth {ground_truth!r} is not a string: the built-in reward {reward!r} "
            f"compares text (bring a reward function of your own, --reward FILE.py:FN)"
        )
    if reward == "math_exact":
        try:
            exact_number(ground_truth)
        except (ValueError, ZeroDivisionError):
            what = "is not a number math_exact reads (rewards.NUMBER: 42, -0.5, 1,000, 1e-12): fix it"
            raise ValueError(f"{where}: ground_truth {ground_truth[:40]!r} {what} or use --reward exact") from None
    elif reward == "digits" and not ground_truth.strip():
        raise ValueError(f"{where}: empty ground_truth: digits scores characters against it")


# ----------------------------------------------------------------------------------------------
# The user's reward functions


def load_reward_fn(spec: str):
    """(function, style "verl" | "trl") of FILE.py[:FN]; the style from its parameters (module docstring, 2)."""
    fn, name = load_function(spec), spec.partition(":")[2] or "compute_score"
    params = inspect.signature(fn).parameters
    if "solution_str" in params:
        return fn, "verl"
    if "completions" in params:
        return fn, "trl"
    raise TypeError(
        f"--reward {spec!r}: {name}{inspect.signature(fn)} has neither a 'solution_str' parameter "
        f"(veRL's compute_score) nor a 'completions' one (a TRL reward function)"
    )


def verl_calls(spec: str, rows: list[dict], texts: list[str]) -> list[tuple]:
    """One compute_score call per sample, with veRL's arguments: (spec, args, kwargs)."""
    kwargs = [
        dict(data_source=r["data_source"], solution_str=t, ground_truth=r["ground_truth"], extra_info=r["extra_info"])
        for r, t in zip(rows, texts)
    ]
    return [(spec, (), kw) for kw in kwargs]


def trl_call(spec: str, rows: list[dict], texts: list[str], ids: list[list[int]]) -> tuple:
    """One batch call with TRL's arguments: prompts, completions (messages for chat prompts), completion_ids and
    every other column of the rows as a keyword list, as TRL's GRPOTrainer passes them."""
    as_message = lambda t: [{"role": "assistant", "content": t}]
    completions = [as_message(t) if isinstance(r["prompt"], list) else t for r, t in zip(rows, texts)]
    names = dict.fromkeys(k for row in rows for k in row["columns"])
    columns = {k: [row["columns"].get(k) for row in rows] for k in names}
    return (
        spec,
        (),
        dict(prompts=[row["prompt"] for row in rows], completions=completions, completion_ids=ids, **columns),
    )


def check_value(value, spec: str, i: int, row: dict, text: str, style: str) -> tuple[float | None, dict]:
    """(reward, extra numbers) of one sample's value; anything but a finite number (or TRL's None) is an error."""
    where = f"reward {spec!r} on sample {i} ({row['where']}, prompt {str(row['prompt'])[:60]!r}, response {text!r})"
    extra = {}
    if isinstance(value, dict) and style == "verl":
        if "score" not in value:
            raise ValueError(f"{where} returned a dict without 'score' (veRL reads the reward there): {value!r}")
        extra = {k: float(v) for k, v in value.items() if k != "score" and isinstance(v, (int, float))}
        value = value["score"]
    if value is None and style == "trl":
        return None, extra
    try:  # numbers, numpy scalars and 0-d tensors pass; a string, a list or a 2-element array do not
        number = float(value) if not isinstance(value, str) else None
    except (TypeError, ValueError):
        number = None
    if number is None:
        raise TypeError(f"{where} returned {str(value)[:80]!r}, not a number")
    if not math.isfinite(number):
        raise ValueError(f"{where} returned {number}: a reward must be finite")
    return number, extra


# ----------------------------------------------------------------------------------------------
# A reward model


class RewardModel:
    """An HF sequence classifier with one label scoring prompt + response: r = logits[:, 0], batched, no gradient."""

    def __init__(self, path: str, device, batch: int = 16):
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # as for the policy: no "Loading weights" bar in the metrics table

        if not Path(path).is_dir():
            raise FileNotFoundError(f"--reward-model {path!r} is not a folder (AutoModelForSequenceClassification)")
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).to(device).eval()
        if self.model.config.num_labels != 1:
            raise ValueError(
                f"--reward-model {path!r} has {self.model.config.num_labels} labels: a reward model has "
                f"one (a scalar score per sequence)"
            )
        if self.tokenizer.pad_token_id is None:  # pooling finds each row's last non-pad token
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.device, self.batch, self.chat = device, batch, bool(getattr(self.tokenizer, "chat_template", None))

    def text(self, prompt, response: str) -> str:
        """Prompt + response as the reward model reads them: its chat template if it has one, else concatenated."""
        if self.chat:
            msgs = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
            conversation = msgs + [{"role": "assistant", "content": response}]
            return self.tokenizer.apply_chat_template(conversation, tokenize=False)
        return user_text(prompt) + response

    def score(self, prompts: list, responses: list[str]) -> list[float]:
        """[B] scores, `batch` sequences per forward."""
        import torch

        out = []
        texts = [self.text(p, r) for p, r in zip(prompts, responses)]
        for i in range(0, len(texts), self.batch):
            special = not self.chat  # a chat template writes its own BOS
            enc = self.tokenizer(
                texts[i : i + self.batch], return_tensors="pt", padding=True, add_special_tokens=special
            )
            with torch.no_grad():
                out += self.model(**enc.to(self.device)).logits[:, 0].float().tolist()
        return out


# ----------------------------------------------------------------------------------------------
# Every term, weighted


class RewardSet:
    """The weighted sum of every reward term on a batch of rows and responses (module docstring, 4)."""

    def __init__(self, args: RewardArgs, device="cpu", batch: int = 16):
        self.specs, self.weights = args.reward_terms(), args.reward_weights or [1.0] * len(args.reward_terms())
        self.fns = {s: load_reward_fn(s) for s in self.specs if s.split(":")[0].endswith(".py")}  # in the trainer too:
        self.model = RewardModel(args.reward_model, device, batch) if args.reward_model else None  # errors at load
        self.names = names = [term_name(s) for s in self.specs]
        if len(set(names)) < len(names):
            raise ValueError(
                f"--reward terms {self.specs} would log under the same name reward/<name> ({names}): "
                f"give their functions different names"
            )
        self.workers = None  # detail 1: the user's functions run in these processes
        if self.fns and args.reward_workers > 0:
            self.workers = Workers(list(self.fns), args.reward_workers, args.reward_timeout)

    def _run(self, jobs: list[tuple], rows: list[dict], texts: list[str]) -> list:
        """Each call's value, in order: on the workers, or here without a timeout. The first failure stops the run,
        naming the function, the cause and the sample (the batch, for a TRL function's one call)."""
        try:
            if self.workers is not None:
                return self.workers.run(jobs)
            return [here(i, self.fns[spec][0], args, kwargs) for i, (spec, args, kwargs) in enumerate(jobs)]
        except CallFailed as e:
            i, row = e.index, rows[e.index]
            what = f"sample {i} ({row['where']}, prompt {str(row['prompt'])[:60]!r}, response {texts[i]!r})"
            what = f"a batch of {len(rows)} (first: {row['where']})" if len(jobs) < len(rows) else what
            raise RuntimeError(f"reward {jobs[i][0]!r} {e.why} on {what}") from None

    def score(self, rows: list[dict], texts: list[str], ids: list[list[int]]) -> tuple[list, list, list]:
        """[B] weighted rewards of B responses (texts: decoded without special tokens; ids: their token ids), [B]
        solved (the first term's own value >= 1: module docstring, 4) and [B] per-sample metrics for the episode's
        info: reward/<term> (each term that scored it), reward/<term>/<key> (a veRL dict's other numbers) and
        time/reward (the batch's seconds / B): evaluation.rollout_metrics averages them and sums the time."""
        t0 = time.perf_counter()
        per_term = []  # per term: [(value or None, extra numbers)] per sample
        for spec in self.specs:
            if spec in REWARDS:
                values = [(REWARDS[spec](t, as_text(r["ground_truth"])), {}) for r, t in zip(rows, texts)]
            elif spec.startswith("model:"):
                values = [(v, {}) for v in self.model.score([r["prompt"] for r in rows], texts)]
            else:
                style = self.fns[spec][1]
                jobs = verl_calls(spec, rows, texts) if style == "verl" else [trl_call(spec, rows, texts, ids)]
                values = self._checked(spec, style, self._run(jobs, rows, texts), rows, texts)
            per_term.append(values)
        out, infos = [], []
        for i, row in enumerate(rows):
            mine = [(name, w, *v[i]) for name, w, v in zip(self.names, self.weights, per_term) if v[i][0] is not None]
            if not mine:
                raise ValueError(f"no reward term scores sample {i} ({row['where']}): every function returned None")
            out.append(sum(w * x for _, w, x, _ in mine))
            info = {}
            for name, _, x, extra in mine:
                info[f"reward/{name}"] = x
                info.update({f"reward/{name}/{e}": y for e, y in extra.items()})
            infos.append(info)
        dt = (time.perf_counter() - t0) / len(rows)
        return out, [v is not None and v >= 1.0 for v, _ in per_term[0]], [{**d, "time/reward": dt} for d in infos]

    def _checked(self, spec, style, results, rows, texts) -> list[tuple]:
        """Each sample's (reward or None, extra numbers) from the calls' values; an error names the sample."""
        if style == "trl":
            value = results[0]
            if not isinstance(value, (list, tuple)) or len(value) != len(rows):
                got = f"{len(value)} values" if isinstance(value, (list, tuple)) else repr(value)[:80]
                raise ValueError(f"reward {spec!r} returned {got} for {len(rows)} completions: one per completion")
            results = value
        return [check_value(v, spec, i, row, text, style) for i, (v, row, text) in enumerate(zip(results, rows, texts))]

    def close(self) -> None:
        """Stop the worker processes (killed: a hung reward function must not keep the run alive)."""
        if self.workers is not None:
            self.workers.close()
            self.workers = None


def here(i: int, fn, args: tuple, kwargs: dict):
    """Call i of a batch in this process (0 workers): its value, or CallFailed as a worker's would say it."""
    status, value = call(fn, args, kwargs, None)
    if status == "error":
        raise CallFailed(i, value)
    return value


def term_name(spec: str) -> str:
    """A term's metric name: the built-in reward's, the function's (file stem if compute_score) or the model's."""
    if spec in REWARDS or spec.startswith("model:"):
        return spec if spec in REWARDS else "model"
    path, _, fn = spec.partition(":")
    return fn if fn not in ("", "compute_score") else Path(path).stem


def main(argv=None) -> None:
    """Score four answers to "What is 6 * 7?" with each built-in reward and the example reward files (or yours)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reward", action="append", help="FILE.py[:FN] or a built-in name (default: all examples)")
    args = ap.parse_args(argv)
    here = Path(__file__).parent / "examples"
    specs = args.reward or [*REWARDS, f"{here}/rewards_verl.py", f"{here}/rewards_trl.py:length_penalty"]
    specs = [s.replace(f"{Path.cwd()}/", "") for s in specs]
    prompt, truth = "What is 6 * 7?", "42"
    answers = ["42", "The answer is 42.", "41", "forty-two"]
    row = {"prompt": prompt, "ground_truth": truth, "data_source": "demo", "extra_info": None, "where": "demo:1"}
    row["columns"] = {"ground_truth": truth}
    print(f"prompt {prompt!r}, ground truth {truth!r}")
    for spec in specs:
        rs = RewardSet(RewardArgs(reward=[spec], reward_workers=0))
        scores, _, _ = rs.score(
            [row] * len(answers), answers, [[ord(c) for c in a] for a in answers]
        )  # ids: characters
        print(f"{spec:>36s}: " + "  ".join(f"{a!r} -> {s:.2f}" for a, s in zip(answers, scores)))


if __name__ == "__main__":
    main()
