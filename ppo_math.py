"""The pure math of PPO and its critic-free cousins: tensors in, tensors (and a metrics dict) out. No config, no model.

    python ppo_math.py     # each function on a hand-made batch

Both trainers import this file: the textbook (ppo_minimal.py) and the full trainer. They call it through the
module (`ppo_math.gae(...)`), which lets repro.py plant a bug by patching one function from outside the loop.
The semantics are veRL 0.9.1's (core_algos.py), golden-tested against veRL itself (tests/test_verl_golden.py).
All per-token tensors are [B, R] over response tokens; `mask` is 1 on the tokens the loss trains.

  GAE (Schulman et al. 2016, eq. 16), backwards over the response, masked positions passing values through:
      delta_t = r_t + gamma V_{t+1} - V_t,   A_t = delta_t + gamma lam A_{t+1},   returns = A + V (before whitening)
  GRPO (DeepSeekMath sec. 4.1.2): A_i = (s_i - mean_g) / (std_g + eps), std unbiased; a singleton: mean 0, std 1
  Dr. GRPO (arXiv 2503.20783): A_i = s_i - mean_g, and token sums over a constant (seq-mean-token-sum-norm)
  RLOO (Ahmadian et al. 2024): A_i = s_i - mean_{j != i} s_j = (s_i - mean_g) n / (n - 1)
  REINFORCE++ (arXiv 2501.03262): the return-to-go G_t = r_t + gamma G_{t+1}, whitened; its baseline variant
      s_i - mean_g broadcast over tokens, whitened
  PPO clip (Schulman et al. 2017, eq. 7), as a loss: L = max(-A r, -A clip(r, 1 - eps_lo, 1 + eps_hi)),
      r = exp(clamp(logp - old, +-20)); dual clip (Ye et al. 2020) for A < 0: L = min(L, -c A)
  value loss: L_V = 0.5 max((V - R)^2, (clip(V, V_old +- eps_v) - R)^2)
  KL (Schulman's estimators), x = logp - ref: k1 = x, k2 = x^2 / 2, k3 = exp(-x) + x - 1 (clamped);
      in the reward r_t = s_t - beta k1_t; entropy bonus: L - c H

Implementation details
1. Aggregation (veRL's loss_agg_mode): token-mean = sum(mask l) / n_tokens; seq-mean-token-mean / -sum average
   the rows' token means / sums over non-empty rows; seq-mean-token-sum-norm divides the token sums by
   n_rows x C (Dr. GRPO). Under data parallelism (W ranks) the denominator is the global count and the loss is
   multiplied by W, so that DDP's gradient average equals the one-process gradient of the global minibatch.
   Ours: the denominator is clamped at 1 (an empty minibatch gives 0, not NaN).
2. Advantages and returns are 0 at masked positions (veRL leaves pass-through values there).
3. Whitening (GAE, REINFORCE++) pools every rank's valid tokens (common.masked_whiten, global statistics).
"""

from __future__ import annotations

import math

import torch

from common import all_reduce_sum, masked_mean, masked_whiten

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def agg_denominator(mask, mode: str, global_: bool = True, scale: int | None = None):
    """Number of valid tokens (token-mean) or non-empty sequences (seq-mean modes), summed over ranks; times the
    constant `scale` for seq-mean-token-sum-norm (None: the padded width R, veRL's default loss_scale_factor)."""
    n = (mask.sum() if mode == "token-mean" else (mask.sum(-1) > 0).sum()).double().reshape(1)
    n = (all_reduce_sum(n) if global_ else n)[0]
    return n * (scale or mask.shape[-1]) if mode == "seq-mean-token-sum-norm" else n


def aggregate(loss_mat, mask, mode: str = "token-mean", denom=None, world: int = 1):
    """Scalar loss from a [B, R] per-token loss (detail 1); denom: the global normaliser, else this rank's."""
    if mode == "token-mean":
        total = (loss_mat * mask).sum()
    else:
        seq = (loss_mat * mask).sum(-1)  # [B]
        if mode == "seq-mean-token-mean":
            seq = seq / (mask.sum(-1) + 1e-8)
        total = (seq * (mask.sum(-1) > 0)).sum()  # fully masked sequences excluded
    denom = agg_denominator(mask, mode, global_=False) if denom is None else denom
    return total / denom.clamp(min=1) * world


def gae(token_rewards, values, mask, gamma: float, lam: float):
    """Raw GAE advantages and returns [B, R] (no whitening). Masked positions pass values through."""
    B, R = token_rewards.shape
    nextvalue, lastgae = token_rewards.new_zeros(B), token_rewards.new_zeros(B)  # [B] each
    adv = torch.zeros_like(token_rewards)  # [B, R]
    for t in reversed(range(R)):
        # delta_t = r_t + gamma V_{t+1} - V_t ; A_t = delta_t + gamma lam A_{t+1}   (GAE eq. 16)
        delta = token_rewards[:, t] + gamma * nextvalue - values[:, t]
        gae_t = delta + gamma * lam * lastgae
        valid = mask[:, t].to(values.dtype)  # [B] 1 where token t is an action (response) token
        nextvalue = valid * values[:, t] + (1 - valid) * nextvalue  # only valid tokens move the recursion
        lastgae = valid * gae_t + (1 - valid) * lastgae
        adv[:, t] = lastgae
    returns = adv + values  # before whitening
    return adv * mask, returns * mask  # detail 2


def group_stats(scores, group_ids):
    """Per-sample group mean, unbiased std and group size [B] each (singletons: mean 0, std 1)."""
    _, inv = torch.unique(group_ids, return_inverse=True)  # [B]
    n = torch.bincount(inv).to(scores.dtype)  # [G]
    mean = torch.zeros_like(n).index_add_(0, inv, scores) / n  # [G]
    sq = torch.zeros_like(n).index_add_(0, inv, (scores - mean[inv]) ** 2)  # [G]
    std = (sq / (n - 1).clamp(min=1)).sqrt()  # [G] unbiased (N - 1)
    mean, std = mean.masked_fill(n == 1, 0.0), std.masked_fill(n == 1, 1.0)
    return mean[inv], std[inv], n[inv]


def group_advantages(rewards, group_ids, *, norm_std: bool = True, eps: float = 1e-6):
    """GRPO outcome advantage per sequence [B]: (s - mean_g) / (std_g + eps), or s - mean_g (Dr. GRPO)."""
    mean, std, _ = group_stats(rewards, group_ids)
    return (rewards - mean) / (std + eps) if norm_std else rewards - mean


def rloo_advantages(rewards, group_ids):
    """RLOO per sequence [B]: s_i - mean of the other samples of its group = (s_i - mean) * n / (n - 1)."""
    mean, _, n = group_stats(rewards, group_ids)
    return torch.where(n > 1, (rewards - mean) * n / (n - 1).clamp(min=1), rewards)


def reinforce_pp_advantages(token_rewards, mask, gamma: float):
    """REINFORCE++: the discounted return-to-go G_t = r_t + gamma G_{t+1} over action tokens (observation tokens
    carry it through), whitened over the batch's valid tokens (every rank's). Returns (advantages, returns) [B, R]."""
    returns, running = torch.zeros_like(token_rewards), token_rewards.new_zeros(token_rewards.shape[0])
    m = mask.to(token_rewards.dtype)
    for t in reversed(range(token_rewards.shape[1])):
        new = token_rewards[:, t] + gamma * running
        returns[:, t] = new * m[:, t]
        running = new * m[:, t] + running * (1 - m[:, t])
    return masked_whiten(returns, mask, global_=True) * mask, returns


def reinforce_pp_baseline_advantages(rewards, group_ids, mask):
    """REINFORCE++ with a group baseline: (s_i - mean of its group; a singleton: s_i) broadcast over its valid
    tokens, then whitened over the batch's valid tokens (every rank's). rewards, group_ids [B]; returns [B, R]."""
    _, inv = torch.unique(group_ids, return_inverse=True)  # [B]
    n = torch.bincount(inv).to(rewards.dtype)  # [G]
    mean = torch.zeros_like(n).index_add_(0, inv, rewards) / n  # [G]
    centred = rewards - torch.where(n[inv] > 1, mean[inv], 0.0)  # [B]
    return masked_whiten(centred[:, None] * mask, mask, global_=True) * mask


def kl_estimate(logprobs, ref_logprobs, kind: str = "k1"):
    """Per-token KL estimate, x = logp - ref: k1 = x, k2 = x^2/2, k3 = exp(-x) + x - 1 (clamped)."""
    x = logprobs - ref_logprobs
    if kind == "k1":
        return x
    if kind == "k2":
        return 0.5 * x * x
    if kind == "k3":
        neg_x = (-x).clamp(-20, 20)
        return (neg_x.exp() - neg_x - 1).clamp(-10, 10)
    raise ValueError(f"unknown KL estimator {kind!r}: k1 | k2 | k3")


def kl_reward(token_scores, kl, beta: float):
    """KL in the reward: r_t = s_t - beta KL_t [B, R] (KL_t: kl_estimate k1 of the old policy against the reference)."""
    return token_scores - beta * kl


def kl_controller(beta: float, kl: float, n: int, kind: str, target: float = 0.1, horizon: int = 10000) -> float:
    """beta of KL in the reward after n sequences of mean per-sequence KL kl: fixed, or adaptive (Ziegler et al.
    2019; veRL's target and horizon): beta (1 + e n / horizon), e = clip(kl / target - 1, +-0.2)."""
    e = min(max(kl / target - 1, -0.2), 0.2)
    return beta * (1 + e * n / horizon) if kind == "adaptive" else beta


def ratio_stats(logprobs, old_logprobs, mask) -> dict:
    """The importance ratio's masked mean and max (detached 0-d tensors), for any loss family."""
    ratio = torch.exp((logprobs - old_logprobs).clamp(-20, 20))  # [B, R]
    return {"ratio_mean": masked_mean(ratio, mask).detach(), "ratio_max": (ratio * mask).max().detach()}


def clipped_objective(logprobs, old_logprobs, advantages, mask, *, clip_low: float, clip_high: float, dual_clip):
    """PPO's clipped surrogate as a per-token loss [B, R] (not aggregated), and its metrics: clipfrac (the clipped
    term is the larger), clipfrac_lower (the dual clip acts), approx_kl = mean(old - new) (veRL's ppo_kl)."""
    log_ratio = (logprobs - old_logprobs).clamp(-20, 20)  # [B, R]
    ratio = torch.exp(log_ratio)
    l1, l2 = -advantages * ratio, -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)
    loss = torch.maximum(l1, l2)  # PPO eq. 7, as a loss
    metrics = {"clipfrac": masked_mean((l2 > l1).float(), mask), "clipfrac_lower": mask.new_zeros(())}
    if dual_clip is not None:
        l3 = -advantages * dual_clip
        metrics["clipfrac_lower"] = masked_mean(((loss > l3) & (advantages < 0)).float(), mask)
        loss = torch.where(advantages < 0, torch.minimum(loss, l3), loss)  # dual clip: A < 0 only
    metrics["approx_kl"] = masked_mean(-log_ratio, mask).detach()  # of the clamped log-ratio, as veRL
    return loss, metrics


def policy_loss(
    logprobs,
    old_logprobs,
    advantages,
    mask,
    *,
    clip_low=0.2,
    clip_high=0.2,
    dual_clip=3.0,
    agg="token-mean",
    denom=None,
    world=1,
):
    """PPO's clipped policy loss aggregated over valid tokens (detail 1), and its metrics. All inputs [B, R]."""
    loss, metrics = clipped_objective(
        logprobs, old_logprobs, advantages, mask, clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip
    )
    metrics.update(ratio_stats(logprobs, old_logprobs, mask))
    return aggregate(loss, mask, agg, denom, world), metrics


def value_loss(values, old_values, returns, mask, *, clip=0.5, agg="token-mean", denom=None, world=1):
    """Clipped value loss 0.5 * agg(max((V - R)^2, (V_clip - R)^2)) and its clipfrac. All inputs [B, R]."""
    v_clip = old_values + (values - old_values).clamp(-clip, clip)
    l_unclipped, l_clipped = (values - returns) ** 2, (v_clip - returns) ** 2
    loss = 0.5 * aggregate(torch.maximum(l_unclipped, l_clipped), mask, agg, denom, world)
    return loss, {"vf_clipfrac": masked_mean((l_clipped > l_unclipped).float(), mask).detach()}


def entropy_bonus(loss, entropy, coef: float):
    """The policy loss with an entropy bonus, L - c H (c > 0: the policy is paid to stay uncertain)."""
    return loss - coef * entropy


def lr_factor(step: int, total: int, warmup: int, schedule: str = "constant", min_ratio: float = 0.0) -> float:
    """The lr multiplier at iteration `step` (0-based) of `total`: linear warm-up over `warmup` iterations, then 1 or
    a half cosine towards min_ratio, reached one iteration after the last (transformers' cosine-with-warm-up with
    veRL's min_lr_ratio floor); 0 for a negative step (critic-only iterations before the actor's first)."""
    if step < 0:
        return 0.0
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = (step - warmup) / max(1, total - warmup)  # 0 after the warm-up, (n - 1) / n at the last iteration
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def main() -> None:
    """Each estimator and loss on two groups of two responses of three tokens, printed."""
    torch.set_printoptions(precision=3)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])  # [B, R]
    scores, groups = torch.tensor([1.0, 0.0, 0.5, 0.5]), torch.tensor([0, 0, 1, 1])  # [B] each
    last = mask * (mask.cumsum(-1) == mask.sum(-1, keepdim=True))  # [B, R] 1 on each row's last valid token
    values = torch.full_like(mask, 0.4) * mask  # [B, R] a critic that guesses 0.4 everywhere
    adv, ret = gae(last * scores[:, None], values, mask, gamma=1.0, lam=0.95)
    print("GAE advantages\n", adv, "\nreturns\n", ret)
    print("GRPO", group_advantages(scores, groups), " RLOO", rloo_advantages(scores, groups))
    logp = torch.log(torch.tensor([[0.5, 0.9, 0.2], [0.3, 0.6, 0.1], [0.7, 0.7, 0.7], [0.4, 0.1, 0.8]]))
    old = torch.log(torch.full_like(logp, 0.5))  # [B, R]
    loss, metrics = policy_loss(logp, old, masked_whiten(adv, mask) * mask, mask)
    print(f"policy loss {loss.item():.4f}", {k: round(float(v), 4) for k, v in metrics.items()})
    print("k1 / k3 KL", kl_estimate(logp, old).mean().item(), kl_estimate(logp, old, "k3").mean().item())
    print("lr factors (warm-up 2, cosine, 6 steps)", [round(lr_factor(s, 6, 2, "cosine"), 3) for s in range(6)])


if __name__ == "__main__":
    main()
