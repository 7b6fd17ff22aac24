"""Off-policy corrections: training on samples drawn by a behaviour policy other than the trained one.

    python offpolicy.py                                      # the corrections on a hand-made gap, side by side
    python ppo_minimal.py --top-p 0.9 --off-policy tis       # a truncated sampler, corrected by truncated IS
    python async_loop.py --async-ratio 2 --off-policy decoupled

Samples are off-policy when the sampler is not the policy the trainer differentiates: stale weights (async RL,
async_loop.py), top-p / top-k truncation, or numerics (a bf16 sampler). With `old` = the trainer's recompute at
update start (pi_old, the proximal policy and PPO anchor) and `behav` = the sampler's logprobs, the per-token
ratio w_t = pi_old(o_t) / pi_behav(o_t) corrects the PPO loss (DESIGN.md 7.4):
  (a) behav      the clip anchored at behav instead of old (the trainer passes rollout_logprobs as the anchor)
  (b) tis        the PPO loss (anchored at old) times min(w_t, C), C = 2, detached (veRL's truncated IS)
  (c) decoupled  the same times w_t, with tokens whose w_t > 5 masked out instead of truncated (AReaL, arXiv
                 2505.24298 eq. 5)
With behav == old (on-policy) every variant is plain PPO. `OffPolicyArgs` holds the knobs (the trainer's Config
inherits them). DESIGN.md section 2 places the other loss families and veRL's rollout corrections here too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from cli import check_fields
from common import masked_mean


@dataclass
class OffPolicyArgs:
    """The off-policy correction's knobs; the trainer's Config inherits them."""

    off_policy: Literal["none", "behav", "tis", "decoupled"] | None = None
    """Off-policy correction: none | behav (clip at sampler logprobs) | tis | decoupled (None = none; async: tis)."""
    is_cap: float = 2.0
    """tis: importance weight pi_old / pi_behav truncated at this C."""
    is_mask_cap: float = 5.0
    """decoupled: tokens whose pi_old / pi_behav exceeds this are masked out of the policy loss."""

    def __post_init__(self):
        self.off_policy = self.off_policy or "none"  # derived once here, printed with the config
        check_fields(self, {"[1.0, inf)": ("is_cap", "is_mask_cap")}, OffPolicyArgs)


def off_policy_weights(old_logprobs, behav_logprobs, mask, mode: str, cap: float = 2.0, mask_cap: float = 5.0):
    """Per-token importance weights [B, R] (detached) of (b) tis and (c) decoupled, and their metrics. All inputs
    [B, R]. none / behav return None: no weights (behav anchors the clip at pi_behav instead, in the caller)."""
    if mode in ("none", "behav"):
        return None, {}
    w = torch.exp((old_logprobs - behav_logprobs).clamp(-20, 20)).detach()  # [B, R] w_t = pi_old / pi_behav
    w = torch.where(mask.bool(), w, torch.ones_like(w))  # masked tokens (observations, padding): neutral
    cut = w > (cap if mode == "tis" else mask_cap)  # [B, R] truncated (tis) or masked out (decoupled)
    out = w.clamp(max=cap) if mode == "tis" else w * (~cut)
    mean = lambda x: float(masked_mean(x.float(), mask, global_=True))  # noqa: E731  (over the tokens of all ranks)
    stats = {"stats/is_weight_mean": mean(w), "stats/is_cut_frac": mean(cut)}
    return out, stats


def gap_stats(old_logprobs, behav_logprobs, mask, policy_version=None, step: int = 0) -> dict:
    """Mean |sampler - trainer| logprob gap over valid tokens: stats/rollout_vs_old_logp_diff on the samples of the
    current weights (numerics only; absent when every sample is stale), and with policy versions (async) also
    stats/behav_vs_old_logp_diff over every sample, staleness included. All inputs [B, R]; policy_version [B]."""
    gap = (behav_logprobs - old_logprobs).abs()  # [B, R]
    fresh = mask if policy_version is None else mask * (policy_version == step)[:, None]  # [B, R] same weights
    mean = lambda m: float(masked_mean(gap, m, global_=True))  # noqa: E731  (over the tokens of all ranks)
    # policy versions come from async_loop.py, whose trainer is one process: the branch is the same on every rank
    stats = {"stats/rollout_vs_old_logp_diff": mean(fresh)} if policy_version is None or fresh.any() else {}
    if policy_version is not None:
        stats["stats/behav_vs_old_logp_diff"] = mean(mask)
    return stats


def main() -> None:
    """Print each correction's weights for one response whose tokens the sampler liked more or less than pi_old."""
    gap = torch.tensor([[-1.5, -0.5, 0.0, 0.4, 1.0, 2.0]])  # [1, R] log pi_old - log pi_behav per token
    behav, mask = torch.zeros_like(gap), torch.ones_like(gap)
    print("w_t = pi_old / pi_behav:", [round(x, 3) for x in gap.exp()[0].tolist()])
    for mode in ("tis", "decoupled"):
        w, stats = off_policy_weights(gap, behav, mask, mode)
        print(f"{mode:10s} weights {[round(x, 3) for x in w[0].tolist()]}  {stats}")


if __name__ == "__main__":
    main()
