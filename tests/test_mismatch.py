"""mismatch.py: each variation's verdict on the embedded tiny model, the suggested thresholds doing what they say
through offpolicy.py's own rejection mask, an HF folder through --model, the refusals."""

import json
import math

import pytest
import torch

import mismatch
import offpolicy
from tasks import make_tiny_model, make_tokenizer


@pytest.fixture(scope="module")
def results():
    return {r["variation"]: r for r in mismatch.main(["--prompts", "16", "--max-new-tokens", "16"])}


def test_every_variation_gets_its_verdict(results):
    """fp32 variations are rounding only (exact), bf16 on either side a numerics gap, the forgotten temperature a
    broken recompute; and the statistics order as they must."""
    assert set(results) == set(mismatch.VARIATIONS)
    for v in ("baseline", "no_kv_cache", "sampler_batch_1", "trainer_micro_batch_1", "extra_padding"):
        assert results[v]["verdict"] == "exact" and results[v]["max"] < 1e-4, results[v]
    for v in ("sampler_bf16", "trainer_bf16", "both_bf16"):
        r = results[v]
        assert r["verdict"] == "numerics" and r["max"] > 1e-3 and r["suggest"], r
        assert r["p50"] <= r["p90"] <= r["p99"] <= r["max"] and r["k3_kl"] >= 0
    bug = results["bug_no_temperature"]
    assert bug["verdict"] == "broken" and bug["extreme"] > 0.01 and not bug["suggest"]  # fix it, do not correct it


def test_suggested_thresholds_act_on_the_shares_they_promise():
    """On a bf16-like gap the suggested flags, fed to offpolicy.py's own functions, act on about 1 token in 1000
    (TIS, token_k1) and about 1 sequence in 100 (seq_mean_k1)."""
    g = torch.Generator().manual_seed(0)
    B, R = 400, 40
    mask = (torch.arange(R) < torch.randint(5, R + 1, (B, 1), generator=g)).double()
    trainer = -torch.rand(B, R, generator=g, dtype=torch.float64) * 3
    sampler = trainer - 0.003 * torch.randn(B, R, generator=g, dtype=torch.float64)  # rho ~ N(0, 0.003)
    s = mismatch.gap_statistics(trainer, sampler, mask)
    assert mismatch.verdict(s) == "numerics"
    flags = mismatch.suggestions(s)
    kind = {k.split()[1] if "rollout-rs" in k else "is": v for k, v in flags.items()}
    tok = offpolicy.rollout_rejection_mask(trainer, sampler, mask, kind="token_k1", threshold=kind["token_k1"])[1]
    assert 0 < tok["rollout_corr/rollout_rs_masked_fraction"] <= 0.002
    seq = offpolicy.rollout_rejection_mask(trainer, sampler, mask, kind="seq_mean_k1", threshold=kind["seq_mean_k1"])
    assert 0 < seq[1]["rollout_corr/rollout_rs_seq_masked_fraction"] <= 0.02
    w = offpolicy.rollout_is_weights(trainer, sampler, mask, level="token", threshold=kind["is"])[1]
    assert 0 < w["rollout_corr/rollout_is_ratio_fraction_high"] <= 0.002


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


@pytest.mark.parametrize("kw,match", [({"variations": ["fp8"]}, "not among"), ({"prompts": 0}, "prompts")])
def test_refusals(kw, match):
    with pytest.raises(ValueError, match=match):
        mismatch.MismatchArgs(**kw)
