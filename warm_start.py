"""The SFT warm start of the embedded tiny model: RL from a random init has no reward signal.

    python warm_start.py                 # build (or load) the trainer's warm start of its default task
    python warm_start.py --task calc     # the warm start of another task or environment

`sft_warm_start(SFTConfig(...))` returns a folder (model + tokenizer, `from_pretrained`-loadable): the tiny model
of tasks.py after a short supervised warm start, stopped on a greedy-accuracy target rather than a time. The
trainer uses `sft_config_for(task)` when no --model is given; every RL seed starts from the same warm start.

Implementation details (our choices)
1. Cached in `.cache/` under a key of (config, the sources of tasks.py, rewards.py, envs.py, rollout.py, logits.py,
   evaluation.py and this file, the embedded tokenizer's tokenizer.json, torch and transformers versions), behind a
   file lock: parallel test workers build it once, and a half-written folder is never seen (temporary name, rename).
2. Single-turn: the loss is on answer tokens and EOS only; every `check_every` steps greedy exact match on 256
   train-split problems is measured and the first check at or above `target_acc` stops it. The transition is
   sharp, so checks are frequent, and every 2 steps once one sees a third of the target. The lr warms up over 50
   steps: without it, the byte-level model's reverse warm start at seed 0 sat at 0.09-0.14 from step 90 to 350
   and reached 0.30 at step 560, with nearly all characters right (RL then started at reward 0.85, no headroom);
   with it, 0.34 at step 102 (seeds 1 and 2, without it: 0.30 at steps 94 and 76).
3. Environments (envs.py): the demonstrations are episodes played by the env's scripted solver (`expert()`),
   with labels on action tokens (+ EOS) only and observations tokenised exactly as rollout_env does; the check
   is greedy success on 256 episodes. An episode is ~4.6x a single-turn pair's tokens (calc: 73 on average, 76
   padded, vs 16), so the trainer's warm start takes 64 of them per step, about the tokens of 256 pairs; a check
   plays whole episodes (2.6 s on 2 cores, more than a step of 256), so it runs every 10 steps until one sees a
   third of the target: calc goes from 0.19 to 0.99 greedy within 18 steps (186-204), and without the warm-up a
   check every 10 steps stopped at 0.96. calc: 192 steps, 0.375; shell: 114 steps, 0.61.
4. Targets per task (SFT_TARGETS): `sort` stops at 0.15, `shell` at 0.6, the others at 0.30 (RESULTS.md: sort).
   The shell warm start imitates a demonstrator with habits (ENV_OPTIONS: envs.ShellEnv.expert, `slip` 0.6, one
   command per episode): 60 % of its commands are a plausible wrong one (`wc -c` for `wc -l`, `ls -a`, `head -n N`
   for line N, `head` for `tail`), as SFT data from a weaker model has errors the answer check can see. Its check
   counts greedy first commands that are one of the demonstrator's (evaluation.Imitated; nothing runs), 0.6 of them; the
   model then mostly types the habit, and RL against the answer check learns from the fifth of its samples at
   temperature 0.6 that are right. With the clean demonstrator the model's errors were copying errors (a file
   name, a word) that GRPO's samples rarely got right: 0.615 held-out went to 0.64-0.66 (RESULTS.md, "Environments
   as a service").
5. Under torch.distributed only rank 0 builds (transformers' save_pretrained writes no model on another rank);
   the other ranks wait for the folder. A cached folder without a model is an error that names it.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import transformers
from tqdm.auto import tqdm

from envs import ENVS, TaskEnv, is_env, make_env
from evaluation import Imitated, greedy_accuracy
from tasks import TASKS, answer_text, format_prompt, make_task, make_tiny_model, make_tokenizer, observation_ids

CACHE_DIR = Path(__file__).resolve().parent / ".cache"
KEY_SOURCES = (
    "tasks.py",
    "rewards.py",
    "envs.py",
    "sandbox.py",
    "rollout.py",
    "logits.py",
    "evaluation.py",
    "warm_start.py",
)


@dataclass
class SFTConfig:
    """One warm start: every field enters the cache key."""

    task: str = "reverse"  # a task of tasks.py or an embedded environment of envs.py
    seed: int = 0  # model init, demonstration order and the validation problems
    lr: float = 1e-3  # AdamW
    warmup: int = 50  # steps of linear lr warm-up (detail 2)
    batch_size: int = 256  # demonstrations per step
    target_acc: float = 0.30  # greedy accuracy on 256 train-split problems that stops the SFT (detail 2)
    check_every: int = 2  # steps between two greedy checks until one sees a third of target_acc, then 2 (detail 2)
    max_steps: int = 1000  # not reaching target_acc by then is an error (detail 2: 560 steps were seen)
    model_overrides: tuple = ()  # (name, value) pairs of tasks.make_tiny_model config overrides
    env_options: tuple = ()  # (name, value) pairs of the environment's config for its demonstrations (detail 4)

    def __post_init__(self):
        for name in ("batch_size", "check_every", "max_steps"):
            if not (isinstance(getattr(self, name), int) and getattr(self, name) >= 1):
                raise ValueError(f"SFTConfig.{name} must be an integer >= 1, got {getattr(self, name)!r}")
        if not (isinstance(self.warmup, int) and self.warmup >= 0):
            raise ValueError(f"SFTConfig.warmup must be an integer >= 0 (0: no warm-up), got {self.warmup!r}")


# Greedy accuracy at which the trainer's warm start stops, per task (SFTConfig.target_acc otherwise). `sort`
# stops at 0.15: its RL run plateaus near 0.75-0.8 greedy on the tiny model, so 0.30 would leave too little headroom;
# `shell` at 0.6 (detail 4).
SFT_TARGETS = {"sort": 0.15, "shell": 0.6}
# The shell warm start's demonstrator types one command, its habit 60 % of the time (detail 4).
ENV_OPTIONS = {"shell": (("slip", 0.6), ("max_turns", 1))}


def sft_target_for(task: str) -> float:
    """The greedy accuracy at which the trainer's warm start of `task` stops."""
    return SFT_TARGETS.get(task, SFTConfig.target_acc)


def sft_config_for(task: str, target_acc: float | None = None) -> SFTConfig:
    """The warm start the trainer uses for a task (one cache key for the trainer, notebooks and tests):
    target_acc None = sft_target_for(task); an environment's episodes get their own batch and cadence (detail 3)."""
    target = sft_target_for(task) if target_acc is None else target_acc
    if is_env(task):
        opts = ENV_OPTIONS.get(task, ())
        return SFTConfig(task=task, target_acc=target, batch_size=64, check_every=10, env_options=opts)
    return SFTConfig(task=task, target_acc=target, check_every=2)


def _sft_pair(tokenizer, problem: dict) -> tuple[list[int], list[int]]:
    """Ids and labels of one single-turn demonstration: the prompt (label -100), then answer + EOS (the answer: the
    problem's "demonstration" where a task gives one, a solver's response as in countdown, else its ground truth)."""
    prompt = tokenizer(format_prompt(tokenizer, problem["prompt"]), add_special_tokens=False).input_ids
    answer = tokenizer(answer_text(problem), add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
    return prompt + answer, [-100] * len(prompt) + answer


def _sft_episode(tokenizer, env, seed: int) -> tuple[list[int], list[int]]:
    """Ids and labels of one episode played by the env's scripted solver: labels on actions (+ EOS) only,
    observations tokenised exactly as rollout_env does (tasks.observation_ids)."""
    obs, _ = env.reset(seed=seed)
    ids = observation_ids(tokenizer, obs, first=True)
    labels = [-100] * len(ids)
    try:
        for turn in range(1, env.cfg.max_turns + 1):
            action = env.expert()
            act = tokenizer(action, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
            ids, labels = ids + act, labels + act
            if turn == env.cfg.max_turns:  # the last action: nothing follows it, so it need not run (a shell command)
                break
            obs, _, terminated, truncated, _ = env.step(action)
            if terminated or truncated:
                break
            o = observation_ids(tokenizer, obs, first=False)
            ids, labels = ids + o, labels + [-100] * len(o)
    finally:  # the episode's workspace goes, also when a step raised
        getattr(env, "close", lambda: None)()
    return ids, labels


def _sft_batch(tokenizer, pairs: list[tuple[list[int], list[int]]]):
    """input_ids, attention_mask and labels [B, T] of (ids, labels) pairs, right-padded."""
    n = max(len(s) for s, _ in pairs)
    ids = torch.full((len(pairs), n), tokenizer.pad_token_id)  # [B, T]
    lab = torch.full((len(pairs), n), -100)  # [B, T]
    mask = torch.zeros(len(pairs), n, dtype=torch.long)  # [B, T]
    for i, (s, la) in enumerate(pairs):
        ids[i, : len(s)], lab[i, : len(s)], mask[i, : len(s)] = torch.tensor(s), torch.tensor(la), 1
    return ids, mask, lab


def sft_cache_key(cfg: SFTConfig) -> str:
    """16 hex digits of sha256 over the config, the sources that shape the warm start, the embedded tokenizer as the
    installed `tokenizers` serialises it (its tokenizer.json) and the library versions."""
    src = [hashlib.sha256((Path(__file__).parent / f).read_bytes()).hexdigest() for f in KEY_SOURCES]
    src.append(hashlib.sha256(make_tokenizer().backend_tokenizer.to_str().encode()).hexdigest())
    blob = json.dumps([asdict(cfg), src, torch.__version__, transformers.__version__], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def wait_for_folder(out: Path, rank: int, wait_s: float) -> None:
    """Detail 5: a rank other than 0 waits for rank 0's folder (it appears whole: renamed); a TimeoutError after."""
    deadline = time.monotonic() + wait_s
    while not (out / "sft.json").exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank}: no SFT warm start at {out} after {wait_s:.0f} s; rank 0 builds it")
        time.sleep(0.5)


def _env_demos_and_check(cfg: SFTConfig, tokenizer, model, rng):
    """(demos(n), accuracy()) of an environment's warm start: n expert episodes of fresh seeds (ids, action-only
    labels; in threads if the env waits), and greedy success on 256 fixed validation seeds (a slipping
    demonstrator's: first commands that are one of its own, detail 4)."""
    seeds = [int(x) for x in np.random.default_rng(cfg.seed + 10_000).integers(2**31, size=256)]
    opts = dict(cfg.env_options)
    env = lambda: make_env(cfg.task, **opts)  # noqa: E731
    turns, wait = env().cfg.max_turns, getattr(ENVS[cfg.task], "step_concurrently", False)

    def demos(n):
        play, threads = lambda seed: _sft_episode(tokenizer, env(), int(seed)), 16 if wait else 1
        with ThreadPoolExecutor(max_workers=threads) as pool:
            return list(pool.map(play, rng.integers(2**31, size=n)))

    def accuracy():
        envs = [Imitated(env()) if opts.get("slip") else env() for _ in seeds]
        n = max(16, ENVS[cfg.task].action_tokens)
        return greedy_accuracy(model, tokenizer, envs, seeds, max_turns=turns, max_new_tokens=n)

    return demos, accuracy


def sft_warm_start(
    cfg: SFTConfig | None = None, cache_dir: Path = CACHE_DIR, verbose: bool = True, device: str = "cpu", wait_s=3600.0
) -> Path:
    """Path of a saved (model + tokenizer) folder: the tiny model after a short SFT on `cfg.task`.

    Built once per key; concurrent callers wait on a file lock and then load the cached folder. Under
    torch.distributed a rank other than 0 waits up to `wait_s` for rank 0 to build it (detail 5).
    `device` only says where to train (e.g. "cuda"); it is not part of the key.
    """
    cfg = cfg or SFTConfig()
    out = Path(cache_dir) / f"sft-{cfg.task}-{sft_cache_key(cfg)}"
    out.parent.mkdir(parents=True, exist_ok=True)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if rank != 0:
        wait_for_folder(out, rank, wait_s)
    with open(str(out) + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if (out / "sft.json").exists():
            if not (out / "config.json").exists():  # e.g. saved by a rank other than 0 before detail 5
                raise RuntimeError(f"the cached SFT warm start {out} holds no model: delete that folder to rebuild it")
            return out
        if verbose:  # minutes once, then a cache hit for every run with this key
            say = f"SFT until greedy accuracy {cfg.target_acc}, at most {cfg.max_steps} steps"
            print(f"[minrl] building the warm start of {cfg.task!r} once ({say}), cached in {out}", flush=True)
        torch.manual_seed(cfg.seed)
        rng = np.random.default_rng(cfg.seed)
        tokenizer = make_tokenizer()  # byte-level: any text (shell commands too)
        model = make_tiny_model(tokenizer, **dict(cfg.model_overrides)).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / max(1, cfg.warmup)))
        if is_env(cfg.task):  # multi-turn: episodes of the env's scripted solver, success of greedy episodes
            demos, accuracy = _env_demos_and_check(cfg, tokenizer, model, rng)
        else:
            task = make_task(cfg.task)
            val = task.sample(256, "train", np.random.default_rng(cfg.seed + 10_000))
            answer_len = max(16, max(len(answer_text(p)) for p in val) + 1)  # + EOS

            def demos(n):
                """n (prompt, answer + EOS) pairs of training problems."""
                return [_sft_pair(tokenizer, p) for p in task.sample(n, "train", rng)]

            def accuracy():
                """Greedy accuracy on the fixed validation problems."""
                envs = [TaskEnv(task, p) for p in val]
                return greedy_accuracy(model, tokenizer, envs, [None] * len(envs), max_new_tokens=answer_len)

        form = "{desc}: {n_fmt} steps [{elapsed}, {rate_fmt}{postfix}]"  # no total: it stops at its target
        acc, step, bar = 0.0, 0, tqdm(desc=f"SFT {cfg.task}", unit="step", bar_format=form, disable=not verbose)
        for step in range(1, cfg.max_steps + 1):
            bar.update()
            model.train()
            ids, mask, labels = (x.to(device) for x in _sft_batch(tokenizer, demos(cfg.batch_size)))
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            if step % (cfg.check_every if acc < cfg.target_acc / 3 else min(2, cfg.check_every)) == 0:
                model.eval()
                acc = accuracy()
                bar.set_postfix(loss=f"{loss.item():.4f}", greedy_acc=f"{acc:.3f}", target=cfg.target_acc)
                if acc >= cfg.target_acc:
                    break
        bar.close()
        if acc < cfg.target_acc:
            raise RuntimeError(
                f"SFT warm start of {cfg.task!r} did not reach {cfg.target_acc} in {cfg.max_steps} steps"
            )
        model.eval()
        tmp = out.with_name(out.name + ".tmp")
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if not (tmp / "config.json").exists():  # never cache a folder that has no model in it
            raise RuntimeError(f"save_pretrained wrote no model to {tmp} (rank {rank}); nothing was cached")
        (tmp / "sft.json").write_text(json.dumps({**asdict(cfg), "steps": step, "val_acc": acc}))
        tmp.rename(out)  # atomic: a half-written folder is never seen as the cache
        return out


def main(argv=None) -> None:
    """Build (or load from the cache) the trainer's warm start of one task and print where it is."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--task", choices=TASKS + tuple(ENVS), default="sort", help="task or environment")
    ap.add_argument("--device", default="cpu", help="where to train (not part of the cache key)")
    args = ap.parse_args(argv)
    path = sft_warm_start(sft_config_for(args.task), device=args.device)
    print("SFT warm start:", path, json.loads((path / "sft.json").read_text()))


if __name__ == "__main__":
    main()
