"""offpolicy.py: rollout corrections and loss families by hand-computed answers and properties, their flags'
refusals, the bf16 inference copy, and the trainer running each (veRL's own numbers: tests/test_verl_golden.py)."""

import contextlib
import math

import pytest
import torch
from batches import full_batch

import offpolicy as op
import ppo_math
import trainer
from evaluation import first_action_mask
from rollout import inference_copy, sync_weights
from tasks import make_tiny_model, make_tokenizer

F64 = torch.float64


def hand_gap():
    """One row of 6 tokens whose log-ratios rho = log pi_old - log pi_rollout are known, the 4th token masked."""
    rho = torch.tensor([[-1.5, -0.5, 0.0, 9.0, 1.0, 2.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1, 0, 1, 1]], dtype=F64)
    return rho, torch.zeros_like(rho), mask


def test_rollout_is_weights_known_answers():
    old, rollout, mask = hand_gap()
    e = [math.exp(x) for x in (-1.5, -0.5, 0.0, 9.0, 1.0, 2.0)]
    w, m = op.rollout_is_weights(old, rollout, mask, level="token", threshold="2.0")  # TIS: min(w, 2)
    assert w[0].tolist() == pytest.approx([e[0], e[1], 1.0, 0.0, 2.0, 2.0])
    assert m["rollout_corr/rollout_is_max"] == 2.0 and m["rollout_corr/rollout_is_min"] == pytest.approx(e[0])
    assert m["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(2 / 5)  # e and e^2 above 2
    w, m = op.rollout_is_weights(old, rollout, mask, level="token", threshold="0.5_2.0")  # IcePop: 0 outside
    assert w[0].tolist() == pytest.approx([0.0, e[1], 1.0, 0.0, 0.0, 0.0])
    assert m["rollout_corr/rollout_is_oob_ratio"] == pytest.approx(3 / 5)
    ws = [x for x, keep in zip(w[0].tolist(), mask[0].tolist()) if keep]
    ess = 1 / (sum((x / (sum(ws) / 5)) ** 2 for x in ws) / 5)  # 1 / E[(w / E w)^2]
    assert m["rollout_corr/rollout_is_eff_sample_size"] == pytest.approx(ess)
    w, _ = op.rollout_is_weights(old, rollout, mask, level="sequence", threshold="100.0")  # exp(sum rho) = e^1
    assert w[0].tolist() == pytest.approx([math.e, math.e, math.e, 0.0, math.e, math.e])


def test_rollout_rejection_mask_known_answers():
    old, rollout, mask = hand_gap()
    keep, m = op.rollout_rejection_mask(old, rollout, mask, kind="token_k1", threshold="2.0")  # |rho| <= log 2
    assert keep[0].tolist() == [0, 1, 1, 0, 0, 0]
    assert m["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(3 / 5)
    keep, _ = op.rollout_rejection_mask(old, rollout, mask, kind="token_k2", threshold="0.6")  # rho^2 / 2 <= 0.6
    assert keep[0].tolist() == [0, 1, 1, 0, 1, 0]
    keep, m = op.rollout_rejection_mask(old, rollout, mask, kind="seq_mean_k1", threshold="0.5_1.5")
    assert keep[0].tolist() == [1, 1, 1, 0, 1, 1]  # mean of -rho = -0.2 in [log 0.5, log 1.5]: the row stays
    keep, m = op.rollout_rejection_mask(old, rollout, mask, kind="seq_mean_k1,seq_max_k3", threshold="0.5_1.5,2.0")
    assert keep.sum() == 0 and m["rollout_corr/rollout_rs_seq_masked_fraction"] == 1.0  # k3 at rho=2: e^2 - 3
    assert m["rollout_corr/rollout_rs_seq_mean_k1_masked_fraction"] == 0.0


def test_on_policy_corrections_are_neutral():
    """rollout == old (the sampler is the trained policy): weights 1, nothing rejected, the gap's KL and chi^2 0."""
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(4, 7, generator=g, dtype=F64) * 3
    mask = (torch.arange(7) < torch.tensor([[7], [3], [5], [1]])).to(F64)
    for level in ("token", "sequence"):
        w, _ = op.rollout_is_weights(old, old.clone(), mask, level=level, threshold="0.5_5.0")
        assert torch.equal(w, mask)
    for kind in op.RS_OPTIONS:
        th = "0.999_1.001" if kind.endswith("k1") else "1e-9"
        assert torch.equal(op.rollout_rejection_mask(old, old.clone(), mask, kind=kind, threshold=th)[0], mask)
    m = op.gap_metrics(old, old.clone(), mask)
    for k in ("kl", "k3_kl", "log_ppl_diff", "chi2_token", "chi2_seq"):
        assert abs(m[f"rollout_corr/{k}"]) < 1e-9, k  # chi2: n / (n + 1e-8) - 1, veRL's masked mean


@pytest.mark.parametrize("kind", [k for k in op.LOSS_MODES if k != "vanilla"])
def test_every_family_is_the_policy_gradient_on_policy(kind):
    """At ratio 1 every family's gradient is vanilla PPO's, -A m / denominator (GSPO's s = 1, CISPO's sg[1],
    SAPO's f'(1) = 1, GMPO's exp(0), DPPO's trust region containing pi_old); off-policy they differ."""
    g = torch.Generator().manual_seed(1)
    old = -torch.rand(5, 6, generator=g, dtype=F64) * 2 - 0.05
    adv = torch.randn(5, 1, generator=g, dtype=F64).expand(5, 6).clone()  # per sequence (GMPO's case)
    mask = (torch.arange(6) < torch.tensor([[6], [2], [4], [1], [5]])).to(F64)
    grads = {}
    for k, lp0 in (("vanilla", old), (kind, old), ("off", old + 0.3 * torch.randn(5, 6, generator=g, dtype=F64))):
        lp = lp0.clone().requires_grad_(True)
        loss, _ = op.policy_loss(lp, old, adv, mask, kind=kind if k == "off" else k, agg="seq-mean-token-mean")
        grads[k] = torch.autograd.grad(loss, lp)[0]
    assert torch.allclose(grads[kind], grads["vanilla"], atol=1e-12), kind
    assert not torch.allclose(grads["off"], grads["vanilla"], atol=1e-6), f"{kind}: off-policy equals on-policy"
    assert (grads[kind][mask == 0] == 0).all()


def test_reinforce_pp_known_answers():
    r = torch.tensor([[0.0, 0.5, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]], dtype=F64)
    mask = torch.tensor([[1, 0, 1, 0], [1, 1, 0, 0]], dtype=F64)  # row 0: an observation token at position 1
    adv, ret = ppo_math.reinforce_pp_advantages(r, mask, gamma=0.5)
    # row 0: G_2 = 1; the observation token carries G unchanged (its own reward 0.5 is not an action's): G_0 = 0.5
    assert ret.tolist() == [[0.5, 0.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]]
    valid = torch.tensor([0.5, 1.0, 1.0, 0.0], dtype=F64)
    z = (valid - valid.mean()) / valid.std()
    assert adv[mask.bool()].tolist() == pytest.approx(z.tolist(), abs=1e-6)
    base = ppo_math.reinforce_pp_baseline_advantages(torch.tensor([1.0, 0.0, 2.0], dtype=F64), torch.tensor([0, 0, 5]),
                                               torch.ones(3, 2, dtype=F64))  # fmt: skip
    centred = torch.tensor([0.5, -0.5, 2.0], dtype=F64).repeat_interleave(2)  # a singleton keeps its score
    assert base.flatten().tolist() == pytest.approx(((centred - centred.mean()) / centred.std()).tolist(), abs=1e-6)


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"loss_mode": "geo_mean"}, "'geo_mean' needs one advantage per sequence"),
        ({"loss_mode": "geo_mean", "adv_estimator": "grpo", "credit": "attention"}, "and no credit"),
        ({"rollout_is": "token", "off_policy": "tis"}, "keep one"),
        ({"rollout_is": "token", "off_policy": "behav"}, "keep one"),
        ({"rollout_is": "token", "rollout_is_threshold": "2.0_0.5"}, "0 < L <= U"),
        ({"rollout_is": "token", "rollout_is_threshold": "nan"}, "needs finite"),
        ({"rollout_is": "token", "rollout_is_threshold": "_2.0"}, "'rollout_is_threshold' = '_2.0'"),
        ({"rollout_rs": "token_k3", "rollout_rs_threshold": "nan"}, "needs finite"),
        ({"rollout_rs_threshold": "2.0"}, "without --rollout-rs"),
        ({"rollout_is_threshold": "0.5_2.0"}, "without --rollout-is"),
        ({"sapo_tau_pos": 2.0}, "only sapo has a gate"),
        ({"rollout_is": "token", "rollout_is_threshold": "two"}, "'rollout_is_threshold' = 'two'"),
        ({"rollout_rs": "token_k1"}, "'rollout_rs_threshold' = None"),
        ({"rollout_rs": "seq_max_k1", "rollout_rs_threshold": "2"}, "'seq_max_k1' is not one of"),
        ({"rollout_rs": "token_k2", "rollout_rs_threshold": "0.1_0.2"}, "takes one upper bound"),
        ({"rollout_rs": "token_k1,token_k2", "rollout_rs_threshold": "2,3,4"}, "one per option"),
        ({"rollout_dtype": "bfloat16", "fsdp": True}, "not with --fsdp"),
        ({"loss_mode": "sapo", "sapo_tau_neg": 0.0}, "sapo_tau_neg"),
    ],
)
def test_flag_refusals_name_the_field_and_the_fix(kw, match):
    with pytest.raises(ValueError, match=match):
        trainer.Config(**kw)


def test_thresholds_are_numbers_or_text_as_in_veRLs_configs():
    """rollout_is_threshold: 2.0 in a veRL YAML is the command line's "2.0"; a list or a bool is refused, named."""
    old, rollout, mask = hand_gap()
    for fn, kw in ((op.rollout_is_weights, {"level": "token"}), (op.rollout_rejection_mask, {"kind": "token_k3"})):
        as_text = fn(old, rollout, mask, **kw, threshold="2.0")
        for number in (2, 2.0):
            as_number = fn(old, rollout, mask, **kw, threshold=number)
            assert torch.equal(as_number[0], as_text[0]) and as_number[1] == as_text[1]
    cfg = trainer.Config(rollout_is="token", rollout_is_threshold=2, rollout_rs="token_k2", rollout_rs_threshold=0.05)
    assert (cfg.rollout_is_threshold, cfg.rollout_rs_threshold) == ("2.0", "0.05")
    for bad in ([0.5, 2.0], True, {"upper": 2}):
        with pytest.raises(ValueError, match=r"'rollout_is_threshold' = .*: a number \(2.0\) or a string"):
            trainer.Config(rollout_is="token", rollout_is_threshold=bad)
        with pytest.raises(ValueError, match="'rollout_rs_threshold'"):
            op.rollout_rejection_mask(old, rollout, mask, kind="token_k1", threshold=bad)


def test_inference_copy_is_a_bf16_snapshot_synced_on_demand():
    policy = make_tiny_model(make_tokenizer())
    assert inference_copy(policy, "float32") is policy
    engine = inference_copy(policy, "bfloat16")
    assert engine is not policy and all(p.dtype == torch.bfloat16 and not p.requires_grad for p in engine.parameters())
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.01)
    assert not all(torch.equal(e, p.bfloat16()) for e, p in zip(engine.parameters(), policy.parameters()))
    sync_weights(engine, policy)
    assert all(torch.equal(e, p.bfloat16()) for e, p in zip(engine.parameters(), policy.parameters()))
    assert all(p.dtype == torch.float32 for p in policy.parameters())  # the trainer's weights stay fp32


def update_of(loss_mask, advantages, old, seed=0, **cfg):
    """(loss/policy, the parameters' gradients) of one policy_step of the tiny model on a fixed ragged batch."""
    torch.manual_seed(seed)
    model = make_tiny_model(make_tokenizer()).eval()
    B, P, R = 6, 4, 7
    g = torch.Generator().manual_seed(3)
    lengths = torch.tensor([7, 3, 5, 1, 6, 4])
    resp = (torch.arange(R) < lengths[:, None]).long()  # [B, R]
    attn = torch.cat([torch.ones(B, P, dtype=torch.long), resp], 1)
    ids = torch.randint(4, 50, (B, P + R), generator=g) * attn
    batch = full_batch(input_ids=ids, attention_mask=attn, response_mask=resp, old_logprobs=old, ref_logprobs=None,
                       advantages=advantages, loss_mask=loss_mask)  # fmt: skip
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    grads = {}
    opt.step = lambda: grads.update({n: p.grad.clone() for n, p in model.named_parameters()})  # before zero_grad
    cfg = trainer.Config(grad_clip=1e9, **cfg)
    _, step, _ = trainer.policy_step(cfg, model, opt, batch, 1, contextlib.nullcontext, True, "test")
    return float(step["loss/policy"]), grads


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean"])
def test_rejected_tokens_leave_the_loss_and_its_normaliser(loss_agg):
    """policy_step on a loss_mask with rejected tokens and a rejected row: what sits at the rejected positions
    (advantages) changes nothing, and at ratio 1 (no anchor: the first forward's) the policy loss is -A averaged
    over the kept tokens alone: sum(keep A) / sum(keep), or per kept row then over the kept rows."""
    g = torch.Generator().manual_seed(0)
    resp = (torch.arange(7) < torch.tensor([7, 3, 5, 1, 6, 4])[:, None]).float()
    keep = resp.clone()
    keep[0, 2], keep[2, 4], keep[4] = 0, 0, 0  # two tokens and the whole row 4 rejected
    adv = torch.randn(6, 7, generator=g) * resp
    loss, grads = update_of(keep, adv, None, loss_agg=loss_agg)
    loss2, grads2 = update_of(keep, torch.where(keep.bool(), adv, 50.0) * resp, None, loss_agg=loss_agg)  # junk
    assert loss == pytest.approx(loss2, abs=1e-7)
    assert all(torch.allclose(grads[n], grads2[n], atol=1e-7) for n in grads)
    if loss_agg == "token-mean":
        want = -(adv * keep).sum() / keep.sum()
    else:
        rows = keep.sum(-1) > 0
        want = -((adv * keep).sum(-1)[rows] / keep.sum(-1)[rows]).mean()
    assert loss == pytest.approx(float(want), abs=1e-6)
    full, _ = update_of(resp, adv, None, loss_agg=loss_agg)
    assert abs(full - loss) > 1e-4 and any(g.abs().sum() > 0 for g in grads.values())


SMALL = dict(task="reverse", steps=2, prompts_per_step=8, group_size=4, eval_every=0, max_new_tokens=8)


def test_trainer_with_a_bf16_sampler_reports_and_applies_the_corrections(tmp_path, sft_path):
    """A bf16 sampler makes a gap; token IcePop zeroes some weights, a tight token mask rejects tokens, and the
    update still runs (rejected tokens leave the losses); with an fp32 sampler the gap is rounding only."""
    common = dict(SMALL, model=str(sft_path))
    fp32 = trainer.train(trainer.Config(**common, out_dir=str(tmp_path / "fp32"), rollout_is="token"))
    tight = dict(rollout_is="token", rollout_is_threshold="0.999_1.001")
    tight.update(rollout_rs="token_k1", rollout_rs_threshold="1.002")
    bf16 = trainer.train(trainer.Config(**common, out_dir=str(tmp_path / "bf16"), rollout_dtype="bfloat16", **tight))
    assert fp32["stats/rollout_vs_old_logp_diff"] < 1e-4 < bf16["stats/rollout_vs_old_logp_diff"]
    assert fp32["rollout_corr/rollout_is_eff_sample_size"] == pytest.approx(1.0, abs=1e-3)
    assert 0 < bf16["rollout_corr/rollout_is_oob_ratio"] < 1 and 0 < bf16["rollout_corr/rollout_rs_masked_fraction"] < 1
    assert math.isfinite(bf16["loss/policy"]) and bf16["stats/grad_norm"] > 0
    rows = {}
    for name, kw in (("none", {}), ("tis", dict(rollout_is="token", rollout_is_threshold="1.0001")), ("rs", tight)):
        hook = lambda step, m, name=name: rows.setdefault(name, m)  # noqa: E731  the first iteration's row
        one = dict(common, steps=1, out_dir=str(tmp_path / name), rollout_dtype="bfloat16")
        trainer.train(trainer.Config(**one, **kw), hooks=[hook])
    assert len({rows[k]["rollout/reward_mean"] for k in rows}) == 1  # the same samples (the same seed and weights)
    assert rows["none"]["rollout_corr/kl"] == rows["tis"]["rollout_corr/kl"]  # the same samples, the same gap
    for name in ("tis", "rs"):  # ... and a different update
        assert abs(rows[name]["loss/policy"] - rows["none"]["loss/policy"]) > 1e-6, name


def test_a_bf16_sampler_with_the_first_forward_as_anchor(tmp_path, sft_path):
    """One epoch of one minibatch (reuse_old_logprobs): the anchor comes from the update's first forward, after
    stanza 4; the gap and veRL's gap metrics are taken from it then."""
    cfg = trainer.Config(**SMALL, ppo_epochs=1, minibatches=1, rollout_dtype="bfloat16", model=str(sft_path),
                    out_dir=str(tmp_path))  # fmt: skip
    assert trainer.reuses_anchor(cfg)
    out = trainer.train(cfg)
    assert 1e-4 < out["stats/rollout_vs_old_logp_diff"] < 0.05 and "rollout_corr/chi2_token" in out


def test_the_bf16_sampler_follows_the_policy(tmp_path, sft_path):
    """The inference copy is synced before every rollout: at a high lr the policy moves far within 4 iterations,
    yet the sampler-trainer gap stays at bf16's rounding (a copy left at the start would drift away)."""
    cfg = dict(SMALL, steps=4, lr=3e-3, warmup_steps=0, model=str(sft_path), out_dir=str(tmp_path))
    rows = []
    trainer.train(trainer.Config(**cfg, rollout_dtype="bfloat16"), hooks=[lambda step, m: rows.append(m)])
    gaps = [r["stats/rollout_vs_old_logp_diff"] for r in rows]
    assert max(abs(r["stats/kl"]) for r in rows) > 0.05, "the policy did not move: the test shows nothing"
    assert max(gaps) < 3 * gaps[0], gaps


@pytest.mark.parametrize(
    "kw",
    [
        dict(adv_estimator="reinforce_plus_plus", loss_mode="cispo"),
        dict(adv_estimator="reinforce_plus_plus_baseline", loss_mode="gspo", clip_low=3e-4, clip_high=4e-4),
        dict(adv_estimator="gae", loss_mode="sapo"),  # per sequence for the policy term, token-mean for the critic
        dict(adv_estimator="rloo", loss_mode="geo_mean"),
        dict(adv_estimator="grpo", loss_mode="dppo_kl", clip_low=0.05, clip_high=0.05),
    ],
    ids=lambda kw: f"{kw['adv_estimator']}-{kw['loss_mode']}",
)
def test_trainer_runs_each_estimator_and_family(kw, tmp_path, sft_path):
    out = trainer.train(trainer.Config(**SMALL, **kw, model=str(sft_path), out_dir=str(tmp_path)))
    assert math.isfinite(out["loss/policy"]) and out["stats/grad_norm"] > 0
    assert out["stats/adv_abs_mean"] > 0


def test_gap_stats_first_turn_known_answers():
    old = torch.zeros(2, 5)
    behav = torch.tensor([[0.0, 0.0, 0.0, 0.4, 0.2], [0.1, 0.1, 0.0, 0.0, 0.0]])  # |gap| per token
    mask = torch.tensor([[1, 1, 0, 1, 1], [1, 1, 0, 0, 0]])  # row 0: two actions around an observation
    episodes = [{"action_spans": [(0, 2), (3, 5)]}, {"action_spans": [(0, 2)]}]
    first = first_action_mask(episodes, mask)
    assert first.tolist() == [[1, 1, 0, 0, 0], [1, 1, 0, 0, 0]]
    stats = op.gap_stats(old, behav, mask.float(), first_turn=first.float())
    assert stats["stats/rollout_vs_old_logp_diff"] == pytest.approx(0.8 / 6)
    assert stats["stats/rollout_vs_old_logp_diff_first_turn"] == pytest.approx(0.2 / 4)
    assert "stats/rollout_vs_old_logp_diff_first_turn" not in op.gap_stats(old, behav, mask.float())
