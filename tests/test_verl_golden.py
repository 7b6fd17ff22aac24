"""Differential test: minrl's PPO/GRPO math against outputs of the real veRL 0.9.1 code (DESIGN.md 7.1).

tests/golden/verl_core_algos.json holds seeded fp64 inputs and what `verl.trainer.ppo.core_algos` and
`verl.utils.torch_functional` (verl 0.9.1, torch 2.13 CPU) returned for them. It was written by
tests/golden/make_verl_golden.py in a separate virtualenv (its docstring says how); this test needs no
veRL. Everything is compared in fp64 with an absolute tolerance of 1e-6, and only at valid positions:
at masked positions veRL keeps pass-through values where minrl writes 0.

veRL -> minrl correspondence:
  compute_gae_advantage_return  -> masked_whiten(gae(...)[0]) and gae(...)[1] (veRL whitens inside)
  compute_grpo_outcome_advantage -> group_advantages (per sequence; veRL broadcasts it over tokens)
  compute_rloo_outcome_advantage -> rloo_advantages
  compute_policy_loss_vanilla    -> policy_loss (pg_clipfrac, ppo_kl, pg_clipfrac_lower ->
                                    clipfrac, approx_kl, clipfrac_lower)
  compute_value_loss             -> value_loss (vf_clipfrac)
  kl_penalty kl / mse / low_var_kl -> kl_estimate k1 / k2 / k3
  agg_loss                       -> aggregate
"""

import json
from pathlib import Path

import pytest
import torch

import common
import ppo_minimal as pm

GOLDEN = json.loads((Path(__file__).parent / "golden" / "verl_core_algos.json").read_text())
ATOL = 1e-6
F64 = torch.float64


def t64(x) -> torch.Tensor:
    return torch.tensor(x, dtype=F64)


def close_at_valid(ours, verl, mask, what: str) -> None:
    """ours == verl within ATOL where mask == 1; the message names the case and the max abs diff."""
    valid = mask.bool()
    a, b = ours.to(F64)[valid], verl[valid]
    diff = (a - b).abs().max().item() if a.numel() else 0.0
    assert a.shape == b.shape and diff <= ATOL, f"{what}: max abs diff {diff:.3e} over {a.numel()} valid entries"


def close_scalar(ours, verl: float, what: str) -> None:
    diff = abs(float(ours) - verl)
    assert diff <= ATOL, f"{what}: ours {float(ours)!r} vs veRL {verl!r} (abs diff {diff:.3e})"


def cases(section: str, settings_key: str | None = None, inner: list[str] | None = None):
    """pytest params over the golden cases (x settings x inner keys), with readable ids."""
    out = []
    for case in GOLDEN[section]:
        for k, setting in enumerate(case[settings_key] if settings_key else [None]):
            for key in inner or [None]:
                ident = "-".join(str(p) for p in (case["name"], k if settings_key else None, key) if p is not None)
                out.append(pytest.param(case, setting, key, id=ident))
    return out


# ------------------------------------------------------------------------------------------------
# The golden file is what it claims to be (checked on its inputs, independently of minrl's code)


def test_golden_provenance_and_coverage():
    meta = GOLDEN["meta"]
    assert meta["verl"] == "0.9.1" and meta["dtype"] == "float64"
    assert meta["torch"].startswith("2.")
    masks = [t64(c["inputs"]["mask"]) for s in ("gae", "policy_loss", "agg_loss") for c in GOLDEN[s]]
    for m in masks:
        assert (m.sum(-1) == 0).any(), "every masked case has a fully masked row"
        holes = (m[:, :-1] == 0) & (m[:, 1:] == 1)  # a 0 followed by a 1: a masked middle position
        assert holes.any(), "every masked case has a masked middle position"
    for c in GOLDEN["grpo"]:
        ids, r = torch.tensor(c["inputs"]["group_ids"]), t64(c["inputs"]["rewards"])
        sizes = {g: int((ids == g).sum()) for g in ids.unique().tolist()}
        assert 1 in sizes.values() and len(set(sizes.values())) >= 3, "a singleton group and varied sizes"
        assert any(n > 1 and r[ids == g].unique().numel() == 1 for g, n in sizes.items()), "an all-equal group"
    for c in GOLDEN["policy_loss"]:
        x = t64(c["inputs"]["logprobs"]) - t64(c["inputs"]["old_logprobs"])
        valid, adv = t64(c["inputs"]["mask"]).bool(), t64(c["inputs"]["advantages"])
        assert (x[valid] > 20).any() and (x[valid] < -20).any(), "the +-20 log-ratio clamp is exercised"
        assert ((x[valid] > 2) & (adv[valid] < 0)).any(), "the dual clip is exercised"
        assert all(s["outputs"]["token-mean"]["pg_clipfrac_lower"] > 0 for s in c["settings"])
    x = t64(GOLDEN["kl_penalty"][0]["inputs"]["logprobs"]) - t64(GOLDEN["kl_penalty"][0]["inputs"]["ref_logprobs"])
    assert (x > 20).any() and (x < -20).any() and (t64(GOLDEN["kl_penalty"][0]["outputs"]["k3"]) == 10).any()


# ------------------------------------------------------------------------------------------------
# verl.utils.torch_functional


@pytest.mark.parametrize("case,_s,_k", cases("masked_stats"))
def test_masked_stats(case, _s, _k):
    x, mask, out = t64(case["inputs"]["x"]), t64(case["inputs"]["mask"]), case["outputs"]
    name = case["name"]
    close_scalar(common.masked_mean(x, mask), out["mean"], f"masked_mean {name}")
    rows = mask.sum(-1) >= 0  # every row: a fully masked row has mean 0 / (0 + 1e-8) = 0 in both
    close_at_valid(common.masked_mean(x, mask, dim=-1), t64(out["mean_last_dim"]), rows, f"masked_mean dim=-1 {name}")
    close_scalar(common.masked_var(x, mask, unbiased=True), out["var_unbiased"], f"masked_var unbiased {name}")
    close_scalar(common.masked_var(x, mask, unbiased=False), out["var_biased"], f"masked_var biased {name}")
    close_at_valid(common.masked_whiten(x, mask), t64(out["whiten"]), mask, f"masked_whiten {name}")
    ours = common.masked_whiten(x, mask, shift_mean=False)
    close_at_valid(ours, t64(out["whiten_no_shift"]), mask, f"masked_whiten shift_mean=False {name}")


# ------------------------------------------------------------------------------------------------
# core_algos: advantage estimators


@pytest.mark.parametrize("case,setting,_k", cases("gae", "settings"))
def test_gae_matches_verl(case, setting, _k):
    inp = case["inputs"]
    r, v, mask = t64(inp["token_rewards"]), t64(inp["values"]), t64(inp["mask"])
    adv, ret = pm.gae(r, v, mask, setting["gamma"], setting["lam"])
    what = f"{case['name']} gamma={setting['gamma']} lam={setting['lam']}"
    close_at_valid(ret, t64(setting["returns"]), mask, f"gae returns {what}")
    # veRL 0.9.1 whitens inside compute_gae_advantage_return; minrl's gae is raw
    close_at_valid(common.masked_whiten(adv, mask), t64(setting["advantages_whitened"]), mask, f"gae adv {what}")


@pytest.mark.parametrize("case,_s,_k", cases("grpo"))
def test_group_advantages_match_verl(case, _s, _k):
    inp = case["inputs"]
    rewards, ids, mask = t64(inp["rewards"]), torch.tensor(inp["group_ids"]), t64(inp["mask"])
    ours = pm.group_advantages(rewards, ids, norm_std=case["norm_std"], eps=case["epsilon"])  # [B]
    assert ours.shape == rewards.shape
    what = f"grpo {case['name']} norm_std={case['norm_std']}"
    close_at_valid(ours[:, None].expand_as(mask), t64(case["advantages"]), mask, what)


@pytest.mark.parametrize("case,_s,_k", cases("rloo"))
def test_rloo_advantages_match_verl(case, _s, _k):
    inp = case["inputs"]
    rewards, ids, mask = t64(inp["rewards"]), torch.tensor(inp["group_ids"]), t64(inp["mask"])
    ours = pm.rloo_advantages(rewards, ids)  # [B]
    assert ours.shape == rewards.shape
    close_at_valid(ours[:, None].expand_as(mask), t64(case["advantages"]), mask, f"rloo {case['name']}")


# ------------------------------------------------------------------------------------------------
# core_algos: losses


AGG_MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


@pytest.mark.parametrize("case,setting,mode", cases("policy_loss", "settings", AGG_MODES))
def test_policy_loss_matches_verl(case, setting, mode):
    inp = {k: t64(v) for k, v in case["inputs"].items()}
    loss, metrics = pm.policy_loss(
        inp["logprobs"],
        inp["old_logprobs"],
        inp["advantages"],
        inp["mask"],
        clip_low=setting["clip_low"],
        clip_high=setting["clip_high"],
        dual_clip=setting["clip_ratio_c"],
        agg=mode,
    )
    out = setting["outputs"][mode]
    what = f"{case['name']} clip=({setting['clip_low']}, {setting['clip_high']}) c={setting['clip_ratio_c']} {mode}"
    close_scalar(loss, out["loss"], f"policy loss {what}")
    close_scalar(metrics["clipfrac"], out["pg_clipfrac"], f"clipfrac {what}")
    close_scalar(metrics["clipfrac_lower"], out["pg_clipfrac_lower"], f"clipfrac_lower {what}")
    close_scalar(metrics["approx_kl"], out["ppo_kl"], f"approx_kl (veRL ppo_kl, clamped log-ratio) {what}")


@pytest.mark.parametrize("case,setting,mode", cases("value_loss", "settings", AGG_MODES))
def test_value_loss_matches_verl(case, setting, mode):
    inp = {k: t64(v) for k, v in case["inputs"].items()}
    loss, metrics = pm.value_loss(
        inp["values"], inp["old_values"], inp["returns"], inp["mask"], clip=setting["clip"], agg=mode
    )
    out = setting["outputs"][mode]
    what = f"{case['name']} clip={setting['clip']} {mode}"
    close_scalar(loss, out["loss"], f"value loss {what}")
    close_scalar(metrics["vf_clipfrac"], out["vf_clipfrac"], f"vf_clipfrac {what}")


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_kl_estimate_matches_verl(kind):
    case = GOLDEN["kl_penalty"][0]
    logp, ref = t64(case["inputs"]["logprobs"]), t64(case["inputs"]["ref_logprobs"])
    ours = pm.kl_estimate(logp, ref, kind)
    what = f"kl_estimate {kind} (veRL {case['verl_names'][kind]})"
    close_at_valid(ours, t64(case["outputs"][kind]), torch.ones_like(logp), what)


@pytest.mark.parametrize("case,_s,mode", cases("agg_loss", None, AGG_MODES))
def test_aggregate_matches_verl(case, _s, mode):
    loss_mat, mask = t64(case["inputs"]["loss_mat"]), t64(case["inputs"]["mask"])
    close_scalar(pm.aggregate(loss_mat, mask, mode), case["outputs"][mode], f"aggregate {case['name']} {mode}")
