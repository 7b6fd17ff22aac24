"""Verifiable tasks, reward functions, the tiny embedded default model and tokenizer, the SFT warm start.

    python tasks.py                  # show samples of every task and build (or load) the SFT warm start
    python tasks.py --task add       # the same for one task

What lives here
1. A character-level tokenizer built locally as a real `transformers.PreTrainedTokenizerFast`
   (`make_tokenizer`; it round-trips through `save_pretrained` / `AutoTokenizer.from_pretrained`).
2. `make_tiny_model(tokenizer)`: a Qwen2-style config with random init (about 0.5 M parameters, fp32).
3. Procedural single-turn tasks with a veRL-compatible `compute_score(solution_str, ground_truth)`:
   `reverse` (reverse 6 digits), `add` (2-digit addition, zero-padded 3-digit sum), `sort` (sort 6
   digits), `chain` (sum of five 2-digit numbers written step by step with zero-padded partial sums,
   43-character answers: long enough for attention_credit.py's windows). Partial credit = matching
   characters at matching positions / max(len(answer), len(truth)).
4. `JsonlTask`: the user's own data (one `{"prompt", "ground_truth"}` per line) scored by a reward
   chosen by name from `REWARDS` (`exact`, `math_exact`, `digits`).
5. `sft_warm_start`: a short supervised warm start of the tiny model, stopped on a greedy-accuracy
   target (not a time), cached under a key of (config, this file's hash, torch and transformers
   versions) behind a file lock, so parallel test workers build it once. For an environment it imitates
   the env's scripted solver (`expert()`), with labels on action tokens only.
6. Multi-turn environments with GEM's signatures (`Env`): `calc` (CalculatorEnv: a word problem, a
   calculator tool `calc EXPR` evaluated by `safe_calc`, a recursive-descent parser that never calls
   eval/exec, then `answer N`) and `guess` (GuessNumberEnv: higher/lower feedback). Seeded and
   deterministic, train/eval episodes disjoint (detail 1 on the first observation), a documented penalty
   for a malformed action (the episode goes on), optional per-step latency. `TaskEnv` makes a single-turn
   task a one-turn environment, so rollout.rollout_env is the only sampling path. `GemEnv` adapts the
   `gem` package's environments (`gem:<env id>`; pip install gem-llm).

Implementation details (our choices)
1. Disjoint splits: a problem belongs to the eval split iff crc32(prompt) % 10 == 0. Train sampling
   rejects eval problems and vice versa, so no held-out prompt ever appears in training, whatever the
   size of the problem space (2-digit addition has only 10,000 problems).
2. Reward parsing is string comparison and a regular expression for numbers; nothing from a model
   reaches eval/exec. `math_exact` compares the last number in the output with the ground truth.
3. Prompts for the tiny model are `<bos>` + text; the answer ends with `<eos>`. Models with a chat
   template get the prompt as one user message (see `format_prompt`).
4. The SFT loss is on answer (action) tokens and EOS only; evaluation is greedy exact match on 256 train-split
   prompts checked every `check_every` steps; the first check at or above `target_acc` stops it. The
   transition is sharp (NOTES-CPU.md), so checks are frequent.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import re
import time
import zlib
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Protocol

import numpy as np

CHARS = "0123456789abcdefghijklmnopqrstuvwxyz+-*/=()<>.,:?! \n"
SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]
CACHE_DIR = Path(__file__).resolve().parent / ".cache"


# ----------------------------------------------------------------------------------------------
# Task and environment interfaces


class Task(Protocol):
    """A single-turn verifiable task."""

    name: str

    def sample(self, n: int, split: str, rng: np.random.Generator) -> list[dict]:
        """n problems {"prompt": str, "ground_truth": str} from split "train" or "eval"."""

    def compute_score(self, solution_str: str, ground_truth: str) -> float:
        """veRL-compatible reward in [0, 1]; 1.0 means exactly right."""


class Env(Protocol):
    """A multi-turn environment with GEM-compatible signatures (`gem.Env`)."""

    def reset(self, seed: int | None = None) -> tuple[str, dict]:
        """Start an episode; returns (first observation, info)."""

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        """Apply one action; returns (observation, reward, terminated, truncated, info)."""


def is_eval_problem(prompt: str) -> bool:
    """The split rule shared by every task: a fixed 10 % of the problem space is held out."""
    return zlib.crc32(prompt.encode()) % 10 == 0


# ----------------------------------------------------------------------------------------------
# Rewards (safe parsing only)

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


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


def math_exact_score(solution_str: str, ground_truth: str) -> float:
    """1.0 iff the last number in the solution equals the ground-truth number."""
    found = _NUMBER.findall(solution_str)
    if not found:
        return 0.0
    return float(abs(float(found[-1]) - float(ground_truth)) < 1e-9)


REWARDS = {"digits": digits_score, "exact": exact_score, "math_exact": math_exact_score}


def score_responses(task, texts: list[str], problems: list[dict]) -> list[float]:
    """Task scores; a reward function that raises or returns non-finite stops the run, naming the sample."""
    out = []
    for i, (text, p) in enumerate(zip(texts, problems)):
        try:
            s = float(task.compute_score(text, p["ground_truth"]))
        except Exception as e:
            raise RuntimeError(f"reward of task {task.name!r} raised on sample {i} (response {text!r}): {e!r}") from e
        if not math.isfinite(s):
            raise ValueError(f"reward of task {task.name!r} is {s} on sample {i} (response {text!r})")
        out.append(s)
    return out


# ----------------------------------------------------------------------------------------------
# Procedural tasks


@dataclass
class DigitTask:
    """A family of tasks on digit strings: `reverse`, `sort` (6 digits) and `add` (2-digit sum)."""

    name: str = "reverse"

    def make(self, rng: np.random.Generator) -> dict:
        if self.name == "add":
            a, b = rng.integers(0, 100, size=2)
            return {"prompt": f"{a}+{b}=", "ground_truth": f"{a + b:03d}"}
        if self.name == "chain":  # 5 two-digit numbers summed step by step: "012+34=046,046+56=102,..." (43 chars)
            nums = [int(x) for x in rng.integers(0, 100, size=5)]
            sums = np.cumsum(nums)
            steps = [f"{int(s):03d}+{b:02d}={int(s) + b:03d}" for s, b in zip(sums[:-1], nums[1:])]
            return {"prompt": "+".join(f"{a:02d}" for a in nums) + "=", "ground_truth": ",".join(steps)}
        digits = "".join(str(d) for d in rng.integers(0, 10, size=6))
        answer = digits[::-1] if self.name == "reverse" else "".join(sorted(digits))
        return {"prompt": f"{digits}>" if self.name == "reverse" else f"s{digits}>", "ground_truth": answer}

    def sample(self, n: int, split: str, rng: np.random.Generator) -> list[dict]:
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        out = []
        while len(out) < n:  # rejection keeps the two splits disjoint (implementation detail 1)
            p = self.make(rng)
            if is_eval_problem(p["prompt"]) == (split == "eval"):
                out.append(p)
        return out

    def compute_score(self, solution_str: str, ground_truth: str) -> float:
        return digits_score(solution_str, ground_truth)


@dataclass
class JsonlTask:
    """The user's data: a JSONL file of {"prompt", "ground_truth"}, split by `is_eval_problem`."""

    path: str
    reward: str = "math_exact"

    def __post_init__(self):
        if self.reward not in REWARDS:
            raise ValueError(f"config field 'reward' = {self.reward!r}: must be one of {list(REWARDS)}")
        p = Path(self.path)
        if not p.is_file():
            raise FileNotFoundError(f"--data file {self.path!r} does not exist")
        self.name = f"jsonl:{p.name}"
        self.rows = {"train": [], "eval": []}
        for i, line in enumerate(p.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{self.path}:{i}: not valid JSON ({e.msg}): {line[:80]!r}") from None
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or "ground_truth" not in row:
                raise ValueError(f'{self.path}:{i}: expected {{"prompt": str, "ground_truth": ...}}, got {line[:80]!r}')
            item = {"prompt": row["prompt"], "ground_truth": str(row["ground_truth"])}
            self.rows["eval" if is_eval_problem(item["prompt"]) else "train"].append(item)
        if not self.rows["train"]:
            n_eval = len(self.rows["eval"])
            raise ValueError(f"{self.path}: no training rows ({n_eval} rows, all in the held-out 10 % by prompt hash)")
        if not self.rows["eval"]:
            print(f"[minrl] {self.path}: no prompt falls in the held-out split; evaluation uses training rows")

    def sample(self, n: int, split: str, rng: np.random.Generator) -> list[dict]:
        rows = self.rows[split] or self.rows["train"]  # no held-out row: logged once in __post_init__
        return [rows[i] for i in rng.integers(0, len(rows), size=n)]

    def compute_score(self, solution_str: str, ground_truth: str) -> float:
        return REWARDS[self.reward](solution_str, ground_truth)


TASKS = ("reverse", "add", "sort", "chain")


def make_task(name: str, data: str | None = None, reward: str = "math_exact"):
    """A task by name, or the user's JSONL file when `data` is given."""
    if data is not None:
        return JsonlTask(data, reward)
    if name not in TASKS:
        raise ValueError(f"config field 'task' = {name!r}: must be one of {list(TASKS)} (or pass --data FILE)")
    return DigitTask(name)


# ----------------------------------------------------------------------------------------------
# Environments (GEM signatures: reset(seed) -> (obs, info); step(action) -> (obs, reward, terminated,
# truncated, info)). rollout.rollout_env runs them; a single-turn task is a one-turn TaskEnv.


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
        return toks[pos] if pos < len(toks) else None

    def take():
        nonlocal pos
        pos += 1
        return toks[pos - 1]

    def check(v: int) -> int:
        if abs(v) > max_abs:
            raise CalcError(f"a value beyond {max_abs}")
        return v

    def expr_(depth: int) -> int:
        v = term(depth)
        while peek() in ("+", "-"):
            v = check(v + term(depth) if take() == "+" else v - term(depth))
        return v

    def term(depth: int) -> int:
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
        return check(int(t))

    value = expr_(0)
    if pos != len(toks):
        raise CalcError(f"unexpected {toks[pos]}")
    return value


_ACTION = re.compile(r"^(calc|answer|guess) (.{1,24})$")


def parse_action(text: str, verbs: tuple[str, ...]) -> tuple[str, str]:
    """(verb, argument) of an action `"<verb> <argument>"`; CalcError says what is wrong otherwise."""
    m = _ACTION.match(text.strip())
    if m is None or m.group(1) not in verbs:
        raise CalcError(f"expected {' or '.join(verbs)}")
    return m.group(1), m.group(2).strip()


@dataclass
class EnvConfig:
    """Knobs of the embedded environments."""

    max_turns: int = 3  # the episode is truncated after this many actions
    penalty: float = -0.1  # reward of a malformed action; the episode goes on
    latency_s: float = 0.0  # mean wall-clock delay of each step (to exercise async rollouts)
    latency_sigma: float = 0.0  # log-normal spread of that delay, drawn from the episode's seed


class _EmbeddedEnv:
    """Shared reset/step logic: seeded episodes in a split, turn count, latency, malformed actions.

    A subclass defines `make(rng) -> (first observation, state)`, `act(verb, arg) -> (obs, reward,
    terminated, info)` (raising CalcError on a malformed argument) and `expert() -> str`, the next action
    of a scripted solver (SFT demonstrations). The same seed always gives the same episode.
    """

    name, verbs = "", ()

    def __init__(self, split: str = "train", cfg: EnvConfig | None = None):
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        self.split, self.cfg, self.turn, self.done = split, cfg or EnvConfig(), 0, True

    def reset(self, seed: int | None = None) -> tuple[str, dict]:
        self.rng = np.random.default_rng(seed)
        while True:  # rejection keeps train and eval episodes disjoint (implementation detail 1)
            obs, self.state = self.make(self.rng)
            if is_eval_problem(obs) == (self.split == "eval"):
                break
        self.turn, self.done = 0, False
        return obs, {"seed": seed}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        if self.done:
            raise RuntimeError(f"{self.name}: step() after the episode ended; call reset()")
        if self.cfg.latency_s > 0:
            time.sleep(self.cfg.latency_s * float(np.exp(self.cfg.latency_sigma * self.rng.standard_normal())))
        self.turn += 1
        try:
            obs, reward, terminated, info = self.act(*parse_action(action, self.verbs))
        except CalcError as e:  # malformed: the documented penalty, nothing executed, the episode goes on
            obs, reward, terminated, info = f"error: {e}\n", self.cfg.penalty, False, {"malformed": True}
        truncated = not terminated and self.turn >= self.cfg.max_turns
        self.done = terminated or truncated
        return obs, reward, terminated, truncated, {"success": False, **info}


class CalculatorEnv(_EmbeddedEnv):
    """Tool use: an arithmetic word problem. `calc EXPR` is answered `=VALUE` by safe_calc (reward 0);
    `answer N` ends the episode with reward 1 if N is right, else 0. A malformed action gets `penalty` and
    an `error: ...` observation; after max_turns actions the episode is truncated."""

    name, verbs = "calc", ("calc", "answer")
    NAMES, ITEMS = ("ann", "bob", "eve", "max", "sam"), ("pens", "cards", "eggs", "coins")

    def make(self, rng):
        who, item, kind = self.NAMES[rng.integers(5)], self.ITEMS[rng.integers(4)], int(rng.integers(3))
        if kind == 2:
            a, b = int(rng.integers(2, 10)), int(rng.integers(10, 100))
            return f"{who} buys {a} bags of {b} {item}. how many {item}?", (a * b, f"{a}*{b}")
        b, a = sorted(int(x) for x in rng.integers(10, 100, size=2))
        if kind == 1:
            return f"{who} has {a} {item} and gives away {b}. how many left?", (a - b, f"{a}-{b}")
        return f"{who} has {a} {item} and gets {b} more. how many now?", (a + b, f"{a}+{b}")

    def act(self, verb, arg):
        if verb == "calc":
            return f"={safe_calc(arg)}\n", 0.0, False, {}
        if not re.fullmatch(r"-?\d{1,9}", arg):
            raise CalcError("answer must be an integer")
        right = int(arg) == self.state[0]
        return "", float(right), True, {"success": right}

    def expert(self) -> str:
        return f"calc {self.state[1]}" if self.turn == 0 else f"answer {self.state[0]}"


class GuessNumberEnv(_EmbeddedEnv):
    """A game: find a secret number in [1, 32]; a wrong `guess N` is answered `higher` or `lower`; the
    right one ends the episode with reward 1. Truncated after max_turns guesses (binary search: at most 6).
    Its held-out split separates by game id only, which does not change the game's difficulty."""

    name, verbs = "guess", ("guess",)

    def __init__(self, split: str = "train", cfg: EnvConfig | None = None):
        super().__init__(split, cfg or EnvConfig(max_turns=6))

    def make(self, rng):
        secret, game = int(rng.integers(1, 33)), int(rng.integers(10**5))
        self.lo, self.hi = 1, 32  # what the feedback so far allows (for the scripted solver)
        return f"game {game}: guess my number, 1 to 32.", secret

    def act(self, verb, arg):
        if not re.fullmatch(r"\d{1,2}", arg) or not 1 <= int(arg) <= 32:
            raise CalcError("guess a number from 1 to 32")
        g = int(arg)
        if g == self.state:
            return "", 1.0, True, {"success": True}
        self.lo, self.hi = (max(self.lo, g + 1), self.hi) if g < self.state else (self.lo, min(self.hi, g - 1))
        return ("higher\n" if g < self.state else "lower\n"), 0.0, False, {}

    def expert(self) -> str:
        return f"guess {(self.lo + self.hi) // 2}"


class TaskEnv:
    """A single-turn task as a one-turn environment: reset gives the prompt, step scores the response."""

    def __init__(self, task, problem: dict):
        self.task, self.problem, self.name = task, problem, task.name

    def reset(self, seed: int | None = None) -> tuple[str, dict]:
        return self.problem["prompt"], {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        score = float(self.task.compute_score(action, self.problem["ground_truth"]))
        return "", score, True, False, {"success": score == 1.0}


class GemEnv:
    """Adapter for environments of the `gem` package (pip install gem-llm; optional): `gem:<env id>`.

    GEM already uses these signatures; the adapter names the env, sets info["success"] (GEM's own if given,
    else: terminated, not truncated, reward >= 1, GEM's convention for a solved task) and splits by seed:
    eval episodes use seeds >= 2**31 (EVAL_SEED), train episodes seeds below it. No scripted solver, so no
    SFT warm start: `--task gem:<id>` needs `--model`.
    """

    EVAL_SEED = 2**31

    def __init__(self, env_id: str, split: str = "train", **kwargs):
        try:
            import gem
        except ImportError as e:
            raise ImportError(f"environment 'gem:{env_id}' needs the gem package: pip install gem-llm") from e
        self.name, self.split, self.env = f"gem:{env_id}", split, gem.make(env_id, **kwargs)

    def reset(self, seed: int | None = None) -> tuple[str, dict]:
        seed = None if seed is None else seed % self.EVAL_SEED + (self.EVAL_SEED if self.split == "eval" else 0)
        obs, info = self.env.reset(seed=seed)
        return str(obs), dict(info or {})

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        obs, reward, terminated, truncated, info = self.env.step(action)
        info = dict(info or {})
        info.setdefault("success", bool(terminated and not truncated and float(reward) >= 1.0))
        return str(obs), float(reward), bool(terminated), bool(truncated), info


ENVS = {"calc": CalculatorEnv, "guess": GuessNumberEnv}


def is_env(name: str | None) -> bool:
    """Whether a --task name is a multi-turn environment (embedded, or gem:<id>)."""
    return name in ENVS or (name or "").startswith("gem:")


def make_env(name: str, split: str = "train", **overrides):
    """An environment by name: calc | guess | gem:<id>; overrides: EnvConfig fields of an embedded env."""
    if name.startswith("gem:"):
        return GemEnv(name[4:], split)
    if name not in ENVS:
        raise ValueError(f"unknown environment {name!r}: must be one of {list(ENVS)} or gem:<env id>")
    env = ENVS[name](split)
    env.cfg = replace(env.cfg, **overrides)  # on top of the env's own defaults (guess: 6 turns)
    return env


# ----------------------------------------------------------------------------------------------
# Tokenizer and tiny model


def make_tokenizer():
    """A character-level PreTrainedTokenizerFast: one token per character of CHARS plus 4 specials."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + list(CHARS))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # every char its own piece
    tok.decoder = decoders.Fuse()  # join pieces without spaces
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", unk_token="<unk>"
    )


def make_tiny_model(tokenizer, **overrides):
    """Qwen2-style causal LM from a config, random init, dropout off: the embedded default policy."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = dict(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        attention_dropout=0.0,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    cfg.update(overrides)
    return Qwen2ForCausalLM(Qwen2Config(**cfg))


def format_prompt(tokenizer, text: str) -> str:
    """The prompt as the model sees it: the chat template when the tokenizer has one, else <bos> + text."""
    if getattr(tokenizer, "chat_template", None):
        msgs = [{"role": "user", "content": text}]
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    return (tokenizer.bos_token or "") + text


# ----------------------------------------------------------------------------------------------
# SFT warm start of the embedded default


@dataclass
class SFTConfig:
    task: str = "reverse"
    seed: int = 0
    lr: float = 1e-3
    batch_size: int = 256
    target_acc: float = 0.30
    check_every: int = 2
    max_steps: int = 400
    model_overrides: tuple = ()


# Greedy accuracy at which the trainer's warm start stops, per task (SFTConfig.target_acc otherwise). `sort`
# stops at 0.15: its RL run plateaus near 0.75-0.8 greedy on the tiny model, so 0.30 would leave too little headroom.
SFT_TARGETS = {"sort": 0.15}


def sft_target_for(task: str) -> float:
    return SFT_TARGETS.get(task, SFTConfig.target_acc)


def sft_config_for(task: str, target_acc: float | None = None) -> SFTConfig:
    """The warm start the trainer uses for a task (one cache key for the trainer, notebooks and tests):
    target_acc None = sft_target_for(task); an environment's greedy check plays whole episodes, so it runs
    every 5 steps instead of 2."""
    target = sft_target_for(task) if target_acc is None else target_acc
    return SFTConfig(task=task, target_acc=target, check_every=5 if is_env(task) else 2)


def greedy_success(model, tokenizer, envs, seeds, max_new_tokens: int = 16, max_turns: int = 1, batch: int = 256):
    """Share of episodes solved with greedy decoding (rollout.rollout_env at temperature 0)."""
    from types import SimpleNamespace

    import torch

    from rollout import rollout_env

    cfg = SimpleNamespace(max_prompt_len=10_000, max_new_tokens=max_new_tokens, temperature=0.0, top_p=1.0, top_k=0)
    kw = {"max_turns": max_turns, "max_context": getattr(model.config, "max_position_embeddings", 1 << 30)}
    hits, eos = 0, [tokenizer.eos_token_id]
    for i in range(0, len(envs), batch):
        with torch.no_grad():
            _, info = rollout_env(model, tokenizer, envs[i : i + batch], seeds[i : i + batch], cfg, eos, **kw)
        hits += sum(e["success"] for e in info)
    return hits / len(envs)


def greedy_accuracy(model, tokenizer, task, problems: list[dict], max_new_tokens: int = 16, batch: int = 256):
    """Share of a single-turn task's problems whose greedy answer scores exactly 1 (one-turn TaskEnvs)."""
    envs = [TaskEnv(task, p) for p in problems]
    return greedy_success(model, tokenizer, envs, [None] * len(envs), max_new_tokens, batch=batch)


def _sft_pair(tokenizer, problem: dict) -> tuple[list[int], list[int]]:
    """Ids and labels of one single-turn demonstration: the prompt (label -100), then answer + EOS."""
    prompt = tokenizer(format_prompt(tokenizer, problem["prompt"]), add_special_tokens=False).input_ids
    answer = tokenizer(problem["ground_truth"], add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
    return prompt + answer, [-100] * len(prompt) + answer


def _sft_episode(tokenizer, env, seed: int) -> tuple[list[int], list[int]]:
    """Ids and labels of one episode played by the env's scripted solver: labels on actions (+ EOS) only,
    observations tokenised exactly as rollout_env does (rollout.observation_ids)."""
    from rollout import observation_ids

    obs, _ = env.reset(seed=seed)
    ids = observation_ids(tokenizer, obs, first=True)
    labels = [-100] * len(ids)
    while True:
        action = env.expert()
        act = tokenizer(action, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
        ids, labels = ids + act, labels + act
        obs, _, terminated, truncated, _ = env.step(action)
        if terminated or truncated:
            return ids, labels
        o = observation_ids(tokenizer, obs, first=False)
        ids, labels = ids + o, labels + [-100] * len(o)


def _sft_batch(tokenizer, pairs: list[tuple[list[int], list[int]]]):
    """input_ids, attention_mask and labels [B, T] of (ids, labels) pairs, right-padded."""
    import torch

    n = max(len(s) for s, _ in pairs)
    ids = torch.full((len(pairs), n), tokenizer.pad_token_id)  # [B, T]
    lab = torch.full((len(pairs), n), -100)  # [B, T]
    mask = torch.zeros(len(pairs), n, dtype=torch.long)  # [B, T]
    for i, (s, la) in enumerate(pairs):
        ids[i, : len(s)], lab[i, : len(s)], mask[i, : len(s)] = torch.tensor(s), torch.tensor(la), 1
    return ids, mask, lab


def sft_cache_key(cfg: SFTConfig) -> str:
    import torch
    import transformers

    src = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()
    blob = json.dumps([asdict(cfg), src, torch.__version__, transformers.__version__], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def sft_warm_start(
    cfg: SFTConfig | None = None, cache_dir: Path = CACHE_DIR, verbose: bool = True, device: str = "cpu"
) -> Path:
    """Path of a saved (model + tokenizer) folder: the tiny model after a short SFT on `cfg.task`.

    Built once per key; concurrent callers wait on a file lock and then load the cached folder.
    `device` only says where to train (e.g. "cuda"); it is not part of the key.
    """
    import torch

    cfg = cfg or SFTConfig()
    out = Path(cache_dir) / f"sft-{cfg.task}-{sft_cache_key(cfg)}"
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(str(out) + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if (out / "sft.json").exists():
            return out
        torch.manual_seed(cfg.seed)
        rng = np.random.default_rng(cfg.seed)
        tokenizer = make_tokenizer()
        model = make_tiny_model(tokenizer, **dict(cfg.model_overrides)).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
        if is_env(cfg.task):  # multi-turn: episodes of the env's scripted solver, success of greedy episodes
            seeds = [int(x) for x in np.random.default_rng(cfg.seed + 10_000).integers(2**31, size=256)]
            turns = make_env(cfg.task).cfg.max_turns

            def demos(n):
                return [_sft_episode(tokenizer, make_env(cfg.task), int(x)) for x in rng.integers(2**31, size=n)]

            def accuracy():
                return greedy_success(model, tokenizer, [make_env(cfg.task) for _ in seeds], seeds, 16, turns)
        else:
            task = make_task(cfg.task)
            val = task.sample(256, "train", np.random.default_rng(cfg.seed + 10_000))
            answer_len = max(16, max(len(p["ground_truth"]) for p in val) + 1)  # + EOS; chain answers: 43 chars

            def demos(n):
                return [_sft_pair(tokenizer, p) for p in task.sample(n, "train", rng)]

            def accuracy():
                return greedy_accuracy(model, tokenizer, task, val, max_new_tokens=answer_len)

        acc, step = 0.0, 0
        for step in range(1, cfg.max_steps + 1):
            model.train()
            ids, mask, labels = (x.to(device) for x in _sft_batch(tokenizer, demos(cfg.batch_size)))
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if step % cfg.check_every == 0:
                model.eval()
                acc = accuracy()
                if verbose:
                    print(f"sft step {step:4d}  loss {loss.item():.4f}  greedy acc {acc:.3f}", flush=True)
                if acc >= cfg.target_acc:
                    break
        if acc < cfg.target_acc:
            raise RuntimeError(
                f"SFT warm start of {cfg.task!r} did not reach {cfg.target_acc} in {cfg.max_steps} steps"
            )
        model.eval()
        tmp = out.with_name(out.name + ".tmp")
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "sft.json").write_text(json.dumps({**asdict(cfg), "steps": step, "val_acc": acc}))
        tmp.rename(out)  # atomic: a half-written folder is never seen as the cache
        return out


def main():
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--task", choices=TASKS, default=None, help="one task (default: all)")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    for name in [args.task] if args.task else TASKS:
        task = make_task(name)
        for p in task.sample(3, "train", rng):
            print(f"{name:8s} prompt {p['prompt']!r:14s} answer {p['ground_truth']!r}")
    path = sft_warm_start(sft_config_for(args.task or "sort"))  # the trainer's warm start (default task: sort)
    print("SFT warm start:", path, json.loads((path / "sft.json").read_text()))


if __name__ == "__main__":
    main()
