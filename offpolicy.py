"""Off-policy RL for LLMs: the loss families beyond vanilla PPO and the corrections for a sampler that is not the
trained policy, with veRL 0.9.1's semantics (golden-tested against veRL itself: tests/test_verl_golden.py).

    python offpolicy.py                                                  # each correction on a hand-made gap
    python trainer.py --rollout-dtype bfloat16 --rollout-is token    # a bf16 sampler, token-level TIS
    python trainer.py --rollout-rs seq_mean_k1 --rollout-rs-threshold 0.99_1.01 --rollout-dtype bfloat16
    python trainer.py --adv-estimator grpo --loss-mode gspo --loss-agg seq-mean-token-mean --clip-low 3e-4 \
        --clip-high 4e-4
    python async_loop.py --async-ratio 2 --off-policy decoupled

Samples are off-policy when the sampler is not the policy the trainer differentiates: stale weights (async RL,
async_loop.py), top-p / top-k truncation, or numerics (a bf16 inference engine against an fp32 trainer:
--rollout-dtype bfloat16 samples with a bf16 copy of the weights, rollout.inference_copy, synced before each
rollout).
Notation, all [B, R] over response tokens: logp = the policy being trained (with grad), old = the trainer's
recompute at update start (pi_old, the PPO anchor), rollout = the sampler's logprobs, A the advantage, m the
response mask, n_i = sum_t m_it.

1. Rollout corrections (veRL's rollout_corr_helper; "When Speed Kills Stability", 2025), from the
   log-ratio rho = old - rollout, once per batch, before the advantages:
   - `rollout_is_weights`: importance weights, detached, multiplying the policy loss. token: w_t = exp(rho_t);
     sequence: w_i = exp(sum_t m rho_t) on every token of row i (both clamped to exp(+-20)). A threshold "U"
     truncates at U (TIS, Yao et al. 2025); "L_U" zeroes the weights outside [L, U] (IcePop, Ling team 2025).
   - `rollout_rejection_mask`: a hard trust region. Per token k1 = -rho, k2 = rho^2 / 2, k3 = exp(rho) - 1 - rho;
     token_kX rejects tokens, seq_{sum,mean,max}_kX whole rows by the row's sum / mean / max of the token values.
     k1 bounds are ratios "L_U" (one number U: [1/U, U]), compared in log space; seq_mean_k1 is the geometric-mean
     sequence mask (exp of the mean log-ratio in [L, U]). Options chain with commas, every one must pass.
   - `gap_metrics`: veRL's rollout_corr/ KL, k3 KL, perplexities, log-PPL difference, chi^2 of the gap.
   Rejected tokens leave the policy's losses and their normalisers (the batch's loss_mask). Our choice: they keep
   their advantages and the critics still fit them (veRL 0.9.1 swaps the response mask before the advantages, so
   a rejected last token would also drop its reward from GAE).
2. The older corrections (docs/design.md 5.4), kept for async RL: (a) behav anchors the clip at rollout instead of old;
   (b) tis = token IS truncated at is_cap; (c) decoupled = token IS with tokens above is_mask_cap masked out
   (AReaL, arXiv 2505.24298 eq. 5). `--off-policy tis|decoupled` and `--rollout-is` are one correction twice: refused.
3. The loss families (veRL's policy_loss.loss_mode), per-token loss matrices that `policy_loss`
   aggregates like vanilla PPO's; each takes the rollout IS weights as veRL's do:
   gspo (GSPO, arXiv 2507.18071), cispo (MiniMax-M1, arXiv 2506.13585), sapo (SAPO, arXiv 2511.20347), geo_mean
   (GMPO, arXiv 2507.20673), dppo_tv / dppo_kl (DPPO, arXiv 2602.04879); docs/design.md 5.1 has each formula.
   Their clip knobs are PPO's (--clip-low / --clip-high; DPPO: divergence thresholds; dual_clip: DPPO's TIS cap);
   sapo and geo_mean average their policy term per sequence whatever loss_agg says (veRL's; `policy_agg`).
4. `policy_loss`: the one entry point the trainer's update calls for every family: vanilla is ppo_math's clipped
   objective; the rollout IS weights and AsyPPO's pg_mask multiply the per-token loss before the aggregation
   (attention credit's token weights shape the advantages before it is called: trainer.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

import ppo_math
from cli import check_fields
from common import masked_mean, masked_sum

SAFETY_BOUND = 20.0  # veRL: log-ratios clamped to +-20 before exp (exp(20) ~ 4.9e8)
RS_OPTIONS = [f"token_k{k}" for k in (1, 2, 3)] + [f"seq_{a}_k{k}" for a in ("sum", "mean") for k in (1, 2, 3)]
RS_OPTIONS += ["seq_max_k2", "seq_max_k3"]
LOSS_MODES = ("vanilla", "gspo", "cispo", "sapo", "geo_mean", "dppo_tv", "dppo_kl")


@dataclass
class OffPolicyArgs:
    """The off-policy knobs: corrections, loss family and their settings; the trainer's Config inherits them."""

    off_policy: Literal["none", "behav", "tis", "decoupled"] | None = None
    """How to correct for samples drawn by another policy than the one trained: none | behav (clip at the sampler's
    logprobs) | tis (truncated importance weights) | decoupled (unset: none, or tis in async_loop.py)."""
    is_cap: float = 2.0
    """tis: the cap C on the importance weights pi_old / pi_behav."""
    is_mask_cap: float = 5.0
    """decoupled: tokens whose pi_old / pi_behav exceeds this are masked out of the policy loss."""
    rollout_is: Literal["token", "sequence"] | None = None
    """Importance weights that correct for the sampler's logprobs differing from the trainer's, per token or per
    sequence (veRL's rollout IS, pi_old / pi_rollout; none = off)."""
    rollout_is_threshold: str | None = None
    """Rollout IS: U truncates weights at U (TIS); "L_U" zeroes weights outside [L, U] (IcePop) (None = 2.0). A
    number or a string, as in veRL's configs."""
    rollout_rs: str | None = None
    """Drop the samples whose sampler and trainer logprobs differ too much (veRL's rollout rejection): comma-separated
    token_k1|k2|k3, seq_sum_kX, seq_mean_kX, seq_max_k2|k3 (None = off)."""
    rollout_rs_threshold: str | None = None
    """Rejection bounds, one for all options or one per option: kX "U", k1 ratios "L_U" (or "U": [1/U, U]); a
    number is one U for every option."""
    loss_mode: Literal[LOSS_MODES] = "vanilla"
    """Which policy loss: vanilla (PPO's clip) or one of veRL's others, gspo | cispo | sapo | geo_mean | dppo_tv |
    dppo_kl. clip_low/high bound all but sapo's (dppo: divergences); dual_clip is vanilla's dual clip and dppo's
    ratio cap, else unused."""
    sapo_tau_pos: float = 1.0
    """sapo: gate temperature for tokens with A > 0 (veRL tau_pos)."""
    sapo_tau_neg: float = 1.05
    """sapo: gate temperature for tokens with A <= 0 (veRL tau_neg)."""
    rollout_dtype: Literal["float32", "bfloat16"] = "float32"
    """Sample with a copy of the policy's weights in this dtype, as an inference engine holds them (the trainer's
    stay fp32: a sampler-trainer gap to correct; evaluation uses the policy); float32 samples with the policy. With
    --rollout-engine vllm: the engine's dtype (vLLM's own bf16 kernels)."""
    rollout_engine: Literal["hf", "vllm"] = "hf"
    """What samples: hf = rollout.generate (the readable decode loop); vllm = a vLLM engine in this process, synced
    every iteration (vllm_engine.py; bash scripts/install_vllm.sh). Evaluation uses the policy."""

    def __post_init__(self):
        self.off_policy = self.off_policy or "none"  # derived once here, printed with the config, and:
        self.rollout_is_threshold = threshold_text(self.rollout_is_threshold, "rollout_is_threshold")  # 2.0: "2.0"
        self.rollout_rs_threshold = threshold_text(self.rollout_rs_threshold, "rollout_rs_threshold")
        if self.rollout_is and self.rollout_is_threshold is None:
            self.rollout_is_threshold = "2.0"  # veRL's default (TIS at 2)
        ranges = {"[1.0, inf)": ("is_cap", "is_mask_cap"), "(0, inf)": ("sapo_tau_pos", "sapo_tau_neg")}
        check_fields(self, ranges, OffPolicyArgs)
        if self.rollout_is:
            is_bounds(self.rollout_is_threshold)  # a malformed threshold fails here, naming the field
        if self.rollout_rs is not None:
            rs_bounds(self.rollout_rs, self.rollout_rs_threshold)
        for bad, why in (
            (self.rollout_is and self.off_policy != "none", f"'rollout_is' = {self.rollout_is!r} with off_policy = "
             f"{self.off_policy!r}: both correct pi_old / pi_behav; keep one (--off-policy none)"),
            (self.rollout_rs is None and self.rollout_rs_threshold is not None,
             "'rollout_rs_threshold' without --rollout-rs: it bounds nothing (name the rejection kind)"),
            (self.rollout_is is None and self.rollout_is_threshold is not None,
             f"'rollout_is_threshold' = {self.rollout_is_threshold!r} without --rollout-is: it weights nothing"),
            (self.loss_mode != "sapo" and (self.sapo_tau_pos, self.sapo_tau_neg) != (1.0, 1.05),
             f"'sapo_tau_pos' / 'sapo_tau_neg' set with loss_mode = {self.loss_mode!r}: only sapo has a gate"),
        ):  # fmt: skip
            if bad:
                raise ValueError(f"config field {why}")

    def reports_gap(self) -> bool:
        """veRL's rollout_corr/ gap metrics are logged: with a rollout correction or a bf16 sampler (as veRL)."""
        return self.rollout_is is not None or self.rollout_rs is not None or self.rollout_dtype != "float32"


# ------------------------------------------------------------------------------------------------
# 1. Rollout corrections (veRL 0.9.1 rollout_corr_helper), tensors in, tensors + metrics out


def threshold_text(value, field: str) -> str | None:
    """A threshold as text: veRL's configs write a single bound as a number (2.0), a pair as "0.5_2.0"; both are
    accepted, anything else is refused naming the field."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return repr(float(value))  # 2 -> "2.0", 0.05 -> "0.05": the text the command line would give
    raise ValueError(f'config field {field!r} = {value!r}: a number (2.0) or a string ("2.0", "0.5_2.0")')


def is_bounds(spec) -> tuple[float | None, float]:
    """(lower, upper) of a rollout IS threshold: U -> (None, U) (TIS), "L_U" -> (L, U) (IcePop); U a number or text."""
    spec = threshold_text(spec, "rollout_is_threshold")
    lo, sep, hi = spec.rpartition("_")  # "U" -> ("", "", "U")
    try:
        lower, upper = (float(lo) if sep else None), float(hi)
    except ValueError:
        raise ValueError(f"config field 'rollout_is_threshold' = {spec!r}: a number U or L_U (e.g. 0.5_2.0)") from None
    if not (math.isfinite(upper) and 0 < upper) or (lower is not None and not 0 < lower <= upper):
        raise ValueError(f"config field 'rollout_is_threshold' = {spec!r}: needs finite 0 < L <= U")
    return lower, upper


def rs_bounds(kind: str, threshold) -> dict[str, tuple[float | None, float]]:
    """{option: (lower, upper)} of a rejection spec. k1 options: ratio bounds ("U" means [1/U, U]); others: an upper
    bound on the divergence. One threshold is shared by every option, else one per option (a number: one for all)."""
    threshold = threshold_text(threshold, "rollout_rs_threshold")
    options = list(dict.fromkeys(o.strip() for o in kind.split(",") if o.strip()))  # in order, once each
    specs = [s.strip() for s in (threshold or "").split(",") if s.strip()]
    for o in options:
        if o not in RS_OPTIONS:
            raise ValueError(f"config field 'rollout_rs' = {kind!r}: {o!r} is not one of {RS_OPTIONS}")
    if not options or len(specs) not in (1, len(options)):
        each = f"or one per option of rollout_rs = {kind!r}"
        raise ValueError(f"config field 'rollout_rs_threshold' = {threshold!r}: give one threshold, {each}")
    out = {}
    for o, s in zip(options, specs * len(options) if len(specs) == 1 else specs):
        try:
            lo, hi = (float(x) for x in s.split("_", 1)) if "_" in s else (None, float(s))
        except ValueError:
            raise ValueError(f"config field 'rollout_rs_threshold' = {threshold!r}: {s!r} is not a number") from None
        if "_" in s and not o.endswith("k1"):
            raise ValueError(f"config field 'rollout_rs_threshold': {o} takes one upper bound, not {s!r}")
        lo = (1.0 / hi if lo is None else lo) if o.endswith("k1") else None
        if not (math.isfinite(hi) and 0 < hi) or (lo is not None and not 0 < lo <= hi):
            raise ValueError(f"config field 'rollout_rs_threshold' = {threshold!r}: {o} needs finite 0 < L <= U")
        out[o] = (lo, hi)
    return out


def rollout_is_weights(old_logprobs, rollout_logprobs, mask, *, level: str = "token", threshold: str | float = "2.0"):
    """Importance weights [B, R] pi_old / pi_rollout, detached, 0 where mask is 0, and their rollout_corr/ metrics.
    level token: w_t = exp(rho_t); sequence: exp(sum_t m rho_t) broadcast over the row. Threshold "U": min(w, U)
    (TIS); "L_U": w where L <= w <= U, else 0 (IcePop)."""
    lower, upper = is_bounds(threshold)
    log_ratio = old_logprobs - rollout_logprobs  # [B, R] rho
    if level == "token":
        stat = log_ratio  # [B, R] (unclamped, for the metrics)
        raw = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND).exp()
    elif level == "sequence":
        stat = masked_sum(log_ratio, mask, -1)[:, None]  # [B, 1] log of the product of the token ratios
        raw = stat.clamp(-SAFETY_BOUND, SAFETY_BOUND).exp().expand_as(log_ratio)
    else:
        raise ValueError(f"rollout_is level {level!r}: token | sequence")
    raw = raw * mask  # [B, R]
    w = raw.clamp(max=upper) if lower is None else torch.where((raw >= lower) & (raw <= upper), raw, 0.0)
    mean = lambda x: float(masked_mean(x.float(), mask, global_=True))  # noqa: E731  (tokens of every rank)
    valid, lo = mask.bool(), 1.0 / upper if lower is None else lower
    if level == "sequence":  # veRL: the row's log-ratio in log space (its max clamped), every row counted
        big, tiny = stat.max().clamp(max=SAFETY_BOUND).exp(), stat.min().exp()
        high, low = float((stat > math.log(upper)).float().mean()), float((stat < math.log(lo)).float().mean())
    else:
        big, tiny = w.masked_fill(~valid, -math.inf).max(), w.masked_fill(~valid, math.inf).min()
        high, low = mean(raw > upper), mean(raw < lo)
    capped = w.clamp(0.0, upper)  # ESS over the applied weights (IcePop's zeros included)
    ess = 1.0 / mean((capped / (masked_mean(capped, mask, global_=True) + 1e-8)) ** 2)
    metrics = {
        "rollout_is_mean": mean(w),
        "rollout_is_max": float(big),
        "rollout_is_min": float(tiny),
        "rollout_is_eff_sample_size": ess,
        "rollout_is_ratio_fraction_high": high,
        "rollout_is_ratio_fraction_low": low,
    }
    if lower is not None:  # IcePop: the share of tokens whose weight it zeroed
        metrics["rollout_is_oob_ratio"] = mean((raw < lower) | (raw > upper))
    return w.detach(), {f"rollout_corr/{k}": v for k, v in metrics.items()}


def rollout_rejection_mask(old_logprobs, rollout_logprobs, mask, *, kind="token_k1", threshold: str | float = "2.0"):
    """The response mask [B, R] with the tokens / rows outside the trust region set to 0, and its rollout_corr/
    metrics (each option's and the overall masked token and sequence fractions)."""
    rho = (old_logprobs - rollout_logprobs).clamp(-SAFETY_BOUND, SAFETY_BOUND)  # [B, R]
    token = {"k1": -rho, "k2": 0.5 * rho**2, "k3": rho.exp() - 1.0 - rho}  # [B, R] each
    valid, rows = mask.bool(), mask.sum(-1) > 0  # [B, R], [B] non-empty rows
    keep_all, metrics = torch.ones_like(rho), {}
    for option, (lower, upper) in rs_bounds(kind, threshold).items():
        level, k = option.rsplit("_", 1)  # e.g. "seq_mean", "k3"
        x = token[k]
        if level == "seq_sum":
            x = masked_sum(x, mask, -1)[:, None]  # [B, 1]
        elif level == "seq_mean":
            x = masked_mean(x, mask, -1)[:, None]
        elif level == "seq_max":  # an empty row: 0
            top = x.masked_fill(~valid, -math.inf).max(-1, keepdim=True).values
            x = torch.where(top == -math.inf, 0.0, top)
        if lower is None:
            keep = x <= upper
        else:  # k1: ratio bounds, compared in log space
            keep = (x >= math.log(lower)) & (x <= math.log(upper))
        keep = keep.expand_as(rho).to(rho.dtype)  # [B, R]
        keep_all = keep_all * keep
        stat = x.expand_as(rho)
        metrics[f"rollout_rs_{option}_mean"] = float(masked_mean(stat, mask, global_=True))
        where = valid if level == "token" else rows[:, None].expand_as(valid)  # tokens, or non-empty rows
        metrics[f"rollout_rs_{option}_max"] = float(stat.masked_fill(~where, -math.inf).max())  # none: -inf
        metrics[f"rollout_rs_{option}_masked_fraction"] = float(masked_mean(1 - keep, mask, global_=True))
        rejected = ((keep == 0) & valid).any(-1).float()  # [B] rows with a rejected token
        metrics[f"rollout_rs_{option}_seq_masked_fraction"] = float(masked_mean(rejected, rows.float(), global_=True))
    metrics["rollout_rs_masked_fraction"] = float(masked_mean(1 - keep_all, mask, global_=True))
    metrics["rollout_rs_seq_masked_fraction"] = float(((keep_all < 0.5) & valid).any(-1).float().mean())
    return (mask * keep_all).to(mask.dtype), {f"rollout_corr/{k}": v for k, v in metrics.items()}


def gap_metrics(old_logprobs, rollout_logprobs, mask) -> dict:
    """veRL's off-policy diagnostics of the sampler-trainer gap (rollout_corr/): KL(rollout || old) by k1 and k3,
    per-sequence perplexities and their log difference, chi^2 = E[rho^2] - 1 per token and per sequence."""
    rho = old_logprobs - rollout_logprobs  # [B, R]
    mean = lambda x: float(masked_mean(x, mask, global_=True))  # noqa: E731
    lp_old, lp_roll = masked_mean(old_logprobs, mask, -1), masked_mean(rollout_logprobs, mask, -1)  # [B]
    diff = lp_roll - lp_old  # [B] log PPL(old) - log PPL(rollout)
    seq = masked_sum(rho, mask, -1).clamp(-SAFETY_BOUND, SAFETY_BOUND)  # [B]
    out = {
        "kl": mean(-rho),
        "k3_kl": mean(rho.exp() - rho - 1),
        "training_ppl": float((-lp_old).exp().mean()),
        "rollout_ppl": float((-lp_roll).exp().mean()),
        "log_ppl_diff": float(diff.mean()),
        "log_ppl_abs_diff": float(diff.abs().mean()),
        "log_ppl_diff_max": float(diff.max()),
        "ppl_ratio": float(diff.exp().mean()),
        "chi2_token": mean(rho.clamp(-SAFETY_BOUND, SAFETY_BOUND).exp() ** 2) - 1.0,
        "chi2_seq": float((2 * seq).exp().mean()) - 1.0,
    }
    return {f"rollout_corr/{k}": v for k, v in out.items()}


def corrections(args: OffPolicyArgs, old_logprobs, rollout_logprobs, mask):
    """The batch's off-policy corrections: IS weights [B, R] (detached; None without any), the loss mask [B, R]
    (mask without the rejected tokens) and their metrics (rollout_corr/*, veRL's; the gap's own: gap_stats)."""
    gap = (old_logprobs, rollout_logprobs, mask)
    weights, stats = off_policy_weights(*gap, args.off_policy, args.is_cap, args.is_mask_cap)
    loss_mask = mask
    if args.rollout_is:
        weights, m = rollout_is_weights(*gap, level=args.rollout_is, threshold=args.rollout_is_threshold)
        stats.update(m)
    if args.rollout_rs:
        loss_mask, m = rollout_rejection_mask(*gap, kind=args.rollout_rs, threshold=args.rollout_rs_threshold)
        stats.update(m)
    return weights, loss_mask, stats


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


def gap_stats(
    old_logprobs, behav_logprobs, mask, policy_version=None, step: int = 0, verl: bool = False, first_turn=None
) -> dict:
    """Mean |sampler - trainer| logprob gap over valid tokens: stats/rollout_vs_old_logp_diff on the samples of the
    current weights (numerics only; absent when every sample is stale), and with policy versions (async) also
    stats/behav_vs_old_logp_diff over every sample, staleness included; verl: veRL's gap_metrics too (the trainer's
    with a correction or a bf16 sampler: OffPolicyArgs.reports_gap); first_turn (multi-turn: the first action's
    tokens) the gap there, ..._first_turn (a history the trainer re-tokenised differs from the second turn on). All
    inputs [B, R]; policy_version [B]."""
    gap = (behav_logprobs - old_logprobs).abs()  # [B, R]
    fresh = mask if policy_version is None else mask * (policy_version == step)[:, None]  # [B, R] same weights
    mean = lambda m: float(masked_mean(gap, m, global_=True))  # noqa: E731  (over the tokens of all ranks)
    # policy versions come from async_loop.py, whose trainer is one process: the branch is the same on every rank
    stats = {"stats/rollout_vs_old_logp_diff": mean(fresh)} if policy_version is None or fresh.any() else {}
    if policy_version is not None:
        stats["stats/behav_vs_old_logp_diff"] = mean(mask)
    if first_turn is not None and "stats/rollout_vs_old_logp_diff" in stats:
        stats["stats/rollout_vs_old_logp_diff_first_turn"] = mean(fresh * first_turn)
    return {**stats, **gap_metrics(old_logprobs, behav_logprobs, mask)} if verl else stats


# ------------------------------------------------------------------------------------------------
# 3. The loss families: (per-token loss [B, R], metrics); `policy_loss` aggregates them (ppo_math.aggregate)


def policy_agg(kind: str, agg: str) -> str:
    """The policy term's aggregation: sapo and geo_mean average per sequence (seq-mean-token-mean) whatever
    loss_agg says (veRL 0.9.1's); the others use loss_agg. Only the policy term: entropy, KL and value keep it."""
    return "seq-mean-token-mean" if kind in ("sapo", "geo_mean") else agg


def family_loss(kind: str, args: tuple, clips: dict, *, cap=None, tau_pos=1.0, tau_neg=1.05, is_weights=None):
    """The per-token loss [B, R] of loss family `kind` (vanilla is ppo_math.clipped_objective), times the rollout
    IS weights (geo_mean: their geometric mean per row, inside), and its metrics (clipfrac, clipfrac_lower,
    approx_kl = veRL's ppo_kl). args: (logprobs, old_logprobs, advantages, mask), [B, R] each; clips: policy_loss's
    {"clip_low", "clip_high"}."""
    if kind == "gspo":
        loss, metrics = gspo_loss(*args, **clips)
    elif kind == "cispo":
        loss, metrics = cispo_loss(*args, **clips)
    elif kind == "sapo":
        loss, metrics = sapo_loss(*args, tau_pos=tau_pos, tau_neg=tau_neg)
    elif kind == "geo_mean":
        return geo_mean_loss(*args, **clips, is_weights=is_weights)
    elif kind in ("dppo_tv", "dppo_kl"):
        loss, metrics = dppo_loss(*args, **clips, cap=20.0 if cap is None else cap, kl=kind == "dppo_kl")
    else:
        raise ValueError(f"loss_mode {kind!r}: one of {LOSS_MODES}")
    return (loss if is_weights is None else loss * is_weights), metrics


def policy_loss(
    logprobs,
    old_logprobs,
    advantages,
    mask,
    *,
    kind="vanilla",
    clip_low=0.2,
    clip_high=0.2,
    dual_clip=3.0,
    tau_pos=1.0,
    tau_neg=1.05,
    agg="token-mean",
    is_weights=None,
    pg_mask=None,
    denom=None,
    world=1,
):
    """The policy loss of family `kind` aggregated over valid tokens (vanilla: ppo_math's clipped PPO + dual clip),
    and its metrics. All inputs [B, R]; the advantages as the update uses them (attention credit's gamma_t A_t is
    shaped by the caller). is_weights: the rollout correction's, detached; pg_mask (AsyPPO) zeroes the term of some
    tokens, the normaliser still counting every token of `mask` (masking shrinks the step)."""
    agg = policy_agg(kind, agg)  # sapo, geo_mean: per sequence, whatever loss_agg says (veRL's)
    args, clips = (logprobs, old_logprobs, advantages, mask), {"clip_low": clip_low, "clip_high": clip_high}
    if kind == "vanilla":
        loss, metrics = ppo_math.clipped_objective(*args, **clips, dual_clip=dual_clip)
        loss = loss if is_weights is None else loss * is_weights  # off-policy correction weights, detached
    else:
        gates = {"cap": dual_clip, "tau_pos": tau_pos, "tau_neg": tau_neg}  # the families' own bounds
        loss, metrics = family_loss(kind, args, clips, **gates, is_weights=is_weights)
    if pg_mask is not None:
        loss = loss * pg_mask  # I^A_t (AsyPPO advantage mask)
    metrics.update(ppo_math.ratio_stats(logprobs, old_logprobs, mask))
    return ppo_math.aggregate(loss, mask, agg, denom, world), metrics


def _metrics(clip, lower, log_ratio, mask) -> dict:
    """The families' common metrics (veRL's pg_clipfrac, pg_clipfrac_lower, ppo_kl)."""
    return {"clipfrac": clip, "clipfrac_lower": lower, "approx_kl": masked_mean(-log_ratio, mask).detach()}


def gspo_loss(logprobs, old_logprobs, advantages, mask, *, clip_low: float, clip_high: float):
    """GSPO (arXiv 2507.18071, its GSPO-token form): s_it = sg[s_i] pi_t / sg[pi_t] with the sequence ratio
    s_i = exp(mean_t log r_t), clipped like PPO's ratio: every token of a row has the sequence ratio's value and its
    own gradient. The log-ratio is not clamped at +-20 (veRL); log s_it at 10."""
    raw, zero = logprobs - old_logprobs, mask.new_zeros(())
    seq = masked_sum(raw, mask, -1) / mask.sum(-1).clamp(min=1)  # [B] mean token log-ratio
    s = (logprobs - logprobs.detach() + seq.detach()[:, None]).clamp(max=10.0).exp()  # [B, R]
    l1, l2 = -advantages * s, -advantages * s.clamp(1 - clip_low, 1 + clip_high)
    return torch.maximum(l1, l2), _metrics(masked_mean((l2 > l1).float(), mask), zero, raw, mask)


def cispo_loss(logprobs, old_logprobs, advantages, mask, *, clip_low: float, clip_high: float):
    """CISPO (MiniMax-M1, arXiv 2506.13585): -sg[clip(r, 1 - eps_low, 1 + eps_high)] A log pi. The clip
    bounds the importance weight, not the update: every token keeps its gradient -clip(r) A."""
    log_ratio = (logprobs - old_logprobs).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    r = log_ratio.exp()
    rc = r.clamp(1 - clip_low, 1 + clip_high).detach()
    clip = masked_mean((r != rc).float(), mask)
    return -rc * advantages * logprobs, _metrics(clip, mask.new_zeros(()), log_ratio, mask)


def sapo_loss(logprobs, old_logprobs, advantages, mask, *, tau_pos: float, tau_neg: float):
    """SAPO (arXiv 2511.20347): -f(r) A with the soft gate f(r) = 4 / tau sigmoid(tau (r - 1)), tau_pos for
    A > 0 and tau_neg otherwise: f(1) = 2 / tau, f'(1) = 1 (the policy gradient on-policy), decaying smoothly
    instead of PPO's hard clip."""
    log_ratio, zero = (logprobs - old_logprobs).clamp(-SAFETY_BOUND, SAFETY_BOUND), mask.new_zeros(())
    pos, neg = (torch.as_tensor(t, dtype=advantages.dtype) for t in (tau_pos, tau_neg))
    tau = torch.where(advantages > 0, pos, neg)  # [B, R]
    gate = torch.sigmoid(tau * (log_ratio.exp() - 1.0)) * (4.0 / tau)
    return -gate * advantages, _metrics(zero, zero, log_ratio, mask)


def geo_mean_loss(logprobs, old_logprobs, advantages, mask, *, clip_low: float, clip_high: float, is_weights=None):
    """GMPO (arXiv 2507.20673): -A_i exp(mean_t clip(log r_t)), the geometric mean of the token ratios, each
    clipped in log space on the pessimistic side for the sign of A (A_i: the row's mean advantage). Returned on
    every token of the row (loss_agg seq-mean-token-mean then averages rows); IS weights enter as their geometric
    mean over the row (veRL). The log-ratio is not clamped at +-20 (veRL). Ours: seq-mean-token-mean averages
    over non-empty rows; veRL's torch.mean counts fully masked (or rejected) rows too (B / non-empty rows smaller).
    Sequence-level advantages only (trainer.Config refuses the token-level ones: GMPO is defined per row)."""
    sign, raw = torch.sign(advantages), logprobs - old_logprobs
    clamped = raw.clamp(-clip_low, clip_high)
    picked = sign * torch.minimum(sign * raw, sign * clamped)  # [B, R]
    n = mask.sum(-1) + 1e-8  # [B]
    seq = -(masked_sum(advantages, mask, -1) / n) * (masked_sum(picked, mask, -1) / n).exp()  # [B]
    if is_weights is not None:
        seq = seq * (masked_sum((is_weights + 1e-10).log(), mask, -1) / n).exp()
    clipped = (raw != clamped).float()
    clip, lower = masked_mean(clipped * (advantages > 0), mask), masked_mean(clipped * (advantages < 0), mask)
    return seq[:, None].expand_as(logprobs), _metrics(clip, lower, raw, mask)


def dppo_loss(logprobs, old_logprobs, advantages, mask, *, clip_low: float, clip_high: float, cap: float, kl: bool):
    """DPPO (arXiv 2602.04879): -A sg[min(r, C)] log pi on the tokens inside a divergence trust region, 0
    elsewhere. Binary TV (kl False): pi - pi_old <= clip_high when A > 0, >= -clip_low otherwise; binary KL: the
    KL of (pi_old, pi) as Bernoullis <= clip_high / clip_low, or a step against A's direction. C truncates the
    ratio (its sec. 5.4; veRL's clip_ratio_c)."""
    lp, old, adv = logprobs, old_logprobs, advantages
    log_ratio = (lp - old).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    r, p, p_old = log_ratio.exp(), lp.exp(), old.exp()
    if kl:
        div = p_old * (old - lp) + (1 - p_old) * torch.log((1.0 - p_old + 1e-8) / (1.0 - p + 1e-8))
        inside = torch.where(adv > 0, (div <= clip_high) | (p <= p_old), (div <= clip_low) | (p >= p_old))
    else:
        inside = torch.where(adv > 0, p - p_old <= clip_high, p - p_old >= -clip_low)
    inside = inside.detach().to(lp.dtype)
    loss = -adv * r.clamp(max=cap).detach() * lp * inside
    clip, lower = masked_mean(1.0 - inside, mask), masked_mean((r > cap).float() * inside, mask)
    return loss, _metrics(clip, lower, log_ratio, mask)


def main() -> None:
    """Print each correction's weights and mask for one response whose tokens the sampler liked more or less."""
    gap = torch.tensor([[-1.5, -0.5, 0.0, 0.4, 1.0, 2.0]])  # [1, R] log pi_old - log pi_rollout per token
    rollout, mask = torch.zeros_like(gap), torch.ones_like(gap)
    show = lambda t: [round(x, 3) for x in t[0].tolist()]  # noqa: E731
    print("w_t = pi_old / pi_rollout:", show(gap.exp()))
    for mode in ("tis", "decoupled"):
        w, stats = off_policy_weights(gap, rollout, mask, mode)
        print(f"--off-policy {mode:10s} weights {show(w)}  {stats}")
    for level, threshold in (("token", "2.0"), ("token", "0.5_2.0"), ("sequence", "2.0")):
        w, stats = rollout_is_weights(gap, rollout, mask, level=level, threshold=threshold)
        ess = stats["rollout_corr/rollout_is_eff_sample_size"]
        print(f"--rollout-is {level} --rollout-is-threshold {threshold:7s} weights {show(w)}  ESS {ess:.3f}")
    for kind, threshold in (("token_k1", "2.0"), ("token_k3", "0.5"), ("seq_mean_k1", "0.9_1.1")):
        keep, stats = rollout_rejection_mask(gap, rollout, mask, kind=kind, threshold=threshold)
        print(f"--rollout-rs {kind} --rollout-rs-threshold {threshold:7s} mask {show(keep)}")
    print({k.split("/")[1]: round(v, 3) for k, v in gap_metrics(gap, rollout, mask).items()})


if __name__ == "__main__":
    main()
