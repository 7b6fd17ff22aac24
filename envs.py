"""Multi-turn environments with GEM's interface: a calculator tool, a number game, any GEM env, a task as one turn.

    python envs.py             # one episode of each embedded environment, played by its scripted solver

`Env` is GEM's interface: `reset(seed) -> (observation, info)`, `step(action) -> (observation, reward,
terminated, truncated, info)`. `rollout.rollout_env` runs B of them in lockstep turns; nothing else in the
project steps an environment.
- `calc` (CalculatorEnv): an arithmetic word problem; the tool call `calc EXPR` is answered `=VALUE` by
  sandbox.safe_calc, a recursive-descent parser that never calls eval/exec; `answer N` ends the episode (reward 1
  if right).
- `guess` (GuessNumberEnv): find a secret number in [1, 32] from higher / lower feedback.
- `shell` (ShellEnv): the action is a shell command, run in the episode's own workspace by sandbox.py (what it
  isolates and what not is said there); the task: count matching lines or files, print a line or the largest
  number, checked against the answer computed from the files.
- `gem:<env id>` (GemEnv): the `gem` package's environments (pip install gem-llm; optional).
- `TaskEnv`: a single-turn task of tasks.py as a one-turn environment, so that single- and multi-turn runs
  share one sampling path.

Implementation details (our choices)
1. Seeded and deterministic: the same seed gives the same episode. Train and held-out episodes are disjoint:
   an episode belongs to the eval split iff its first observation does (tasks.is_eval_problem); GEM envs
   split by seed instead (GemEnv.EVAL_SEED).
2. A malformed action (wrong verb, bad argument, an expression the parser refuses) gets a documented penalty
   (EnvConfig.penalty, -0.1) and an `error: ...` observation; the episode goes on. Nothing from a model
   reaches eval, exec, a shell or a file path, but for ShellEnv's commands, and those only inside sandbox.py.
3. `expert()` is each embedded env's scripted solver: warm_start.py imitates it (labels on actions only). The
   shell solver can slip (ShellConfig.slip): its first command is then its habit, a plausible wrong one.
4. Optional per-step latency (EnvConfig.latency_s, log-normal with latency_sigma, drawn from the episode's
   seed) exercises asynchronous rollouts (async_loop.py); evaluation episodes never sleep.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import time
from dataclasses import dataclass, field, replace
from typing import Protocol

import numpy as np

import sandbox
from cli import check_fields
from sandbox import CalcError, safe_calc
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
    env_url: str | None = None
    """env_service.py servers that run the episodes, http://HOST:PORT[,http://HOST:PORT...] (None: in this process)."""
    env_timeout: float = 30.0
    """Seconds a remote environment's server may take to answer before its episode fails (env_service.py)."""

    def __post_init__(self):
        check_fields(self, {"[1, inf)": ("max_turns",), "[0.0, inf)": ("env_latency",), "(0.0, inf)": ("env_timeout",)},
                     EnvArgs)  # fmt: skip


# ----------------------------------------------------------------------------------------------
# The interface


class Env(Protocol):
    """A multi-turn environment with GEM-compatible signatures (`gem.Env`)."""

    def reset(self, seed: int | None = None) -> tuple[str, dict]:
        """Start an episode; returns (first observation, info)."""

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        """Apply one action; returns (observation, reward, terminated, truncated, info)."""


# ----------------------------------------------------------------------------------------------
# The action format


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
    action_tokens = 0  # tokens the longest scripted action needs with its stop token, when more than 16 (the trainer
    # refuses a smaller max_new_tokens; warm_start's greedy check gives the larger of the two)

    def __init__(self, split: str = "train", cfg: EnvConfig | None = None):
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        self.split, self.cfg, self.turn, self.done = split, cfg or EnvConfig(), 0, True

    def reset(self, seed: int | None = None) -> tuple[str, dict]:
        """Start the episode of `seed` (Env.reset): its first observation."""
        self.rng = np.random.default_rng(seed)
        while True:  # rejection keeps train and eval episodes disjoint (implementation detail 1)
            obs, self.state = self.make(self.rng)
            if is_eval_problem(self.split_key(obs)) == (self.split == "eval"):
                break
        self.turn, self.done = 0, False
        return obs, {"seed": seed}

    def split_key(self, obs: str) -> str:
        """The text whose crc32 puts an episode in a split (tasks.is_eval_problem): its first observation."""
        return obs

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        """Apply one action (Env.step); a malformed one gets the penalty and an error observation."""
        if self.done:
            raise RuntimeError(f"{self.name}: step() after the episode ended; call reset()")
        if self.cfg.latency_s > 0:
            time.sleep(self.cfg.latency_s * float(np.exp(self.cfg.latency_sigma * self.rng.standard_normal())))
        self.turn += 1
        obs, reward, terminated, info = self.respond(action)
        truncated = not terminated and self.turn >= self.cfg.max_turns
        self.done = terminated or truncated
        return obs, reward, terminated, truncated, {"success": False, **info}

    def respond(self, action: str) -> tuple[str, float, bool, dict]:
        """(observation, reward, terminated, info) of an action: `act` on its verb and argument."""
        try:
            return self.act(*parse_action(action, self.verbs))
        except CalcError as e:  # malformed: the documented penalty, nothing executed, the episode goes on
            return f"error: {e}\n", self.cfg.penalty, False, {"malformed": True}


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


@dataclass
class ShellConfig(EnvConfig):
    """Knobs of the shell environment: EnvConfig's, the sandbox's limits per command and the workspace's."""

    max_turns: int = 2  # a second command after seeing the first one's output
    limits: sandbox.Limits = field(default_factory=sandbox.Limits)
    obs_chars: int = 96  # characters of a command's output the model sees (non-printable ones as ?)
    workspace_dir: str = ""  # where the workspaces go ("" = <tmp>/minrl-shell)
    slip: float = 0.0  # share of the scripted solver's first commands that are its habit instead (ShellEnv.expert)

    def __post_init__(self):
        check_fields(self, {"[0.0, 1.0]": ("slip",)}, ShellConfig)

    def capped(self, ceiling: float) -> None:  # env_service.ServiceArgs.limit_ceiling: what a client may ask
        """A ValueError when the sandbox's limits (the workspace's size among them) pass `ceiling` x the defaults."""
        self.limits.capped(ceiling)


class ShellEnv(_EmbeddedEnv):
    """Shell tasks in a workspace of generated files: the action is a command (`sh -c`, in the sandbox); an output
    equal to the answer (computed here from the files, never by a shell) ends the episode with reward 1; another
    output is the next observation (reward 0), and after max_turns commands the episode is truncated. Kinds: count
    the lines of a file that contain a word (grep -c), count the files in a folder (ls | wc -l), print line n of a
    file (sed -n), print the largest number of a file (sort -n | tail); each with the scripted solver's habit
    (`expert`). Its split key is the first observation plus the files: held-out episodes are unseen workspaces."""

    name, verbs, action_tokens = "shell", (), 40  # `sort -n scores.txt | tail -n 1` + EOS: 31
    step_concurrently = True  # a turn's commands run at once (rollout.step_envs): they wait on processes
    WORDS = ("fox", "owl", "cat", "dog", "bee", "elk", "ant", "yak", "emu", "cod", "ram", "hen")
    FILES = ("notes.txt", "todo.txt", "log.txt", "words.txt", "list.txt", "draft.md")
    DIRS = ("src", "docs", "img", "Music", "old_files")
    NUMS = ("nums.txt", "scores.txt", "sizes.dat")

    def __init__(self, split: str = "train", cfg: ShellConfig | None = None):
        super().__init__(split, cfg or ShellConfig())
        sandbox.check_available()  # fail at construction, never run a command unsandboxed
        self.workspace, self.uid = None, None

    def make(self, rng):
        """The files of a workspace {path: text}, a task over them and (its answer, the scripted solver's command, its
        habit: a plausible command that is wrong on almost every workspace)."""
        files = {}
        for f in rng.choice(self.FILES, size=3, replace=False):
            lines = [" ".join(rng.choice(self.WORDS, size=3)) for _ in range(int(rng.integers(3, 9)))]
            files[str(f)] = lines
        folder = str(rng.choice(self.DIRS))
        for i in range(int(rng.integers(1, 10))):
            files[f"{folder}/f{i}.txt"] = [str(i)]
        nums = str(rng.choice(self.NUMS))
        files[nums] = [str(x) for x in rng.integers(1, 1000, size=int(rng.integers(3, 8)))]
        kind, f = int(rng.integers(4)), str(rng.choice(sorted(k for k in files if "/" not in k and k != nums)))
        if kind == 0:  # (task, answer, command, habit)
            w = str(rng.choice(sorted({w for x in files[f] for w in x.split()})))  # >= 1 match: grep -c exits 1 on 0
            n = str(sum(w in x for x in files[f]))
            task = (f"count the lines of {f} that contain {w}.", n, f"grep -c {w} {f}", f"grep {w} {f} | wc -c")
        elif kind == 1:
            n = len([k for k in files if k.startswith(folder + "/")])
            task = (f"count the files in {folder}.", str(n), f"ls {folder} | wc -l", f"ls -a {folder} | wc -l")
        elif kind == 2:
            n = int(rng.integers(1, len(files[f]) + 1))
            task = (f"print line {n} of {f}.", files[f][n - 1], f"sed -n {n}p {f}", f"head -n {n} {f}")
        else:
            top, cmd = str(max(map(int, files[nums]))), f"sort -n {nums} | "
            task = (f"print the largest number in {nums}.", top, cmd + "tail -n 1", cmd + "head -n 1")
        self.files = {k: "\n".join(v) + "\n" for k, v in files.items()}
        return task[0], task[1:]

    def split_key(self, obs: str) -> str:
        """The first observation and the workspace's files."""
        return obs + json.dumps(self.files, sort_keys=True)

    def reset(self, seed: int | None = None) -> tuple[str, dict]:
        """A fresh workspace with the episode's files (the previous episode's is removed)."""
        obs, info = super().reset(seed)
        self.close()
        base = self.cfg.workspace_dir or os.path.join(tempfile.gettempdir(), "minrl-shell")
        os.makedirs(base, mode=0o711, exist_ok=True)
        episode_dir = tempfile.mkdtemp(dir=base)
        os.chmod(episode_dir, 0o711)  # searchable by the sandbox's uid, listable by no one else
        self.workspace, self.uid = os.path.join(episode_dir, "work"), sandbox.take_uid()
        sandbox.prepare_workspace(self.workspace, self.uid, self.files)
        return obs, info

    def respond(self, action: str) -> tuple[str, float, bool, dict]:
        """Run the command in the sandbox; reward 1 (the end) when its output is the answer."""
        if not action.strip():
            return "error: empty command\n", self.cfg.penalty, False, {"malformed": True}
        if "\x00" in action:  # a byte-level model can type any byte; no command line can hold a NUL
            return "error: the command holds a NUL byte\n", self.cfg.penalty, False, {"malformed": True}
        r = sandbox.run(action, self.workspace, self.cfg.limits, self.uid)
        right = r.exit_code == 0 and r.output.strip() == self.state[0]
        shown = "".join(c if c.isprintable() or c == "\n" else "?" for c in r.output[: self.cfg.obs_chars])
        info = {"success": right, "exit_code": r.exit_code, "timed_out": r.timed_out, "capped": r.capped}
        return shown + f"[exit {r.exit_code}]\n", float(right), right, info

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        """Env.step; the workspace is removed when the episode ends."""
        out = super().step(action)
        if self.done:
            self.close()
        return out

    def expert(self) -> str:
        """The scripted solver's command; its first one is its habit with probability cfg.slip (a demonstrator that
        types `wc -c` for `wc -l`, `ls -a`, `head -n N` for line N, `head` for `tail`: what SFT on its episodes
        imitates and RL against the answer check must unlearn; warm_start.py's shell warm start)."""
        if self.turn == 0 and self.cfg.slip > 0 and self.rng.random() < self.cfg.slip:
            return self.state[2]
        return self.state[1]

    def demonstrations(self) -> tuple[str, str]:
        """The first commands the scripted solver may type: (the right one, its habit)."""
        return self.state[1], self.state[2]

    def close(self) -> None:
        """Remove the workspace and give its uid back (also at the end of every episode)."""
        if self.workspace is not None:
            sandbox.remove_workspace(self.workspace)
            os.rmdir(os.path.dirname(self.workspace))  # the episode's mkdtemp folder, empty now
            sandbox.release_uid(self.uid)
        self.workspace, self.uid = None, None


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


ENVS = {"calc": CalculatorEnv, "guess": GuessNumberEnv, "shell": ShellEnv}


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


def sample_episodes(task, env: str, split: str, n: int, rng, repeat: int = 1, latency: float = 0.0, make=make_env):
    """n x repeat episodes [(env, seed)], a group of `repeat` per problem or env seed: a single-turn `task`'s
    problems as TaskEnvs (seed None), or, when task is None, episodes of the environment named `env`, each made by
    `make` (make_env, or env_client.env_maker's RemoteEnvs)."""
    if task is not None:
        return [(TaskEnv(task, p), None) for p in task.sample(n, split, rng) for _ in range(repeat)]
    seeds = [int(x) for x in rng.integers(2**31, size=n)]
    return [(make(env, split, **env_overrides(env, latency, split)), s) for s in seeds for _ in range(repeat)]


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
