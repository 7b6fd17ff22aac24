"""Multi-turn environments with GEM's interface: a calculator tool, a number game, any GEM env, a task as one turn.

    python envs.py             # one episode of each embedded environment, played by its scripted solver

`Env` is GEM's interface: `reset(seed) -> (observation, info)`, `step(action) -> (observation, reward,
terminated, truncated, info)`. `rollout.rollout_env` runs B of them in lockstep turns; nothing else in the
project steps an environment.
- `calc` (CalculatorEnv): an arithmetic word problem; the tool call `calc EXPR` is answered `=VALUE` by
  `safe_calc`, a recursive-descent parser that never calls eval/exec; `answer N` ends the episode (reward 1 if
  right).
- `guess` (GuessNumberEnv): find a secret number in [1, 32] from higher / lower feedback.
- `gem:<env id>` (GemEnv): the `gem` package's environments (pip install gem-llm; optional).
- `TaskEnv`: a single-turn task of tasks.py as a one-turn environment, so that single- and multi-turn runs
  share one sampling path.

Implementation details (our choices)
1. Seeded and deterministic: the same seed gives the same episode. Train and held-out episodes are disjoint:
   an episode belongs to the eval split iff its first observation does (tasks.is_eval_problem); GEM envs
   split by seed instead (GemEnv.EVAL_SEED).
2. A malformed action (wrong verb, bad argument, an expression the parser refuses) gets a documented penalty
   (EnvConfig.penalty, -0.1) and an `error: ...` observation; the episode goes on. Nothing from a model
   reaches eval, exec, a shell or a file path.
3. `expert()` is each embedded env's scripted solver: warm_start.py imitates it (labels on actions only).
4. Optional per-step latency (EnvConfig.latency_s, log-normal with latency_sigma, drawn from the episode's
   seed) exercises asynchronous rollouts (async_loop.py); evaluation episodes never sleep.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np

from cli import check_fields
from tasks import is_eval_problem


@dataclass
class EnvArgs:
    """The trainer's knobs of multi-turn episodes; its Config inherits them."""

    max_turns: int = 8
    """Multi-turn environments: actions per episode at most (the environment's own limit usually ends it first)."""
    max_context: int = 256
    """Multi-turn environments: tokens per episode at most (prompt, actions, observations)."""
    env_latency: float = 0.0
    """Embedded environments: mean seconds each step takes (log-normal, sigma 0.5; exercises async rollouts)."""

    def __post_init__(self):
        check_fields(self, {"[1, inf)": ("max_turns",), "[0.0, inf)": ("env_latency",)}, EnvArgs)


# ----------------------------------------------------------------------------------------------
# The interface


class Env(Protocol):
    """A multi-turn environment with GEM-compatible signatures (`gem.Env`)."""

    def reset(self, seed: int | None = None) -> tuple[str, dict]:
        """Start an episode; returns (first observation, info)."""

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        """Apply one action; returns (observation, reward, terminated, truncated, info)."""


# ----------------------------------------------------------------------------------------------
# The calculator's safe parser and the action format


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
        """Start the episode of `seed` (Env.reset): its first observation."""
        self.rng = np.random.default_rng(seed)
        while True:  # rejection keeps train and eval episodes disjoint (implementation detail 1)
            obs, self.state = self.make(self.rng)
            if is_eval_problem(obs) == (self.split == "eval"):
                break
        self.turn, self.done = 0, False
        return obs, {"seed": seed}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        """Apply one action (Env.step); a malformed one gets the penalty and an error observation."""
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
        """A word problem and (its answer, the expression a calculator call needs)."""
        who, item, kind = self.NAMES[rng.integers(5)], self.ITEMS[rng.integers(4)], int(rng.integers(3))
        if kind == 2:
            a, b = int(rng.integers(2, 10)), int(rng.integers(10, 100))
            return f"{who} buys {a} bags of {b} {item}. how many {item}?", (a * b, f"{a}*{b}")
        b, a = sorted(int(x) for x in rng.integers(10, 100, size=2))
        if kind == 1:
            return f"{who} has {a} {item} and gives away {b}. how many left?", (a - b, f"{a}-{b}")
        return f"{who} has {a} {item} and gets {b} more. how many now?", (a + b, f"{a}+{b}")

    def act(self, verb, arg):
        """The calculator's answer to `calc EXPR`, or the reward of `answer N` (which ends the episode)."""
        if verb == "calc":
            return f"={safe_calc(arg)}\n", 0.0, False, {}
        if not re.fullmatch(r"-?\d{1,9}", arg):
            raise CalcError("answer must be an integer")
        right = int(arg) == self.state[0]
        return "", float(right), True, {"success": right}

    def expert(self) -> str:
        """The scripted solver's next action: one calculator call, then the answer."""
        return f"calc {self.state[1]}" if self.turn == 0 else f"answer {self.state[0]}"


class GuessNumberEnv(_EmbeddedEnv):
    """A game: find a secret number in [1, 32]; a wrong `guess N` is answered `higher` or `lower`; the
    right one ends the episode with reward 1. Truncated after max_turns guesses (binary search: at most 6).
    Its held-out split separates by game id only, which does not change the game's difficulty."""

    name, verbs = "guess", ("guess",)

    def __init__(self, split: str = "train", cfg: EnvConfig | None = None):
        super().__init__(split, cfg or EnvConfig(max_turns=6))

    def make(self, rng):
        """The opening line of a game and its secret number."""
        secret, game = int(rng.integers(1, 33)), int(rng.integers(10**5))
        self.lo, self.hi = 1, 32  # what the feedback so far allows (for the scripted solver)
        return f"game {game}: guess my number, 1 to 32.", secret

    def act(self, verb, arg):
        """higher / lower for a wrong guess; reward 1 and the end for the right one."""
        if not re.fullmatch(r"\d{1,2}", arg) or not 1 <= int(arg) <= 32:
            raise CalcError("guess a number from 1 to 32")
        g = int(arg)
        if g == self.state:
            return "", 1.0, True, {"success": True}
        self.lo, self.hi = (max(self.lo, g + 1), self.hi) if g < self.state else (self.lo, min(self.hi, g - 1))
        return ("higher\n" if g < self.state else "lower\n"), 0.0, False, {}

    def expert(self) -> str:
        """Binary search over what the feedback so far allows."""
        return f"guess {(self.lo + self.hi) // 2}"


class TaskEnv:
    """A single-turn task as a one-turn environment: reset gives the prompt, step scores the response (solved: a
    score >= 1). The user's data (a task with `score_batch`) is scored for the whole turn at once by score_turn."""

    def __init__(self, task, problem: dict):
        self.task, self.problem, self.name, self.scored = task, problem, task.name, None

    def reset(self, seed: int | None = None) -> tuple[str | list[dict], dict]:
        """The task's prompt (a text, or chat messages) as the first observation."""
        self.scored = None
        return self.problem["prompt"], {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        """Score the response with the task's reward, or take score_turn's (score, solved, its reward metrics);
        the episode ends."""
        if self.scored is None:  # a procedural task: its reward right here (time/reward: evaluation.rollout_metrics)
            t0 = time.perf_counter()
            score = float(self.task.compute_score(action, self.problem["ground_truth"]))
            self.scored = score, score >= 1.0, {"time/reward": time.perf_counter() - t0}
        return "", self.scored[0], True, False, {"success": self.scored[1], "reward_info": self.scored[2]}


def score_turn(envs: list, texts: list[str], ids: list[list[int]]) -> None:
    """Before a turn's envs step: the TaskEnvs of a task with `score_batch` (data.DataTask: the user's reward
    functions in their worker pool, a reward model) get (score, solved, reward metrics) in one call per task."""
    by_task = {}
    for env, text, act in zip(envs, texts, ids):
        if isinstance(env, TaskEnv) and hasattr(env.task, "score_batch"):
            by_task.setdefault(id(env.task), []).append((env, text, act))
    for group in by_task.values():
        scored = group[0][0].task.score_batch([e.problem for e, _, _ in group], [t for _, t, _ in group],
                                              [a for _, _, a in group])  # fmt: skip
        for (env, _, _), *this in zip(group, *scored):
            env.scored = tuple(this)


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
        """GEM's reset on a seed of this split (eval seeds >= EVAL_SEED)."""
        seed = None if seed is None else seed % self.EVAL_SEED + (self.EVAL_SEED if self.split == "eval" else 0)
        obs, info = self.env.reset(seed=seed)
        return str(obs), dict(info or {})

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        """GEM's step, with info['success'] set."""
        obs, reward, terminated, truncated, info = self.env.step(action)
        info = dict(info or {})
        info.setdefault("success", bool(terminated and not truncated and float(reward) >= 1.0))
        return str(obs), float(reward), bool(terminated), bool(truncated), info


ENVS = {"calc": CalculatorEnv, "guess": GuessNumberEnv}


def is_env(name: str | None) -> bool:
    """Whether a --task name is a multi-turn environment (embedded, or gem:<id>)."""
    return name in ENVS or (name or "").startswith("gem:")


def multi_turn(cfg) -> bool:
    """Whether a run samples episodes of an environment (rewards per turn) rather than a single-turn task."""
    return cfg.data is None and is_env(cfg.task)


def rollout_kw(cfg) -> dict:
    """rollout_env's limits and sampling settings from a trainer config: an environment's turns and context, or
    one turn of max_prompt_len + max_new_tokens (a task)."""
    turns, context = (
        (cfg.max_turns, cfg.max_context) if multi_turn(cfg) else (1, cfg.max_prompt_len + cfg.max_new_tokens)
    )
    return dict(
        max_prompt_len=cfg.max_prompt_len,
        max_new_tokens=cfg.max_new_tokens,
        max_turns=turns,
        max_context=context,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        top_k=cfg.top_k,
    )


def make_env(name: str, split: str = "train", **overrides):
    """An environment by name: calc | guess | gem:<id>; overrides: EnvConfig fields of an embedded env."""
    if name.startswith("gem:"):
        return GemEnv(name[4:], split)
    if name not in ENVS:
        raise ValueError(f"unknown environment {name!r}: must be one of {list(ENVS)} or gem:<env id>")
    env = ENVS[name](split)
    env.cfg = replace(env.cfg, **overrides)  # on top of the env's own defaults (guess: 6 turns)
    return env


def env_overrides(name: str, latency: float, split: str) -> dict:
    """EnvConfig overrides of an embedded environment: the step latency (log-normal, sigma 0.5), not in evaluation."""
    if name.startswith("gem:") or split == "eval":
        return {}
    return {"latency_s": latency, "latency_sigma": 0.5 if latency else 0.0}


def sample_episodes(task, env: str, split: str, n: int, rng, repeat: int = 1, latency: float = 0.0) -> list:
    """n x repeat episodes [(env, seed)], a group of `repeat` per problem or env seed: a single-turn `task`'s
    problems as TaskEnvs (seed None), or, when task is None, episodes of the environment named `env`."""
    if task is not None:
        return [(TaskEnv(task, p), None) for p in task.sample(n, split, rng) for _ in range(repeat)]
    seeds = [int(x) for x in rng.integers(2**31, size=n)]
    return [(make_env(env, split, **env_overrides(env, latency, split)), s) for s in seeds for _ in range(repeat)]


def main() -> None:
    """Play one episode of each embedded environment with its scripted solver and print the transcript."""
    for name in ENVS:
        env = make_env(name)
        obs, _ = env.reset(seed=0)
        print(f"--- {name}\nobs    {obs!r}")
        done = False
        while not done:
            action = env.expert()
            obs, reward, terminated, truncated, info = env.step(action)
            done = terminated or truncated
            print(f"action {action!r} -> reward {reward}, obs {obs!r}, info {info}")
    env = make_env("calc")
    env.reset(seed=1)
    obs, reward, *_ = env.step("calc 2**99")  # not in the calculator's grammar: a penalty, the episode goes on
    print(f"--- a malformed action: 'calc 2**99' -> reward {reward}, obs {obs!r}")


if __name__ == "__main__":
    main()
