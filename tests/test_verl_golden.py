"""Differential test: minrl's PPO/GRPO math against outputs of the real veRL 0.9.1 code (docs/design.md 5.1).

tests/golden/verl_core_algos.json holds seeded fp64 inputs and what `verl.trainer.ppo.core_algos` and
`verl.utils.torch_functional` (verl 0.9.1, torch 2.13 CPU) returned for them. It was written by
tests/golden/make_verl_golden.py in a separate virtualenv (its docstring says how); this test needs no
veRL. Everything is compared in fp64 with an absolute tolerance of 1e-6, and only at valid positions:
at masked positions veRL keeps pass-through values where minrl writes 0. `python -m tests.test_verl_golden` runs
them and prints the largest difference each test saw.

veRL -> minrl correspondence:
  compute_gae_advantage_return  -> masked_whiten(gae(...)[0]) and gae(...)[1] (veRL whitens inside)
  compute_grpo_outcome_advantage -> group_advantages (per sequence; veRL broadcasts it over tokens)
  compute_rloo_outcome_advantage -> rloo_advantages
  compute_policy_loss_vanilla    -> policy_loss (pg_clipfrac, ppo_kl, pg_clipfrac_lower ->
                                    clipfrac, approx_kl, clipfrac_lower)
  compute_value_loss             -> value_loss (vf_clipfrac)
  kl_penalty kl / mse / low_var_kl -> kl_estimate k1 / k2 / k3
  agg_loss                       -> aggregate
  rollout_corr_helper: compute_rollout_correction_weights -> offpolicy.rollout_is_weights,
    compute_rollout_rejection_mask -> rollout_rejection_mask, compute_offpolicy_metrics -> gap_metrics
    (minrl's metric keys: veRL's with the rollout_corr/ prefix of its unified entry point; a subset of them)
  compute_policy_loss_{gspo,cispo,sapo,geo_mean,dppo_tv,dppo_kl} -> policy_loss(kind=...): values, metrics and
    gradients w.r.t. log_prob (geo_mean: veRL takes torch.mean over every row, minrl the seq-mean-token-mean over
    non-empty rows: compared as ours * n_nonempty / B)
  compute_reinforce_plus_plus[_baseline]_outcome_advantage -> ppo_math.reinforce_pp[_baseline]_advantages
"""

import json
import os
import sys
from pathlib import Path

import pytest
import torch

import common
import offpolicy
import ppo_math

GOLDEN = json.loads((Path(__file__).parent / "golden" / "verl_core_algos.json").read_text())
ATOL = 1e-6
F64 = torch.float64


def t64(x) -> torch.Tensor:
    return torch.tensor(x, dtype=F64)


MAX_DIFF: dict[str, float] = {}  # test -> the largest |ours - veRL| it saw (`python -m tests.test_verl_golden`)


def record(diff: float) -> float:
    test = os.environ.get("PYTEST_CURRENT_TEST", "?").split("::")[-1].split("[")[0]
    MAX_DIFF[test] = max(MAX_DIFF.get(test, 0.0), diff)
    return diff


def close_at_valid(ours, verl, mask, what: str) -> None:
    """ours == verl within ATOL where mask == 1; the message names the case and the max abs diff."""
    valid = mask.bool()
    a, b = ours.detach().to(F64)[valid], verl[valid]
    diff = record((a - b).abs().max().item() if a.numel() else 0.0)
    assert a.shape == b.shape and diff <= ATOL, f"{what}: max abs diff {diff:.3e} over {a.numel()} valid entries"


def close_scalar(ours, verl: float, what: str) -> None:
    diff = record(abs(float(ours) - verl))
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
    adv, ret = ppo_math.gae(r, v, mask, setting["gamma"], setting["lam"])
    what = f"{case['name']} gamma={setting['gamma']} lam={setting['lam']}"
    close_at_valid(ret, t64(setting["returns"]), mask, f"gae returns {what}")
    # veRL 0.9.1 whitens inside compute_gae_advantage_return; minrl's gae is raw
    close_at_valid(common.masked_whiten(adv, mask), t64(setting["advantages_whitened"]), mask, f"gae adv {what}")


@pytest.mark.parametrize("case,_s,_k", cases("grpo"))
def test_group_advantages_match_verl(case, _s, _k):
    inp = case["inputs"]
    rewards, ids, mask = t64(inp["rewards"]), torch.tensor(inp["group_ids"]), t64(inp["mask"])
    ours = ppo_math.group_advantages(rewards, ids, norm_std=case["norm_std"], eps=case["epsilon"])  # [B]
    assert ours.shape == rewards.shape
    what = f"grpo {case['name']} norm_std={case['norm_std']}"
    close_at_valid(ours[:, None].expand_as(mask), t64(case["advantages"]), mask, what)


@pytest.mark.parametrize("case,_s,_k", cases("rloo"))
def test_rloo_advantages_match_verl(case, _s, _k):
    inp = case["inputs"]
    rewards, ids, mask = t64(inp["rewards"]), torch.tensor(inp["group_ids"]), t64(inp["mask"])
    ours = ppo_math.rloo_advantages(rewards, ids)  # [B]
    assert ours.shape == rewards.shape
    close_at_valid(ours[:, None].expand_as(mask), t64(case["advantages"]), mask, f"rloo {case['name']}")


# ------------------------------------------------------------------------------------------------
# core_algos: losses


AGG_MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


@pytest.mark.parametrize("case,setting,mode", cases("policy_loss", "settings", AGG_MODES))
def test_policy_loss_matches_verl(case, setting, mode):
    inp = {k: t64(v) for k, v in case["inputs"].items()}
    loss, metrics = offpolicy.policy_loss(
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
    loss, metrics = ppo_math.value_loss(
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
    ours = ppo_math.kl_estimate(logp, ref, kind)
    what = f"kl_estimate {kind} (veRL {case['verl_names'][kind]})"
    close_at_valid(ours, t64(case["outputs"][kind]), torch.ones_like(logp), what)


@pytest.mark.parametrize("case,_s,mode", cases("agg_loss", None, AGG_MODES))
def test_aggregate_matches_verl(case, _s, mode):
    loss_mat, mask = t64(case["inputs"]["loss_mat"]), t64(case["inputs"]["mask"])
    close_scalar(ppo_math.aggregate(loss_mat, mask, mode), case["outputs"][mode], f"aggregate {case['name']} {mode}")


# ------------------------------------------------------------------------------------------------
# rollout_corr_helper: rollout IS weights, rejection masks, off-policy metrics (offpolicy.py 1)

CORR = GOLDEN["rollout_corr"]


def gap_of(case):
    inp = case["inputs"]
    return t64(inp["old_logprobs"]), t64(inp["rollout_logprobs"]), t64(inp["mask"])


def same_metrics(ours: dict, verl: dict, what: str, expected: set[str]) -> None:
    """minrl reports exactly the `expected` metrics (rollout_corr/<veRL's key>), each one of veRL's and equal to it."""
    assert {k.removeprefix("rollout_corr/") for k in ours} == expected, f"{what}: {sorted(ours)}"
    for key, value in ours.items():
        name = key.removeprefix("rollout_corr/")
        assert key.startswith("rollout_corr/") and name in verl, f"{what}: {key} is not a veRL metric"
        close_scalar(value, verl[name], f"{what} {name}")


def test_rollout_corr_golden_coverage():
    kinds = {o for c in CORR["rs"] for s in c["settings"] for o in s["kind"].split(",")}
    assert kinds == set(offpolicy.RS_OPTIONS), "every rejection option is golden-tested"
    assert any("," in s["kind"] and "," in s["threshold"] for s in CORR["rs"][0]["settings"]), "a chain"
    for c in CORR["is"]:
        old, rollout, mask = gap_of(c)
        rho = (old - rollout)[mask.bool()]
        assert (rho > 20).any() and (rho < -20).any(), "valid log-ratios beyond the +-20 safety bound"
        assert (mask.sum(-1) == 0).any() and ((mask[:, :-1] == 0) & (mask[:, 1:] == 1)).any(), "empty rows, holes"
    fams = {(s["kind"], s["agg"]) for c in GOLDEN["policy_loss_families"] for s in c["settings"]}
    assert {k for k, _ in fams} == set(offpolicy.LOSS_MODES) - {"vanilla"}, "every loss family is golden-tested"
    assert len(fams) == 6 * len(AGG_MODES), "each under every aggregation mode (sapo, geo_mean: veRL ignores it)"
    for c in GOLDEN["policy_loss_families"]:
        x, adv = t64(c["inputs"]["logprobs"]) - t64(c["inputs"]["old_logprobs"]), t64(c["inputs"]["advantages"])
        valid = t64(c["inputs"]["mask"]).bool()
        assert (x[valid] > 20).any() and (adv == 0).all(-1).any(), "ratios beyond exp(20), a row with A = 0"


@pytest.mark.parametrize("case,setting", [
    pytest.param(c, s, id=f"{c['name']}-{s['level']}-{s['threshold']}") for c in CORR["is"] for s in c["settings"]
])  # fmt: skip
def test_rollout_is_weights_match_verl(case, setting):
    old, rollout, mask = gap_of(case)
    w, m = offpolicy.rollout_is_weights(old, rollout, mask, level=setting["level"], threshold=setting["threshold"])
    what = f"rollout_is {case['name']} {setting['level']} {setting['threshold']}"
    close_at_valid(w, t64(setting["weights"]), torch.ones_like(mask), what)  # 0 at masked positions in both
    assert not w.requires_grad
    keys = {f"rollout_is_{k}" for k in ("mean", "max", "min", "eff_sample_size", "ratio_fraction_high")}
    keys |= {"rollout_is_ratio_fraction_low"} | ({"rollout_is_oob_ratio"} if "_" in setting["threshold"] else set())
    same_metrics(m, setting["metrics"], what, keys)  # IcePop also reports the share it zeroed


@pytest.mark.parametrize("case,setting", [
    pytest.param(c, s, id=f"{c['name']}-{s['kind']}-{s['threshold']}") for c in CORR["rs"] for s in c["settings"]
])  # fmt: skip
def test_rollout_rejection_mask_matches_verl(case, setting):
    old, rollout, mask = gap_of(case)
    keep, m = offpolicy.rollout_rejection_mask(old, rollout, mask, kind=setting["kind"], threshold=setting["threshold"])
    what = f"rollout_rs {case['name']} {setting['kind']} {setting['threshold']}"
    assert torch.equal(keep.to(F64), t64(setting["mask"])), f"{what}: masks differ"
    each = ("mean", "max", "masked_fraction", "seq_masked_fraction")
    keys = {f"rollout_rs_{o}_{k}" for o in setting["kind"].split(",") for k in each}
    same_metrics(m, setting["metrics"], what, keys | {"rollout_rs_masked_fraction", "rollout_rs_seq_masked_fraction"})


NUMERIC = [(c, s) for kind in ("is", "rs") for c in CORR[kind] for s in c["settings"] if s["threshold"][0].isdigit()]
NUMERIC = [(c, s) for c, s in NUMERIC if "_" not in s["threshold"] and "," not in s["threshold"]]  # one bound


@pytest.mark.parametrize("case,setting", [pytest.param(c, s, id=f"{c['name']}-{s['threshold']}") for c, s in NUMERIC])
def test_a_threshold_written_as_a_number_as_veRLs_configs_do_is_the_same_threshold(case, setting):
    """veRL's YAML writes a single bound as a number (rollout_is_threshold: 2.0): the functions take it as it is."""
    old, rollout, mask = gap_of(case)
    number = float(setting["threshold"])
    if "level" in setting:
        w, m = offpolicy.rollout_is_weights(old, rollout, mask, level=setting["level"], threshold=number)
        close_at_valid(w, t64(setting["weights"]), torch.ones_like(mask), f"rollout_is {setting['threshold']}")
    else:
        keep, m = offpolicy.rollout_rejection_mask(old, rollout, mask, kind=setting["kind"], threshold=number)
        assert torch.equal(keep.to(F64), t64(setting["mask"])), f"rollout_rs {setting['kind']} {number}"


@pytest.mark.parametrize("case", [pytest.param(c, id=c["name"]) for c in CORR["offpolicy_metrics"]])
def test_gap_metrics_match_verl(case):
    m = offpolicy.gap_metrics(*gap_of(case))
    keys = {"kl", "k3_kl", "training_ppl", "rollout_ppl", "log_ppl_diff", "log_ppl_abs_diff", "log_ppl_diff_max"}
    keys |= {"ppl_ratio", "chi2_token", "chi2_seq"}
    same_metrics(m, case["metrics"], f"offpolicy metrics {case['name']}", keys)


# ------------------------------------------------------------------------------------------------
# core_algos: the loss families (values AND gradients w.r.t. log_prob) and REINFORCE++ (offpolicy.py 3, 4)


@pytest.mark.parametrize("case,setting", [
    pytest.param(c, s, id=f"{c['name']}-{s['kind']}-{s['clip_low']}-{s['agg']}-{'w' if s['weighted'] else 'nw'}")
    for c in GOLDEN["policy_loss_families"] for s in c["settings"]
])  # fmt: skip
def test_loss_families_match_verl_values_and_gradients(case, setting):
    inp = {k: t64(v) for k, v in case["inputs"].items()}
    mask, kind = inp["mask"], setting["kind"]
    lp = inp["logprobs"].clone().requires_grad_(True)
    loss, m = offpolicy.policy_loss(
        lp, inp["old_logprobs"], inp["advantages"], mask, kind=kind, clip_low=setting["clip_low"],
        clip_high=setting["clip_high"], dual_clip=3.0, tau_pos=1.0, tau_neg=1.05, agg=setting["agg"],
        is_weights=inp["is_weights"] if setting["weighted"] else None,
    )  # fmt: skip
    (grad,) = torch.autograd.grad(loss, lp)
    if kind == "geo_mean":  # veRL: torch.mean over every row; minrl: over non-empty rows (seq-mean-token-mean)
        scale = (mask.sum(-1) > 0).sum() / mask.shape[0]
        loss, grad = loss * scale, grad * scale
    what = f"{kind} {case['name']} clip=({setting['clip_low']}, {setting['clip_high']}) {setting['agg']}"
    what += " weighted" if setting["weighted"] else ""
    close_scalar(loss.detach(), setting["loss"], f"loss {what}")
    close_at_valid(grad, t64(setting["grad"]), torch.ones_like(mask), f"d loss / d logprob {what}")
    out = setting["metrics"]
    close_scalar(m["clipfrac"], out["pg_clipfrac"], f"clipfrac {what}")
    close_scalar(m["clipfrac_lower"], out["pg_clipfrac_lower"], f"clipfrac_lower {what}")
    close_scalar(m["approx_kl"], out["ppo_kl"], f"approx_kl {what}")


@pytest.mark.parametrize("case,setting,_k", cases("reinforce_pp", "settings"))
def test_reinforce_pp_matches_verl(case, setting, _k):
    r, mask = t64(case["inputs"]["token_rewards"]), t64(case["inputs"]["mask"])
    adv, ret = ppo_math.reinforce_pp_advantages(r, mask, setting["gamma"])
    what = f"reinforce++ {case['name']} gamma={setting['gamma']}"
    close_at_valid(ret, t64(setting["returns"]), mask, f"{what} returns")
    close_at_valid(adv, t64(setting["advantages"]), mask, f"{what} advantages")


@pytest.mark.parametrize("case,_s,_k", cases("reinforce_pp_baseline"))
def test_reinforce_pp_baseline_matches_verl(case, _s, _k):
    inp = case["inputs"]
    rewards, ids, mask = t64(inp["rewards"]), torch.tensor(inp["group_ids"]), t64(inp["mask"])
    adv = ppo_math.reinforce_pp_baseline_advantages(rewards, ids, mask)
    close_at_valid(adv, t64(case["advantages"]), mask, f"reinforce++ baseline {case['name']}")


if __name__ == "__main__":  # every golden test, then the largest difference from veRL each saw (RESULTS.md)
    code = pytest.main([__file__, "-q", "-p", "no:cacheprovider"])
    for test, diff in sorted(sys.modules[Path(__file__).stem].MAX_DIFF.items()):
        print(f"{test:55s} max |minrl - veRL| {diff:.1e}")
    sys.exit(code)
