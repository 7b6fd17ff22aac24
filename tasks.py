"""Single-turn procedural tasks, the embedded tiny model and tokenizer, prompts as the model sees them, model loading.

    python tasks.py                  # samples of every task, the embedded model's size
    python tasks.py --task add       # the same for one task

What lives here
1. Procedural single-turn tasks with a veRL-compatible `compute_score(solution_str, ground_truth)`:
   `reverse` (reverse 6 digits), `add` (2-digit addition, zero-padded 3-digit sum), `sort` (sort 6
   digits), `chain` (sum of five 2-digit numbers written step by step with zero-padded partial sums,
   43-character answers: long enough for attention_credit.py's windows). Partial credit = matching
   characters at matching positions / max(len(answer), len(truth)). And `countdown`, the 3A paper's task (4
   numbers to a target; worked steps then the expression, 40.5 tokens on average; TinyZero's reward,
   rewards.countdown_score; a search solver's demonstrations for the warm start: `CountdownTask`).
2. The user's own data and reward functions are data.py and rewards.py.
3. A byte-level tokenizer built locally as a real `transformers.PreTrainedTokenizerFast` (`make_tokenizer`: one
   token per byte plus 4 specials, so any text tokenizes, in any language; it round-trips through
   `save_pretrained` / `AutoTokenizer.from_pretrained` as tokenizer.json, no remote code), and
   `make_tiny_model(tokenizer)`: a Qwen2-style config with random init (about 0.53 M parameters, fp32).
   warm_start.py gives it a short SFT; multi-turn environments are in envs.py.
4. `load_policy(NAME_OR_PATH)`: any Hugging Face causal LM and its tokenizer (a local folder or a hub id);
   encoders, folders without a tokenizer and damaged weights are refused at load with the reason.

Implementation details (our choices)
1. Disjoint splits: a problem belongs to the eval split iff crc32(prompt) % 10 == 0. Train sampling
   rejects eval problems and vice versa, so no held-out prompt ever appears in training, whatever the
   size of the problem space (2-digit addition has only 10,000 problems).
2. Prompts for the tiny model are `<bos>` + text; the answer ends with `<eos>`. Models with a chat
   template get the prompt as one user message, or the row's chat messages (see `format_prompt`).
3. Loaded models run with dropout off (`.eval()`) in fp32; a tokenizer without a pad token gets its eos as
   pad (logged: masks are carried explicitly, never rebuilt from ids, so that is harmless).
"""

from __future__ import annotations

import argparse
import json
import math
import pickle
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from rewards import countdown_score, digits_score, user_text

SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]  # ids 0-3 of the embedded tokenizer; byte b is id 4 + b


# ----------------------------------------------------------------------------------------------
# What to train: the trainer's knobs, and the task interface


@dataclass
class TaskArgs:
    """The model and the task to train on (the user's data: data.DataArgs); the trainer's Config inherits these."""

    model: str | None = None
    """HF model name or local folder (AutoModelForCausalLM); None = the embedded tiny model after SFT."""
    task: str = "sort"
    """Task reverse | add | sort | chain | countdown, or multi-turn environment calc | guess | gem:<id> (ignored
    with --data)."""
    sft_target: float | None = None
    """Embedded default: greedy accuracy at which the SFT warm start stops (None = the task's, in warm_start.py)."""


class Task(Protocol):
    """A single-turn verifiable task."""

    name: str

    def sample(self, n: int, split: str, rng: np.random.Generator) -> list[dict]:
        """n problems {"prompt": str, "ground_truth": str} from split "train" or "eval"."""

    def compute_score(self, solution_str: str, ground_truth: str) -> float:
        """veRL-compatible reward in [0, 1]; 1.0 means exactly right."""


def is_eval_problem(prompt: str) -> bool:
    """The split rule shared by every task: a fixed 10 % of the problem space is held out."""
    return zlib.crc32(prompt.encode()) % 10 == 0


def split_sample(n: int, split: str, rng: np.random.Generator, draw, key) -> list:
    """n draws (draw(rng)) of one split, with replacement: rejection on is_eval_problem(key(drawn)) keeps the two
    splits disjoint (implementation detail 1)."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    out = []
    while len(out) < n:
        if is_eval_problem(key(x := draw(rng))) == (split == "eval"):
            out.append(x)
    return out


def answer_text(problem: dict) -> str:
    """The answer a warm start imitates: the task's "demonstration" where it has one (countdown), else the truth."""
    return problem.get("demonstration", problem["ground_truth"])


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
        """One problem of this task: {prompt, ground_truth}."""
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
        """n problems of one split, drawn with replacement; the split hashes the prompt."""
        return split_sample(n, split, rng, self.make, lambda p: p["prompt"])

    def compute_score(self, solution_str: str, ground_truth: str) -> float:
        """Partial credit (rewards.digits_score) of one response."""
        return digits_score(solution_str, ground_truth)


def combine(a: tuple, b: tuple, op: str) -> tuple[tuple, str] | None:
    """Countdown's one step on two nodes (value, expression, precedence), the larger operand first: (the new node,
    the step's text "25-5=20"), or None when the rules forbid it (a result that is not a positive integer).
    Parentheses only where precedence needs them."""
    (x, ex, px), (y, ey, py) = (a, b) if a[0] >= b[0] else (b, a)
    if op == "-" and x == y or op == "/" and x % y:
        return None
    prec = 1 if op in "+-" else 2
    left = f"({ex})" if px < prec else ex
    right = f"({ey})" if py < prec or py == prec and op in "-/" else ey
    value = {"+": x + y, "-": x - y, "*": x * y, "/": x // y}[op]
    return (value, f"{left}{op}{right}", prec), f"{x}{op}{y}={value}"


def countdown_solve(numbers: list[int], target: int) -> str | None:
    """The search solver of the demonstrations: depth-first over (pair of the numbers left, operation), the result
    going last, until one number is left; the first order that ends at `target` as its response, "25-5=20, 20*4=80,
    80+3=83 => (25-5)*4+3" (the worked steps, then the expression); None if no order reaches it."""

    def search(nodes: list[tuple], steps: list[str]) -> str | None:
        if len(nodes) == 1:
            return ", ".join(steps) + " => " + nodes[0][1] if nodes[0][0] == target else None
        for i in range(len(nodes)):
            for j in range(i + 1, len(nodes)):
                rest = [n for k, n in enumerate(nodes) if k not in (i, j)]
                for op in "+-*/":
                    if (step := combine(nodes[i], nodes[j], op)) and (
                        found := search(rest + [step[0]], steps + [step[1]])
                    ):
                        return found
        return None

    return search([(n, str(n), 3) for n in numbers], [])


@dataclass
class CountdownTask:
    """`countdown`: reach a target from `n_numbers` numbers in [1, max_number] with + - * / (integer steps), each
    number used once (the 3A paper's task, TinyZero's rules and reward: rewards.countdown_score). A problem's
    target is where a random order of random steps ends, kept if in [1, max_target]; its demonstration (for the
    warm start) is the search solver's first solution, so one problem has one demonstration. A problem is its
    numbers as a multiset and its target: the split (detail 1) hashes that, so no reordering of a held-out problem
    is ever trained on."""

    name: str = "countdown"
    n_numbers: int = 4
    max_number: int = 25
    max_target: int = 100

    def __post_init__(self):
        if not (2 <= self.n_numbers <= 6 and self.max_number >= 1 and self.max_target >= 1):
            raise ValueError(f"CountdownTask: n_numbers in [2, 6], max_number and max_target >= 1, got {self}")

    def draw(self, rng: np.random.Generator) -> tuple[list[int], int]:
        """Numbers and a target: random steps on random pairs until one number is left, redrawn until that number
        is in [1, max_target] (a forbidden step also redraws)."""
        while True:
            numbers = [int(x) for x in rng.integers(1, self.max_number + 1, size=self.n_numbers)]
            nodes = [(n, str(n), 3) for n in numbers]
            while len(nodes) > 1:
                i, j = rng.choice(len(nodes), size=2, replace=False)
                step = combine(nodes[i], nodes[j], "+-*/"[rng.integers(4)])
                if step is None:
                    break
                nodes = [n for k, n in enumerate(nodes) if k not in (i, j)] + [step[0]]
            if len(nodes) == 1 and 1 <= nodes[0][0] <= self.max_target:
                return numbers, nodes[0][0]

    @staticmethod
    def key(numbers: list[int], target: int) -> str:
        """What the split hashes: the numbers in sorted order and the target (any reordering, the same problem)."""
        return f"{sorted(numbers)}>{target}"

    def sample(self, n: int, split: str, rng: np.random.Generator) -> list[dict]:
        """n problems of one split, {prompt "25 5 4 3>83:", ground_truth "83|25,5,4,3", demonstration}; the
        solver runs on the kept ones only."""
        out = []
        for numbers, target in split_sample(n, split, rng, self.draw, lambda d: self.key(*d)):
            prompt, truth = f"{' '.join(map(str, numbers))}>{target}:", f"{target}|{','.join(map(str, numbers))}"
            out.append({"prompt": prompt, "ground_truth": truth, "demonstration": countdown_solve(numbers, target)})
        return out

    def compute_score(self, solution_str: str, ground_truth: str) -> float:
        """TinyZero's Countdown reward (1, format 0.1, or 0) of one response."""
        return countdown_score(solution_str, ground_truth)


TASKS = ("reverse", "add", "sort", "chain", "countdown")


def make_task(name: str):
    """A procedural task by name (the user's data is data.DataTask)."""
    if name not in TASKS:
        raise ValueError(f"config field 'task' = {name!r}: must be one of {list(TASKS)} (or pass --data FILE)")
    return CountdownTask() if name == "countdown" else DigitTask(name)


# ----------------------------------------------------------------------------------------------
# Tokenizer and tiny model


def byte_symbols() -> list[str]:
    """The 256 characters that stand for the bytes 0..255 in a byte-level vocabulary (GPT-2's convention, which
    the `tokenizers` ByteLevel pre-tokenizer applies): a printable byte is its own character, each of the others
    (control bytes, space, 127-160, 173) is shifted to a code point from 256 up, in byte order."""
    printable = {*range(33, 127), *range(161, 173), *range(174, 256)}
    shifted = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(shifted)) for b in range(256)]


def make_tokenizer():
    """The embedded byte-level PreTrainedTokenizerFast: 4 specials, then one token per byte (id 4 + b), no merges.
    Any text tokenizes (UTF-8 bytes; an ASCII character is one token, so the tasks' answers stay short), and
    decoding joins the bytes back (an incomplete UTF-8 sequence decodes to U+FFFD)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + byte_symbols())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))  # no merges: a token is a byte
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)  # text -> byte symbols
    tok.decoder = decoders.ByteLevel()
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


def format_prompt(tokenizer, prompt: str | list[dict]) -> str:
    """The prompt (a text, or chat messages) as the model sees it: the chat template when the tokenizer has one (a
    text is one user message), else <bos> + the text, or + the user messages' contents joined by newlines."""
    if getattr(tokenizer, "chat_template", None):
        msgs = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    return (tokenizer.bos_token or "") + user_text(prompt)


def observation_ids(tokenizer, text: str, first: bool) -> list[int]:
    """Ids of an environment observation, tokenised once (implementation detail 5).

    The first observation is the prompt (`format_prompt`: the chat template or <bos> + text). A later one
    follows the model's end-of-turn token: without a chat template it is the raw text; with one, it is the
    template's own text from the end of an assistant turn to the start of the next one, around a user
    message holding the observation (located by rendering a probe conversation).
    """
    if first:
        return tokenizer(format_prompt(tokenizer, text), add_special_tokens=False).input_ids
    if not getattr(tokenizer, "chat_template", None):
        return tokenizer(text, add_special_tokens=False).input_ids
    probe = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "PROBE"}]
    msgs = probe + [{"role": "user", "content": text}]
    rendered = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    end = "PROBE" + (tokenizer.eos_token or "")
    if not tokenizer.eos_token or end not in rendered:
        raise ValueError(
            f"chat template of {tokenizer.name_or_path!r}: an assistant turn does not end with the eos token "
            f"{tokenizer.eos_token!r}, so the text of the next observation cannot be located"
        )
    return tokenizer(rendered[rendered.index(end) + len(end) :], add_special_tokens=False).input_ids


# ----------------------------------------------------------------------------------------------
# Any Hugging Face causal LM


def encode_prompts(tokenizer, texts: list[str], max_prompt_len: int) -> list[list[int]]:
    """Token ids of each prompt text; raises if a prompt is empty or longer than max_prompt_len."""
    enc = [tokenizer(t, add_special_tokens=False).input_ids for t in texts]
    for i, ids in enumerate(enc):
        if len(ids) > max_prompt_len:
            raise ValueError(f"prompt {i} has {len(ids)} tokens > max_prompt_len={max_prompt_len}: {texts[i][:80]!r}")
        if not ids:
            raise ValueError(f"prompt {i} is empty")
    return enc


def tokenize_prompts(tokenizer, texts: list[str], max_prompt_len: int):
    """Left-padded prompt ids [B, P] and mask [B, P]; raises if a prompt is longer than max_prompt_len."""
    return left_pad(encode_prompts(tokenizer, texts, max_prompt_len), tokenizer.pad_token_id)


def left_pad(seqs: list[list[int]], pad_id: int):
    """[b, L] ids and attention mask of token lists, left-padded (docs/design.md section 3)."""
    import torch

    n = max(map(len, seqs))
    ids = torch.full((len(seqs), n), pad_id, dtype=torch.long)
    mask = torch.zeros(len(seqs), n, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, n - len(s) :], mask[i, n - len(s) :] = torch.tensor(s, dtype=torch.long), 1
    return ids, mask


def resolve_model_path(name: str) -> str:
    """A local folder as is; a path-like name that does not exist is an error; else a hub name."""
    if Path(name).exists():
        return name
    # "./x", "/x", "~/x", "a/b/c", or "runs/x" whose parent folder exists here: a missing local path, not a hub id
    looks_local = (
        name.startswith((".", "/", "~")) or name.count("/") > 1 or (name.count("/") == 1 and Path(name).parent.is_dir())
    )
    if looks_local:
        raise FileNotFoundError(f"model {name!r} does not exist (not a local folder, not a hub id)")
    return name


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


def load_tokenizer(name_or_path: str):
    """The model's tokenizer as load_policy loads it (a local folder's own tokenizer.json, an eos token, a pad token
    guaranteed and logged if assigned), without the weights: for a process given the policy (model_proxy.py)."""
    from transformers import AutoTokenizer

    path = resolve_model_path(name_or_path)
    if Path(path).is_dir() and not any((Path(path) / f).is_file() for f in TOKENIZER_FILES):
        raise FileNotFoundError(f"model folder {name_or_path!r} has no tokenizer (none of {list(TOKENIZER_FILES)}): "
                                f"save the one it was trained with beside it (tokenizer.save_pretrained)")  # fmt: skip
    try:
        tokenizer = _as_saved(AutoTokenizer.from_pretrained(path), path)
    except (OSError, ValueError) as e:  # hub name unreachable or not a model folder: say which model
        raise FileNotFoundError(f"could not load the tokenizer of model {name_or_path!r}: {e}") from e
    if tokenizer.eos_token_id is None:
        raise ValueError(f"tokenizer of {name_or_path!r} has no eos token: responses could never end")
    if tokenizer.pad_token_id is None:
        # masks are carried explicitly and never rebuilt from ids, so pad == eos is harmless here
        tokenizer.pad_token = tokenizer.eos_token
        print(f"[minrl] tokenizer of {name_or_path!r} has no pad token: using eos {tokenizer.eos_token!r} as pad")
    return tokenizer


def load_policy(name_or_path: str, device):
    """AutoModelForCausalLM + load_tokenizer's tokenizer, dropout off. Refused at load, naming the model and the fix:
    an encoder or encoder-decoder, a local folder without a tokenizer, damaged weights, a model whose logits at
    position t depend on later tokens (check_causal)."""
    import torch
    from safetensors import SafetensorError
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one "Loading weights" bar per model would drown the metrics table
    path, tokenizer = resolve_model_path(name_or_path), load_tokenizer(name_or_path)
    try:
        config = AutoConfig.from_pretrained(path)
        if config.is_encoder_decoder or config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            kind = "an encoder-decoder" if config.is_encoder_decoder else "not a causal LM"
            fix = "RL here trains decoder-only causal LMs (AutoModelForCausalLM): pick one such as Qwen2 or Llama"
            raise TypeError(f"model {name_or_path!r} is a {config.model_type} model, {kind}: {fix}")
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    except (OSError, ValueError) as e:  # hub name unreachable or not a model folder: say which model
        raise FileNotFoundError(f"could not load model {name_or_path!r}: {e}") from e
    except (SafetensorError, pickle.UnpicklingError, EOFError, RuntimeError) as e:  # a truncated or damaged file
        raise ValueError(f"could not read the weights of model {name_or_path!r} ({type(e).__name__}: {e}): the "
                         f"file is damaged or truncated; save or download the model again") from e  # fmt: skip
    return check_causal(model.to(device).eval(), name_or_path), tokenizer  # eval() = dropout off, always


def check_causal(model, name: str):
    """The model, unless the logits at positions 0..2 change when only token 3 does: then attention looks ahead (an
    encoder loaded through a causal-LM head, e.g. BERT without is_decoder) and every logprob would be wrong."""
    import torch

    device = next(model.parameters()).device
    ids = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 5]], device=device) % model.get_input_embeddings().num_embeddings
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    if not torch.allclose(logits[0, :3], logits[1, :3], atol=1e-4, rtol=1e-4):
        raise TypeError(f"model {name!r} ({type(model).__name__}) is not causal: position t's logits depend on later "
                        f"tokens (bidirectional attention); RL here needs a decoder-only causal LM")  # fmt: skip
    return model


def _as_saved(tokenizer, path: str):
    """The tokenizer exactly as saved in a local folder's tokenizer.json.

    transformers 5 rebuilds the tokenizer of some model types from their class (for qwen2: Qwen's NFC normaliser
    and split rules) instead of the folder's tokenizer.json; a custom tokenizer saved next to such a model (the
    embedded byte-level one: an e and a combining accent would become one character, 2 bytes where it saved 3; a
    character-level one would lose its spaces) would then encode text differently from what it was trained on. If
    tokenizer.json encodes a probe differently from what AutoTokenizer built, the folder's own file wins. That is
    logged only where the folder itself declares the class AutoTokenizer built (tokenizer_config.json): otherwise
    transformers overrode the declared class by model type, and loading the file as saved is what the folder asked
    for.
    """
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    saved, declared = Path(path) / "tokenizer.json", Path(path) / "tokenizer_config.json"
    probe = "Ab 12+3 = x,\n  y? e\u0301 \u212b \u6f22\x07"  # spaces, newlines, text NFC would change, CJK, control
    if not saved.is_file():
        return tokenizer
    if (
        Tokenizer.from_file(str(saved)).encode(probe, add_special_tokens=False).ids
        == tokenizer(probe, add_special_tokens=False).input_ids
    ):
        return tokenizer
    built = type(tokenizer).__name__.removesuffix("Fast")
    if (
        declared.is_file()
        and (json.loads(declared.read_text()).get("tokenizer_class") or "").removesuffix("Fast") == built
    ):
        print(f"[minrl] {path}: its {built} encodes differently from its tokenizer.json; loading tokenizer.json")
    return PreTrainedTokenizerFast.from_pretrained(path)


def stop_token_ids(model, tokenizer) -> list[int]:
    """EOS of the tokenizer plus the model's generation-config EOS ids (chat models have several)."""
    ids = {tokenizer.eos_token_id}
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update(gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else [])
    return sorted(ids)


def main(argv=None) -> None:
    """Print three training samples of each task (or one task): the prompt and the answer a demonstration gives
    (countdown: its solver's; the others: the ground truth); the embedded model's size."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--task", choices=TASKS, default=None, help="one task (default: all)")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    for name in [args.task] if args.task else TASKS:
        task = make_task(name)
        for p in task.sample(3, "train", rng):
            print(f"{name:8s} prompt {p['prompt']!r:14s} answer {answer_text(p)!r}")
    tok = make_tokenizer()
    n = sum(p.numel() for p in make_tiny_model(tok).parameters())
    print(f"embedded model: Qwen2 config, {n / 1e6:.2f}M parameters, vocabulary {len(tok)} (256 bytes + 4 specials)")


if __name__ == "__main__":
    main()
