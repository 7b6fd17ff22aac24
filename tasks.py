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
   versions) behind a file lock, so parallel test workers build it once.

Implementation details (our choices)
1. Disjoint splits: a problem belongs to the eval split iff crc32(prompt) % 10 == 0. Train sampling
   rejects eval problems and vice versa, so no held-out prompt ever appears in training, whatever the
   size of the problem space (2-digit addition has only 10,000 problems).
2. Reward parsing is string comparison and a regular expression for numbers; nothing from a model
   reaches eval/exec. `math_exact` compares the last number in the output with the ground truth.
3. Prompts for the tiny model are `<bos>` + text; the answer ends with `<eos>`. Models with a chat
   template get the prompt as one user message (see `format_prompt`).
4. The SFT loss is on answer tokens (and EOS) only; evaluation is greedy exact match on 256 train-split
   prompts checked every `check_every` steps; the first check at or above `target_acc` stops it. The
   transition is sharp (NOTES-CPU.md), so checks are frequent.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import re
import zlib
from dataclasses import asdict, dataclass
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


def greedy_accuracy(model, tokenizer, task, problems: list[dict], max_new_tokens: int = 16, batch: int = 256):
    """Share of problems whose greedy answer scores exactly 1 (uses rollout.generate, temperature 0)."""
    import torch

    from rollout import decode_responses, generate, tokenize_prompts

    hits = 0
    for i in range(0, len(problems), batch):
        chunk = problems[i : i + batch]
        ids, mask = tokenize_prompts(tokenizer, [format_prompt(tokenizer, p["prompt"]) for p in chunk], 10_000)
        ids, mask = ids.to(model.device), mask.to(model.device)
        with torch.no_grad():
            ro = generate(
                model,
                ids,
                mask,
                max_new_tokens=max_new_tokens,
                temperature=0.0,
                eos_token_ids=[tokenizer.eos_token_id],
                pad_token_id=tokenizer.pad_token_id,
            )
        texts = decode_responses(tokenizer, ro)
        hits += sum(task.compute_score(t, p["ground_truth"]) == 1.0 for t, p in zip(texts, chunk))
    return hits / len(problems)


def _sft_batch(tokenizer, problems: list[dict]):
    """input_ids, attention_mask and labels (answer + EOS only) for teacher forcing, right-padded."""
    import torch

    seqs, labels = [], []
    for p in problems:
        prompt = tokenizer(format_prompt(tokenizer, p["prompt"]), add_special_tokens=False).input_ids
        answer = tokenizer(p["ground_truth"], add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
        seqs.append(prompt + answer)
        labels.append([-100] * len(prompt) + answer)
    n = max(map(len, seqs))
    ids = torch.full((len(seqs), n), tokenizer.pad_token_id)  # [B, T]
    lab = torch.full((len(seqs), n), -100)  # [B, T]
    mask = torch.zeros(len(seqs), n, dtype=torch.long)  # [B, T]
    for i, (s, la) in enumerate(zip(seqs, labels)):
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
        tokenizer, task = make_tokenizer(), make_task(cfg.task)
        model = make_tiny_model(tokenizer, **dict(cfg.model_overrides)).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
        val = task.sample(256, "train", np.random.default_rng(cfg.seed + 10_000))
        answer_len = max(16, max(len(p["ground_truth"]) for p in val) + 1)  # + EOS; chain answers are 43 chars
        acc, step = 0.0, 0
        for step in range(1, cfg.max_steps + 1):
            model.train()
            ids, mask, labels = (x.to(device) for x in _sft_batch(tokenizer, task.sample(cfg.batch_size, "train", rng)))
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if step % cfg.check_every == 0:
                model.eval()
                acc = greedy_accuracy(model, tokenizer, task, val, max_new_tokens=answer_len)
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
    path = sft_warm_start(SFTConfig(task=args.task or "reverse"))
    print("SFT warm start:", path, json.loads((path / "sft.json").read_text()))


if __name__ == "__main__":
    main()
