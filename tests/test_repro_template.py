"""examples/repro_template.py, the copyable one-file GRPO iteration, against trainer.py: the same defaults, the
same advantages, and one update on a fixed batch with the same loss, gradient norm and gradient (CPU, seconds)."""

import ast
import contextlib
import copy
import importlib.util
import math
import sys
from pathlib import Path

import torch

import ppo_math
import trainer
from tasks import make_tiny_model, make_tokenizer

PATH = Path(__file__).resolve().parents[1] / "examples" / "repro_template.py"
spec = importlib.util.spec_from_file_location("repro_template", PATH)
T = importlib.util.module_from_spec(spec)
spec.loader.exec_module(T)


class GradRecorder(torch.optim.Optimizer):
    """An optimizer whose step() keeps a copy of every gradient (the clipped one both updates hand to step)."""

    def __init__(self, params):
        super().__init__(params, {})
        self.grads = None

    def step(self, closure=None):
        self.grads = [p.grad.detach().clone() for g in self.param_groups for p in g["params"]]


def fixed_batch(B=8, P=5, R=6, V=260, seed=0):  # V: the embedded vocabulary (4 specials, 256 bytes)
    """Ids [B, P+R] with left-padded prompts and responses stopping early, anchors off the current policy by up to
    e^1.5 (so clipping and the dual clip both bind on some tokens), advantages of both signs."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, V, (B, P + R), generator=g)
    attn = torch.ones(B, P + R, dtype=torch.long)
    attn[::3, :2] = 0  # left padding on some prompts
    resp_len = torch.randint(1, R + 1, (B,), generator=g)
    resp_mask = (torch.arange(R)[None] < resp_len[:, None]).long()  # [B, R] a response of resp_len tokens
    attn[:, P:] = resp_mask
    ids = ids * attn  # pad id 0 where masked
    adv = (torch.randn(B, generator=g) * 2)[:, None] * resp_mask  # [B, R]
    noise = (torch.rand(B, R, generator=g) * 3 - 1.5) * resp_mask
    return ids, attn, resp_mask, adv, noise


def test_defaults_are_the_trainers_defaults():
    """The template's constants are the trainer's defaults, and those defaults have no KL or entropy term."""
    cfg = trainer.Config()
    ours = (T.TEMPERATURE, T.CLIP_LOW, T.CLIP_HIGH, T.DUAL_CLIP, T.GRAD_CLIP, T.LR)
    assert ours == (cfg.temperature, cfg.clip_low, cfg.clip_high, cfg.dual_clip, cfg.grad_clip, cfg.lr)
    assert (cfg.loss_agg, cfg.ent_coef, cfg.kl_loss, cfg.kl_in_reward) == ("token-mean", 0, False, False)


def test_grpo_advantages_equal_the_trainers():
    rewards = torch.rand(24, generator=torch.Generator().manual_seed(1))
    rewards[4:8] = 0.5  # a group without variance: advantages 0
    want = ppo_math.group_advantages(rewards, torch.arange(24) // 4)
    torch.testing.assert_close(T.grpo_advantages(rewards, 4), want, rtol=1e-6, atol=1e-7)  # fp32: other sum order


def test_one_update_equals_the_trainers_update_on_the_same_batch():
    torch.manual_seed(0)
    model = make_tiny_model(make_tokenizer()).eval()
    ids, attn, resp_mask, adv, noise = fixed_batch()
    with torch.no_grad():
        old = T.logprobs(model, ids, attn, resp_mask.shape[1]) + noise  # [B, R] an anchor the ratio moves from
    ours, theirs = model, copy.deepcopy(model)
    opt_a, opt_b = GradRecorder(ours.parameters()), GradRecorder(theirs.parameters())
    loss_a, gn_a = T.update(ours, opt_a, ids, attn, resp_mask, old, adv)

    ones = torch.ones_like(adv)
    mb = trainer.Batch(input_ids=ids, attention_mask=attn, response_mask=resp_mask, loss_mask=resp_mask.float(),
                  old_logprobs=old, clip_anchor=old,
                  ref_logprobs=None, advantages=adv, token_weights=ones, pg_mask=resp_mask, ent_mask=resp_mask,
                  is_weights=None, old_values=None, critic_returns=None, shares=None)  # fmt: skip
    rows, step, _ = trainer.policy_step(trainer.Config(), theirs, opt_b, mb, 1, contextlib.nullcontext, True, "test")
    assert 0 < rows[0]["stats/clipfrac"] < 1 and rows[0]["stats/clipfrac_lower"] > 0  # both clips bind
    torch.testing.assert_close(loss_a.double(), step["loss/policy"], rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(gn_a, step["stats/grad_norm"], rtol=1e-5, atol=1e-7)
    assert gn_a > T.GRAD_CLIP  # the clip changes the gradient handed to step: compared after it
    for a, b in zip(opt_a.grads, opt_b.grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-8)


def test_main_runs_on_the_tiny_model_and_on_a_saved_hf_folder(tmp_path, monkeypatch, capsys):
    tok = make_tokenizer()
    make_tiny_model(tok).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    for extra in ([], ["--model", str(tmp_path)]):
        monkeypatch.setattr(sys, "argv", ["repro_template.py", "--steps", "2", *extra])
        T.main()
        rows = [ast.literal_eval(ln[2:]) for ln in capsys.readouterr().out.splitlines() if ln[:2] in ("1 ", "2 ")]
        assert len(rows) == 2 and all(math.isfinite(r[k]) for r in rows for k in ("reward", "loss", "grad_norm")), rows


def digits_first_tokenizer():
    """The template's vocabulary reordered so that id 0 is the ordinary token "7" (as "!" is in Qwen2 or GPT-2)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["7", "<pad>", "<bos>", "<eos>", "<unk>", ">", *"01234568" + "9"])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.Split(Regex("."), "isolated"), decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<eos>", bos_token="<bos>", eos_token="<eos>")


def test_sample_masks_every_stop_id_with_pad_equal_to_eos():
    """A chat model's case: pad == EOS, a second stop id in the generation config, and id 0 an ordinary token. The
    mask follows the stop-token rule (evaluation.eos_mask_errors: 0) and each text is exactly its masked tokens."""
    from evaluation import eos_mask_errors

    torch.manual_seed(0)
    model, tok = T.tiny_model_and_tokenizer()[0], digits_first_tokenizer()
    model.generation_config.eos_token_id = [tok.eos_token_id, tok.convert_tokens_to_ids("0")]
    stops = T.stop_ids(model, tok)
    assert stops == [3, 6]
    ids, attn, mask, texts = T.sample(model, tok, ["<bos>1234>", "<bos>50>"], 8, 12, torch.Generator().manual_seed(0))
    resp = ids[:, -mask.shape[1] :]
    assert eos_mask_errors(resp, mask, stops, max_len=12) == 0.0
    ends = [int(resp[i, n - 1]) for i, n in enumerate(mask.sum(-1).tolist()) if n < 12]
    assert 3 in ends and 6 in ends, ends  # rows stopped by either stop id
    kept = [tok.convert_ids_to_tokens(r[m.bool()].tolist()) for r, m in zip(resp, mask)]  # the masked tokens
    want = ["".join(t for t in ts if t not in tok.all_special_tokens) for ts in kept]
    assert texts == want and torch.equal(attn[:, -mask.shape[1] :], mask)
