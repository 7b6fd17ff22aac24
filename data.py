"""The user's data: JSONL, parquet or a `datasets` folder, in veRL's schema or the plain one, checked at load.

    python data.py FILE_OR_FOLDER [--reward SPEC ...]   # load, check and print a few rows as the model sees them

What lives here
1. `read_rows(path)`: the rows of a JSONL file (`.jsonl`, `.json` lines), a parquet file (needs `pyarrow`) or a
   `datasets.save_to_disk` folder (needs `datasets`; a DatasetDict gives its "train" split to --data and its
   "test" or "validation" split to --eval-data), each with where it came from (file:line, file:row N).
2. `normalize_row`: one schema for every source. veRL's: `prompt` a list of chat messages, `data_source`,
   `reward_model.ground_truth`, `extra_info`; the plain one: `prompt` a string (or messages, TRL's
   conversational format) and `ground_truth`. Every column is kept for TRL reward functions.
3. `check_rows`: every row at load, not at the step that first samples it (rewards.check_ground_truth, prompt
   lengths as the model sees them, repeated prompts, characters the tokenizer cannot read); a held-out prompt that
   is also a training one is an error.
4. `DataTask`: the trainer's task for --data: sample rows of a split, score responses with rewards.RewardSet.

Implementation details (our choices)
1. Splits: with --eval-data, every --data row trains and the held-out rows are that file's; without it, a row is
   held out iff crc32(its prompt) % 10 == 0 (tasks.is_eval_problem), so no held-out prompt is ever trained on.
   Evaluation scores each held-out row once, in file order (the first --eval-n), as veRL's validation does;
   training draws rows with replacement.
2. Chat prompts go through the tokenizer's chat template (tasks.format_prompt). A tokenizer without one (the
   embedded model's) gets the user messages' contents joined by newlines, said once in the log.
3. A row counts as solved (rollout/acc, eval/acc, pass@k) when the first reward term's own value is >= 1: a right
   answer under the built-in rewards and veRL's convention of score 1.0 for a correct one (rewards.py, 4).
4. Ground truths reach veRL and TRL functions as stored (a number stays a number); the built-in rewards compare
   their text (rewards.as_text).
"""

from __future__ import annotations

import argparse
import collections
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cli import json_refusal, parse_config
from rewards import REWARDS, RewardArgs, RewardSet, as_text, check_ground_truth
from tasks import format_prompt, is_eval_problem, make_task, make_tokenizer


@dataclass
class DataArgs:
    """The user's data; the trainer's Config inherits these fields."""

    data: str | None = None
    """Rows to train on instead of a procedural task: JSONL, parquet or a datasets.save_to_disk folder, in veRL's
    schema (prompt as chat messages, reward_model.ground_truth, data_source, extra_info) or the plain one
    {"prompt", "ground_truth"}."""
    eval_data: str | None = None
    """Held-out rows (same formats) for evaluation instead of the 10 % hash split of --data."""

    def __post_init__(self):
        if self.eval_data is not None and self.data is None:
            raise ValueError("config field 'eval_data' needs --data: the procedural tasks hold out their own problems")


# ----------------------------------------------------------------------------------------------
# Reading: JSONL, parquet, a datasets folder


def read_rows(path: str, split: str = "train") -> list[tuple[dict, str]]:
    """[(row, where)] of a file or folder; split picks a DatasetDict's split ("train" or "eval")."""
    p = Path(path)
    if p.is_dir():
        return _read_dataset_folder(p, split)
    if not p.is_file():
        raise FileNotFoundError(f"data file {path!r} does not exist")
    if p.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as e:
            raise ImportError(f"data file {path!r} is parquet: pip install pyarrow") from e
        return [(row, f"{path}:row {i}") for i, row in enumerate(pq.read_table(p).to_pylist(), 1)]
    return _read_jsonl(p)


def _read_jsonl(p: Path) -> list[tuple[dict, str]]:
    """One JSON object per line; blank lines skipped; bytes split on \\n only (a str would split at U+2028 too)."""
    out = []
    for i, raw in enumerate(p.read_bytes().split(b"\n"), 1):
        try:
            line = raw.decode("utf-8-sig" if i == 1 else "utf-8")
        except UnicodeDecodeError as e:
            bad = raw[e.start : e.start + 4]
            fix = "re-encode the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)"
            raise ValueError(f"{p}:{i}: not UTF-8 (byte {e.start + 1} of the line: {bad!r}): {fix}") from None
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{p}:{i}: not valid JSON ({e.msg}): {line[:80]!r}") from None
        except (ValueError, RecursionError) as e:  # an integer of over 4300 digits; brackets nested ~100k deep
            raise ValueError(f"{p}:{i}: JSON that Python will not read ({json_refusal(e)}): {line[:80]!r}") from None
        if not isinstance(row, dict):
            raise ValueError(f"{p}:{i}: expected a JSON object per line, got {line[:80]!r}")
        out.append((row, f"{p}:{i}"))
    return out


def _read_dataset_folder(p: Path, split: str) -> list[tuple[dict, str]]:
    """A datasets.save_to_disk folder: a Dataset, or a DatasetDict's train / test-or-validation split."""
    if not any((p / f).is_file() for f in ("dataset_info.json", "state.json", "dataset_dict.json")):
        missing = "no state.json, dataset_info.json or dataset_dict.json"
        raise FileNotFoundError(f"data folder {str(p)!r} is not a datasets.save_to_disk folder ({missing})")
    try:
        import datasets
    except ImportError as e:
        raise ImportError(f"data folder {str(p)!r} is a datasets folder: pip install datasets") from e
    ds = datasets.load_from_disk(str(p))
    if isinstance(ds, datasets.DatasetDict):
        wanted = ["train"] if split == "train" else ["test", "validation"]
        name = next((s for s in wanted if s in ds), None)
        if name is None:
            raise ValueError(f"{p}: a DatasetDict with splits {list(ds)}, none of {wanted} (for the {split} rows)")
        if split == "train" and len(ds) > 1:
            print(
                f"[minrl] {p}: training on its 'train' split; {[s for s in ds if s != 'train']} only with --eval-data"
            )
        ds, p = ds[name], p / name
    return [(row, f"{p}:row {i}") for i, row in enumerate(ds.to_list(), 1)]


# ----------------------------------------------------------------------------------------------
# One schema for every source


def normalize_row(row: dict, where: str, default_source: str) -> dict:
    """{"prompt": str | messages, "ground_truth", "data_source", "extra_info", "columns", "where"} of a veRL or a
    plain row; "columns": every column but the prompt (what TRL passes its reward functions)."""
    prompt = row.get("prompt")
    if isinstance(prompt, list):
        for k, msg in enumerate(prompt):
            if not (isinstance(msg, dict) and isinstance(msg.get("role"), str) and isinstance(msg.get("content"), str)):
                raise ValueError(
                    f"{where}: prompt message {k} is {str(msg)[:80]!r}, not {{'role': str, 'content': str}}"
                )
        if not any(m["role"] == "user" for m in prompt):
            raise ValueError(f"{where}: the prompt's messages have no 'user' message: {str(prompt)[:80]!r}")
    elif not isinstance(prompt, str):
        raise ValueError(f"{where}: 'prompt' must be a string or a list of chat messages, got {str(prompt)[:80]!r}")
    truth = row.get("ground_truth")
    rm = row.get("reward_model")
    if truth is None and isinstance(rm, dict):  # veRL: reward_model = {"ground_truth": ..., "style": "rule"}
        truth = rm.get("ground_truth")
    extra = row.get("extra_info") or {}  # veRL passes {} for a row without one
    columns = {k: v for k, v in row.items() if k != "prompt"}  # what TRL passes its reward functions
    if truth is not None:  # a veRL row's truth sits in reward_model: a TRL function reads kw["ground_truth"] anyway
        columns.setdefault("ground_truth", truth)
    source = row.get("data_source") or default_source
    verl_fields = {"prompt": prompt, "ground_truth": truth, "data_source": source, "extra_info": extra}
    return {**verl_fields, "columns": columns, "where": where}


def prompt_text(prompt) -> str:
    """A prompt as one string (for the hash split and messages): the text, or the messages as JSON."""
    return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True)


def check_rows(rows: list[dict], rewards: list[str], tokenizer=None, max_prompt_len=None) -> None:
    """Every normalized row at load; `rewards`: the terms that read the ground truth (built-in names, and veRL
    functions' specs: they need one but may read it any way). Errors: a ground truth missing or one a built-in
    reward cannot score, two ground truths for one prompt, an empty prompt, a prompt longer than max_prompt_len
    tokens as the model sees it (format_prompt). Reported with counts: rows repeating an earlier row's prompt and
    answer (kept: they weigh more) and characters the tokenizer maps to its unknown token."""
    first, dups = {}, collections.Counter()  # repeats per file (--data and --eval-data are told apart)
    for row in rows:
        at, truth = row["where"], row["ground_truth"]
        if rewards and truth is None:
            raise ValueError(f"{at}: no ground_truth (nor reward_model.ground_truth): reward {rewards[0]!r} reads one")
        for name in (r for r in rewards if r in REWARDS):
            check_ground_truth(name, truth, at)
        text = prompt_text(row["prompt"])
        if (
            not "".join(m["content"] for m in row["prompt"]).strip()
            if isinstance(row["prompt"], list)
            else not text.strip()
        ):
            raise ValueError(f"{at}: empty prompt")
        seen = first.setdefault(text, (truth, at))
        if seen[0] != truth:
            here = f"{at}: prompt {text[:60]!r} has ground_truth {str(truth)[:40]!r} here"
            raise ValueError(f"{here} but {str(seen[0])[:40]!r} at {seen[1]}: one prompt, one answer (fix or drop one)")
        dups[at.rsplit(":", 1)[0]] += seen[1] != at
    files = collections.Counter(row["where"].rsplit(":", 1)[0] for row in rows)  # rows per file
    for name, n in dups.items():
        if n:
            print(f"[minrl] {name}: {n} of its {files[name]} rows repeat an earlier row (kept: sampled more often)")
    source = " + ".join(files) or "data"
    if tokenizer is not None and max_prompt_len is not None:
        check_lengths(rows, tokenizer, max_prompt_len, source)


def check_lengths(rows: list[dict], tokenizer, max_prompt_len: int, source: str) -> None:
    """Prompts longer than max_prompt_len tokens as the model sees them are an error; unknown characters are told."""
    prompts = [format_prompt(tokenizer, r["prompt"]) for r in rows]
    lengths = [len(ids) for ids in tokenizer(prompts, add_special_tokens=False).input_ids]
    over = [(r["where"], n) for r, n in zip(rows, lengths) if n > max_prompt_len]
    if over:
        shown = ", ".join(f"{at} ({n} tokens)" for at, n in over[:3])
        what = f"{len(over)} prompts are longer than max_prompt_len={max_prompt_len} tokens as the model sees them"
        raise ValueError(f"{source}: {what}: {shown}{', ...' * (len(over) > 3)}; raise --max-prompt-len or drop them")
    unk = tokenizer.unk_token_id
    texts = {"prompt": prompts}
    texts["ground_truth"] = [as_text(r["ground_truth"]) for r in rows if isinstance(as_text(r["ground_truth"]), str)]
    for key in texts if unk is not None else ():
        counts = collections.Counter(c for t in texts[key] for c in t)
        lost = {c: n for c, n in counts.items() if unk in tokenizer(c, add_special_tokens=False).input_ids}
        if lost:
            top = ", ".join(f"{c!r} x{n}" for c, n in sorted(lost.items(), key=lambda kv: -kv[1])[:8])
            n, name = sum(lost.values()), tokenizer.unk_token
            print(f"[minrl] {source}: {n} characters of the {key}s map to the unknown token {name}: {top}")


def load_rows(path: str, split: str = "train") -> list[dict]:
    """Normalized rows of a file or folder (read_rows, normalize_row); none at all is an error."""
    if not (rows := read_rows(path, split)):
        where = f"data file {path!r}" + (f" (split {split!r})" if Path(path).is_dir() else "")
        raise ValueError(f"{where} has no rows: a run needs at least one prompt")
    return [normalize_row(row, where, Path(path).stem) for row, where in rows]


# ----------------------------------------------------------------------------------------------
# The trainer's task for --data


class DataTask:
    """The user's rows (train and held-out), scored in batches by a RewardSet (rewards.py)."""

    def __init__(self, args: DataArgs, rewards: RewardArgs, tokenizer=None, max_prompt_len=None, device="cpu"):
        self.name = f"data:{Path(args.data).name}"
        self.rewards = RewardSet(rewards, device)
        readers = [t for t in rewards.reward_terms() if t in REWARDS or self.rewards.fns.get(t, ("", ""))[1] == "verl"]
        train = load_rows(args.data, "train")
        held = load_rows(args.eval_data, "eval") if args.eval_data else []
        check_rows(train + held, readers, tokenizer, max_prompt_len)
        seen = {prompt_text(r["prompt"]): r["where"] for r in train}
        if both := [(r["where"], seen[prompt_text(r["prompt"])]) for r in held if prompt_text(r["prompt"]) in seen]:
            what = f"{len(both)} held-out prompts are training prompts too, e.g. {both[0][0]} = {both[0][1]}"
            raise ValueError(f"{what}: drop them from one file (a held-out score of trained prompts measures memory)")
        if held:
            self.rows = {"train": train, "eval": held}
        else:
            self.rows = {"train": [], "eval": []}
            for row in train:
                self.rows["eval" if is_eval_problem(prompt_text(row["prompt"])) else "train"].append(row)
        if not self.rows["train"]:
            raise ValueError(
                f"{args.data}: no training rows ({len(train)} rows, all in the held-out 10 % by prompt hash)"
            )
        if not self.rows["eval"]:
            print(f"[minrl] {args.data}: no prompt falls in the held-out split; evaluation uses training rows")
        sources = {r["data_source"] for r in self.rows["eval"] or self.rows["train"]}  # veRL's val-core/<source>/...
        self.source = sources.pop() if len(sources) == 1 else self.name
        chat = any(isinstance(r["prompt"], list) for r in train + held)
        if chat and tokenizer is not None and not getattr(tokenizer, "chat_template", None):
            how = "the model reads each prompt's user messages joined by newlines"
            print(f"[minrl] {args.data}: chat prompts, and the tokenizer has no chat template: {how}")

    def sample(self, n: int, split: str, rng: np.random.Generator) -> list[dict]:
        """Training: n rows drawn with replacement. Held out: the first n rows once each (detail 1); the training
        rows if none is held out."""
        rows = self.rows[split] or self.rows["train"]
        return rows[:n] if split == "eval" else [rows[i] for i in rng.integers(0, len(rows), size=n)]

    def score_batch(self, rows: list[dict], texts: list[str], ids: list[list[int]]) -> tuple[list, list, list]:
        """[B] weighted rewards, [B] solved and [B] per-sample reward metrics of B responses (RewardSet.score)."""
        return self.rewards.score(rows, texts, ids)

    def close(self) -> None:
        """Stop the reward workers."""
        self.rewards.close()


def load_task(cfg, tokenizer=None, device="cpu"):
    """The trainer's single-turn task: cfg.task's procedural one, or the DataTask of cfg.data (cfg: a config with
    DataArgs, RewardArgs and max_prompt_len fields, such as trainer.Config)."""
    return make_task(cfg.task) if cfg.data is None else DataTask(cfg, cfg, tokenizer, cfg.max_prompt_len, device)


def main(argv=None) -> None:
    """Load a file or folder as the trainer would, check every row and print three as the model sees them."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("data", help="JSONL, parquet or a datasets.save_to_disk folder")
    known, rest = ap.parse_known_args(argv)
    rewards = parse_config(RewardArgs, rest)
    tok = make_tokenizer()
    task = DataTask(DataArgs(data=known.data), rewards, tok, max_prompt_len=1 << 20)
    print(f"{task.name}: {len(task.rows['train'])} train rows, {len(task.rows['eval'])} held out")
    for row in task.rows["train"][:3]:
        print(f"{row['where']}: {format_prompt(tok, row['prompt'])!r} -> ground truth {row['ground_truth']!r}")
    task.close()


if __name__ == "__main__":
    main()
