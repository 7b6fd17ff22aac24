"""mismatch.py: each variation's verdict on the embedded tiny model, the suggested thresholds doing what they say
through offpolicy.py's own rejection mask, an HF folder through --model, the refusals."""

import json
import math

import pytest
import torch

import mismatch
import offpolicy
from rollout import generate
from tasks import make_tiny_model, make_tokenizer


@pytest.fixture(scope="module")
def results():
    return {r["variation"]: r for r in mismatch.main(["--prompts", "16", "--max-new-tokens", "16", "--device", "cpu"])}


def test_every_variation_gets_its_verdict(results):
    """fp32 variations are rounding only (exact), bf16 on either side a numerics gap, the forgotten temperature a
    broken recompute; and the statistics order as they must."""
    assert set(results) == set(mismatch.VARIATIONS)
    for v in ("baseline", "no_kv_cache", "sampler_batch_1", "trainer_micro_batch_1", "extra_padding"):
        assert results[v]["verdict"] == "exact" and results[v]["max"] < 1e-4, results[v]
    for v in ("autocast_bf16", "sampler_bf16", "trainer_bf16", "both_bf16"):
        r = results[v]
        assert r["verdict"] == "numerics" and r["max"] > 1e-3 and r["suggest"], r
        assert r["p50"] <= r["p90"] <= r["p99"] <= r["max"] and r["k3_kl"] >= 0
    bug = results["bug_no_temperature"]
    assert bug["verdict"] == "broken" and bug["extreme"] > 0.01 and not bug["suggest"]  # fix it, do not correct it


def test_the_printed_table_has_a_legend_a_marked_control_and_short_thresholds(results):
    out = mismatch.report(list(results.values()))
    lines = out.splitlines()
    bug = next(line for line in lines if line.startswith("bug_no_temperature"))
    assert bug.endswith("broken  (control)") and sum("(control)" in line for line in lines) == 2  # row + legend
    for col in ("p50 p90 p99 max", "k3_kl", "extreme", "seq_mean_max", "tokens", "verdict", "rho ="):
        assert any(line.lstrip().startswith(col) for line in lines[len(results) + 1 :]), col
    flags = [line for line in lines if "--rollout-" in line]
    values = [v for f in flags for v in f.split("threshold ")[1].split()[0].split("_")]  # 1.0004123, not 12 digits
    assert values and all(len(v) <= 9 and abs(float(v) - 1) < 1 for v in values), values
    assert (
        mismatch.near_one(math.log(1.00041234)) == "1.0004123"
        and mismatch.near_one(math.log(0.99958766)) == "0.9995877"
    )
    assert mismatch.near_one(0.14) == "1.1503" and mismatch.near_one(1.2) == "3.320" and mismatch.near_one(0) == "1"
    broken = {**results["baseline"], "variation": "bug_no_temperature"}  # exact: the checker missed the bug
    assert "NOT broken" in mismatch.report([broken])


@pytest.mark.parametrize("R", [40, 400])  # 400-token rows: |mean rho| ~ 2e-4, where 4-digit rounding said 1
def test_suggested_thresholds_act_on_the_shares_they_promise(R):
    """On a bf16-like gap the suggested flags, fed to offpolicy.py's own functions, act on about 1 token in 1000
    (TIS, token_k1) and about 1 sequence in 100 (seq_mean_k1), as acts_on reports."""
    g = torch.Generator().manual_seed(0)
    B = 2000 if R == 40 else 400
    mask = (torch.arange(R) < torch.randint(R // 2, R + 1, (B, 1), generator=g)).double()
    trainer = -torch.rand(B, R, generator=g, dtype=torch.float64) * 3
    sampler = trainer - 0.003 * torch.randn(B, R, generator=g, dtype=torch.float64)  # rho ~ N(0, 0.003)
    s = mismatch.gap_statistics(trainer, sampler, mask)
    assert mismatch.verdict(s) == "numerics"
    flags = mismatch.suggestions(s)
    shares = mismatch.acts_on(trainer, sampler, mask, flags)
    tok = offpolicy.rollout_rejection_mask(trainer, sampler, mask, kind="token_k1", threshold=flags["token_k1"])[1]
    assert tok["rollout_corr/rollout_rs_masked_fraction"] == shares["token_k1"]
    assert 0.0002 <= shares["token_k1"] <= 0.002 and 0.0002 <= shares["rollout_is_threshold"] <= 0.002, shares
    assert 0.002 <= shares["seq_mean_k1"] <= 0.02, shares


def test_each_variation_changes_what_it_names(monkeypatch):
    """The sampler's batch, the trainer's micro-batch and padding, the cache and the temperature really change."""
    seen = []
    real_gen, real_seq, real_unc = mismatch.generate, mismatch.sequence_logprobs, mismatch.uncached_logprobs

    def gen(model, ids, mask, **kw):
        seen.append(("sampler", ids.shape[0], next(model.parameters()).dtype, torch.is_autocast_enabled("cpu")))
        return real_gen(model, ids, mask, **kw)

    def seq(model, ids, mask, R, *, temperature, micro_batch):
        seen.append(("trainer", ids.shape[1], micro_batch, temperature, torch.is_autocast_enabled("cpu")))
        return real_seq(model, ids, mask, R, temperature=temperature, micro_batch=micro_batch)

    monkeypatch.setattr(mismatch, "generate", gen)
    monkeypatch.setattr(mismatch, "sequence_logprobs", seq)
    monkeypatch.setattr(mismatch, "uncached_logprobs", lambda *a: seen.append(("uncached",)) or real_unc(*a))
    args = mismatch.MismatchArgs(prompts=4, max_new_tokens=4, device="cpu")
    tok = make_tokenizer()
    model = make_tiny_model(tok).eval()
    ids, mask = mismatch.tokenize_prompts(tok, [mismatch.format_prompt(tok, "12 34")] * 4, 16)
    out = {}
    for v in mismatch.VARIATIONS:
        seen.clear()
        mismatch.measure(args, model, tok, ids, mask, v)
        out[v] = list(seen)
    base_s, base_t = out["baseline"][0], out["baseline"][-1]
    assert base_s == ("sampler", 4, torch.float32, False) and base_t[2:] == (4, 0.6, False)
    assert [e[1] for e in out["sampler_batch_1"] if e[0] == "sampler"] == [1, 1, 1, 1]
    assert out["trainer_micro_batch_1"][-1][2] == 1 and out["extra_padding"][-1][1] == base_t[1] + args.pad
    assert ("uncached",) in out["no_kv_cache"] and out["bug_no_temperature"][-1][3] == 1.0
    assert out["sampler_bf16"][0][2] == torch.bfloat16 and out["trainer_bf16"][-1][4] is True
    assert out["autocast_bf16"][0][3] is True and out["autocast_bf16"][-1][4] is True


def test_uncached_logprobs_are_the_samplers():
    """The cache-off path gives the sampler's own logprobs of its tokens (fp32: within rounding)."""
    tok = make_tokenizer()
    torch.manual_seed(0)
    model = make_tiny_model(tok).eval()
    ids, mask = mismatch.tokenize_prompts(tok, [mismatch.format_prompt(tok, p) for p in ("1 2", "34 5 6")], 16)
    with torch.no_grad():
        s = generate(model, ids, mask, max_new_tokens=6, temperature=0.7, eos_token_ids=[tok.eos_token_id],
                     pad_token_id=tok.pad_token_id, generator=torch.Generator().manual_seed(0))  # fmt: skip
        full = torch.cat([ids, s.response_ids], 1)
        unc = mismatch.uncached_logprobs(model, full, s.attention_mask, s.response_mask, 0.7)
    assert (unc - s.rollout_logprobs).abs().max() < 1e-5 and s.response_mask.sum() > 4


def test_a_saved_hf_folder_through_model_and_the_json(tmp_path):
    tok = make_tokenizer()
    torch.manual_seed(0)
    make_tiny_model(tok).save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    out = tmp_path / "gap.json"
    args = ["--model", str(tmp_path / "m"), "--variations", "baseline", "sampler_bf16", "--prompts", "8"]
    res = mismatch.main([*args, "--max-new-tokens", "8", "--json", str(out)])
    saved = json.loads(out.read_text())
    assert [r["variation"] for r in saved["results"]] == ["baseline", "sampler_bf16"] == [r["variation"] for r in res]
    assert saved["results"][0]["verdict"] == "exact" and math.isfinite(saved["results"][1]["k3_kl"])


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"variations": ["fp8"]}, "not among"),
        ({"variations": []}, "at least one"),
        ({"variations": ["baseline", "baseline"]}, "each variation once"),
        ({"prompts": 0}, "prompts"),
        ({"task": "sorting"}, "'task'"),
    ],
)
def test_refusals(kw, match):
    with pytest.raises(ValueError, match=match):
        mismatch.MismatchArgs(**kw)


def test_default_variations_follow_the_engine_and_an_explicit_list_is_never_filtered():
    assert mismatch.MismatchArgs().variations == list(mismatch.VARIATIONS)
    vllm = mismatch.MismatchArgs(engine="vllm").variations
    assert vllm == [v for v in mismatch.VARIATIONS if v not in mismatch.NOT_VLLM] and len(vllm) >= 3
    with pytest.raises(ValueError, match="vary our own sampler"):  # every variation named: refused, not filtered
        mismatch.MismatchArgs(engine="vllm", variations=list(mismatch.VARIATIONS))
