"""PPO and GRPO for causal LMs: the math (veRL-compatible semantics), the training loop, the torchrun path.

    python ppo_minimal.py                                        # tiny default on CPU, about two minutes
    python ppo_minimal.py --adv-estimator grpo                   # GRPO (group baseline, no critic)
    python ppo_minimal.py --model PATH_OR_HF_NAME --data my.jsonl --reward math_exact
    torchrun --standalone --nproc_per_node=2 ppo_minimal.py      # data parallel: gloo on CPU, nccl on GPU
    python ppo_minimal.py --inject reward_scale --steps 40       # plant a classic bug; the live diagnosis names it
    python ppo_minimal.py --dump-batch 7 --steps 7               # save everything update 7 needs (batch-7.pt)
    python ppo_minimal.py --replay runs/ppo/batch-7.pt           # re-run exactly that update, bit for bit
    python ppo_minimal.py --task calc --adv-estimator grpo       # multi-turn tool use (calculator environment)

One iteration (DESIGN.md section 4): sample G responses per prompt -> score -> recompute old logprobs
-> ref logprobs -> values -> token rewards -> advantages (GAE then whitening, or a group baseline) ->
extension hooks (token weights, pg/entropy masks) -> ppo_epochs x minibatches of clipped policy loss
(+ value loss) with gradient accumulation over micro-batches -> metrics, eval, checkpoint.

Equations (sources: PPO, Schulman et al. 2017 eq. 7; GAE, Schulman et al. 2016 eq. 16; GRPO, Shao et
al. 2024 sec. 4.1; Dr. GRPO, Liu et al. 2025; RLOO, Ahmadian et al. 2024; k1/k2/k3, Schulman's
"Approximating KL divergence"; veRL 0.9.1 `core_algos.py` for every quirk, see DESIGN.md 7.1):
  GAE      delta_t = r_t + gamma V_{t+1} - V_t,  A_t = delta_t + gamma lam A_{t+1}   (masked t pass through)
  GRPO     A_i = (s_i - mean_g) / (std_g + eps)   (std unbiased; singleton: mean 0, std 1)
  RLOO     A_i = s_i - mean_{j != i} s_j
  clip     L = max(-A r, -A clip(r, 1 - eps_lo, 1 + eps_hi)); dual clip (A < 0): L = min(L, -c A)
  value    L_V = 0.5 max((V - R)^2, (clip(V, V_old +- eps_v) - R)^2)
  KL       x = logp - ref: k1 = x, k2 = x^2 / 2, k3 = exp(-x) + x - 1

Extension points (frozen; later concepts plug in here without reshaping the loop):
1. `adv_estimator`: gae | grpo | rloo (`compute_advantages`).
2. After whitening: `batch["token_weights"]` (multiplies the advantage per token), `batch["pg_mask"]`
   (tokens whose policy term counts) and `batch["ent_mask"]` (tokens whose entropy bonus counts).
   They default to None / response_mask / response_mask (`shape_advantages`). The masks multiply the
   per-token terms; the loss normaliser still counts every valid token (DESIGN.md 7.2: masking shrinks the step).
3. The critic interface of `critics.py`: `Critics.values(...)` -> [M, B, R]; `critic_update` steps them.
4. `train(cfg, hooks=[fn(step, metrics)])`: per-step metric hooks (every rank, metrics already reduced).
5. Live diagnosis: diagnose.LiveDiagnoser checks every metrics row (a warning line; --strict stops).

Implementation details (numbered; the deviations from veRL are marked "ours")
1. Every model runs with dropout off (`.eval()`); `train()` mode is never used.
2. old_logprobs are recomputed by the trainer before the update (never the sampler's), with the sampling
   temperature; `stats/rollout_vs_old_logp_diff` logs their mean |difference|.
3. Under DDP the loss denominator is global: `sum_local(mask * l) / all_reduce(sum mask) * W`, so
   DDP's gradient averaging gives exactly the single-process gradient of the global minibatch.
4. Whitening (GAE only) uses global masked statistics; GRPO groups are rank-local (each rank samples
   whole groups).
5. A truncated response (no EOS within max_new_tokens) keeps its mask and score, unless
   `no_eos_penalty` is set, which replaces its score (N implementation details, #4).
6. ours: the aggregation denominator is clamped at 1 so that a fully masked minibatch gives loss 0,
   not NaN (veRL divides by zero there); identical otherwise.
7. ours: advantages and returns are 0 at masked positions (veRL leaves pass-through values there).
8. ours: the embedded default is an SFT warm start (tasks.py) of a tiny Qwen2 model: RL from a random
   init has no reward signal. All RL seeds start from the same warm start (SFT seed 0). The defaults
   (task sort, SFT stopped at 0.15 greedy, 32 prompts x 4, T 0.6, lr 2e-4 with 20 warm-up iterations then a
   cosine decay towards 0, 2 epochs x 2 minibatches, 90 iterations) are the recipe measured in the README's
   "Learning" section: at T 1 or a constant lr the tiny model's greedy accuracy oscillates or first falls.
9. KL: off in the reward and off as a loss by default (veRL's default too), since the tiny task's
   partial-credit reward does not need it; `--kl-loss` (k3, GRPO style) or `--kl-in-reward` (k1,
   fixed or adaptive controller) turn them on, and stats/kl is logged whenever a reference model exists.
10. Mixed precision: `--dtype bfloat16` autocasts the compute; weights and AdamW state stay fp32.
11. CPU runs are bitwise reproducible for a fixed seed and thread count; a resumed run reproduces the
    uninterrupted one exactly (torch, sampler, task and shuffle RNG states are checkpointed).
12. Bug injection (INJECTIONS, lines marked "INJECT"): an injection's stated config is applied to the fields
    whose value equals the default (a flag set explicitly TO the default is overridden too; each override
    is printed). diagnose.py's regression suite is tests/test_inject.py.
13. --dump-batch needs world size 1; --replay runs one process and matches the original bit for bit on the
    same device, dtype and thread count. The file is saved before the update, so a crashing update (a NaN
    gradient) still leaves its inputs, with the error, and its replay must raise the same error.
14. Environments (`--task calc | guess | gem:<id>`, tasks.py): rollout.rollout_env runs G episodes per env
    seed (a GRPO group); each turn's reward sits at its last action token, observation tokens have mask 0
    and GAE passes values through them (DESIGN.md 7.1). A single-turn task is the one-turn case
    (envs.TaskEnv), so both share one code path; eval/acc is greedy success on held-out episodes.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Literal

import numpy as np
import torch

import repro
from attention_credit import CreditArgs, token_weights
from common import (
    all_reduce_sum,
    check_choice,
    check_range,
    masked_mean,
    masked_var,
    masked_whiten,
    parse_config,
    reduce_metrics,
    setup_dist,
)
from critics import CriticArgs, Critics, asyppo_masks, critic_footprint, make_value_model, partition_shares, value_stats
from diagnose import LiveDiagnoser
from envs import ENVS, TaskEnv, is_env, make_env
from repro import ReproArgs
from rollout import decode_responses, greedy_success, last_valid, rollout_env
from runlog import (
    MetricsLogger,
    load_checkpoint,
    plot_metrics,
    restore_streams,
    save_checkpoint,
    stream_states,
)
from tasks import REWARDS, TASKS, load_policy, make_task, stop_token_ids
from warm_start import sft_config_for, sft_target_for, sft_warm_start

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


@dataclass
class Config(CriticArgs, CreditArgs, ReproArgs):
    model: str | None = None
    """HF model name or local folder (AutoModelForCausalLM); None = the embedded tiny model after SFT."""
    task: str = "sort"
    """Task reverse | add | sort | chain, or multi-turn environment calc | guess | gem:<id> (ignored with --data)."""
    data: str | None = None
    """JSONL file of {"prompt", "ground_truth"} lines to train on instead of a procedural task."""
    reward: str = "math_exact"
    """Reward for --data: math_exact | exact | digits."""
    adv_estimator: Literal["gae", "grpo", "rloo"] = "gae"
    """Advantage estimator: gae (PPO with a critic), grpo (group baseline), rloo (leave-one-out)."""
    steps: int = 90
    """Number of RL iterations."""
    prompts_per_step: int = 32
    """Prompts per iteration, over all ranks (must divide by the world size)."""
    group_size: int = 4
    """Responses sampled per prompt (G)."""
    max_prompt_len: int = 64
    """Longest prompt in tokens; a longer prompt is an error."""
    max_new_tokens: int = 16
    """Response (per-turn action) length limit; one without EOS by then is kept and counted as truncated."""
    max_turns: int = 8
    """Multi-turn environments: actions per episode at most (the environment's own limit usually ends it first)."""
    max_context: int = 256
    """Multi-turn environments: tokens per episode at most (prompt, actions, observations)."""
    env_latency: float = 0.0
    """Embedded environments: mean seconds each step takes (log-normal, sigma 0.5; exercises async rollouts)."""
    temperature: float = 0.6
    """Sampling temperature (logprobs are recomputed with the same temperature)."""
    top_p: float = 1.0
    """Nucleus sampling; < 1 makes the behaviour policy differ from the trained one (off-policy)."""
    top_k: int = 0
    """Top-k sampling (0 = off); > 0 makes the behaviour policy differ from the trained one."""
    off_policy: Literal["none", "behav", "tis", "decoupled"] | None = None
    """Off-policy correction: none | behav (clip at sampler logprobs) | tis | decoupled (None = none; async: tis)."""
    is_cap: float = 2.0
    """tis: importance weight pi_old / pi_behav truncated at this C."""
    is_mask_cap: float = 5.0
    """decoupled: tokens whose pi_old / pi_behav exceeds this are masked out of the policy loss."""
    lr: float = 2e-4
    """Policy learning rate (AdamW)."""
    warmup_steps: int = 20
    """Linear learning-rate warm-up (iterations), for policy and critic."""
    lr_schedule: Literal["constant", "cosine"] = "cosine"
    """After the warm-up: constant, or a cosine decay towards min_lr_ratio * lr (reached one step after the last)."""
    min_lr_ratio: float = 0.0
    """Cosine schedule: the floor of the decay as a share of lr (and critic_lr)."""
    adam_eps: float = 1e-8
    """AdamW epsilon (PyTorch placement)."""
    ppo_epochs: int = 2
    """Passes over each batch."""
    minibatches: int = 2
    """Optimizer steps per epoch (the batch is split into this many shuffled minibatches)."""
    micro_batch: int = 128
    """Sequences per forward/backward (gradient accumulation inside a minibatch)."""
    clip_low: float = 0.2
    """PPO clip epsilon below 1 (ratio >= 1 - clip_low)."""
    clip_high: float = 0.2
    """PPO clip epsilon above 1 (clip-higher: > clip_low)."""
    dual_clip: float | None = 3.0
    """Dual-clip constant c > 1 for negative advantages (None = off)."""
    value_clip: float = 0.5
    """Value clipping epsilon."""
    gamma: float = 1.0
    """GAE discount."""
    lam: float = 1.0
    """GAE lambda."""
    grpo_norm_std: bool = True
    """GRPO: divide by the group std (False = Dr. GRPO)."""
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = "token-mean"
    """How per-token losses are averaged."""
    kl_in_reward: bool = False
    """Subtract beta * KL(old || ref) (k1) from every token's reward."""
    kl_coef: float = 0.001
    """Initial beta of the KL-in-reward penalty."""
    kl_ctrl: Literal["fixed", "adaptive"] = "fixed"
    """KL-in-reward controller."""
    kl_target: float = 0.1
    """Adaptive controller: target KL."""
    kl_horizon: int = 10000
    """Adaptive controller: horizon."""
    kl_loss: bool = False
    """Add kl_loss_coef * agg(KL(current || ref)) to the loss (GRPO style)."""
    kl_loss_coef: float = 0.001
    """Coefficient of the KL loss."""
    kl_loss_type: Literal["k1", "k2", "k3"] = "k3"
    """Estimator of the KL loss."""
    ent_coef: float | None = None
    """Entropy bonus coefficient (None = 0, or 1e-3 with --critic asyppo so its entropy filter acts)."""
    grad_clip: float = 1.0
    """Gradient norm clipping."""
    no_eos_penalty: float | None = None
    """Score given to a response that hit max_new_tokens without EOS (None = keep its score)."""
    eval_every: int = 10
    """Greedy evaluation on held-out prompts every this many iterations (0 = never)."""
    eval_n: int = 500
    """Held-out prompts per evaluation."""
    seed: int = 0
    """Seed (sampling uses seed + rank)."""
    out_dir: str = "runs/ppo"
    """Where metrics.jsonl, plots and checkpoints go."""
    save_every: int = 0
    """Checkpoint every this many iterations (0 = never)."""
    resume: str | None = None
    """Checkpoint folder to resume from."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Compute dtype (bfloat16 autocasts; weights and optimizer state stay fp32)."""
    device: str = "auto"
    """auto | cpu | cuda."""
    dist_timeout: float = 120.0
    """Seconds before a collective gives up (a dead rank makes the others fail)."""
    sft_target: float | None = None
    """Embedded default: greedy accuracy at which the SFT warm start stops (None = the task's, in warm_start.py)."""
    tensorboard: bool = False
    """Also log to TensorBoard (needs the tensorboard package)."""
    strict: bool = False
    """Stop the run when the live diagnosis (diagnose.py) flags a failure mode."""

    def __post_init__(self):
        repro.apply_stated_config(self)  # first: an injection's stated config fills fields left at their default
        if self.ent_coef is None:  # derived once here, printed with the config
            self.ent_coef = 1e-3 if self.critic == "asyppo" and self.adv_estimator == "gae" else 0.0
        CriticArgs.__post_init__(self)
        CreditArgs.__post_init__(self)
        check_choice("lr_schedule", self.lr_schedule, ("constant", "cosine"))
        check_range("min_lr_ratio", self.min_lr_ratio, 0.0, 1.0)
        if self.min_lr_ratio and self.lr_schedule != "cosine":
            raise ValueError("config field 'min_lr_ratio' needs lr_schedule 'cosine' (a constant lr has no floor)")
        if self.critic == "asyppo" and self.group_size % self.n_critics:
            raise ValueError(
                f"config field 'group_size' = {self.group_size} must divide by n_critics = {self.n_critics}"
            )
        for name in ("steps", "eval_every", "save_every", "top_k", "warmup_steps"):
            check_range(name, getattr(self, name), 0)
        check_range("dump_batch", self.dump_batch, 0, self.steps)
        for name in ("prompts_per_step", "group_size", "max_prompt_len", "max_new_tokens", "ppo_epochs", "minibatches"):
            check_range(name, getattr(self, name), 1)
        for name in ("micro_batch", "eval_n", "kl_horizon"):
            check_range(name, getattr(self, name), 1)
        for name in ("lr", "kl_coef", "kl_loss_coef", "ent_coef"):
            check_range(name, getattr(self, name), 0.0)
        for name in ("clip_low", "clip_high", "value_clip", "adam_eps", "grad_clip", "kl_target", "dist_timeout"):
            check_range(name, getattr(self, name), 0.0, lo_open=True)
        check_range("clip_low", self.clip_low, 0.0, 1.0, lo_open=True, hi_open=True)
        check_range("temperature", self.temperature, 0.0, lo_open=True)
        check_range("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        check_range("gamma", self.gamma, 0.0, 1.0)
        check_range("lam", self.lam, 0.0, 1.0)
        if self.sft_target is None:  # derived once here, so config.json and checkpoints record the value used
            self.sft_target = sft_target_for(self.task)
        check_range("sft_target", self.sft_target, 0.0, 1.0, lo_open=True)
        if self.dual_clip is not None:
            check_range("dual_clip", self.dual_clip, 1.0, lo_open=True)
        check_choice("loss_agg", self.loss_agg, AGG_MODES)
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ValueError(f"config field 'device' = {self.device!r}: must be auto, cpu, cuda or cuda:N")
        if self.no_eos_penalty is not None:
            check_range("no_eos_penalty", self.no_eos_penalty)
        if self.critic_warmup_steps and self.adv_estimator != "gae":
            raise ValueError("config field 'critic_warmup_steps' needs adv_estimator 'gae' (no critic otherwise)")
        check_choice("adv_estimator", self.adv_estimator, ("gae", "grpo", "rloo"))
        check_choice("kl_ctrl", self.kl_ctrl, ("fixed", "adaptive"))
        check_choice("kl_loss_type", self.kl_loss_type, ("k1", "k2", "k3"))
        check_choice("dtype", self.dtype, ("float32", "bfloat16"))
        check_choice("reward", self.reward, tuple(REWARDS))
        if self.data is None and not self.task.startswith("gem:"):
            check_choice("task", self.task, TASKS + tuple(ENVS))
        check_range("max_turns", self.max_turns, 1)
        if self.data is None and self.task.startswith("gem:") and self.model is None:
            raise ValueError(f"config field 'task' = {self.task!r}: a gem environment needs --model (no SFT solver)")
        if self.data is None and is_env(self.task):  # single-turn runs use max_prompt_len + max_new_tokens
            check_range("max_context", self.max_context, self.max_prompt_len + 1)
        check_range("env_latency", self.env_latency, 0.0)
        self.off_policy = self.off_policy or "none"
        check_choice("off_policy", self.off_policy, ("none", "behav", "tis", "decoupled"))
        check_range("is_cap", self.is_cap, 1.0)
        check_range("is_mask_cap", self.is_mask_cap, 1.0)
        if self.adv_estimator in ("grpo", "rloo") and self.group_size < 2:
            raise ValueError(f"config field 'group_size' = {self.group_size}: {self.adv_estimator} needs >= 2")


# ------------------------------------------------------------------------------------------------
# Pure math (veRL 0.9.1 semantics; tests/test_verl_golden.py compares against veRL's own outputs)


def aggregate(loss_mat, mask, mode: str = "token-mean", denom=None, world: int = 1):
    """Scalar loss from a [B, R] per-token loss. denom: the global normaliser (detail 3), else local.

    token-mean           sum(mask * l) / n_tokens
    seq-mean-token-mean  sum over non-empty seqs of (sum_t mask l / n_t) / n_seqs
    seq-mean-token-sum   sum over non-empty seqs of (sum_t mask l) / n_seqs
    """
    if mode == "token-mean":
        total = (loss_mat * mask).sum()
    else:
        seq = (loss_mat * mask).sum(-1)  # [B]
        if mode == "seq-mean-token-mean":
            seq = seq / (mask.sum(-1) + 1e-8)
        total = (seq * (mask.sum(-1) > 0)).sum()  # fully masked sequences excluded
    if denom is None:
        denom = agg_denominator(mask, mode, global_=False)
    return total / denom.clamp(min=1) * world  # detail 6


def agg_denominator(mask, mode: str, global_: bool = True):
    """Number of valid tokens (token-mean) or non-empty sequences (seq-mean modes), summed over ranks."""
    n = mask.sum() if mode == "token-mean" else (mask.sum(-1) > 0).sum()
    n = n.double().reshape(1)
    return (all_reduce_sum(n) if global_ else n)[0]


def gae(token_rewards, values, mask, gamma: float, lam: float):
    """Raw GAE advantages and returns [B, R] (no whitening). Masked positions pass values through."""
    B, R = token_rewards.shape
    nextvalue = token_rewards.new_zeros(B)  # [B]
    lastgae = token_rewards.new_zeros(B)  # [B]
    adv = torch.zeros_like(token_rewards)  # [B, R]
    for t in reversed(range(R)):
        # delta_t = r_t + gamma V_{t+1} - V_t ; A_t = delta_t + gamma lam A_{t+1}   (GAE eq. 16)
        delta = token_rewards[:, t] + gamma * nextvalue - values[:, t]
        gae_t = delta + gamma * lam * lastgae
        m = mask[:, t].to(values.dtype)
        nextvalue = m * values[:, t] + (1 - m) * nextvalue  # only valid tokens move the recursion
        lastgae = m * gae_t + (1 - m) * lastgae
        adv[:, t] = lastgae
    returns = adv + values  # before whitening
    return adv * mask, returns * mask  # detail 7


def _group_stats(scores, group_ids):
    """Per-sample group mean, unbiased std and group size (singletons: mean 0, std 1)."""
    _, inv = torch.unique(group_ids, return_inverse=True)  # [B]
    n = torch.bincount(inv).to(scores.dtype)  # [G]
    mean = torch.zeros_like(n).index_add_(0, inv, scores) / n  # [G]
    sq = torch.zeros_like(n).index_add_(0, inv, (scores - mean[inv]) ** 2)  # [G]
    std = (sq / (n - 1).clamp(min=1)).sqrt()  # [G] unbiased (N - 1)
    single = n == 1
    mean, std = mean.masked_fill(single, 0.0), std.masked_fill(single, 1.0)
    return mean[inv], std[inv], n[inv]


def group_advantages(rewards, group_ids, *, norm_std: bool = True, eps: float = 1e-6):
    """GRPO outcome advantage per sequence [B]: (s - mean_g) / (std_g + eps), or s - mean_g (Dr. GRPO)."""
    mean, std, _ = _group_stats(rewards, group_ids)
    return (rewards - mean) / (std + eps) if norm_std else rewards - mean


def rloo_advantages(rewards, group_ids):
    """RLOO per sequence [B]: s_i - mean of the other samples of its group = (s_i - mean) * n / (n - 1)."""
    mean, _, n = _group_stats(rewards, group_ids)
    return torch.where(n > 1, (rewards - mean) * n / (n - 1).clamp(min=1), rewards)


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
    token_weights=None,
    is_weights=None,
    pg_mask=None,
    denom=None,
    world=1,
):
    """Clipped PPO surrogate (+ dual clip) aggregated over valid tokens. All inputs [B, R].

    pg_mask (AsyPPO) zeroes the term of some tokens; the normaliser still counts every token of `mask`.
    """
    if token_weights is not None:
        advantages = advantages * token_weights  # shaped advantage gamma_t * A_t (attention credit)
    log_ratio = (logprobs - old_logprobs).clamp(-20, 20)  # [B, R]
    ratio = torch.exp(log_ratio)
    l1 = -advantages * ratio
    l2 = -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)
    loss = torch.maximum(l1, l2)  # PPO eq. 7, as a loss
    metrics = {"clipfrac": masked_mean((l2 > l1).float(), mask), "clipfrac_lower": torch.zeros(())}
    if dual_clip is not None:
        l3 = -advantages * dual_clip
        metrics["clipfrac_lower"] = masked_mean(((loss > l3) & (advantages < 0)).float(), mask)
        loss = torch.where(advantages < 0, torch.minimum(loss, l3), loss)  # dual clip: A < 0 only
    if is_weights is not None:
        loss = loss * is_weights  # off-policy correction weights (async_loop.py), detached
    if pg_mask is not None:
        loss = loss * pg_mask  # I^A_t (AsyPPO advantage mask); masking shrinks the step (DESIGN.md 7.2)
    metrics["approx_kl"] = masked_mean(-log_ratio, mask).detach()  # veRL ppo_kl: of the clamped log-ratio
    metrics["ratio_mean"] = masked_mean(ratio, mask).detach()
    metrics["ratio_max"] = (ratio * mask).max().detach()
    return aggregate(loss, mask, agg, denom, world), metrics


def value_loss(values, old_values, returns, mask, *, clip=0.5, agg="token-mean", denom=None, world=1):
    """Clipped value loss 0.5 * agg(max((V - R)^2, (V_clip - R)^2)). All inputs [B, R]."""
    v_clip = old_values + (values - old_values).clamp(-clip, clip)
    l_unclipped, l_clipped = (values - returns) ** 2, (v_clip - returns) ** 2
    loss = 0.5 * aggregate(torch.maximum(l_unclipped, l_clipped), mask, agg, denom, world)
    return loss, {"vf_clipfrac": masked_mean((l_clipped > l_unclipped).float(), mask).detach()}


def off_policy_weights(old_logprobs, behav_logprobs, mask, mode: str, cap: float = 2.0, mask_cap: float = 5.0):
    """Per-token importance weights [B, R] (detached) for samples drawn by a stale or different behaviour policy
    (DESIGN.md 7.4; veRL TIS; AReaL decoupled PPO, arXiv 2505.24298 eq. 5). All inputs [B, R].

      w_t = pi_old(o_t) / pi_behav(o_t)        (pi_old: the trainer's recompute at update start, the proximal policy)
      tis:       the PPO loss (anchored at pi_old) times min(w_t, C)
      decoupled: times w_t, and tokens with w_t > mask_cap masked out (zero, not truncated)
    none / behav return None: no weights (behav anchors the clip at pi_behav instead, in the caller).
    With pi_behav == pi_old (on-policy) every variant is plain PPO."""
    if mode in ("none", "behav"):
        return None, {}
    w = torch.exp((old_logprobs - behav_logprobs).clamp(-20, 20)).detach()  # [B, R]
    w = torch.where(mask.bool(), w, torch.ones_like(w))  # masked tokens (observations, padding): neutral
    cut = w > (cap if mode == "tis" else mask_cap)  # [B, R] truncated (tis) or masked out (decoupled)
    out = w.clamp(max=cap) if mode == "tis" else w * (~cut)
    stats = {"stats/is_weight_mean": float(masked_mean(w, mask)), "stats/is_cut_frac": float(masked_mean(cut, mask))}
    return out, stats


SCHEDULE_FIELDS = ("steps", "lr", "critic_lr", "warmup_steps", "lr_schedule", "min_lr_ratio", "critic_warmup_steps")


def lr_factor(step: int, total: int, warmup: int, schedule: str = "constant", min_ratio: float = 0.0) -> float:
    """Multiplier of the base lr at iteration `step` (0-based) of `total`: linear warm-up over `warmup`
    iterations, then 1 (constant) or a half cosine from 1 towards min_ratio, which it would reach one
    iteration after the last (transformers' cosine-with-warm-up, with veRL's min_lr_ratio floor).
    A negative step (critic-only iterations before the actor's first) gives 0."""
    if step < 0:
        return 0.0
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = (step - warmup) / max(1, total - warmup)  # 0 after the warm-up, (n - 1) / n at the last iteration
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


class KLController:
    """beta for KL in the reward: fixed, or adaptive (Ziegler et al. 2019): e = clip(KL/target - 1, +-0.2)."""

    def __init__(self, beta: float, kind: str, target: float, horizon: int):
        self.beta, self.kind, self.target, self.horizon = beta, kind, target, horizon

    def update(self, kl: float, n: int) -> None:
        if self.kind == "adaptive":
            e = min(max(kl / self.target - 1, -0.2), 0.2)
            self.beta *= 1 + e * n / self.horizon


# ------------------------------------------------------------------------------------------------
# One iteration's pieces


def trainer_logprobs(cfg: Config, model, input_ids, attention_mask, R: int, with_entropy: bool = False):
    """The trainer's logprobs (and entropies) [B, R] with the sampling temperature (detail 2): old, ref, loss."""
    score, temperature = repro.at_logprobs(cfg.inject, cfg.temperature)  # INJECT no_temperature, logprob_shift
    kw = {"temperature": temperature, "micro_batch": cfg.micro_batch, "with_entropy": with_entropy}
    return score(model, input_ids, attention_mask, R, **kw)


def compute_advantages(cfg: Config, batch: dict, scores, group_ids, values):
    """Token rewards, then advantages and returns [B, R] (whitened for GAE only, DESIGN.md 7.1).

    scores: [B] one outcome per sequence, placed on its last valid token, or [B, R] the environment's
    rewards already placed (each turn's at its last action token); a reward on a masked token is an error."""
    mask = batch["response_mask"].float()
    if scores.dim() == 1:
        scores = last_valid(mask).float() * scores[:, None]  # [B, R]
    if scores.shape != mask.shape:
        raise ValueError(f"scores of shape {tuple(scores.shape)}: expected [B] or [B, R] = {tuple(mask.shape)}")
    if (scores * (1 - mask)).abs().sum() > 0:
        raise ValueError("a reward sits on a masked token (mask 0): it would be lost; place it on an action token")
    token_rewards = scores.clone()  # [B, R]
    kl = kl_estimate(batch["old_logprobs"], batch["ref_logprobs"], "k1") * mask  # [B, R]
    if cfg.kl_in_reward:
        token_rewards = token_rewards - batch["kl_beta"] * kl
    if cfg.adv_estimator == "gae":
        adv, returns = gae(token_rewards, values, mask, cfg.gamma, cfg.lam)
        adv = masked_whiten(adv, mask, global_=True) * mask  # detail 4
    else:
        seq_score = token_rewards.sum(-1)  # [B] veRL: the score is the sum of token rewards
        if cfg.adv_estimator == "grpo":
            seq_adv = group_advantages(seq_score, group_ids, norm_std=cfg.grpo_norm_std)
        else:
            seq_adv = rloo_advantages(seq_score, group_ids)
        adv = seq_adv[:, None] * mask  # [B, R] broadcast over valid tokens
        returns = adv
    return token_rewards, adv, returns, kl


def shape_advantages(cfg: Config, batch: dict, policy, all_values) -> dict:
    """Extension point 2, after whitening: token weights and pg/entropy masks. Returns their metrics."""
    mask = batch["response_mask"]
    batch["token_weights"], batch["pg_mask"], batch["ent_mask"], metrics = None, mask, mask, {}
    if cfg.adv_estimator == "gae" and cfg.critic == "asyppo":  # AsyPPO: critic disagreement masks
        batch["pg_mask"], batch["ent_mask"], metrics = asyppo_masks(all_values, mask, cfg.asyppo_k, cfg.asyppo_h)
    if cfg.credit == "attention":  # attention-based token credit: gamma_t multiplies A_t in the loss
        kw = {k: getattr(cfg, "credit_" + k) for k in ("mode", "q", "intro_window", "alpha", "amp")}
        w, m = token_weights(
            policy, batch["input_ids"], batch["attention_mask"], mask, **kw, micro_batch=cfg.micro_batch
        )
        if cfg.credit_nonneg_only:
            w = torch.where(batch["advantages"] < 0, torch.ones_like(w), w)
        batch["token_weights"] = w
        metrics.update(m)
    return metrics


def select(batch: dict, idx) -> dict:
    return {k: (v[idx] if isinstance(v, torch.Tensor) and v.dim() > 0 else v) for k, v in batch.items()}


def ppo_update(cfg, policy_train, opt, critics, batch: dict, world: int, gen, autocast, update_actor=True) -> dict:
    """ppo_epochs x minibatches optimizer steps of the policy (and critics) on one batch.

    update_actor=False (critic warm-up): the policy loss is computed for its metrics only, without grad or step.
    """
    B = batch["input_ids"].shape[0]
    R = batch["response_mask"].shape[1]
    mb_size = B // cfg.minibatches
    micro_rows, step_rows, first = [], [], {}
    clip = {"clip_low": cfg.clip_low, "clip_high": cfg.clip_high, "dual_clip": cfg.dual_clip, "agg": cfg.loss_agg}
    for epoch in range(cfg.ppo_epochs):
        perm = torch.randperm(B, generator=gen) if cfg.minibatches > 1 else torch.arange(B)
        for j in range(cfg.minibatches):
            mb = select(batch, perm[j * mb_size : (j + 1) * mb_size])
            mask = mb["response_mask"].float()
            denom = agg_denominator(mask, cfg.loss_agg)  # all valid tokens, also under pg/ent masks (DESIGN.md 7.2)
            starts, mb_loss = list(range(0, mb_size, cfg.micro_batch)), {}
            for s in starts:
                mi = select(mb, slice(s, s + cfg.micro_batch))
                mmask = mi["response_mask"].float()
                sync = s == starts[-1] or world == 1  # DDP all-reduces gradients on the last micro-batch only
                no_sync = contextlib.nullcontext() if sync else policy_train.no_sync()
                with no_sync, autocast(), torch.set_grad_enabled(update_actor):
                    logp, ent = trainer_logprobs(
                        cfg, policy_train, mi["input_ids"], mi["attention_mask"], R, with_entropy=True
                    )  # [b, R]
                    pg, m = policy_loss(
                        logp,
                        mi["old_logprobs"] if mi.get("clip_anchor") is None else mi["clip_anchor"],
                        mi["advantages"],
                        mmask,
                        **clip,
                        denom=denom,
                        world=world,
                        token_weights=mi["token_weights"],
                        pg_mask=mi["pg_mask"].float(),
                        is_weights=mi.get("is_weights"),
                    )
                    ent_masked = ent * mi["ent_mask"].float()  # [b, R] I^H_t H_t (AsyPPO entropy filter)
                    ent_loss = aggregate(ent_masked, mmask, cfg.loss_agg, denom, world)
                    kl_t = kl_estimate(logp, mi["ref_logprobs"], cfg.kl_loss_type)  # [b, R]
                    kl_loss = aggregate(kl_t, mmask, cfg.loss_agg, denom, world)
                    loss = pg + (cfg.kl_loss_coef * kl_loss if cfg.kl_loss else 0.0)
                    if cfg.ent_coef > 0:  # the entropy term joins the graph only when it is used
                        loss = loss - cfg.ent_coef * ent_loss
                if update_actor:
                    loss.backward()
                ratio_dev = ((logp.detach() - mi["old_logprobs"]).exp() - 1).abs().mul(mmask).max()
                if epoch == 0 and j == 0:  # first minibatch, before any optimizer step: the ratio must be 1
                    first = {
                        "stats/first_mb_clipfrac": max(first.get("stats/first_mb_clipfrac", 0.0), float(m["clipfrac"])),
                        "stats/first_mb_ratio_dev": max(first.get("stats/first_mb_ratio_dev", 0.0), float(ratio_dev)),
                    }
                # a micro-batch's loss is its share of the minibatch loss: sum them (the rank mean is taken later)
                for k, v in {"loss/policy": pg, "loss/entropy": ent_loss, "loss/kl": kl_loss}.items():
                    mb_loss[k] = mb_loss.get(k, 0.0) + v.item()
                micro_rows.append(
                    {
                        **{f"stats/{k}": float(v) for k, v in m.items()},
                        "stats/entropy": float(masked_mean(ent.detach(), mmask)),
                    }
                )
            gn = torch.nn.utils.clip_grad_norm_(policy_train.parameters(), cfg.grad_clip)
            if not torch.isfinite(gn):
                raise FloatingPointError(f"policy gradient norm is {gn.item()} at epoch {epoch} minibatch {j}")
            if update_actor:
                opt.step()
            opt.zero_grad(set_to_none=True)
            row = {"stats/grad_norm": gn.item(), **mb_loss}
            if critics is not None:
                row.update(critic_update(cfg, critics, mb, world))
            step_rows.append(row)
    out = {
        k: float(np.mean([r[k] for r in micro_rows + step_rows if k in r]))
        for k in {k for r in micro_rows + step_rows for k in r}
    }
    out["stats/ratio_max"] = max(r["stats/ratio_max"] for r in micro_rows)
    return {**out, **first}


def critic_update(cfg: Config, critics: Critics, mb: dict, world: int) -> dict:
    """One optimizer step per critic on a minibatch: critic m on the rows of its share, each micro-batch's
    clipped value loss (7.1) against its own target R^(m) [b, M, R], the denominator over its share's tokens."""
    metrics, R = {}, mb["response_mask"].shape[1]
    for k, (model, opt) in enumerate(zip(critics.train_models, critics.opts)):
        mask = mb["response_mask"].float() * mb["shares"][:, k, None]  # [b, R] critic k's rows only
        denom, losses = agg_denominator(mask, cfg.loss_agg), []
        for i in range(0, mask.shape[0], cfg.micro_batch):
            sl = slice(i, i + cfg.micro_batch)
            values = model(mb["input_ids"][sl], mb["attention_mask"][sl], R)  # [mb, R]
            old = mb["old_values"][sl, k]  # [mb, R]
            target = repro.at_value_target(cfg.inject, mb["critic_returns"][sl, k], old, values)  # INJECT
            kw = {"clip": cfg.value_clip, "agg": cfg.loss_agg, "denom": denom, "world": world}
            loss, m = value_loss(values, old, target, mask[sl], **kw)
            loss.backward()
            losses.append(loss.detach())
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        if not torch.isfinite(gn):  # never step a NaN into the weights
            raise FloatingPointError(f"critic {k}: gradient norm is {gn.item()}")
        opt.step()
        opt.zero_grad(set_to_none=True)
        metrics[f"critic/loss_{k}"] = float(sum(losses))
        metrics[f"critic/grad_norm_{k}"] = float(gn)
        metrics["critic/vf_clipfrac"] = float(m["vf_clipfrac"])  # the last micro-batch of the last critic
    return metrics


def rollout_kw(cfg: Config) -> dict:
    """rollout_env's limits and sampling settings: an environment's turns and context, or one turn (a task)."""
    kw = dict(max_prompt_len=cfg.max_prompt_len, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature)
    kw.update(top_p=cfg.top_p, top_k=cfg.top_k)
    if cfg.data is None and is_env(cfg.task):
        return {**kw, "max_turns": cfg.max_turns, "max_context": cfg.max_context}
    return {**kw, "max_turns": 1, "max_context": cfg.max_prompt_len + cfg.max_new_tokens}


def env_overrides(cfg: Config, split: str) -> dict:
    """EnvConfig overrides of an embedded environment: the step latency (log-normal, sigma 0.5), not in evaluation."""
    if cfg.task.startswith("gem:") or split == "eval":
        return {}
    return {"latency_s": cfg.env_latency, "latency_sigma": 0.5 if cfg.env_latency else 0.0}


def evaluate(policy, tokenizer, episodes: list, cfg: Config, rank: int, world: int, eos_ids, autocast):
    """Greedy success (exact answer) on held-out episodes [(env, seed)], sharded over ranks and summed."""
    mine = episodes[rank::world]
    envs, seeds = [e for e, _ in mine], [s for _, s in mine]
    with autocast():
        hits = greedy_success(policy, tokenizer, envs, seeds, eos_ids, **rollout_kw(cfg))
    t = all_reduce_sum(torch.tensor([hits, len(mine)], dtype=torch.float64, device=policy.device))
    return (t[0] / t[1]).item()


TABLE = (
    "step rollout/reward_mean rollout/acc eval/acc rollout/response_len stats/kl stats/entropy stats/clipfrac "
    "loss/policy loss/value critic/explained_var stats/grad_norm perf/tokens_per_s"
).split()


def eos_mask_errors(response_ids, response_mask, eos_ids, max_len: int) -> float:
    """Share of responses whose mask breaks the stop-token rule (DESIGN.md 3): every run of mask-1 tokens (an
    action) ends at its first stop token, unless it is max_len tokens long (cut by the length limit).
    Catches EOS masked out (pad == eos with masks rebuilt from ids) and padding trained after EOS."""
    if response_mask.shape[0] == 0:
        return 0.0
    m = response_mask.bool()  # [B, R]
    stop = torch.isin(response_ids, torch.tensor(eos_ids, device=response_ids.device))  # [B, R]
    after_stop = (m[:, 1:] & m[:, :-1] & stop[:, :-1]).any(-1)  # [B] a trained token right after a stop token
    idx = torch.arange(m.shape[1], device=m.device).expand_as(m)  # [B, R]
    starts = m & ~torch.cat([torch.zeros_like(m[:, :1]), m[:, :-1]], 1)  # [B, R] first token of each run
    run_len = idx - torch.where(starts, idx, -1).cummax(-1).values + 1  # [B, R] length of the run so far
    ends = m & ~torch.cat([m[:, 1:], torch.zeros_like(m[:, :1])], 1)  # [B, R] last token of each run
    open_end = (ends & ~stop & (run_len < max_len)).any(-1)  # [B] an action ends early without a stop token
    return (after_stop | open_end).float().mean().item()


def make_autocast(cfg: Config, device):
    """A context factory: bf16 autocast for --dtype bfloat16 (weights stay fp32, detail 10), else a no-op."""
    if cfg.dtype == "bfloat16":
        return lambda: torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext


def train(cfg: Config, hooks=(), sampler=None) -> dict:
    """The RL loop. Returns the last metrics row plus the eval history ("eval_history": [(step, acc)]).

    sampler: None samples here, synchronously, with the current policy. Otherwise `sampler(step, policy)` returns
    (rollout with policy_version, episode infos, group_ids, metrics) from elsewhere (async_loop.py's rollout ranks).
    """
    rank, _, world, device = setup_dist(timeout_s=cfg.dist_timeout, device=cfg.device)
    if cfg.prompts_per_step % world:
        raise ValueError(f"config field 'prompts_per_step' = {cfg.prompts_per_step} must divide by world size {world}")
    n_local = cfg.prompts_per_step // world * cfg.group_size  # sequences per rank per step
    if n_local % cfg.minibatches:
        raise ValueError(f"config field 'minibatches' = {cfg.minibatches} must divide the {n_local} sequences per rank")
    torch.manual_seed(cfg.seed)  # identical init on every rank
    if cfg.dump_batch and world > 1:
        raise ValueError("config field 'dump_batch' needs world size 1 (the replay is one process, no DDP)")
    autocast = make_autocast(cfg, device)

    # --- models (policy, frozen reference, critics), tokenizer, task
    source = cfg.model or str(sft_warm_start(sft_config_for(cfg.task, cfg.sft_target)))
    policy, tokenizer = load_policy(cfg.resume + "/policy" if cfg.resume else source, device)
    ref, _ = load_policy(source, device)
    ref.requires_grad_(False)
    eos_ids = stop_token_ids(policy, tokenizer)
    anchor = repro.stale_anchor(cfg.inject, policy)  # computes old_logprobs: the policy (detail 2); INJECT
    multi_turn = cfg.data is None and is_env(cfg.task)  # an environment: rewards per turn, episodes
    task = None if multi_turn else make_task(cfg.task, cfg.data, cfg.reward)

    def episodes(split: str, n: int, rng, repeat: int = 1) -> list:
        """n x repeat episodes [(env, seed)]: a group of `repeat` per env seed (or single-turn problem)."""
        if not multi_turn:
            return [(TaskEnv(task, p), None) for p in task.sample(n, split, rng) for _ in range(repeat)]
        seeds = [int(x) for x in rng.integers(2**31, size=n)]
        return [(make_env(cfg.task, split, **env_overrides(cfg, split)), s) for s in seeds for _ in range(repeat)]

    if cfg.data is not None and cfg.model is None and rank == 0:
        print("[minrl] WARNING --data without --model trains the character-level tiny model on your text")
    ddp = world > 1
    policy_train = torch.nn.parallel.DistributedDataParallel(policy) if ddp else policy
    opt = torch.optim.AdamW(policy.parameters(), lr=cfg.lr, eps=cfg.adam_eps, weight_decay=0.0)
    critics = None
    if cfg.adv_estimator == "gae":  # M = 1 is plain PPO; AsyPPO trains M critics on disjoint shares
        n_critics = cfg.n_critics if cfg.critic == "asyppo" else 1
        models = [
            make_value_model(policy, cfg.critic_model, tokenizer, cfg.critic_depth).to(device) for _ in range(n_critics)
        ]
        critics = Critics(models, lr=cfg.critic_lr, adam_eps=cfg.adam_eps, ddp=ddp)
    kl_ctrl = KLController(cfg.kl_coef, cfg.kl_ctrl, cfg.kl_target, cfg.kl_horizon)

    # --- random streams: task sampling and the sampler use seed + rank; minibatch shuffling is shared
    rng = np.random.default_rng(cfg.seed + rank)
    sample_gen = torch.Generator(device=device).manual_seed(cfg.seed + rank)
    shuffle_gen = torch.Generator().manual_seed(cfg.seed)
    part_gen = torch.Generator().manual_seed(cfg.seed + rank)  # AsyPPO partition: its own stream
    gens = {"sample_gen": sample_gen, "shuffle_gen": shuffle_gen, "part_gen": part_gen}
    eval_set = episodes("eval", cfg.eval_n, np.random.default_rng(12345))  # same held-out set for all seeds
    start, history = 0, {"eval": []}
    if cfg.resume:
        st, streams = load_checkpoint(cfg.resume, rank)  # this rank's own streams
        opt.load_state_dict(st["opt"])
        if critics is not None:
            critics.load(cfg.resume, st)
        restore_streams(streams, rng, gens)
        kl_ctrl.beta, start, history = st["kl_beta"], st["step"], json.loads(st["history"])
        saved = json.loads(st["config"])  # the lr is recomputed every iteration from these fields
        moved = [k for k in SCHEDULE_FIELDS if saved.get(k) != getattr(cfg, k)]
        if moved and rank == 0:  # documented, logged: e.g. --steps raised to extend a run
            changes = ", ".join(f"{k} {saved.get(k)} -> {getattr(cfg, k)}" for k in moved)
            print(f"[minrl] resume: {changes}: the lr schedule continues on the new values", flush=True)
    out_dir = Path(cfg.out_dir)
    logger = MetricsLogger(out_dir, TABLE, enabled=rank == 0, tensorboard=cfg.tensorboard, start_step=start)
    if rank == 0:
        (out_dir / "config.json").write_text(json.dumps(asdict(cfg), indent=1))
        print(
            f"[minrl] {cfg.adv_estimator} on {cfg.task if multi_turn else task.name}, world {world}, device {device}, "
            "policy "
            f"{sum(p.numel() for p in policy.parameters()) / 1e6:.2f}M params, {n_local} sequences/rank/step"
        )

    metrics, footprint, diag = {}, {}, LiveDiagnoser()
    if critics is not None:  # critic params and training memory vs one actor-sized critic (one micro-batch)
        ids = torch.full((cfg.micro_batch, cfg.max_prompt_len + cfg.max_new_tokens), eos_ids[0], device=device)
        footprint = critic_footprint(critics.models, policy, ids, torch.ones_like(ids), cfg.max_new_tokens)
        if rank == 0:
            print("[minrl] critics:", ", ".join(f"{k.split('/')[1]} {v:.4g}" for k, v in footprint.items()))
    if cfg.eval_every and start == 0 and cfg.steps > 0:  # the starting point, before any update
        history["eval"].append((0, evaluate(policy, tokenizer, eval_set, cfg, rank, world, eos_ids, autocast)))
        if rank == 0:
            print(f"[minrl] eval/acc before training: {history['eval'][0][1]:.3f}")
    for step in range(start, cfg.steps):
        t0 = time.perf_counter()
        update_actor = step >= cfg.critic_warmup_steps  # critic-only iterations first (critics.py detail 8)
        sched = (cfg.warmup_steps, cfg.lr_schedule, cfg.min_lr_ratio)
        actor_step = step - cfg.critic_warmup_steps  # the actor's schedule starts at its first step (lr 0 before)
        for group in opt.param_groups:
            group["lr"] = cfg.lr * lr_factor(actor_step, cfg.steps - cfg.critic_warmup_steps, *sched)
        if critics is not None:
            for o in critics.opts:
                for group in o.param_groups:
                    group["lr"] = cfg.critic_lr * lr_factor(step, cfg.steps, *sched)

        # --- rollout: G episodes per prompt or env seed (the group is rank-local); rewards come from the envs
        sampled = {}  # the sampler's own metrics (staleness, drops)
        if sampler is None:
            envs, seeds = zip(*episodes("train", n_local // cfg.group_size, rng, repeat=cfg.group_size))
            group_ids = torch.arange(n_local, device=device) // cfg.group_size + rank * n_local  # [B]
            with autocast():
                ro, eps = rollout_env(policy, tokenizer, envs, seeds, eos_ids, generator=sample_gen, **rollout_kw(cfg))
        else:
            ro, eps, group_ids, sampled = sampler(step, policy)
        ro = repro.at_rollout(cfg.inject, ro, eos_ids[0])  # INJECT pad_eq_eos
        t1 = time.perf_counter()

        # --- rewards: each turn's at its last action token (single-turn: the task score at the stop token)
        texts = decode_responses(tokenizer, ro)
        token_scores = ro.token_scores  # [B, R]
        acc = torch.tensor([float(e["success"]) for e in eps], device=device)  # [B] exact answers / solved
        if cfg.no_eos_penalty is not None:  # detail 5: the whole return of a truncated episode is replaced
            penalty = last_valid(ro.response_mask).float() * cfg.no_eos_penalty  # [B, R]
            token_scores = torch.where(ro.truncated[:, None], penalty, token_scores)
        token_scores = repro.at_scores(cfg.inject, ro, token_scores)  # INJECT reward_scale, eos_unmasked
        scores = token_scores.sum(-1)  # [B] episode return
        token_scores = repro.at_score_placement(cfg.inject, ro.response_mask, token_scores, scores)  # INJECT
        t2 = time.perf_counter()

        # --- old logprobs (PPO anchor), reference logprobs, values: no gradient
        R = ro.response_ids.shape[1]
        batch = {
            "input_ids": ro.input_ids,
            "attention_mask": ro.attention_mask,
            "response_mask": ro.response_mask,
            "kl_beta": kl_ctrl.beta,
            "policy_version": ro.policy_version,  # [B] or None: the weights version each sample started with
        }
        with torch.no_grad(), autocast():
            batch["old_logprobs"] = trainer_logprobs(cfg, anchor, ro.input_ids, ro.attention_mask, R)[0]  # [B, R]
            batch["ref_logprobs"] = trainer_logprobs(cfg, ref, ro.input_ids, ro.attention_mask, R)[0]  # [B, R]
            repro.resync_anchor(anchor, policy)  # INJECT stale_old_logprobs: re-synced only after its use
            all_values = critics.values(ro.input_ids, ro.attention_mask, R, cfg.micro_batch) if critics else None
        mask = ro.response_mask.float()  # [B, R]
        behav_gap = (ro.rollout_logprobs - batch["old_logprobs"]).abs()  # [B, R] sampler vs trainer recompute
        fresh = mask if ro.policy_version is None else mask * (ro.policy_version == step)[:, None]  # same weights
        behav_diff = {"stats/rollout_vs_old_logp_diff": float(masked_mean(behav_gap, fresh))} if fresh.any() else {}
        # (a) behav: the clip anchored at the behaviour policy (DESIGN.md 7.4); KL and checks keep old_logprobs
        batch["clip_anchor"] = ro.rollout_logprobs if cfg.off_policy == "behav" else None
        batch["is_weights"], off_stats = off_policy_weights(
            batch["old_logprobs"], ro.rollout_logprobs, mask, cfg.off_policy, cfg.is_cap, cfg.is_mask_cap
        )  # [B, R] or None: (b) tis, (c) decoupled
        if ro.policy_version is not None:  # async: the gap of every sample, staleness included
            off_stats["stats/behav_vs_old_logp_diff"] = float(masked_mean(behav_gap, mask))
        values = all_values.mean(0) * mask if all_values is not None else None  # [B, R] ensemble mean

        # --- token rewards and advantages, then the extension hooks
        token_rewards, adv, returns, kl = compute_advantages(cfg, batch, token_scores, group_ids, values)
        batch.update(advantages=adv, returns=returns)
        if critics is not None:
            batch["old_values"] = all_values.transpose(0, 1)  # [B, M, R] batch-first for minibatching
            batch["shares"] = partition_shares(group_ids, len(critics.models), part_gen)  # [B, M]
            # a value target per critic, R^(m) = GAE(V_m) + V_m; for M = 1 that is `returns` already
            if len(all_values) > 1:
                per_critic = [gae(token_rewards, v * mask, mask, cfg.gamma, cfg.lam)[1] for v in all_values]
                batch["critic_returns"] = torch.stack(per_critic, 1)  # [B, M, R]
            else:
                batch["critic_returns"] = returns[:, None]  # [B, 1, R]
        shaped = shape_advantages(cfg, batch, policy, all_values)

        # --- update
        args = (cfg, policy_train, opt, critics, batch, world, shuffle_gen, autocast, update_actor)
        if cfg.dump_batch == step + 1:  # --dump-batch: save the update's inputs, run it, add its outcome
            prompts = tokenizer.batch_decode(ro.prompt_ids, skip_special_tokens=True)
            texts_in = {"prompts": prompts, "responses": texts, "scores": scores.cpu()}
            extra = {"update_actor": update_actor, "token_rewards": token_rewards.cpu(), **texts_in}
            inputs, run = repro.update_inputs(policy, opt, critics, shuffle_gen), functools.partial(ppo_update, *args)
            dump = out_dir / f"batch-{step + 1}.pt"
            upd = repro.dump_update(dump, cfg, policy, opt, critics, inputs, batch, extra, run)
        else:
            upd = ppo_update(*args)
        if cfg.kl_in_reward:  # adaptive controller: batch mean of per-sequence mean KL, n = sequences
            seq_kl = (kl.sum(-1) / mask.sum(-1).clamp(min=1)).mean().item()
            kl_ctrl.update(float(reduce_metrics({"kl": seq_kl}, device)["kl"]), n_local * world)
        t3 = time.perf_counter()

        # --- metrics (reduced over ranks), eval, hooks, checkpoint
        n_tok = mask.sum()
        full = torch.tensor([not e["context_cut"] for e in eps], device=device)  # [B] no action cut by max_context
        max_len = cfg.max_new_tokens
        _, group_std, group_n = _group_stats(scores, group_ids)  # [B] per sample; singletons count as not equal
        m = {
            "rollout/reward_mean": scores.mean().item(),
            "rollout/reward_std": scores.std().item(),
            "rollout/acc": acc.mean().item(),
            "rollout/response_len": mask.sum(-1).mean().item(),
            "rollout/truncated_frac": ro.truncated.float().mean().item(),
            "rollout/zero_std_frac": ((group_std < 1e-8) & (group_n > 1)).float().mean().item(),
            "rollout/turns": float(np.mean([e["turns"] for e in eps])),
            "rollout/episode_cut_frac": float(np.mean([e["cut"] for e in eps])),  # ended without terminating
            "rollout/malformed": float(np.mean([e["malformed"] for e in eps])),  # malformed actions per episode
            "stats/eos_mask_err_frac": eos_mask_errors(ro.response_ids[full], ro.response_mask[full], eos_ids, max_len),
            "stats/kl": float(masked_mean(kl, mask)),
            "stats/kl_coef": kl_ctrl.beta,
            "stats/lr": opt.param_groups[0]["lr"],  # the policy's lr this iteration (warm-up, schedule)
            **behav_diff,  # numerics only: stale samples differ by design (absent when every sample is stale)
            "stats/adv_abs_mean": float(masked_mean(adv.abs(), mask)),
            "stats/return_mean": float(masked_mean(returns, mask)),
            "stats/return_std": float(masked_var(returns, mask).sqrt()),
            "stats/score_std": scores.std().item(),
            "stats/token_reward_kl_abs": float(masked_mean((batch["kl_beta"] * kl).abs(), mask))
            if cfg.kl_in_reward
            else 0.0,
            **upd,
            **shaped,
            **off_stats,
            **sampled,
            "perf/tokens_per_s": n_tok.item() / (t3 - t0),
            "time/rollout": t1 - t0,
            "time/reward": t2 - t1,
            "time/env": float(sum(sum(e["env_s"]) for e in eps)),  # inside env.step (part of time/rollout)
            "time/train": t3 - t2,
        }
        if "time/credit" in shaped:  # attention credit: its extra forward as a share of the step
            m["perf/credit_overhead"] = shaped["time/credit"] / (t3 - t0)
        if device.type == "cuda":
            m["perf/max_mem_allocated_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
        if critics is not None:
            m.update(value_stats(values, returns, mask, all_values, batch["critic_returns"]))
            m.update(footprint)
            m["loss/value"] = float(np.mean([v for k, v in upd.items() if k.startswith("critic/loss_")]))
        m = reduce_metrics(m, device)
        if cfg.eval_every and ((step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps):
            m["eval/acc"] = evaluate(policy, tokenizer, eval_set, cfg, rank, world, eos_ids, autocast)
            history["eval"].append((step + 1, m["eval/acc"]))
        logger.log(step + 1, m)
        for finding in diag.update(step + 1, m) if rank == 0 else []:  # the checks of diagnose.py, live
            print(f"[minrl] WARNING {finding}", flush=True)
            if cfg.strict:
                raise RuntimeError(f"--strict: stopping at step {step + 1} on {finding}")
        for h in hooks:
            h(step + 1, m)
        metrics = m
        if cfg.save_every and (step + 1) % cfg.save_every == 0:
            ckpt = {
                "policy": policy,
                "tokenizer": tokenizer,
                "critics": critics,
                "opt": opt,
                "rng": rng,
                "kl_ctrl": kl_ctrl,
            }
            save(cfg, out_dir / f"ckpt-{step + 1}", step + 1, ckpt, gens, history, rank)
    result = {**metrics, "eval_history": history["eval"]}
    if rank == 0:  # what experiments read back (runlog.run_trainer)
        (out_dir / "result.json").write_text(json.dumps(result))
    if rank == 0 and cfg.steps > start:
        plot_metrics(out_dir / "metrics.jsonl", ["rollout/reward_mean", "eval/acc", "stats/kl"], out_dir / "curves.png")
    return result


def save(cfg, path, step: int, ckpt: dict, gens: dict, history: dict, rank: int) -> None:
    """Checkpoint (runlog.save_checkpoint): policy and critics as safetensors, optimizer states, the KL
    controller, the eval history and the config in state.pt, every rank's random streams in rank{r}.pt."""
    state = {
        "step": step,
        "opt": ckpt["opt"].state_dict(),
        "kl_beta": ckpt["kl_ctrl"].beta,
        "history": json.dumps(history),
        "config": json.dumps(asdict(cfg)),
    }
    models = {"policy": ckpt["policy"]}
    if ckpt["critics"] is not None:
        models.update({f"critic_{k}": m for k, m in enumerate(ckpt["critics"].models)})
        state.update(ckpt["critics"].state())
    save_checkpoint(path, rank, models, state, stream_states(ckpt["rng"], gens), ckpt["tokenizer"])


# ------------------------------------------------------------------------------------------------
# Deterministic replay of one update: --dump-batch STEP writes batch-STEP.pt, --replay FILE re-runs it


def replay(path: str) -> tuple[dict | None, bool]:
    """Re-run the update saved in `path` (set a breakpoint in ppo_update to step through it). Returns its
    metrics and whether it equals the original: same metrics and state digest, or the same error."""
    from transformers import AutoConfig, AutoModelForCausalLM

    d = torch.load(path, weights_only=True, map_location="cpu")
    saved = json.loads(d["config"])  # a subclass's fields (async_loop.AsyncConfig) do not enter the update
    names = {f.name for f in fields(Config)}  # older dumps lack newer fields: those take their defaults
    cfg = Config(**{**{k: v for k, v in saved.items() if k in names}, "dump_batch": 0, "replay": None})
    _, _, _, device = setup_dist(device=cfg.device)
    model_config = json.loads(d["model_config"])
    policy = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_config.pop("model_type"), **model_config))
    policy.load_state_dict(d["policy"])
    policy.to(device).eval()
    opt = torch.optim.AdamW(policy.parameters(), lr=cfg.lr, eps=cfg.adam_eps, weight_decay=0.0)
    opt.load_state_dict(d["opt"])
    critics = None
    if d["critics"]:
        models = [make_value_model(policy, cfg.critic_model, None, cfg.critic_depth) for _ in d["critics"]]
        for m, state in zip(models, d["critics"]):
            m.load_state_dict(state)
            m.to(device)
        critics = Critics(models, lr=cfg.critic_lr, adam_eps=cfg.adam_eps, ddp=False)
        for o, state in zip(critics.opts, d["critic_opts"]):
            o.load_state_dict(state)
    gen = torch.Generator()
    gen.set_state(d["shuffle_gen"])
    batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in d["batch"].items()}
    torch.set_rng_state(d["torch_rng"])  # last: building the models above draws from the global RNG
    metrics, error = None, None
    try:
        metrics = ppo_update(cfg, policy, opt, critics, batch, 1, gen, make_autocast(cfg, device), d["update_actor"])
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    digest = repro.state_digest(policy, opt, critics) if error is None else None
    return metrics, repro.report_replay(path, d, metrics, error, digest)


def main(argv=None):
    cfg = parse_config(Config, argv)
    if cfg.replay:
        sys.exit(0 if replay(cfg.replay)[1] else 1)
    out = train(cfg)
    if int(__import__("os").environ.get("RANK", "0")) == 0 and out["eval_history"]:
        print("eval accuracy by step:", ", ".join(f"{s}: {a:.3f}" for s, a in out["eval_history"]))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
