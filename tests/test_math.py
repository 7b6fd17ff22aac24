"""Known-answer and property tests for the math of trainer.py and the masked reductions of common.py.

Every expected number is derived by hand in a comment next to it (never by calling the code under test).
Everything runs in fp64 unless a test is about fp32 behaviour.
"""

import contextlib
import math
import shlex
import sys

import numpy as np
import pytest
import torch

import common
import critics
import env_client
import offpolicy
import ppo_math
import trainer
from experiments import seeds

F64 = torch.float64


def t(x, dtype=F64) -> torch.Tensor:
    return torch.tensor(x, dtype=dtype)


def close(a, b, tol=1e-9) -> None:
    a, b = torch.as_tensor(a, dtype=F64), torch.as_tensor(b, dtype=F64)
    assert a.shape == b.shape, f"shape {tuple(a.shape)} != {tuple(b.shape)}"
    diff = (a - b).abs().max().item() if a.numel() else 0.0
    assert diff <= tol, f"max abs diff {diff:.3e} > {tol:.1e}\n got {a}\n want {b}"


# ----------------------------------------------------------------------------------------------
# GAE


def test_gae_gamma_lam_one_terminal_reward():
    # gamma = lam = 1, reward R = 1 on the last token: A_t = R - V_t, returns_t = R.
    # V = [0.1, 0.4, -0.2] -> A = [0.9, 0.6, 1.2], returns = [1, 1, 1]
    r, v, m = t([[0.0, 0.0, 1.0]]), t([[0.1, 0.4, -0.2]]), t([[1.0, 1.0, 1.0]])
    adv, ret = ppo_math.gae(r, v, m, gamma=1.0, lam=1.0)
    close(adv, [[0.9, 0.6, 1.2]])
    close(ret, [[1.0, 1.0, 1.0]])


def test_gae_lam_zero_is_one_step_td():
    # lam = 0: A_t = r_t + gamma V_{t+1} - V_t with V_3 = 0; gamma = 0.9, r = [0, 0, 1], V = [0.5, 0.2, 0.4]
    # A_0 = 0 + 0.9*0.2 - 0.5 = -0.32 ; A_1 = 0 + 0.9*0.4 - 0.2 = 0.16 ; A_2 = 1 + 0 - 0.4 = 0.6
    # returns = A + V = [0.18, 0.36, 1.0]
    r, v, m = t([[0.0, 0.0, 1.0]]), t([[0.5, 0.2, 0.4]]), t([[1.0, 1.0, 1.0]])
    adv, ret = ppo_math.gae(r, v, m, gamma=0.9, lam=0.0)
    close(adv, [[-0.32, 0.16, 0.6]])
    close(ret, [[0.18, 0.36, 1.0]])


def test_gae_general_gamma_lam():
    # gamma = 0.9, lam = 0.5 (gamma*lam = 0.45), deltas from the test above: [-0.32, 0.16, 0.6]
    # A_2 = 0.6 ; A_1 = 0.16 + 0.45*0.6 = 0.43 ; A_0 = -0.32 + 0.45*0.43 = -0.1265
    r, v, m = t([[0.0, 0.0, 1.0]]), t([[0.5, 0.2, 0.4]]), t([[1.0, 1.0, 1.0]])
    adv, ret = ppo_math.gae(r, v, m, gamma=0.9, lam=0.5)
    close(adv, [[-0.1265, 0.43, 0.6]])
    close(ret, [[0.3735, 0.63, 1.0]])


def test_gae_masked_middle_position_is_deleted():
    # mask [1, 1, 0, 1]: position 2 (an observation token) must pass values through, i.e. the result at
    # valid positions equals GAE on the sequence with position 2 deleted: r = [0, 0, 1], V = [.5, .2, .4],
    # gamma 0.9, lam 0.5 -> [-0.1265, 0.43, 0.6] (test above). Junk reward/value at position 2 are ignored;
    # advantages and returns are written as 0 there (implementation detail 7).
    r, v, m = t([[0.0, 0.0, 5.0, 1.0]]), t([[0.5, 0.2, 9.0, 0.4]]), t([[1.0, 1.0, 0.0, 1.0]])
    adv, ret = ppo_math.gae(r, v, m, gamma=0.9, lam=0.5)
    close(adv, [[-0.1265, 0.43, 0.0, 0.6]])
    close(ret, [[0.3735, 0.63, 0.0, 1.0]])


def test_gae_trailing_padding_and_rows_independent():
    # row 0: valid length 2, r = [0, 2], V = [1, 3], gamma = lam = 1 -> A = [2 - 1, 2 - 3] = [1, -1], R = [2, 2]
    # row 1: valid length 1, r = [0.5], V = [0.25] -> A = [0.25], R = [0.5]; padding gives 0
    r = t([[0.0, 2.0, 7.0], [0.5, 3.0, 3.0]])
    v = t([[1.0, 3.0, 4.0], [0.25, 8.0, 8.0]])
    m = t([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    adv, ret = ppo_math.gae(r, v, m, gamma=1.0, lam=1.0)
    close(adv, [[1.0, -1.0, 0.0], [0.25, 0.0, 0.0]])
    close(ret, [[2.0, 2.0, 0.0], [0.5, 0.0, 0.0]])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gae_gamma_lam_one_is_reward_to_go_minus_value_random(seed):
    # Property: with gamma = lam = 1 the recursion telescopes to A_t = sum_{s >= t, mask_s = 1} r_s - V_t at
    # every valid t (masks with holes included), and returns_t = reward-to-go over valid positions.
    g = torch.Generator().manual_seed(seed)
    B, R = 6, 9
    r = torch.randn(B, R, generator=g, dtype=F64)
    v = torch.randn(B, R, generator=g, dtype=F64)
    m = (torch.rand(B, R, generator=g) < 0.7).to(F64)
    m[0] = 0.0  # a fully masked row
    m[1] = 1.0  # a full row
    adv, ret = ppo_math.gae(r, v, m, gamma=1.0, lam=1.0)
    rtg = torch.zeros(B, R, dtype=F64)
    for b in range(B):  # explicit double loop: the reference definition
        for s in range(R):
            rtg[b, s] = sum(float(r[b, u]) for u in range(s, R) if m[b, u] == 1)
    close(adv * m, (rtg - v) * m, 1e-12)
    close(ret * m, rtg * m, 1e-12)
    close(adv * (1 - m), torch.zeros(B, R), 0.0)


# ----------------------------------------------------------------------------------------------
# Group baselines


def test_group_advantages_known_answers():
    # group 7: [1, 0, 0, 1]: mean 0.5, unbiased std = sqrt(4 * 0.25 / 3) = sqrt(1/3) = 0.5773503
    #          A = +-0.5 / (0.5773503 + 1e-6) = +-0.8660239 (0.8660254 without eps)
    # group 3: [1, 1]: std 0 -> A = 0
    # group 5: singleton 0.7 -> mean 0, std 1 -> A = 0.7 / (1 + 1e-6)
    # group 9: [0.2, 0.4, 0.9]: mean 0.5, std = sqrt((0.09 + 0.01 + 0.16) / 2) = sqrt(0.13) = 0.3605551
    scores = t([1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.7, 0.2, 0.4, 0.9])
    gids = torch.tensor([7, 3, 7, 7, 7, 3, 5, 9, 9, 9])
    adv = ppo_math.group_advantages(scores, gids)
    a4 = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    s9 = math.sqrt(0.13) + 1e-6
    want = [a4, 0.0, -a4, -a4, a4, 0.0, 0.7 / (1 + 1e-6), -0.3 / s9, -0.1 / s9, 0.4 / s9]
    close(adv, want, 1e-9)
    assert abs(adv[0].item() - 0.8660) < 1e-4


def test_group_advantages_dr_grpo_no_std():
    # norm_std=False: A = s - mean_g. [1, 0, 0, 1] -> +-0.5 ; [0.2, 0.4, 0.9] -> [-0.3, -0.1, 0.4];
    # singleton 0.7 -> 0.7 (mean 0)
    scores = t([1.0, 0.0, 0.0, 1.0, 0.2, 0.4, 0.9, 0.7])
    gids = torch.tensor([0, 0, 0, 0, 1, 1, 1, 2])
    adv = ppo_math.group_advantages(scores, gids, norm_std=False)
    close(adv, [0.5, -0.5, -0.5, 0.5, -0.3, -0.1, 0.4, 0.7], 1e-12)


def test_rloo_known_answers():
    # A_i = s_i - mean of the OTHER samples of its group
    # [1, 0, 0, 1]: 1 - (0+0+1)/3 = 2/3 ; 0 - (1+0+1)/3 = -2/3
    # [0.5, 0.2]: 0.5 - 0.2 = 0.3, 0.2 - 0.5 = -0.3 ; singleton 0.7 -> 0.7 (no baseline)
    scores = t([1.0, 0.0, 0.0, 1.0, 0.5, 0.2, 0.7])
    gids = torch.tensor([4, 4, 4, 4, 1, 1, 0])
    adv = ppo_math.rloo_advantages(scores, gids)
    close(adv, [2 / 3, -2 / 3, -2 / 3, 2 / 3, 0.3, -0.3, 0.7], 1e-12)


def test_group_advantages_invariant_to_sample_order():
    # Property: shuffling the samples (and their group ids) shuffles the advantages the same way.
    g = torch.Generator().manual_seed(0)
    scores = torch.rand(24, generator=g, dtype=F64)
    gids = torch.arange(24) // 4
    perm = torch.randperm(24, generator=g)
    for fn in (ppo_math.group_advantages, ppo_math.rloo_advantages):
        close(fn(scores[perm], gids[perm]), fn(scores, gids)[perm], 1e-12)


# ----------------------------------------------------------------------------------------------
# KL estimators


def test_kl_estimates_known_answers():
    # x = logp - ref = [0, 1, -1, 0.5]
    # k1 = x ; k2 = x^2 / 2 = [0, 0.5, 0.5, 0.125]
    # k3 = exp(-x) + x - 1 = [0, e^-1 = 0.36787944, e - 2 = 0.71828183, e^-0.5 - 0.5 = 0.10653066]
    logp, ref = t([0.0, 1.0, -1.0, 0.25]), t([0.0, 0.0, 0.0, -0.25])
    close(ppo_math.kl_estimate(logp, ref, "k1"), [0.0, 1.0, -1.0, 0.5])
    close(ppo_math.kl_estimate(logp, ref, "k2"), [0.0, 0.5, 0.5, 0.125])
    close(ppo_math.kl_estimate(logp, ref, "k3"), [0.0, 0.36787944117, 0.71828182846, 0.10653065971], 1e-10)


def test_k3_nonnegative_zero_at_zero_and_quadratic_near_zero():
    x = torch.linspace(-8, 8, 1001, dtype=F64)
    k3 = ppo_math.kl_estimate(x, torch.zeros_like(x), "k3")
    assert (k3 >= 0).all(), "k3 = exp(-x) + x - 1 is >= 0 for every x"
    assert ppo_math.kl_estimate(t([0.3]), t([0.3]), "k3").item() == 0.0
    # exp(-x) + x - 1 = x^2/2 - x^3/6 + O(x^4): for x = 1e-3 the relative gap to x^2/2 is about x/3
    small = t([1e-3, -1e-3])
    ratio = ppo_math.kl_estimate(small, torch.zeros(2, dtype=F64), "k3") / (small**2 / 2)
    close(ratio, [1 - 1e-3 / 3, 1 + 1e-3 / 3], 1e-6)


def test_k3_clamps():
    # x = 5: e^-5 + 4 = 4.00673795 (inside the clamps)
    # x = 30: -x clamped to -20 -> e^-20 + 20 - 1 = 19.000000002 -> result clamped to 10
    # x = -30: -x clamped to 20 -> e^20 - 21 (huge) -> clamped to 10 ; never inf or NaN
    x = t([5.0, 30.0, -30.0, -1000.0])
    k3 = ppo_math.kl_estimate(x, torch.zeros(4, dtype=F64), "k3")
    close(k3, [4.006737947, 10.0, 10.0, 10.0], 1e-8)


def test_kl_unknown_kind_raises():
    with pytest.raises(ValueError, match="k4"):
        ppo_math.kl_estimate(t([0.0]), t([0.0]), "k4")


# ----------------------------------------------------------------------------------------------
# Policy and value losses (one token per call, so the token-mean loss is that token's loss)


def one_token_pg(ratio: float, adv: float, **kw):
    logp = t([[math.log(ratio)]])
    loss, m = offpolicy.policy_loss(logp, t([[0.0]]), t([[adv]]), t([[1.0]]), **kw)
    # metrics are masked means, sum / (n + 1e-8) like veRL: round them to 6 digits
    return loss.item(), {k: round(float(v), 6) for k, v in m.items()}


def test_policy_loss_positive_advantage_clipped_above():
    # A = 2 > 0, r = 1.5: -A r = -3, -A clip(r, 0.8, 1.2) = -2.4 ; max = -2.4 = -1.2 A ; clipped -> clipfrac 1
    loss, m = one_token_pg(1.5, 2.0)
    assert loss == pytest.approx(-2.4, abs=1e-12)
    assert m["clipfrac"] == 1.0 and m["clipfrac_lower"] == 0.0


def test_policy_loss_negative_advantage_clipped_below():
    # A = -2 < 0, r = 0.5: -A r = 1.0, -A clip(r) = -A * 0.8 = 1.6 ; max = 1.6 = -0.8 A ; dual clip -A*3 = 6
    # is larger, so it does not bind: clipfrac 1, clipfrac_lower 0
    loss, m = one_token_pg(0.5, -2.0)
    assert loss == pytest.approx(1.6, abs=1e-12)
    assert m["clipfrac"] == 1.0 and m["clipfrac_lower"] == 0.0


def test_policy_loss_dual_clip():
    # A = -2, r = 10, c = 3: -A r = 20, -A clip(r) = 2.4 -> max 20 ; dual clip min(20, -A c = 6) = 6 = -3 A
    # clipfrac: is the clipped term larger? 2.4 > 20 no -> 0 ; clipfrac_lower 1
    loss, m = one_token_pg(10.0, -2.0, dual_clip=3.0)
    assert loss == pytest.approx(6.0, abs=1e-12)
    assert m["clipfrac"] == 0.0 and m["clipfrac_lower"] == 1.0
    # dual clip off: the unbounded 20 stays
    loss, m = one_token_pg(10.0, -2.0, dual_clip=None)
    assert loss == pytest.approx(20.0, abs=1e-12)
    assert m["clipfrac_lower"] == 0.0
    # dual clip never touches a positive advantage: A = 2, r = 10 -> max(-20, -2.4) = -2.4
    loss, _ = one_token_pg(10.0, 2.0, dual_clip=3.0)
    assert loss == pytest.approx(-2.4, abs=1e-12)


def test_policy_loss_unclipped_inside_trust_region():
    # r = 1.1, A = 1: -1.1 vs -1.1 -> -1.1, clipfrac 0 ; r = 0.9, A = -1: 0.9 vs 0.9 -> 0.9
    loss, m = one_token_pg(1.1, 1.0)
    assert loss == pytest.approx(-1.1, abs=1e-7) and m["clipfrac"] == 0.0
    loss, m = one_token_pg(0.9, -1.0)
    assert loss == pytest.approx(0.9, abs=1e-7) and m["clipfrac"] == 0.0


def test_policy_loss_clip_higher_is_asymmetric():
    # clip_low 0.2, clip_high 0.28: range [0.8, 1.28]
    # A = 1, r = 1.25: inside -> -1.25, clipfrac 0 (with symmetric 0.2 it would be -1.2, clipped)
    # A = 1, r = 1.3: -> -1.28 ; A = -1, r = 0.75: max(0.75, 0.8) = 0.8 (lower bound still 0.8)
    kw = dict(clip_low=0.2, clip_high=0.28)
    loss, m = one_token_pg(1.25, 1.0, **kw)
    assert loss == pytest.approx(-1.25, abs=1e-7) and m["clipfrac"] == 0.0
    loss, m = one_token_pg(1.25, 1.0)
    assert loss == pytest.approx(-1.2, abs=1e-7) and m["clipfrac"] == 1.0
    loss, _ = one_token_pg(1.3, 1.0, **kw)
    assert loss == pytest.approx(-1.28, abs=1e-12)
    loss, _ = one_token_pg(0.75, -1.0, **kw)
    assert loss == pytest.approx(0.8, abs=1e-12)


def test_policy_loss_batch_metrics_and_a_shaped_advantage():
    # 2 x 2 tokens, last one masked. log-ratios [[ln 1.5, 0], [ln 0.5, junk]], A [[1, 1], [-1, 5]]
    # per-token loss: [-1.2, -1, 0.8, *]; token-mean = (-1.2 - 1 + 0.8) / 3 = -1.4 / 3
    # clipfrac: tokens 0 and 2 clipped -> 2/3 ; ratio_mean = (1.5 + 1 + 0.5) / 3 = 1 ; ratio_max = 1.5
    # approx_kl = mean(old - new) = -(ln 1.5 + 0 + ln 0.5) / 3 = -ln(0.75) / 3 = 0.0958940
    logp = t([[math.log(1.5), 0.0], [math.log(0.5), 3.0]])
    mask = t([[1.0, 1.0], [1.0, 0.0]])
    adv = t([[1.0, 1.0], [-1.0, 5.0]])
    loss, m = offpolicy.policy_loss(logp, torch.zeros(2, 2, dtype=F64), adv, mask)
    assert loss.item() == pytest.approx(-1.4 / 3, abs=1e-12)
    assert float(m["clipfrac"]) == pytest.approx(2 / 3, abs=1e-7)
    assert float(m["ratio_mean"]) == pytest.approx(1.0, abs=1e-7)
    assert float(m["ratio_max"]) == pytest.approx(1.5, abs=1e-7)
    assert float(m["approx_kl"]) == pytest.approx(-math.log(0.75) / 3, abs=1e-7)
    # attention credit's weights shape the advantage (the caller's product): [[2, 0], [1, 1]] -> A' = [[2, 0], [-1, 5]]
    # per-token: max(-3, -2.4) = -2.4 ; 0 ; 0.8 -> (-2.4 + 0 + 0.8) / 3 = -1.6 / 3
    w = t([[2.0, 0.0], [1.0, 1.0]])
    loss_w, _ = offpolicy.policy_loss(logp, torch.zeros(2, 2, dtype=F64), adv * w, mask)
    assert loss_w.item() == pytest.approx(-1.6 / 3, abs=1e-12)


def test_policy_loss_pg_mask_keeps_the_full_normaliser():
    # r = 1, A = [3, 6, -9]: per-token loss -A = [-3, -6, 9]. pg_mask [1, 0, 1] drops token 1's term, but the
    # token-mean still divides by the 3 valid tokens of `mask`: (-3 + 9) / 3 = 2 (not 6 / 2 = 3)
    z = torch.zeros(1, 3, dtype=F64)
    loss, _ = offpolicy.policy_loss(z, z, t([[3.0, 6.0, -9.0]]), t([[1.0, 1.0, 1.0]]), pg_mask=t([[1.0, 0.0, 1.0]]))
    assert loss.item() == pytest.approx(2.0, abs=1e-12)


def test_policy_loss_gradient_at_ratio_one_is_minus_advantage():
    # At r = 1 (logp = old) d L / d logp_t = -A_t / n_tokens (token-mean): A = [2, -1, 4 (masked)]
    logp = torch.zeros(1, 3, dtype=F64, requires_grad=True)
    loss, _ = offpolicy.policy_loss(logp, torch.zeros(1, 3, dtype=F64), t([[2.0, -1.0, 4.0]]), t([[1.0, 1.0, 0.0]]))
    loss.backward()
    close(logp.grad, [[-1.0, 0.5, 0.0]], 1e-12)


def test_value_loss_clipped_and_unclipped_branches():
    # eps_v = 0.5, old V = 0 everywhere, new V = 1 -> V_clip = 0.5
    # token a: R = 0: (1 - 0)^2 = 1 vs (0.5 - 0)^2 = 0.25 -> max 1 (unclipped branch)
    # token b: R = 2: (1 - 2)^2 = 1 vs (0.5 - 2)^2 = 2.25 -> max 2.25 (clipped branch)
    # token c: R = 0.8, V = 0.3 (inside the clip range): V_clip = V -> (0.3 - 0.8)^2 = 0.25, no clip
    # loss = 0.5 * token-mean = 0.5 * (1 + 2.25 + 0.25) / 3 = 0.5833333 ; vf_clipfrac = 1/3
    v = t([[1.0, 1.0, 0.3]])
    loss, m = ppo_math.value_loss(v, torch.zeros(1, 3, dtype=F64), t([[0.0, 2.0, 0.8]]), t([[1.0, 1.0, 1.0]]))
    assert loss.item() == pytest.approx(0.5 * 3.5 / 3, abs=1e-12)
    assert float(m["vf_clipfrac"]) == pytest.approx(1 / 3, abs=1e-7)
    # one token alone in each branch
    loss_a, _ = ppo_math.value_loss(t([[1.0]]), t([[0.0]]), t([[0.0]]), t([[1.0]]))
    loss_b, m_b = ppo_math.value_loss(t([[1.0]]), t([[0.0]]), t([[2.0]]), t([[1.0]]))
    assert loss_a.item() == pytest.approx(0.5, abs=1e-12)
    assert loss_b.item() == pytest.approx(1.125, abs=1e-7) and float(m_b["vf_clipfrac"]) == pytest.approx(1.0, abs=1e-7)
    # clip = 2 puts token b inside the range: loss = 0.5 * (1 - 2)^2 = 0.5
    loss_b2, _ = ppo_math.value_loss(t([[1.0]]), t([[0.0]]), t([[2.0]]), t([[1.0]]), clip=2.0)
    assert loss_b2.item() == pytest.approx(0.5, abs=1e-12)


# ----------------------------------------------------------------------------------------------
# Aggregation


L23 = [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]
M23 = [[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]]


def test_aggregate_modes_2x3_by_hand():
    # valid: row 0 -> 1, 2 ; row 1 -> 4
    # token-mean = (1 + 2 + 4) / 3 = 7/3
    # seq-mean-token-mean = mean(1.5, 4) = 2.75 ; seq-mean-token-sum = mean(3, 4) = 3.5
    L, M = t(L23), t(M23)
    assert ppo_math.aggregate(L, M, "token-mean").item() == pytest.approx(7 / 3, abs=1e-12)
    assert ppo_math.aggregate(L, M, "seq-mean-token-mean").item() == pytest.approx(2.75, abs=1e-7)
    assert ppo_math.aggregate(L, M, "seq-mean-token-sum").item() == pytest.approx(3.5, abs=1e-12)


def test_seq_mean_token_sum_norm_divides_by_a_constant():
    # Dr. GRPO: (3 + 4) / (2 sequences x C); C defaults to the padded width R = 3 (veRL), else the given constant
    L, M = t(L23), t(M23)
    assert ppo_math.aggregate(L, M, "seq-mean-token-sum-norm").item() == pytest.approx(7 / 6, abs=1e-12)
    denom = ppo_math.agg_denominator(M, "seq-mean-token-sum-norm", global_=False, scale=10)
    assert denom.item() == 20 and ppo_math.aggregate(L, M, "seq-mean-token-sum-norm", denom).item() == pytest.approx(
        0.35
    )
    cfg = trainer.Config(
        adv_estimator="grpo", grpo_norm_std=False, loss_agg="seq-mean-token-sum-norm", max_new_tokens=24
    )
    assert cfg.loss_scale_factor == 24  # derived: the generation budget, the same for every batch


def test_critic_vf_clipfrac_averages_every_micro_batch_of_every_critic(monkeypatch):
    # two critics x two micro-batches, clip fractions 0.1, 0.2 (critic 0) and 0.3, 0.4 (critic 1): mean 0.25
    # (it used to be the last micro-batch of the last critic, 0.4)
    from batches import full_batch

    from tasks import make_tiny_model, make_tokenizer

    torch.manual_seed(0)
    tok = make_tokenizer()
    vms = [critics.make_value_model(make_tiny_model(tok).eval()) for _ in range(2)]
    crit = critics.Critics(vms, lr=1e-3, adam_eps=1e-8)
    fracs, real = iter([0.1, 0.2, 0.3, 0.4]), ppo_math.value_loss
    clip = lambda: torch.tensor(next(fracs))  # noqa: E731  (value_loss's metric is a 0-d tensor)
    monkeypatch.setattr(ppo_math, "value_loss", lambda *a, **k: (real(*a, **k)[0], {"vf_clipfrac": clip()}))
    B, R = 4, 3
    ids = torch.randint(4, len(tok), (B, 5 + R))
    z = torch.zeros(B, R)
    batch = full_batch(input_ids=ids, attention_mask=torch.ones_like(ids), response_mask=torch.ones(B, R),
                       old_logprobs=z, ref_logprobs=z, advantages=z, old_values=torch.zeros(B, 2, R),
                       critic_returns=torch.ones(B, 2, R), shares=torch.ones(B, 2, dtype=torch.bool))  # fmt: skip
    out = trainer.critic_update(trainer.Config(micro_batch=2), crit, batch, 1, contextlib.nullcontext)
    assert float(out["critic/vf_clipfrac"]) == pytest.approx(0.25)  # (0-d: ppo_update copies them to the host)


def test_aggregate_seq_mean_token_mean_differs_from_token_mean():
    # one sequence with 1 valid token (loss 4), one with 3 (loss 1 each)
    # token-mean = (4 + 3) / 4 = 1.75 ; seq-mean-token-mean = (4 + 1) / 2 = 2.5
    L, M = t([[4.0, 0.0, 0.0], [1.0, 1.0, 1.0]]), t([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    tm = ppo_math.aggregate(L, M, "token-mean").item()
    sm = ppo_math.aggregate(L, M, "seq-mean-token-mean").item()  # per-row means divide by n_t + 1e-8 (veRL)
    assert tm == pytest.approx(1.75, abs=1e-12) and sm == pytest.approx(2.5, abs=1e-7)


def test_aggregate_excludes_fully_masked_rows():
    # a third, fully masked row (loss 9) must not count as a sequence: still 2.75 and 3.5 (not / 3)
    L, M = t(L23 + [[9.0, 9.0, 9.0]]), t(M23 + [[0.0, 0.0, 0.0]])
    assert ppo_math.aggregate(L, M, "token-mean").item() == pytest.approx(7 / 3, abs=1e-12)
    assert ppo_math.aggregate(L, M, "seq-mean-token-mean").item() == pytest.approx(2.75, abs=1e-7)
    assert ppo_math.aggregate(L, M, "seq-mean-token-sum").item() == pytest.approx(3.5, abs=1e-12)
    assert ppo_math.agg_denominator(M, "seq-mean-token-mean", global_=False).item() == 2
    assert ppo_math.agg_denominator(M, "token-mean", global_=False).item() == 3


def test_aggregate_global_denominator_and_world_scaling():
    # DDP: loss = sum_local / global_denominator * W
    # token-mean, denom 6 tokens over 2 ranks: 7 / 6 * 2 = 7/3
    # seq-mean-token-mean, denom 4 sequences: (1.5 + 4) / 4 * 2 = 2.75
    # seq-mean-token-sum, denom 4: (3 + 4) / 4 * 2 = 3.5
    L, M = t(L23), t(M23)
    assert ppo_math.aggregate(L, M, "token-mean", denom=t(6.0), world=2).item() == pytest.approx(7 / 3, abs=1e-12)
    assert ppo_math.aggregate(L, M, "seq-mean-token-mean", denom=t(4.0), world=2).item() == pytest.approx(2.75)
    assert ppo_math.aggregate(L, M, "seq-mean-token-sum", denom=t(4.0), world=2).item() == pytest.approx(3.5)
    # the local share, without world scaling: 7 / 6
    assert ppo_math.aggregate(L, M, "token-mean", denom=t(6.0)).item() == pytest.approx(7 / 6, abs=1e-12)


def test_aggregate_all_masked_is_zero_not_nan():
    for mode in ppo_math.AGG_MODES:
        out = ppo_math.aggregate(t(L23), torch.zeros(2, 3, dtype=F64), mode)
        assert out.item() == 0.0, mode


# ----------------------------------------------------------------------------------------------
# Masked reductions (common.py)


def test_masked_mean_known_answers():
    # [1, 2, 3, 4] with mask [1, 0, 1, 0] -> (1 + 3) / 2 = 2 ; per row: [[1, *], [3, 4]] -> [1, 3.5]
    assert common.masked_mean(t([1.0, 2.0, 3.0, 4.0]), t([1.0, 0.0, 1.0, 0.0])).item() == pytest.approx(2.0)
    close(common.masked_mean(t([[1.0, 2.0], [3.0, 4.0]]), t([[1.0, 0.0], [1.0, 1.0]]), dim=-1), [1.0, 3.5], 1e-7)
    # NaN / inf at masked positions contribute nothing
    x = t([1.0, float("nan"), 3.0, float("inf")])
    assert common.masked_mean(x, t([1.0, 0.0, 1.0, 0.0])).item() == pytest.approx(2.0)


def test_masked_var_known_answers():
    # valid [1, 2, 3, 4] (100 masked): mean 2.5, squared deviations 2.25 + 0.25 + 0.25 + 2.25 = 5
    # unbiased 5 / 3 = 1.6666667 ; biased 5 / 4 = 1.25
    x, m = t([1.0, 2.0, 3.0, 4.0, 100.0]), t([1.0, 1.0, 1.0, 1.0, 0.0])
    assert common.masked_var(x, m).item() == pytest.approx(5 / 3, abs=1e-7)
    assert common.masked_var(x, m, unbiased=False).item() == pytest.approx(1.25, abs=1e-7)


def test_masked_var_of_a_constant_is_zero_never_below():
    # x = 1/3 everywhere: the one-pass expansion rounds to -2.2e-17 in fp64, whose square root (stats/return_std
    # when every return is equal) was NaN; the variance is 0, and its root 0
    x, m = torch.full((5, 16), 1 / 3), torch.ones(5, 16)
    var = common.masked_var(x, m)
    assert var.item() == 0.0 and var.sqrt().item() == 0.0


def test_masked_var_fp32_large_offset():
    # fp32, x = 1000 + 0.01 * [0..7]: the variance is that of 0.01 * [0..7], unbiased 1e-4 * 6 = 6e-4,
    # whatever the offset. A one-pass E[x^2] - E[x]^2 loses it to cancellation (1e6 vs 6e-4 in fp32).
    x = 1000.0 + 0.01 * torch.arange(8, dtype=torch.float32)
    var = common.masked_var(x, torch.ones(8)).item()
    assert var == pytest.approx(6e-4, rel=1e-2)
    w = common.masked_whiten(x, torch.ones(8))
    # whitened: (k - 3.5) / sqrt(6) for k = 0..7 -> first entry -3.5 / 2.4494897 = -1.4288690
    assert w[0].item() == pytest.approx(-3.5 / math.sqrt(6), rel=1e-2)


def test_masked_var_raises_on_fewer_than_two_valid():
    with pytest.raises(ValueError, match="at least 2 valid"):
        common.masked_var(t([1.0, 2.0, 3.0]), t([0.0, 1.0, 0.0]))
    with pytest.raises(ValueError, match="at least 2 valid"):
        common.masked_var(t([1.0, 2.0]), t([0.0, 0.0]))
    with pytest.raises(ValueError, match="at least 2 valid"):
        common.masked_whiten(t([1.0, 2.0]), t([1.0, 0.0]))


def test_masked_whiten_known_answers():
    # valid [1, 2, 3, 4]: mean 2.5, unbiased var 5/3 -> (x - 2.5) / sqrt(5/3 + 1e-8)
    # = [-1.5, -0.5, 0.5, 1.5] / 1.2909944 = [-1.1618950, -0.3872983, 0.3872983, 1.1618950]
    x, m = t([1.0, 2.0, 3.0, 4.0, 50.0]), t([1.0, 1.0, 1.0, 1.0, 0.0])
    s = math.sqrt(5 / 3 + 1e-8)
    w = common.masked_whiten(x, m)
    close(w[:4], [-1.5 / s, -0.5 / s, 0.5 / s, 1.5 / s], 1e-7)
    # shift_mean=False adds the mean back (the mean is sum / (n + 1e-8), like veRL: tolerance 1e-7)
    close(
        common.masked_whiten(x, m, shift_mean=False)[:4],
        [2.5 - 1.5 / s, 2.5 - 0.5 / s, 2.5 + 0.5 / s, 2.5 + 1.5 / s],
        1e-7,
    )


def test_masked_ranks_known_answer_and_random_ties():
    # valid entries in flat order: 3 (0), 1 (1), 3 (2), 2 (3), 3 (4); entry (1, 2) is masked (value 0, rank -1)
    # ascending: 1 -> rank 0, 2 -> rank 1, the three 3s -> ranks 2, 3, 4 in a random order (never "earliest first")
    x, m = t([[3.0, 1.0, 3.0], [2.0, 3.0, 0.0]]), t([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    first_of_ties = set()
    for seed in range(30):
        rank, n, spread = critics.masked_ranks(x, m, generator=torch.Generator().manual_seed(seed))
        assert n == 5 and spread and rank[0, 1] == 0 and rank[1, 0] == 1 and rank[1, 2] == -1
        tied = [int(rank[0, 0]), int(rank[0, 2]), int(rank[1, 1])]
        assert sorted(tied) == [2, 3, 4]
        first_of_ties.add(tied.index(2))
    assert first_of_ties == {0, 1, 2}  # each tied position comes first for some seed
    assert critics.masked_ranks(torch.ones(2, 3), torch.ones(2, 3))[2] is False  # no spread


@pytest.mark.parametrize("frac,n_valid,want", [(0.25, 8, 2), (0.3, 10, 3), (0.6, 5, 3), (0.1, 20, 2), (0.05, 8, 0)])
def test_masked_ranks_select_round_frac_n(frac, n_valid, want):
    # the AsyPPO count: round(frac * n): 0.25*8 = 2, 0.3*10 = 3, 0.6*5 = 3, 0.1*20 = 2, 0.05*8 = 0.4 -> 0
    g = torch.Generator().manual_seed(n_valid)
    x = torch.randn(3, 12, generator=g, dtype=F64)
    m = torch.zeros(3, 12, dtype=F64)
    m.view(-1)[torch.randperm(36, generator=g)[:n_valid]] = 1.0
    rank, n, _ = critics.masked_ranks(x, m)
    sel = rank >= n - round(frac * n)  # the largest
    assert n == n_valid and int(sel.sum()) == want and not (sel & ~m.bool()).any()
    if want:  # the selected entries are the largest valid ones
        assert x[sel].min() >= x[m.bool() & ~sel].max()


# ----------------------------------------------------------------------------------------------
# Learning-rate schedule


def test_lr_factor_warmup_constant_and_cosine_by_hand():
    # warm-up 4 of 10 iterations: (step + 1) / 4 for steps 0..3
    assert [ppo_math.lr_factor(s, 10, 4) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert ppo_math.lr_factor(9, 10, 4, "constant") == 1.0
    # cosine after the warm-up: progress p = (step - 4) / (10 - 4); factor 0.1 + 0.9 * (1 + cos(pi p)) / 2
    # step 4: p = 0 -> 1 ; step 6: p = 1/3, cos = 0.5 -> 0.1 + 0.9 * 0.75 = 0.775 ; step 8: p = 2/3, cos = -0.5 ->
    # 0.1 + 0.9 * 0.25 = 0.325 ; step 9 (the last): p = 5/6, cos = -sqrt(3)/2 -> 0.1 + 0.45 * (1 - sqrt(3)/2) ;
    # step 10 (one past the last): p = 1 -> the floor 0.1
    assert ppo_math.lr_factor(4, 10, 4, "cosine", 0.1) == pytest.approx(1.0, abs=1e-12)
    assert ppo_math.lr_factor(6, 10, 4, "cosine", 0.1) == pytest.approx(0.775, abs=1e-12)
    assert ppo_math.lr_factor(8, 10, 4, "cosine", 0.1) == pytest.approx(0.325, abs=1e-12)
    assert ppo_math.lr_factor(9, 10, 4, "cosine", 0.1) == pytest.approx(0.1 + 0.45 * (1 - math.sqrt(3) / 2), abs=1e-12)
    assert ppo_math.lr_factor(10, 10, 4, "cosine", 0.1) == pytest.approx(0.1, abs=1e-12)
    # no warm-up: full lr at step 0, and the last step still trains (progress 4/5: (1 + cos(0.8 pi)) / 2 > 0)
    assert ppo_math.lr_factor(0, 5, 0, "cosine") == 1.0 and ppo_math.lr_factor(4, 5, 0, "cosine") > 0.09
    # negative steps (critic-only iterations before the actor's first): 0, with or without a warm-up
    assert ppo_math.lr_factor(-1, 10, 4) == ppo_math.lr_factor(-2, 10, 4) == ppo_math.lr_factor(-1, 10, 0) == 0.0


# ----------------------------------------------------------------------------------------------
# KL controller


def test_kl_controller_adaptive_by_hand():
    # e = clip(kl / target - 1, -0.2, 0.2); beta *= 1 + e * n / horizon
    # kl 0.15, target 0.1: e = 0.5 -> 0.2 ; n = 256, horizon 10000: beta = 0.1 * (1 + 0.2 * 0.0256) = 0.100512
    beta = ppo_math.kl_controller(0.1, 0.15, 256, "adaptive", 0.1, 10000)
    assert beta == pytest.approx(0.100512, abs=1e-12)
    # kl 0.09: e = -0.1 ; n = 100: beta = 0.100512 * (1 - 0.1 * 0.01) = 0.100512 * 0.999 = 0.100411488
    beta = ppo_math.kl_controller(beta, 0.09, 100, "adaptive")
    assert beta == pytest.approx(0.100411488, abs=1e-12)
    # kl 0: e = -1 -> -0.2 ; n = 10000: beta * 0.8
    assert ppo_math.kl_controller(beta, 0.0, 10000, "adaptive") == pytest.approx(0.100411488 * 0.8, abs=1e-12)
    assert ppo_math.kl_controller(0.1, 5.0, 256, "fixed") == 0.1


# ----------------------------------------------------------------------------------------------
# Property tests: padding and permutation invariance


def random_batch(seed: int, B: int = 5, R: int = 7):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, R + 1, (B,), generator=g)
    mask = (torch.arange(R)[None] < lengths[:, None]).to(F64)  # [B, R] right-padded
    return dict(
        logp=-torch.rand(B, R, generator=g, dtype=F64) * 3,
        old=-torch.rand(B, R, generator=g, dtype=F64) * 3,
        ref=-torch.rand(B, R, generator=g, dtype=F64) * 3,
        adv=torch.randn(B, R, generator=g, dtype=F64),
        v=torch.randn(B, R, generator=g, dtype=F64),
        old_v=torch.randn(B, R, generator=g, dtype=F64),
        ret=torch.randn(B, R, generator=g, dtype=F64),
        mask=mask,
    )


def all_losses(b, mode: str) -> list[float]:
    # the trainer's denominator: seq-mean-token-sum-norm divides by a constant (loss_scale_factor), not by the
    # padded width (veRL's default, which padding changes by design)
    d = ppo_math.agg_denominator(b["mask"], mode, global_=False, scale=8)
    pg, pm_ = offpolicy.policy_loss(b["logp"], b["old"], b["adv"], b["mask"], agg=mode, denom=d)
    vl, vm = ppo_math.value_loss(b["v"], b["old_v"], b["ret"], b["mask"], agg=mode, denom=d)
    kl = ppo_math.aggregate(ppo_math.kl_estimate(b["logp"], b["ref"], "k3"), b["mask"], mode, d)
    return [
        pg.item(),
        vl.item(),
        kl.item(),
        *(float(pm_[k]) for k in ("clipfrac", "approx_kl")),
        float(vm["vf_clipfrac"]),
    ]


@pytest.mark.parametrize("mode", ppo_math.AGG_MODES)
def test_padding_columns_and_rows_change_no_loss(mode):
    b = random_batch(0)
    base = all_losses(b, mode)
    g = torch.Generator().manual_seed(99)
    padded = {}
    for k, v in b.items():
        B = v.shape[0]
        if k == "mask":
            extra = torch.zeros(B, 4, dtype=F64)  # 4 pad columns with mask 0
        else:
            extra = torch.randn(B, 4, generator=g, dtype=F64) * 50  # large finite junk
        wide = torch.cat([v, extra], 1)
        row = (
            torch.zeros(1, wide.shape[1], dtype=F64) if k == "mask" else torch.full((1, wide.shape[1]), 7.0, dtype=F64)
        )
        padded[k] = torch.cat([wide, row], 0)  # and one fully masked row
    assert base != all_losses(random_batch(1), mode)  # sanity: the losses depend on the data
    close(all_losses(padded, mode), base, 1e-12)


def test_padding_invariance_of_gae_and_whitening():
    b = random_batch(3)
    adv, ret = ppo_math.gae(b["adv"], b["v"], b["mask"], gamma=0.95, lam=0.9)
    junk = torch.full((5, 3), 13.0, dtype=F64)
    m2 = torch.cat([b["mask"], torch.zeros(5, 3, dtype=F64)], 1)
    adv2, ret2 = ppo_math.gae(torch.cat([b["adv"], junk], 1), torch.cat([b["v"], junk], 1), m2, gamma=0.95, lam=0.9)
    close(adv2[:, :7], adv, 1e-12)
    close(ret2[:, :7], ret, 1e-12)
    w = common.masked_whiten(adv, b["mask"])
    w2 = common.masked_whiten(torch.cat([adv, junk], 1), m2)
    close(w2[:, :7] * b["mask"], w * b["mask"], 1e-12)


def test_token_mean_losses_invariant_to_row_and_token_permutation():
    b = random_batch(4)
    base = all_losses(b, "token-mean")
    g = torch.Generator().manual_seed(5)
    rows = torch.randperm(5, generator=g)
    cols = torch.randperm(7, generator=g)  # token-mean does not care which row a token sits in either
    flat = torch.randperm(35, generator=g)
    for perm in (lambda x: x[rows], lambda x: x[:, cols], lambda x: x.reshape(1, -1)[:, flat]):
        close(all_losses({k: perm(v) for k, v in b.items()}, "token-mean"), base, 1e-12)
    # seq-mean modes are invariant to permuting rows
    for mode in ("seq-mean-token-mean", "seq-mean-token-sum"):
        close(all_losses({k: v[rows] for k, v in b.items()}, mode), all_losses(b, mode), 1e-12)


# ----------------------------------------------------------------------------------------------
# compute_advantages: token rewards, then whitening for GAE only


def advantages(cfg, mask, scores, gids, values, old=None, ref=None):
    """compute_advantages on zero old / ref logprobs (unless given) with kl_beta 0.1."""
    zeros = torch.zeros(mask.shape)
    return trainer.compute_advantages(
        cfg, scores, mask, zeros if old is None else old, zeros if ref is None else ref, 0.1, gids, values
    )


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_plus_plus_baseline"])
def test_an_episode_its_env_server_failed_joins_no_group(estimator):
    """An episode with info env_error (rollout_env: its response_mask is 0) is taken out of its group by
    ungroup_failed: the others' advantages are those of the group without it, and its own are 0."""
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0], [1, 1, 1]], dtype=torch.float32)
    scores, gids = torch.tensor([1.0, 0.0, 0.0, 0.0]), torch.zeros(4, dtype=torch.long)
    episodes = [{"env_error": None}, {}, {"env_error": "server down"}, {"env_error": None}]
    cfg = trainer.Config(adv_estimator=estimator)
    _, adv, _, _, _ = advantages(cfg, mask, scores, env_client.ungroup_failed(gids, episodes), None)
    keep = torch.tensor([0, 1, 3])
    _, without, _, _, _ = advantages(cfg, mask[keep], scores[keep], gids[keep], None)
    close(adv[keep], without, 0.0)
    assert adv[2].abs().sum() == 0 and adv[0, 0] > 0
    assert env_client.ungroup_failed(gids, episodes).tolist() == [0, 0, -3, 0]
    with pytest.raises(ValueError, match="3 episode infos for 4 group ids"):
        env_client.ungroup_failed(gids, episodes[:3])


def test_compute_advantages_whitens_gae_only():
    # 4 sequences of lengths 3, 1, 2, 3 (one group), scores [1, 0, 0, 1]
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 1, 1]], dtype=torch.float32)
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0])
    gids = torch.zeros(4, dtype=torch.long)
    # GRPO: +-0.8660 on every valid token, NOT whitened (token mean would be (6 - 3) * 0.866 / 9 != 0)
    tr, adv, ret, kl, _ = advantages(trainer.Config(adv_estimator="grpo"), mask, scores, gids, None)
    a = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    close(adv, torch.tensor([[a, a, a], [-a, 0, 0], [-a, -a, 0], [a, a, a]]), 1e-6)
    # token rewards: score on the last valid token only
    close(tr, mask.new_tensor([[0, 0, 1], [0, 0, 0], [0, 0, 0], [0, 0, 1]]), 0.0)
    # RLOO: 1 - 1/3 = 2/3, 0 - 2/3 = -2/3
    _, adv_r, _, _, _ = advantages(trainer.Config(adv_estimator="rloo"), mask, scores, gids, None)
    close(adv_r, torch.tensor([[2, 2, 2], [-2, 0, 0], [-2, -2, 0], [2, 2, 2]]) / 3, 1e-6)
    # GAE, gamma = lam = 1, V = 0: raw A_t = score at every valid token, returns = score (not whitened);
    # advantages whitened over the 9 valid tokens: six 1s and three 0s -> mean 2/3, unbiased var = (6*(1/9) +
    # 3*(4/9)) / 8 = 2/8 = 0.25 -> whitened 1 -> (1/3) / 0.5 = 2/3, 0 -> -(2/3) / 0.5 = -4/3
    v = torch.zeros(4, 3)
    _, adv_g, ret_g, _, stats = advantages(trainer.Config(adv_estimator="gae"), mask, scores, gids, v)
    close(ret_g, torch.tensor([[1, 1, 1], [0, 0, 0], [0, 0, 0], [1, 1, 1]]), 1e-6)
    close(adv_g, torch.tensor([[2, 2, 2], [-4, 0, 0], [-4, -4, 0], [2, 2, 2]]) / 3, 1e-5)
    assert float(common.masked_mean(adv_g, mask)) == pytest.approx(0.0, abs=1e-6)
    assert float(common.masked_var(adv_g, mask)) == pytest.approx(1.0, abs=1e-5)
    # its metrics: mean |A| over valid tokens = (6 * 2/3 + 3 * 4/3) / 9 = 8/9; mean return 6/9; no KL
    assert stats["stats/adv_abs_mean"] == pytest.approx(8 / 9, abs=1e-6)
    assert stats["stats/return_mean"] == pytest.approx(2 / 3, abs=1e-6) and stats["stats/token_reward_kl_abs"] == 0.0


def test_compute_advantages_kl_in_reward():
    # KL in the reward: token_rewards = score at the last token - beta * (old - ref) on every valid token
    # beta 0.1, old - ref = 0.5 everywhere: rewards row 0 = [-0.05, -0.05, 1 - 0.05] ; GRPO sums them: 0.85
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.float32)
    old, ref = torch.full((2, 3), -1.0), torch.full((2, 3), -1.5)
    cfg = trainer.Config(adv_estimator="grpo", kl_in_reward=True, grpo_norm_std=False)
    scores, gids = torch.tensor([1.0, 0.0]), torch.zeros(2, dtype=torch.long)
    tr, adv, _, kl, stats = advantages(cfg, mask, scores, gids, None, old, ref)
    assert stats["stats/token_reward_kl_abs"] == pytest.approx(0.05, abs=1e-7)  # |0.1 * 0.5| on every valid token
    close(kl, 0.5 * mask, 1e-7)
    close(tr, torch.tensor([[-0.05, -0.05, 0.95], [-0.05, -0.05, 0.0]]), 1e-7)
    # sequence scores 0.85 and -0.1 -> Dr. GRPO: +-0.475
    close(adv, torch.tensor([[0.475, 0.475, 0.475], [-0.475, -0.475, 0.0]]), 1e-6)


def test_bootstrap_interval_known_answers_and_the_pairs_table():
    """Constant seeds: the interval is the point. a = [0, 1] vs b = [0]: a resampled mean is 0, 1/2 or 1 with
    probabilities 1/4, 1/2, 1/4, so the 2.5 and 97.5 percentiles are 0 and 1. More seeds narrow it."""
    assert seeds.bootstrap_diff([0.5, 0.5, 0.5], [0.25, 0.25]) == (0.25, 0.25, 0.25)
    assert seeds.bootstrap_diff([0.0, 1.0], [0.0]) == (0.5, 0.0, 1.0)
    rng = np.random.default_rng(0)
    few, many = rng.normal(0.1, 0.05, 3), rng.normal(0.1, 0.05, 30)
    d3, lo3, hi3 = seeds.bootstrap_diff(few, np.zeros(3))
    d30, lo30, hi30 = seeds.bootstrap_diff(many, np.zeros(30))
    assert lo3 <= d3 <= hi3 and lo30 <= d30 <= hi30 and hi30 - lo30 < hi3 - lo3
    runs = [{"method": m, "eval": [(0, 0.2), (10, a), (20, f)]} for m, a, f in
            [("x", 0.6, 0.5), ("x", 0.8, 0.7), ("y", 0.3, 0.4), ("y", 0.5, 0.4), ("z", 0.2, 0.2)]]  # fmt: skip
    rows = seeds.differences(runs)
    assert [r["difference"] for r in rows] == ["x - y", "x - z", "y - z"]
    assert rows[0]["final_acc [95% CI]"] == "+0.200 [+0.100, +0.300]"  # finals 0.5, 0.7 vs 0.4, 0.4
    assert rows[0]["best_acc [95% CI]"] == "+0.250 [+0.100, +0.400]"  # bests 0.6, 0.8 vs 0.4, 0.5
    against = seeds.differences(runs, baseline="y")
    assert [r["difference"] for r in against] == ["x - y", "z - y"] and against[0] == rows[0]
    assert seeds.final_best([(0, 0.9), (10, 0.1), (20, 0.2)]) == (0.2, 0.2)  # the start model is not "best"
    assert seeds.final_best([(0, 0.3)]) == (0.3, 0.3)  # no evaluation after the start
    assert seeds.steps_to([(0, 0.9), (10, 0.1), (20, 0.5), (30, 0.6)], 0.5) == 20  # the start reaches nothing
    assert seeds.steps_to([(0, 0.9), (10, 0.1)], 0.5) is None
    assert seeds.mean_std([0.1, 0.3]) == "0.20 ± 0.14" and seeds.mean_std([0.5]) == "0.50 ± 0.00"
    assert seeds.mean_std([]) == "-"


def test_run_list_writes_one_file_per_finished_run_and_a_rerun_skips_them(tmp_path, monkeypatch):
    """experiments/seeds.run_list: each run's record (argv, final and best accuracy, commit) lands in its own file;
    a second call runs only what has no file yet."""
    ran = []

    def fake_trainer(argv, out_dir, threads=None):
        ran.append(argv)
        acc = 0.5 + 0.1 * int(argv[1])
        rows = [{"stats/kl": 0.0, "ok": True}, {"stats/kl": 0.5, "perf/x": 2.0, "note": "x"}]
        return {"eval_history": [[0, 0.2], [10, acc + 0.05], [20, acc]], "wall_s": 1.0, "stats/kl": 0.0}, rows

    monkeypatch.setattr(seeds, "RESULTS", tmp_path)
    monkeypatch.setattr(seeds, "run_trainer", fake_trainer)
    runs = {f"a-s{i}": ["--seed", str(i)] for i in range(2)}
    out = seeds.run_list("x", runs)
    assert [r["final_acc"] for r in out.values()] == [0.5, 0.6] and out["a-s1"]["best_acc"] == 0.65
    assert sorted(p.name for p in (tmp_path / "x").iterdir()) == ["a-s0.json", "a-s1.json"] and len(ran) == 2
    assert len(out["a-s0"]["commit"]) == 40 and out["a-s0"]["argv"] == ["--seed", "0"]
    assert out["a-s1"]["mean"] == {"stats/kl": 0.25, "perf/x": 2.0}  # over the rows that have the key
    assert out["a-s0"]["command"] == shlex.join(seeds.portable(sys.argv))  # what asked for the run (here: pytest)
    out = seeds.run_list("x", {**runs, "a-s2": ["--seed", "2"]})
    assert len(ran) == 3 and ran[-1] == ["--seed", "2"] and out["a-s2"]["final_acc"] == 0.7
    with pytest.raises(ValueError, match="a-s1.json holds run 'a-s1' of another command: --seed 1, not --seed 1 --lr"):
        seeds.run_list("x", {**runs, "a-s1": ["--seed", "1", "--lr", "1"]})  # a changed recipe is not mixed in
    assert len(ran) == 3
    model = str(seeds.ROOT / ".cache" / "sft-x-0123")  # a warm start: recorded relative to the repository
    out = seeds.run_list("y", {"b-s0": ["--seed", "3", "--model", model]})
    assert out["b-s0"]["argv"] == ["--seed", "3", "--model", ".cache/sft-x-0123"] and len(ran) == 4
    assert seeds.run_list("y", {"b-s0": ["--seed", "3", "--model", model]}) and len(ran) == 4  # not run again
    (tmp_path / "y" / "b-s1.json").write_text('{"run": "b-s1", "ar')  # a damaged file is named, not mixed in
    with pytest.raises(ValueError, match="b-s1.json is not a finished run's record"):
        seeds.run_list("y", {"b-s1": ["--seed", "1"]})
    assert not list((tmp_path / "x").glob("*.part"))  # each file appears whole (a rename)
    with pytest.raises(ValueError, match="baseline 'w' is not among"):
        seeds.differences([{"method": "x", "eval": [(0, 0.1), (10, 0.2)]}], baseline="w")
