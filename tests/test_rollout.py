"""Tests of rollout.py and the tokenizer of tasks.py: padding, masks, position ids, top-k/top-p, and the
logprob consistency PPO relies on (old_logprobs == rollout_logprobs, ratio == 1 before the first step).
"""

import contextlib
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from batches import full_batch

import offpolicy
import tasks
import trainer
from rollout import (
    _cache_kw,
    _last_logits_kw,
    decode_responses,
    generate,
    position_ids_from_mask,
    sequence_logprobs,
    truncate_logits,
)

TOL = 1e-5  # fp32 on CPU: rollout vs recomputed logprobs


@pytest.fixture(scope="module")
def tok():
    return tasks.make_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    torch.manual_seed(0)
    return tasks.make_tiny_model(tok).eval()


def prompts(tok, texts, max_len=64):
    return tasks.tokenize_prompts(tok, [tasks.format_prompt(tok, x) for x in texts], max_len)


def sample(model, tok, texts, *, temperature=1.0, max_new_tokens=24, seed=0, pad_token_id=None, **kw):
    ids, attention_mask = prompts(tok, texts)
    return generate(
        model,
        ids,
        attention_mask,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        eos_token_ids=[tok.eos_token_id],
        pad_token_id=tok.pad_token_id if pad_token_id is None else pad_token_id,
        generator=torch.Generator().manual_seed(seed),
        **kw,
    )


def check_mask_invariants(rollout, eos_id: int, pad_id: int) -> None:
    """response_mask is 1 up to and including the first EOS, 0 (and pad ids) after; truncated rows all ones."""
    for ids, m, trunc in zip(rollout.response_ids.tolist(), rollout.response_mask.tolist(), rollout.truncated.tolist()):
        if eos_id in ids:
            k = ids.index(eos_id)
            assert m == [1] * (k + 1) + [0] * (len(ids) - k - 1), (ids, m)
            assert ids[k + 1 :] == [pad_id] * (len(ids) - k - 1)
            assert not trunc
        else:
            assert m == [1] * len(ids) and trunc, (ids, m, trunc)


# ----------------------------------------------------------------------------------------------
# Tokenizer and prompts


def test_tokenizer_round_trip_through_save_pretrained(tok, tmp_path):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tok.save_pretrained(tmp_path)
    back = AutoTokenizer.from_pretrained(tmp_path)
    assert isinstance(back, PreTrainedTokenizerFast)
    text = "123456>654321 a+b=(c)"
    assert back(text, add_special_tokens=False).input_ids == tok(text, add_special_tokens=False).input_ids
    assert len(back(text, add_special_tokens=False).input_ids) == len(text)  # one token per ASCII character
    assert back.decode(back(text, add_special_tokens=False).input_ids) == text
    assert len(tok) == 260 and tok("a", add_special_tokens=False).input_ids == [4 + ord("a")]  # byte b: id 4 + b
    for name in ("pad_token_id", "bos_token_id", "eos_token_id", "unk_token_id"):
        assert getattr(back, name) == getattr(tok, name), name
    assert len({tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id}) == 4
    assert back.get_vocab() == tok.get_vocab()


def test_a_model_folder_keeps_its_own_tokenizer_as_saved(tok, tmp_path):
    """transformers 5 rebuilds a qwen2 folder's tokenizer as Qwen2Tokenizer (NFC normalisation, Qwen's split rules),
    which encodes the embedded tokenizer's text differently (an e and a combining accent become one character);
    load_policy must give back the tokenizer as saved."""
    import tasks
    from tasks import load_policy

    tasks.make_tiny_model(tok).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    _, back = load_policy(str(tmp_path), "cpu")
    text = "ann has 37 pens.\nhow many? e\u0301 \u212b"
    assert back(text, add_special_tokens=False).input_ids == tok(text, add_special_tokens=False).input_ids
    assert back.decode(back(text, add_special_tokens=False).input_ids) == text
    assert back(text, add_special_tokens=False).input_ids == [4 + b for b in text.encode()]


def test_the_embedded_tokenizer_reads_any_text_byte_by_byte(tok):
    """Capitals, punctuation, accents, other scripts, emoji, control bytes: one token per UTF-8 byte, no <unk>,
    decoded back exactly; an incomplete UTF-8 sequence (a response cut mid-character) decodes to U+FFFD."""
    text = "What is 2^10? Grüße, 漢字 😀 $|;_\"'{}[]&~#\t\x00"
    ids = tok(text, add_special_tokens=False).input_ids
    assert ids == [4 + b for b in text.encode("utf-8")] and tok.unk_token_id not in ids
    assert tok.decode(ids) == text
    assert tok.decode([4 + b for b in "é".encode()[:1]]) == "\ufffd"
    with_specials = tok("<bos>ab<eos>", add_special_tokens=False).input_ids
    assert with_specials == [tok.bos_token_id, 4 + ord("a"), 4 + ord("b"), tok.eos_token_id]


def test_loading_the_embedded_tokenizer_says_nothing_unless_the_folder_disagrees_with_itself(tok, tmp_path, capsys):
    """The folder declares its own class (tokenizer_config.json) and transformers overrides it by model type:
    loading tokenizer.json as saved is what the folder asked for, so nothing is printed. A folder that itself
    declares the class that encodes differently from its tokenizer.json (here a character-level WordLevel
    tokenizer, whose spaces and newlines Qwen2Tokenizer's byte-level pre-tokenizer drops) gets one line."""
    import json

    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from tasks import load_policy

    tasks.make_tiny_model(tok).save_pretrained(tmp_path / "ours")
    tok.save_pretrained(tmp_path / "ours")
    load_policy(str(tmp_path / "ours"), "cpu")
    assert "encodes differently" not in capsys.readouterr().out
    vocab = {
        t: i for i, t in enumerate(["<pad>", "<bos>", "<eos>", "<unk>", *"0123456789abcdefghijklmnopqrstuvwxyz ,?\n"])
    }
    chars = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    chars.pre_tokenizer, chars.decoder = pre_tokenizers.Split(Regex("."), behavior="isolated"), decoders.Fuse()
    specials = {f"{k}_token": f"<{k}>" for k in ("pad", "bos", "eos", "unk")}
    char_tok = PreTrainedTokenizerFast(tokenizer_object=chars, **specials)
    tasks.make_tiny_model(char_tok).save_pretrained(tmp_path / "odd")
    char_tok.save_pretrained(tmp_path / "odd")
    cfg = json.loads((tmp_path / "odd" / "tokenizer_config.json").read_text())
    (tmp_path / "odd" / "tokenizer_config.json").write_text(json.dumps({**cfg, "tokenizer_class": "Qwen2Tokenizer"}))
    _, back = load_policy(str(tmp_path / "odd"), "cpu")
    assert "its Qwen2Tokenizer encodes differently from its tokenizer.json" in capsys.readouterr().out
    assert back("a b\n", add_special_tokens=False).input_ids == char_tok("a b\n", add_special_tokens=False).input_ids


def test_tokenize_prompts_left_pads(tok):
    ids, mask = tasks.tokenize_prompts(tok, ["ab", "abcd", "c"], max_prompt_len=4)
    a, b, c, d = (tok.convert_tokens_to_ids(x) for x in "abcd")
    p = tok.pad_token_id
    assert ids.tolist() == [[p, p, a, b], [a, b, c, d], [p, p, p, c]]
    assert mask.tolist() == [[0, 0, 1, 1], [1, 1, 1, 1], [0, 0, 0, 1]]
    assert position_ids_from_mask(mask).tolist() == [[0, 0, 0, 1], [0, 1, 2, 3], [0, 0, 0, 0]]


def test_tokenize_prompts_too_long_names_the_prompt(tok):
    with pytest.raises(ValueError, match=r"prompt 1 has 5 tokens > max_prompt_len=4"):
        tasks.tokenize_prompts(tok, ["ab", "abcde"], max_prompt_len=4)


# ----------------------------------------------------------------------------------------------
# top-k / top-p


def test_truncate_logits_known_answers():
    # probabilities [0.5, 0.25, 0.15, 0.1] (logits = their logs)
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.1]]))
    kept = lambda out: torch.isfinite(out[0]).tolist()  # noqa: E731
    # top-p: keep the smallest prefix (by probability) whose mass reaches p; exclusive cumsums [0, .5, .75, .9]
    assert kept(truncate_logits(logits, top_p=0.4, top_k=0)) == [True, False, False, False]  # 0.5 >= 0.4
    assert kept(truncate_logits(logits, top_p=0.7, top_k=0)) == [True, True, False, False]  # 0.75 >= 0.7
    assert kept(truncate_logits(logits, top_p=0.8, top_k=0)) == [True, True, True, False]  # 0.9 >= 0.8
    assert kept(truncate_logits(logits, top_p=1.0, top_k=0)) == [True] * 4
    assert kept(truncate_logits(logits, top_p=1.0, top_k=2)) == [True, True, False, False]
    assert kept(truncate_logits(logits, top_p=1.0, top_k=10)) == [True] * 4  # k > V keeps everything
    # both: top-k 3 renormalises to [0.5, 0.25, 0.15] / 0.9 = [.556, .278, .167]; top-p 0.6 -> 2 tokens
    assert kept(truncate_logits(logits, top_p=0.6, top_k=3)) == [True, True, False, False]
    # unsorted vocabulary order: the kept set follows probability, not position
    shuffled = logits[:, [3, 1, 0, 2]]  # [0.1, 0.25, 0.5, 0.15]
    assert kept(truncate_logits(shuffled, top_p=0.7, top_k=0)) == [False, True, True, False]
    # kept logits are unchanged
    out = truncate_logits(logits, top_p=0.7, top_k=0)
    assert torch.equal(out[0, :2], logits[0, :2])


def test_top_k_one_sampling_is_greedy(model, tok):
    texts = ["123456>", "9876>", "s314159>"]
    greedy = sample(model, tok, texts, temperature=0.0, max_new_tokens=8)
    topk1 = sample(model, tok, texts, temperature=1.0, max_new_tokens=8, top_k=1, seed=3)
    assert torch.equal(greedy.response_ids, topk1.response_ids)
    # rollout_logprobs are those of the distribution sampled from (truncated, renormalised): log 1 = 0
    assert (topk1.rollout_logprobs[topk1.response_mask.bool()] == 0).all()


def test_top_p_behaviour_logprobs_are_the_truncated_distribution_and_corrections_see_it(model, tok):
    # top-p keeps the nucleus and renormalises: log pi_behav = log pi - log Z >= log pi, > where tokens were cut;
    # the trainer's recompute is the untruncated pi, so the gap metric and the tis weights pi / pi_behav see it
    from offpolicy import gap_stats, off_policy_weights

    texts = ["123456>", "9876>", "s314159>", "r2718>"]
    s = sample(model, tok, texts, temperature=1.0, max_new_tokens=12, top_p=0.7, seed=1)
    full = sequence_logprobs(model, s.input_ids, s.attention_mask, s.response_ids.shape[1], temperature=1.0)[0]
    valid = s.response_mask.bool()
    assert (s.rollout_logprobs[valid] >= full[valid] - TOL).all()
    assert (s.rollout_logprobs[valid] > full[valid] + 1e-3).float().mean() > 0.5  # the random model's tails cut
    mask = s.response_mask.float()
    assert gap_stats(full, s.rollout_logprobs, mask)["stats/rollout_vs_old_logp_diff"] > 1e-2
    w, _ = off_policy_weights(full, s.rollout_logprobs, mask, "tis")
    assert (w[valid] <= 1 + TOL).all() and w[valid].min() < 0.9  # pi_old / pi_behav = Z <= 1


# ----------------------------------------------------------------------------------------------
# Masks and EOS handling


class ChainLM(torch.nn.Module):
    """A scripted LM: after token t it predicts t + 1, after `trigger` it predicts EOS (logit margin 50).

    It uses the `past_key_values` keyword (the transformers <= 5.10 name) and ignores its cache: its
    prediction depends on the last token only.
    """

    def __init__(self, vocab: int, trigger: int, eos: int):
        super().__init__()
        self.vocab, self.trigger, self.eos = vocab, trigger, eos
        self.calls = 0

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False, past_key_values=None):
        self.calls += 1
        nxt = torch.where(input_ids == self.trigger, self.eos, (input_ids + 1).clamp(max=self.vocab - 1))
        return SimpleNamespace(logits=F.one_hot(nxt, self.vocab).float() * 50.0, past_key_values=None)


def test_generate_masks_with_eos_at_known_steps(tok):
    # digits are consecutive ids; after '9' the model emits EOS. With max_new_tokens 5:
    #   "<bos>9" -> EOS                       (stops at step 1)
    #   "<bos>7" -> 8 9 EOS pad pad           (step 3)
    #   "<bos>5" -> 6 7 8 9 EOS               (EOS at the very last step: not truncated, all ones)
    #   "<bos>3" -> 4 5 6 7 8                 (truncated: all ones)
    d = {c: tok.convert_tokens_to_ids(c) for c in "0123456789"}
    assert [d[str(i)] for i in range(10)] == list(range(d["0"], d["0"] + 10))
    lm = ChainLM(len(tok), trigger=d["9"], eos=tok.eos_token_id)
    E, P = tok.eos_token_id, tok.pad_token_id
    for temperature in (0.0, 1.0):
        rollout = sample(lm, tok, ["9", "7", "5", "3"], temperature=temperature, max_new_tokens=5)
        assert rollout.response_ids.tolist() == [
            [E, P, P, P, P],
            [d["8"], d["9"], E, P, P],
            [d["6"], d["7"], d["8"], d["9"], E],
            [d["4"], d["5"], d["6"], d["7"], d["8"]],
        ]
        assert rollout.response_mask.tolist() == [[1, 0, 0, 0, 0], [1, 1, 1, 0, 0], [1] * 5, [1] * 5]
        assert rollout.truncated.tolist() == [False, False, False, True]
        assert rollout.attention_mask.tolist() == [[1, 1] + m for m in rollout.response_mask.tolist()]
        # the chosen token has probability 1 - 55 e^-50: logprob ~ 0 on valid tokens, exactly 0 on padding
        assert rollout.rollout_logprobs.abs().max().item() < 1e-12
        assert decode_responses(tok, rollout) == ["", "89", "6789", "45678"]
    # generation stops as soon as every row is done: "9" and "7" alone need 3 forward calls, not 5
    lm.calls = 0
    rollout = sample(lm, tok, ["9", "7"], temperature=0.0, max_new_tokens=5)
    assert rollout.response_ids.shape == (2, 3) and lm.calls == 3


def test_generate_masks_on_sampled_outputs(model, tok):
    rollout = sample(model, tok, ["123456>"] * 24 + ["s98>"] * 24, max_new_tokens=30, seed=1)
    check_mask_invariants(rollout, tok.eos_token_id, tok.pad_token_id)
    assert 0 < rollout.truncated.sum() < 48, "want both ended and truncated rows in this sample"
    R = rollout.response_ids.shape[1]
    assert rollout.attention_mask.shape == (48, rollout.prompt_ids.shape[1] + R)
    assert torch.equal(rollout.attention_mask[:, -R:], rollout.response_mask)
    assert (rollout.rollout_logprobs[rollout.response_mask == 0] == 0).all()
    assert (rollout.rollout_logprobs[rollout.response_mask == 1] < 0).all()


def test_generate_is_seeded(model, tok):
    a = sample(model, tok, ["123456>"] * 8, seed=7)
    b = sample(model, tok, ["123456>"] * 8, seed=7)
    c = sample(model, tok, ["123456>"] * 8, seed=8)
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.rollout_logprobs, b.rollout_logprobs)
    assert not torch.equal(a.response_ids, c.response_ids)


class FixedLM(torch.nn.Module):
    """A scripted LM whose next-token distribution is `probs` after every token."""

    def __init__(self, probs: list[float]):
        super().__init__()
        self.logits = torch.tensor(probs).log()

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False, past_key_values=None):
        return SimpleNamespace(logits=self.logits.expand(*input_ids.shape, -1), past_key_values=None)


def test_per_row_streams_sample_the_truncated_distribution_and_a_row_alone_draws_the_same():
    """generate(generator=[one per row]) (model_proxy.py's sampler): the frequencies of 4000 rows' draws are the
    top-p-truncated distribution (within 4 sigma; zero-probability tokens first, in the middle and the cut one never
    drawn), a row's 3 draws independent; a row's draws are its stream's alone, a shorter budget their prefix; a
    NaN distribution or a list of the wrong length is refused."""
    lm = FixedLM([0.0, 0.45, 0.0, 0.3, 0.15, 0.1, 0.0])
    probs = torch.tensor([0.0, 0.45, 0.0, 0.3, 0.15, 0.0, 0.0]) / 0.9  # top_p 0.85 keeps 0.45 + 0.3 + 0.15
    ids, mask = torch.zeros(4000, 1, dtype=torch.long), torch.ones(4000, 1, dtype=torch.long)
    streams = lambda seeds: [torch.Generator().manual_seed(s) for s in seeds]  # noqa: E731
    run = lambda rows, n, gens, model=lm: generate(model, ids[rows], mask[rows], max_new_tokens=n, top_p=0.85,
                                                   eos_token_ids=[6], pad_token_id=6, generator=gens)  # fmt: skip
    out = run(slice(None), 3, streams(range(4000)))
    freq = torch.bincount(out.response_ids.flatten(), minlength=7) / out.response_ids.numel()
    sigma = (probs * (1 - probs) / out.response_ids.numel()).sqrt()
    assert ((freq - probs).abs() <= 4 * sigma + 1e-9).all(), (freq, probs)
    assert torch.allclose(out.rollout_logprobs, probs[out.response_ids].log())
    same = (out.response_ids == out.response_ids[:, :1]).all(1).float().mean()  # a row's 3 draws: independent
    assert abs(same - (probs**3).sum()) < 0.03, same
    assert torch.equal(run([17, 5, 999], 3, streams([17, 5, 999])).response_ids, out.response_ids[[17, 5, 999]])
    assert torch.equal(run([17, 5, 999], 2, streams([17, 5, 999])).response_ids, out.response_ids[[17, 5, 999], :2])
    with pytest.raises(ValueError, match="NaN or all -inf logits in rows .*no distribution to sample"):
        run([0, 1], 1, streams([0, 1]), FixedLM([float("nan")] * 7))
    with pytest.raises(ValueError, match="a generator per row"):
        run([0, 1], 1, streams([0]))


# ----------------------------------------------------------------------------------------------
# Position ids, left padding, KV cache


def padded_vs_alone(model, tok, short: str, long: str, temperature: float = 0.0):
    both = sample(model, tok, [short, long], temperature=temperature, max_new_tokens=10)
    alone = sample(model, tok, [short], temperature=temperature, max_new_tokens=10)
    assert both.prompt_ids.shape[1] > alone.prompt_ids.shape[1]  # the short prompt really is left-padded
    n = min(int(both.response_mask[0].sum()), int(alone.response_mask[0].sum()))
    assert torch.equal(both.response_ids[0, :n], alone.response_ids[0, :n])
    return (both.rollout_logprobs[0, :n] - alone.rollout_logprobs[0, :n]).abs().max().item()


def test_left_padding_gives_same_logprobs_rope(model, tok):
    assert padded_vs_alone(model, tok, "12>", "s9876543210>") < TOL


def gpt2(tok):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(
        vocab_size=len(tok),
        n_embd=64,
        n_layer=2,
        n_head=2,
        n_positions=128,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    return GPT2LMHeadModel(cfg).eval()


def test_left_padding_gives_same_logprobs_gpt2_absolute_positions(tok):
    m = gpt2(tok)
    assert padded_vs_alone(m, tok, "12>", "s9876543210>") < TOL
    # the check has power: without position ids GPT-2 sees the left padding as positions 0..k-1
    ids, attention_mask = prompts(tok, ["12>", "s9876543210>"])
    with torch.no_grad():
        naive = m(input_ids=ids, attention_mask=attention_mask).logits[0, -1].log_softmax(-1)
        alone_ids, alone_attention_mask = prompts(tok, ["12>"])
        ref = m(input_ids=alone_ids, attention_mask=alone_attention_mask).logits[0, -1].log_softmax(-1)
    assert (naive - ref).abs().max().item() > 1e-3


@torch.no_grad()
def greedy_without_cache(model, ids, attention_mask, steps: int, eos: int, pad: int):
    """Reference decode: a full forward over the whole sequence at every step (no KV cache)."""
    done = torch.zeros(ids.shape[0], dtype=torch.bool)
    toks, logps = [], []
    for _ in range(steps):
        pos = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        logits = (
            model(input_ids=ids, attention_mask=attention_mask, position_ids=pos, use_cache=False).logits[:, -1].float()
        )
        lp = logits.log_softmax(-1)
        nxt = torch.where(done, torch.full_like(logits[:, 0], pad, dtype=torch.long), logits.argmax(-1))
        toks.append(nxt)
        logps.append(lp.gather(-1, nxt[:, None])[:, 0].masked_fill(done, 0.0))
        ids = torch.cat([ids, nxt[:, None]], 1)
        attention_mask = torch.cat([attention_mask, (~done).long()[:, None]], 1)
        done = done | (nxt == eos)
        if done.all():
            break
    return torch.stack(toks, 1), torch.stack(logps, 1)


@pytest.mark.parametrize("arch", ["qwen2", "gpt2"])
def test_kv_cache_generate_equals_no_cache_recompute(model, tok, arch):
    m = model if arch == "qwen2" else gpt2(tok)
    texts = ["12>", "s9876543210>", "5+7=", "000111>"]
    rollout = sample(m, tok, texts, temperature=0.0, max_new_tokens=12)
    ids, attention_mask = prompts(tok, texts)
    ref_ids, ref_lp = greedy_without_cache(m, ids, attention_mask, 12, tok.eos_token_id, tok.pad_token_id)
    assert torch.equal(rollout.response_ids, ref_ids)
    assert (rollout.rollout_logprobs - ref_lp * rollout.response_mask).abs().max().item() < TOL


# ----------------------------------------------------------------------------------------------
# Logprob consistency: old_logprobs (recompute) == rollout_logprobs, ratio == 1 before the first step


def consistency(m, tok, temperature: float, pad_token_id=None, micro_batch: int = 5):
    texts = ["123456>", "s12>", "9+9=", "000000>", "314>", "s271828>"] * 2
    rollout = sample(m, tok, texts, temperature=temperature, max_new_tokens=20, seed=11, pad_token_id=pad_token_id)
    R = rollout.response_ids.shape[1]
    with torch.no_grad():
        old, ent = sequence_logprobs(
            m,
            rollout.input_ids,
            rollout.attention_mask,
            R,
            temperature=temperature,
            micro_batch=micro_batch,
            with_entropy=True,
        )
    valid = rollout.response_mask.bool()
    diff = (old - rollout.rollout_logprobs)[valid].abs().max().item()
    # the entropy is that of the temperature-scaled softmax: positive, at most log V
    assert (ent[valid] > 0).all() and (ent[valid] <= math.log(len(tok)) + 1e-5).all()
    return rollout, old, diff


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_old_logprobs_equal_rollout_logprobs(model, tok, temperature):
    rollout, old, diff = consistency(model, tok, temperature)
    assert diff < TOL, f"max |old - rollout| = {diff:.2e} at T={temperature}"
    # the check has power: recomputing at the wrong temperature is far off
    R = rollout.response_ids.shape[1]
    with torch.no_grad():
        wrong, _ = sequence_logprobs(model, rollout.input_ids, rollout.attention_mask, R, temperature=1.3)
    assert (wrong - rollout.rollout_logprobs)[rollout.response_mask.bool()].abs().max().item() > 1e-2


def test_old_logprobs_equal_rollout_logprobs_pad_equals_eos(model, tok):
    tok2 = tasks.make_tokenizer()
    tok2.pad_token = tok2.eos_token
    assert tok2.pad_token_id == tok2.eos_token_id
    rollout, _, diff = consistency(model, tok2, 0.7, pad_token_id=tok2.pad_token_id)
    check_mask_invariants(rollout, tok2.eos_token_id, tok2.pad_token_id)
    assert (~rollout.truncated).any()  # some rows ended with an EOS followed by pad == eos ids
    assert diff < TOL, f"max |old - rollout| = {diff:.2e} with pad == eos"


def test_old_logprobs_equal_rollout_logprobs_gpt2(tok):
    _, _, diff = consistency(gpt2(tok), tok, 1.0)
    assert diff < TOL


def test_old_logprobs_equal_rollout_logprobs_sft_model(sft_path):
    m, t = tasks.load_policy(str(sft_path), "cpu")
    _, _, diff = consistency(m, t, 1.0)
    assert diff < TOL


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_ratio_is_one_before_first_step(model, tok, temperature):
    """The PPO update's own path (grad enabled, other micro-batching) sees ratio 1 before its first step."""
    rollout, old, _ = consistency(model, tok, temperature)
    B, R = rollout.response_ids.shape
    mask = rollout.response_mask.float()
    logp, _ = sequence_logprobs(
        model, rollout.input_ids, rollout.attention_mask, R, temperature=temperature, micro_batch=3
    )
    assert logp.requires_grad
    ratio = torch.exp(logp.detach() - old)
    assert (ratio - 1)[mask.bool()].abs().max().item() < TOL
    loss, m = offpolicy.policy_loss(logp, old, torch.randn(B, R), mask)
    assert float(m["clipfrac"]) == 0.0 and abs(float(m["ratio_mean"]) - 1) < TOL
    # and ppo_update reports it (stats/first_mb_*) on its first minibatch
    cfg = trainer.Config(adv_estimator="grpo", temperature=temperature, micro_batch=4, minibatches=2, group_size=2)
    batch = full_batch(
        input_ids=rollout.input_ids,
        attention_mask=rollout.attention_mask,
        response_mask=rollout.response_mask,
        old_logprobs=old,
        ref_logprobs=old.clone(),
        advantages=torch.randn(B, R) * mask,
    )
    work = tasks.make_tiny_model(tok)
    work.load_state_dict(model.state_dict())
    work.eval()
    opt = torch.optim.AdamW(work.parameters(), lr=1e-3)
    out = trainer.ppo_update(cfg, work, opt, None, batch, 1, torch.Generator().manual_seed(0), contextlib.nullcontext)
    assert out["stats/first_mb_ratio_dev"] < TOL
    assert out["stats/first_mb_clipfrac"] == 0.0


def test_model_folder_with_chat_template_trains_on_templated_prompts(tmp_path):
    """`--model FOLDER` whose tokenizer has a chat template: load_policy keeps the template, every prompt reaches
    the model as one templated user message (generation prompt included), and a PPO step runs on it."""
    import json

    tok = tasks.make_tokenizer()
    tok.chat_template = (
        "{% for m in messages %}{{ m['role'][0] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}a: {% endif %}"
    )
    torch.manual_seed(0)
    tasks.make_tiny_model(tok).save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    _, back = tasks.load_policy(str(tmp_path / "m"), "cpu")
    assert tasks.format_prompt(back, "123456>") == "u: 123456>\na: "  # the saved template, not <bos> + text
    cfg = trainer.Config(model=str(tmp_path / "m"), task="reverse", steps=1, prompts_per_step=2, group_size=2,
                    eval_every=1, eval_n=4, dump_batch=1, out_dir=str(tmp_path / "run"))  # fmt: skip
    res = trainer.train(cfg)
    rec = torch.load(tmp_path / "run" / "batch-1.pt", weights_only=False)
    assert len(rec["prompts"]) == 4 and all(p.startswith("u: ") and p.endswith(">\na: ") for p in rec["prompts"])
    assert rec["error"] is None and math.isfinite(rec["metrics"]["loss/policy"]) and len(res["eval_history"]) == 2
    assert json.loads(rec["config"])["model"] == str(tmp_path / "m")


@torch.no_grad()
def generate_growing(model, prompt_ids, attention_mask, *, max_new_tokens, temperature, top_p, top_k, eos, pad, gen):
    """The decode loop before the preallocated one (kept as the reference): the mask grows by a column per step,
    positions are a cumsum of it, tokens and logprobs are stacked lists."""
    kw, last1, stop = _cache_kw(model), _last_logits_kw(model, 1), torch.tensor([eos])
    mask, inp, cache, tokens, logps = attention_mask.clone(), prompt_ids, None, [], []
    done = torch.zeros(prompt_ids.shape[0], dtype=torch.bool)
    for _ in range(max_new_tokens):
        pos = ((mask.cumsum(-1) - 1).clamp(min=0))[:, -inp.shape[1] :]
        out = model(input_ids=inp, attention_mask=mask, position_ids=pos, use_cache=True, **{kw: cache}, **last1)
        cache, logits = getattr(out, kw), out.logits[:, -1, :].float()
        if temperature > 0:
            scaled = truncate_logits(logits / temperature, top_p, top_k)
            nxt = torch.multinomial(scaled.softmax(-1), 1, generator=gen).squeeze(1)
        else:
            scaled, nxt = logits, logits.argmax(-1)
        nxt = torch.where(done, torch.full_like(nxt, pad), nxt)
        tokens.append(nxt)
        logps.append(F.log_softmax(scaled, -1).gather(-1, nxt[:, None]).squeeze(1).masked_fill(done, 0.0))
        mask = torch.cat([mask, (~done).long()[:, None]], dim=1)
        done = done | torch.isin(nxt, stop)
        if done.all():
            break
        inp = nxt[:, None]
    rmask = mask[:, prompt_ids.shape[1] :]
    return torch.stack(tokens, 1), mask, torch.stack(logps, 1) * rmask, ~done


@pytest.mark.parametrize("arch", ["qwen2", "gpt2"])
@pytest.mark.parametrize("temperature, top_p, top_k", [(0.0, 1.0, 0), (1.0, 1.0, 0), (0.7, 0.9, 5)])
def test_preallocated_decode_equals_the_growing_one(model, tok, arch, temperature, top_p, top_k):
    """The preallocated decode loop gives the growing loop's tokens, masks, truncation flags and logprobs exactly,
    greedy and sampled (the same seed), with left padding, a bool mask, and rows stopping early: the stop token is
    one that the model emits often (a random model never emits EOS)."""
    m = model if arch == "qwen2" else gpt2(tok)
    ids, attention_mask = prompts(tok, ["12>", "s9876543210>", "5+7=", "000111>", "3>"] * 4)
    settings = dict(max_new_tokens=20, temperature=temperature, top_p=top_p, top_k=top_k)
    gen = torch.Generator().manual_seed(3)  # the seed of the runs below: they draw the same tokens until a stop
    free = generate_growing(m, ids, attention_mask, **settings, eos=-1, pad=tok.pad_token_id, gen=gen)
    stop = int(free[0][:, 3:].flatten().mode().values)  # a token many rows emit after their third
    for mask in (attention_mask, attention_mask.bool()):
        new = generate(m, ids, mask, **settings, eos_token_ids=[stop], pad_token_id=tok.pad_token_id,
                       generator=torch.Generator().manual_seed(3))  # fmt: skip
        toks, full_mask, logps, truncated = generate_growing(
            m, ids, mask, **settings, eos=stop, pad=tok.pad_token_id, gen=torch.Generator().manual_seed(3)
        )
        assert torch.equal(new.response_ids, toks) and torch.equal(new.attention_mask, full_mask.long())
        assert torch.equal(new.truncated, truncated) and torch.equal(new.rollout_logprobs, logps)
        assert 0 < int((~new.truncated).sum()) < len(new.truncated)  # some rows stop early, some run to the end
        assert new.response_mask.dtype == torch.long and new.rollout_logprobs.dtype == torch.float32
