"""PPO and GRPO for causal LMs with veRL's semantics: the math, one update, the training loop. New here? README.md
first; docs/design.md explains the loop and each group of flags below, docs/metrics.md every logged metric.

    python trainer.py                                     # PPO (critic + GAE) on the embedded tiny model, CPU
    python trainer.py --adv-estimator grpo --task calc    # GRPO (a group baseline, no critic), multi-turn tool use
    python trainer.py --model PATH_OR_HUB_ID --data my.jsonl --reward math_exact   # your model, data and reward
    torchrun --standalone --nproc_per_node=2 trainer.py   # data parallel: gloo on CPU, nccl on GPU

One iteration, train()'s numbered stanzas (docs/design.md 4): 1 rollout, G episodes per prompt -> 2 rewards -> 3 old
logprobs (the PPO anchor), reference logprobs, values -> 4 the Batch: token rewards, advantages (GAE then
whitening, or a group baseline), off-policy weights and rejections, token weights and masks -> 5 ppo_epochs x
minibatches of the policy loss (PPO's clip, or a family of offpolicy.py) (+ value loss), gradients accumulated over
micro-batches -> 6 metrics, eval, checkpoint.

Equations (PPO eq. 7; GAE eq. 16; GRPO sec. 4.1; Dr. GRPO; RLOO; Schulman's k1-k3; veRL 0.9.1 core_algos):
  GAE      delta_t = r_t + gamma V_{t+1} - V_t,  A_t = delta_t + gamma lam A_{t+1}   (masked t pass through)
  GRPO     A_i = (s_i - mean_g) / (std_g + eps), std unbiased, singleton mean 0, std 1;  RLOO  s_i - mean_{j!=i}
  Dr. GRPO A_i = s_i - mean_g;  L = sum_i sum_t l_it / (n_seqs C), C a constant (loss_agg seq-mean-token-sum-norm)
  clip     L = max(-A r, -A clip(r, 1 - eps_lo, 1 + eps_hi)); dual clip (A < 0): L = min(L, -c A)
  value    L_V = 0.5 max((V - R)^2, (clip(V, V_old +- eps_v) - R)^2)
  KL       x = logp - ref: k1 = x, k2 = x^2 / 2, k3 = exp(-x) + x - 1

Implementation details (deviations from veRL marked "ours")
1. Models run with dropout off (`.eval()`). old_logprobs are the trainer's recompute before the update, with the
   sampling temperature; `stats/rollout_vs_old_logp_diff` is their mean gap to the sampler's. ours: an exactly
   on-policy update (reuses_anchor) takes them from its first forward instead, bit for bit the same (as TRL does);
   the reference runs only for a KL term or, every kl_metric_every iterations, for stats/kl.
2. Under DDP the loss denominator is global (`sum_local(mask l) / all_reduce(sum mask) * W`): DDP's average is the
   single-process gradient of the global minibatch. Whitening (GAE only) and the logged metrics are global (pooled
   over every rank's samples and tokens); GRPO groups are rank-local.
3. A truncated response (no EOS within max_new_tokens) keeps its mask and score, unless no_eos_penalty is set.
4. ours: the aggregation denominator is clamped at 1 (an empty minibatch gives 0, not NaN); advantages, returns
   are 0 at masked positions (veRL leaves pass-through values there).
5. Extension points: the advantage estimator; `Batch.token_weights`, `pg_mask`, `ent_mask` after whitening
   (shape_advantages; masks multiply per-token terms, the denominator counts every valid token); the critics;
   `train(cfg, hooks=[fn(step, metrics)])`; the live diagnosis; the bug injections (repro.planted wraps the run:
   a bug replaces a function the loop calls through its module, `ppo_math.gae(...)`, `rollout.rollout_env(...)`,
   `rollout.sync_weights(...)`, or one of this file's helpers by its global name; so never `from x import f` a
   function a bug may replace).
6. ours: the embedded default starts from an SFT warm start (warm_start.py), its recipe measured in RESULTS.md;
   KL is off in the reward and as a loss (as in veRL), stats/kl logged every kl_metric_every iterations.
7. `--dtype bfloat16` autocasts; weights and AdamW state stay fp32. CPU runs are bitwise reproducible for a seed
   and thread count, resumed runs too (every RNG stream is checkpointed), and so is a replay (replay.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import checkpoint
import checks
import common
import env_client
import memory
import offpolicy
import ppo_math
import repro
import rollout
import tasks
import vllm_engine
from attention_credit import CreditArgs, credit_weights
from checkpoint import RunArgs, check_resume, resume_checkpoint, run_fingerprint, save_checkpoint, save_policy
from checks import sequences_per_rank
from cli import check_fields, parse_config
from common import DistArgs, make_autocast, masked_mean, masked_whiten
from critics import CriticArgs, Critics, asyppo_masks, critic_targets, make_critics, partition_shares, value_stats
from data import DataArgs, DataTask, load_task
from diagnose import LiveDiagnoser, verl_aliases
from envs import EnvArgs, multi_turn, rollout_kw, sample_episodes
from evaluation import EvalArgs, evaluate, evaluate_all, first_action_mask, held_out, rollout_metrics, score_stats
from lora import LoraArgs, adapters_off, add_adapters, params_line
from memory import Batch, MemoryArgs, clipped_step, critics_footprint, host_floats
from offpolicy import OffPolicyArgs
from repro import ReproArgs
from rewards import RewardArgs
from rollout import SampleArgs, last_valid
from runlog import MetricsLogger, stopping_cleanly, write_result
from tasks import TaskArgs, load_policy
from warm_start import sft_config_for, sft_warm_start

ESTIMATORS = ("gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")  # Config.adv_estimator


@dataclass
class Config(TaskArgs, DataArgs, RewardArgs, SampleArgs, EvalArgs, CriticArgs, CreditArgs, OffPolicyArgs, EnvArgs,
             MemoryArgs, LoraArgs, DistArgs, RunArgs, ReproArgs):  # fmt: skip
    """The trainer's knobs: the algorithm, its scale and loss here; each other concept's in its Args class (--help)."""

    help_first = ("TaskArgs", "Config", "DataArgs", "RewardArgs", "SampleArgs", "EvalArgs", "RunArgs", "DistArgs")

    adv_estimator: Literal[ESTIMATORS] = "gae"
    """How a response's advantage is computed: gae (PPO, with a critic), or from its group's scores without a critic:
    grpo | rloo | reinforce_plus_plus[_baseline] (offpolicy.py)."""
    steps: int = 90
    """Number of RL iterations."""
    prompts_per_step: int = 32
    """Prompts per iteration, over all ranks (must divide by the world size)."""
    group_size: int = 4
    """Responses sampled per prompt (G)."""
    lr: float = 2e-4
    """Policy learning rate (AdamW)."""
    warmup_steps: int = 20
    """Linear learning-rate warm-up (iterations), for policy and critic."""
    lr_schedule: Literal["constant", "cosine"] = "cosine"
    """After the warm-up: constant, or a cosine decay towards min_lr_ratio * lr (reached one step after the last)."""
    min_lr_ratio: float = 0.0
    """Cosine schedule: the floor of the decay as a share of lr (and critic_lr)."""
    adam_eps: float = 1e-8
    """AdamW's epsilon (added after the square root of the second moment, as PyTorch does)."""
    ppo_epochs: int = 2
    """Passes over each batch."""
    minibatches: int = 2
    """Optimizer steps per epoch (the batch is split into this many shuffled minibatches)."""
    micro_batch: int = 128
    """Sequences per forward/backward (gradient accumulation inside a minibatch)."""
    clip_low: float = 0.2
    """How far below 1 the PPO ratio may go before it is clipped (ratio >= 1 - clip_low)."""
    clip_high: float = 0.2
    """How far above 1 the PPO ratio may go before it is clipped (ratio <= 1 + clip_high; > clip_low: clip-higher)."""
    dual_clip: float | None = 3.0
    """Bounds the loss of a token with a negative advantage A at c * |A| (dual clip, c > 1; None = off)."""
    value_clip: float = 0.5
    """How far a value estimate may move from its old one before its loss is clipped (value clip epsilon)."""
    gamma: float = 1.0
    """Discount of future rewards in GAE (1 = none)."""
    lam: float = 1.0
    """GAE's lambda: 1 = the full return minus the value, 0 = one-step TD errors."""
    grpo_norm_std: bool = True
    """GRPO: divide each advantage by its group's score std (Dr. GRPO does not: --no-grpo-norm-std --loss-agg
    seq-mean-token-sum-norm)."""
    loss_agg: Literal[ppo_math.AGG_MODES] = "token-mean"
    """How per-token losses become one number: a mean over all tokens, or per sequence first (veRL's modes;
    seq-mean-token-sum-norm divides each sequence's token sum by loss_scale_factor)."""
    loss_scale_factor: int | None = None
    """C dividing a sequence's token sum in seq-mean-token-sum-norm (None = max_new_tokens; multi-turn max_context)."""
    kl_in_reward: bool = False
    """Penalise drifting from the reference model in the reward: beta * KL(old || ref) (k1) is subtracted from
    every token's reward."""
    kl_coef: float = 0.001
    """Initial beta of the KL-in-reward penalty."""
    kl_ctrl: Literal["fixed", "adaptive"] = "fixed"
    """How that beta changes: fixed, or adaptive towards a KL target (target 0.1, horizon 10000, veRL's defaults)."""
    kl_loss: bool = False
    """Penalise drifting from the reference model in the loss: kl_loss_coef * agg(KL(current || ref)) is added
    (GRPO style)."""
    kl_loss_coef: float = 0.001
    """Coefficient of the KL loss."""
    kl_loss_type: Literal["k1", "k2", "k3"] = "k3"
    """The KL loss's per-token estimate, x the logprob gap: k1 = x, k2 = x^2 / 2, k3 = exp(-x) + x - 1."""
    ent_coef: float | None = None
    """Weight of the entropy bonus, which keeps sampling from becoming deterministic (None = 0, or 1e-3 with
    --critic asyppo so its entropy filter acts)."""
    grad_clip: float = 1.0
    """Largest gradient norm: a larger gradient is scaled down to it (policy and critics)."""
    reuse_old_logprobs: bool = True
    """Save a forward when the update is exactly on-policy: the old logprobs are the first training forward's, detached,
    not a separate forward (same numbers). Only with one epoch of one minibatch and no off-policy correction, KL in
    the reward, credit or injection. On: TRL's way; --no-reuse-old-logprobs: veRL's."""
    kl_metric_every: int = 1
    """Run the reference model for the logged stats/kl every this many iterations if no KL term needs it (0 = never)."""
    no_eos_penalty: float | None = None
    """Not a switch: the score of a response that reached max_new_tokens without EOS (None = it keeps its score)."""
    seed: int = 0
    """Random seed (each rank samples with seed + rank)."""
    strict: bool = False
    """Stop the run (every rank) when the live diagnosis (diagnose.py) flags a failure mode."""

    def __post_init__(self):
        repro.apply_stated_config(self)  # first: an injection's stated config fills fields left at their default
        check_fields(self, checks.RANGES)  # PPO's own fields (a None derived below passes)
        for base in [b for b in Config.__bases__ if "__post_init__" in vars(b)]:  # each concept's checks, its own
            base.__post_init__(self)
        checks.derive(self)  # the fields derived from others (None defaults), once, printed with the config
        if self.data is not None and self.model is None and os.environ.get("RANK", "0") == "0":
            print("[minrl] WARNING --data without --model trains the 0.53M-parameter embedded model: a dry run")
        checks.check_config(self)  # the checks across fields (checks.py)
        if self.resume:  # the checkpoint's config against this one, at load: before a warm start for its task is built
            check_resume(self.resume, self)


def sample_here(
    cfg, step, policy, *, engine, tokenizer, eos_ids, task, make_env, rng, gen, autocast, rank, n_local, sampling
):
    """train()'s sampler when none is given: G episodes per prompt or env seed (a rank-local group), sampled by
    `engine` (the policy, its --rollout-dtype copy, or a vLLM Engine; synced first) with `sampling`, rollout_env's
    limits and settings (envs.rollout_kw). Returns (rollout, episode infos, group_ids [B], {"time/sync": s})."""
    n, G = n_local // cfg.group_size, cfg.group_size
    envs, seeds = zip(*sample_episodes(task, cfg.task, "train", n, rng, G, cfg.env_latency, make_env))
    group_ids = torch.arange(n_local, device=gen.device) // G + rank * n_local  # [B]
    # the policy's weights into the sampler, which runs under the trainer's autocast (hf) or in its own dtype (vllm)
    with vllm_engine.sampling(engine, policy, autocast) as (model, sample, synced):
        samples, episodes = rollout.rollout_env(model, tokenizer, envs, seeds, eos_ids, **sampling, generator=gen,
                                                sample=sample)  # fmt: skip
    return samples, episodes, group_ids, synced


def release(task, engine) -> None:
    """The end of a run: what it started outside its loop stops (--data's reward workers, a vLLM engine)."""
    if isinstance(task, DataTask):
        task.close()
    vllm_engine.release(engine)


def episode_rewards(cfg: Config, samples):
    """Stanza 2: (the rollout, its token rewards [B, R], each episode's return [B]): the environment's rewards, each
    turn's at its last action token; a truncated episode's whole return replaced by no_eos_penalty (detail 3)."""
    token_scores = samples.token_scores  # [B, R]
    if cfg.no_eos_penalty is not None:
        penalty = last_valid(samples.response_mask).float() * cfg.no_eos_penalty  # [B, R]
        token_scores = torch.where(samples.truncated[:, None], penalty, token_scores)
    return samples, token_scores, token_scores.sum(-1)


def trainer_logprobs(cfg: Config, model, input_ids, attention_mask, R: int, with_entropy=False, micro_batch=None):
    """The trainer's logprobs (and entropies, with grad for an entropy bonus) [B, R] with the sampling temperature
    (detail 1), the LM head in chunks of logit_chunk tokens (rollout.py detail 4), micro_batch rows per forward
    (default cfg.micro_batch): old, ref, loss."""
    logprob_fn = rollout.sequence_logprobs
    logprob_fn = partial(common.collective, logprob_fn) if cfg.fsdp else logprob_fn  # FSDP2: gathers, a dead rank named
    chunks = {"entropy_grad": cfg.ent_coef > 0, "logit_chunk": cfg.logit_chunk}
    chunks.update(temperature=cfg.temperature, micro_batch=micro_batch or cfg.micro_batch, with_entropy=with_entropy)
    return logprob_fn(model, input_ids, attention_mask, R, **chunks)


def compute_advantages(cfg: Config, token_scores, response_mask, old_logp, ref_logp, kl_beta, group_ids, values):
    """Token rewards, advantages and returns [B, R] (whitened for GAE only, docs/design.md 5.1), the k1 KL [B, R] (0 if
    old_logp or ref_logp is None: KL in the reward needs both) and their metrics. token_scores: [B] one outcome per
    sequence, placed on its last valid token, or [B, R] the environment's rewards already placed (each turn's at its
    last action token); one on a masked token is an error."""
    mask = response_mask.float()
    if token_scores.dim() == 1:
        token_scores = last_valid(mask).float() * token_scores[:, None]  # [B, R]
    if token_scores.shape != mask.shape:
        raise ValueError(f"scores of shape {tuple(token_scores.shape)}: expected [B] or [B, R] = {tuple(mask.shape)}")
    if (token_scores * (1 - mask)).abs().sum() > 0:
        raise ValueError("a reward sits on a masked token (mask 0): it would be lost; place it on an action token")
    if cfg.kl_in_reward and (old_logp is None or ref_logp is None):
        raise ValueError("KL in the reward needs old and reference logprobs before the update (got None)")
    both = old_logp is not None and ref_logp is not None
    kl = ppo_math.kl_estimate(old_logp, ref_logp, "k1") * mask if both else torch.zeros_like(mask)  # [B, R]
    token_rewards = ppo_math.kl_reward(token_scores, kl, kl_beta) if cfg.kl_in_reward else token_scores.clone()
    seq_score = token_rewards.sum(-1)  # [B] veRL: an outcome estimator's score is the sum of token rewards
    if cfg.adv_estimator == "gae":
        adv, returns = ppo_math.gae(token_rewards, values, mask, cfg.gamma, cfg.lam)
        adv = masked_whiten(adv, mask, global_=True) * mask  # detail 2: global statistics
    elif cfg.adv_estimator == "reinforce_plus_plus":  # offpolicy.py 4: whitened returns-to-go (global statistics)
        adv, returns = ppo_math.reinforce_pp_advantages(token_rewards, mask, cfg.gamma)
    elif cfg.adv_estimator == "reinforce_plus_plus_baseline":
        adv = returns = ppo_math.reinforce_pp_baseline_advantages(seq_score, group_ids, mask)
    else:
        if cfg.adv_estimator == "grpo":
            seq_adv = ppo_math.group_advantages(seq_score, group_ids, norm_std=cfg.grpo_norm_std)
        else:
            seq_adv = ppo_math.rloo_advantages(seq_score, group_ids)
        adv = returns = seq_adv[:, None] * mask  # [B, R] broadcast over valid tokens
    mean = lambda x: float(masked_mean(x, mask, global_=True))  # noqa: E731  (token statistics of all ranks)
    metrics = {"stats/adv_abs_mean": mean(adv.abs()), "stats/return_mean": mean(returns)}
    metrics["stats/return_std"] = float(common.masked_var(returns, mask, global_=True).sqrt())
    metrics["stats/token_reward_kl_abs"] = mean((kl_beta * kl).abs()) if cfg.kl_in_reward else 0.0
    return token_rewards, adv, returns, kl, metrics


def shape_advantages(cfg: Config, response_mask, advantages, all_values, gen, gamma=None):
    """After whitening (detail 5): (token_weights (attention credit's gamma), pg_mask, ent_mask (AsyPPO; gen: ties))
    [B, R], metrics. gamma = 1 where A < 0 with credit_nonneg_only (attention_credit.py detail 6)."""
    weights, pg_mask, ent_mask, metrics = torch.ones_like(advantages), response_mask, response_mask, {}
    if cfg.adv_estimator == "gae" and cfg.critic == "asyppo":  # AsyPPO: masks from the critics' disagreement
        pg_mask, ent_mask, metrics = asyppo_masks(all_values, response_mask, cfg.asyppo_k, cfg.asyppo_h, gen)
    if (gamma is None) != (cfg.credit == "none"):
        raise ValueError(
            f"credit = {cfg.credit!r} with gamma {'None' if gamma is None else 'given'}: pass credit's gamma"
        )
    if gamma is not None:  # attention-based token credit: gamma_t multiplies A_t in the loss
        weights = torch.where(advantages < 0, weights, gamma) if cfg.credit_nonneg_only else gamma
    return weights, pg_mask, ent_mask, metrics


def ppo_update(cfg, policy_train, opt, critics, batch: Batch, world: int, gen, autocast, update_actor=True) -> dict:
    """ppo_epochs x minibatches optimizer steps of the policy (and critics) on one batch; the mean metrics.
    update_actor=False (critic warm-up): the policy loss is computed for its metrics only, without grad or step.
    batch.old_logprobs None (reuse_old_logprobs): the first forward's logprobs, detached, fill it and clip_anchor."""
    B, micro_rows, step_rows, first, own = batch.input_ids.shape[0], [], [], [], batch.old_logprobs is None
    if batch.old_logprobs is None and cfg.ppo_epochs * cfg.minibatches > 1:
        raise ValueError("a batch without old_logprobs needs ppo_epochs = minibatches = 1 (reuse_old_logprobs)")
    if cfg.kl_loss and batch.ref_logprobs is None:
        raise ValueError("kl_loss needs the batch's ref_logprobs (the reference pass: needs_reference)")
    for epoch in range(cfg.ppo_epochs):
        perm = torch.randperm(B, generator=gen) if cfg.minibatches > 1 else torch.arange(B)
        for j, rows_j in enumerate(perm.tensor_split(cfg.minibatches)):  # B not a multiple (a proxy batch): no row lost
            mb = batch.rows(rows_j)
            where, plan = f"epoch {epoch} minibatch {j}", mb.micro_batches(cfg)  # the critics' too
            rows, row, logps = policy_step(cfg, policy_train, opt, mb, world, autocast, update_actor, where, plan)
            first = first or rows  # the first minibatch, before any optimizer step: the ratio must be 1
            if batch.old_logprobs is None:  # one epoch of one minibatch, in order: the batch's anchor
                batch.old_logprobs = batch.clip_anchor = logps
            if critics is not None:
                row.update(critic_update(cfg, critics, mb, world, autocast, plan))
            micro_rows += rows
            step_rows.append(row)
    host_floats(micro_rows + step_rows)  # the update's one device-to-host copy
    devs = [r.pop("ratio_dev") for r in micro_rows]
    keys = {k for r in micro_rows + step_rows for k in r}
    out = {k: float(np.mean([r[k] for r in micro_rows + step_rows if k in r])) for k in keys}
    if not own:  # the ratio at the first minibatch (before any step) must be 1; own anchor: 1 by construction
        out["stats/first_mb_clipfrac"] = max([0.0, *(r["stats/clipfrac"] for r in first)])
        out["stats/first_mb_ratio_dev"] = max([0.0, *devs[: len(first)]])
    return {**out, "stats/ratio_max": max(r["stats/ratio_max"] for r in micro_rows)}


def policy_step(cfg: Config, policy_train, opt, mb: Batch, world, autocast, update_actor, where: str, plan=None):
    """One optimizer step of the policy on a minibatch, gradients accumulated over its micro-batches (plan:
    memory.micro_batches). Returns each micro-batch's stats (0-d tensors; its max |ratio - 1| as "ratio_dev"), the
    step's losses and gradient norm, and the minibatch's logprobs [b, R] (detached; None unless the batch has no
    anchor: then they are its anchor)."""
    mask, plan = mb.loss_mask, plan or mb.micro_batches(cfg)
    # every kept token, pg_mask or not
    denom = ppo_math.agg_denominator(mask, cfg.loss_agg, scale=cfg.loss_scale_factor)
    agg = {"mode": cfg.loss_agg, "denom": denom, "world": world}
    pg_agg = offpolicy.policy_agg(cfg.loss_mode, cfg.loss_agg)  # sapo, geo_mean: per sequence (veRL)
    pg_denom = denom if pg_agg == cfg.loss_agg else ppo_math.agg_denominator(mask, pg_agg)
    clip = {"kind": cfg.loss_mode, "clip_low": cfg.clip_low, "clip_high": cfg.clip_high, "dual_clip": cfg.dual_clip}
    clip.update({"tau_pos": cfg.sapo_tau_pos, "tau_neg": cfg.sapo_tau_neg, "agg": cfg.loss_agg})
    losses, rows, logps = {}, [], None if mb.old_logprobs is not None else torch.zeros_like(mask)
    for n, (idx, lo, r) in enumerate(plan):
        mi = mb.part(idx, lo, r)  # [b, lo:P + r] tokens, [b, r] response
        mmask = mi.loss_mask  # [b, r]
        sync = n == len(plan) - 1 or not isinstance(policy_train, DDP)  # DDP all-reduces on the last one (FSDP2: each)
        no_sync = contextlib.nullcontext() if sync else policy_train.no_sync()
        with no_sync, autocast(), torch.set_grad_enabled(update_actor):
            ids, b = mi.input_ids, mi.input_ids.shape[0]  # one forward per micro-batch (its graph is kept anyway)
            logp, ent = trainer_logprobs(cfg, policy_train, ids, mi.attention_mask, r, with_entropy=True, micro_batch=b)
            old = logp.detach() if mi.old_logprobs is None else mi.old_logprobs  # (reuse_old_logprobs)
            anchor = old if mi.clip_anchor is None else mi.clip_anchor
            # the shaped advantage gamma_t A_t (attention credit; ones otherwise)
            adv = mi.advantages if mi.token_weights is None else mi.advantages * mi.token_weights
            shaping = {"pg_mask": mi.pg_mask.float(), "is_weights": mi.is_weights}
            pg, m = offpolicy.policy_loss(logp, anchor, adv, mmask, **clip, **shaping, denom=pg_denom, world=world)
            ent_loss = ppo_math.aggregate(ent * mi.ent_mask.float(), mmask, **agg)  # I^H_t H_t: AsyPPO's entropy filter
            terms = {"loss/policy": pg, "loss/entropy": ent_loss}
            if mi.ref_logprobs is not None:  # an iteration with the reference pass (needs_reference)
                terms["loss/kl"] = ppo_math.aggregate(
                    ppo_math.kl_estimate(logp, mi.ref_logprobs, cfg.kl_loss_type), mmask, **agg
                )
            loss = pg + (cfg.kl_loss_coef * terms["loss/kl"] if cfg.kl_loss else 0.0)
            if cfg.ent_coef > 0:  # the entropy term joins the graph only when it is used
                loss = ppo_math.entropy_bonus(loss, ent_loss, cfg.ent_coef)
        if update_actor:  # DDP all-reduces inside backward: common.collective names a rank that never joins it
            common.collective(loss.backward)
        for k, v in terms.items():  # a micro-batch's loss is its share of the minibatch's (summed in fp64)
            losses[k] = losses.get(k, 0.0) + v.detach().double()
        rows.append({f"stats/{k}": v.detach() for k, v in m.items()})  # 0-d tensors, detached: no graph kept
        rows[-1]["stats/entropy"] = masked_mean(ent.detach(), mmask)
        rows[-1]["ratio_dev"] = ((logp.detach() - old).exp() - 1).abs().mul(mmask).max()
        if logps is not None:
            logps[idx, :r] = logp.detach()
    gn = clipped_step(policy_train, opt, cfg.grad_clip, f"policy at {where}", step=update_actor)
    return rows, {"stats/grad_norm": gn, **losses}, logps


def critic_update(cfg: Config, critics: Critics, mb: Batch, world: int, autocast, plan=None) -> dict:
    """One optimizer step per critic on a minibatch (micro-batches: plan, as the policy's): critic m on its share's
    rows, the clipped value loss (7.1) to its own target R^(m) over its share's tokens, in old_values' precision
    (autocast: the clip is centred there)."""
    metrics, dev, plan = {}, mb.response_mask.device, plan or mb.micro_batches(cfg)
    clipped = torch.zeros(2, dtype=torch.float64, device=dev)  # [clipped, valid] tokens
    for k, (model, opt) in enumerate(zip(critics.train_models, critics.opts)):
        mask = mb.response_mask.float() * mb.shares[:, k, None]  # [b, R] critic k's rows only
        # critic k's tokens, all ranks
        denom = ppo_math.agg_denominator(mask, cfg.loss_agg, scale=cfg.loss_scale_factor)
        loss_args, losses = {"clip": cfg.value_clip, "agg": cfg.loss_agg, "denom": denom, "world": world}, []
        for idx, lo, r in plan:
            mi = mb.part(idx, lo, r)
            mmask = mi.response_mask.float() * mi.shares[:, k, None]  # [b, r]
            with autocast():
                values, old = model(mi.input_ids, mi.attention_mask, r), mi.old_values[:, k]  # [b, r]
            loss, m = ppo_math.value_loss(values, old, mi.critic_returns[:, k], mmask, **loss_args)
            common.collective(loss.backward)  # (DDP: as in policy_step)
            losses.append(loss.detach())
            n = mmask.sum().double()
            clipped += torch.stack([m["vf_clipfrac"].double() * (n + 1e-8), n])  # masked_mean^-1, no host sync
        gn = clipped_step(model, opt, cfg.grad_clip, f"critic {k}")
        metrics.update({f"critic/loss_{k}": sum(losses), f"critic/grad_norm_{k}": gn})  # 0-d: host_floats
    clipped = common.all_reduce_sum(clipped)  # the tokens of every critic and rank
    return {**metrics, "critic/vf_clipfrac": clipped[0] / clipped[1].clamp(min=1)}


def set_learning_rates(cfg: Config, step: int, opt, critics) -> bool:
    """Set this iteration's lr of policy and critics; whether the actor updates (not in the critic-only warm-up)."""
    sched = (cfg.warmup_steps, cfg.lr_schedule, cfg.min_lr_ratio)
    for group in opt.param_groups:
        group["lr"] = cfg.lr * ppo_math.lr_factor(
            step - cfg.critic_warmup_steps, cfg.steps - cfg.critic_warmup_steps, *sched
        )
    for group in [g for o in (critics.opts if critics else []) for g in o.param_groups]:
        group["lr"] = cfg.critic_lr * ppo_math.lr_factor(step, cfg.steps, *sched)
    return step >= cfg.critic_warmup_steps


def reuses_anchor(cfg: Config) -> bool:
    """reuse_old_logprobs applies: one epoch of one minibatch in order (its first forward sees the sampling weights,
    bit for bit the recompute; within rounding under micro_batch_tokens, whose micro-batches have other widths), and
    nothing needs the anchor before the update (KL in the reward, tis / decoupled weights, behav, attention
    credit's pass); injections keep the recompute (several are planted on it)."""
    alone = cfg.off_policy == "none" and not cfg.kl_in_reward and cfg.credit == "none"
    alone = alone and cfg.rollout_is is None and cfg.rollout_rs is None
    return cfg.reuse_old_logprobs and cfg.ppo_epochs == cfg.minibatches == 1 and alone and not cfg.inject


def anchor_logprobs(cfg: Config, anchor, ref, input_ids, attention_mask, response_mask, step: int):
    """Stanza 3's logprobs [B, R]: old_logprobs, the PPO anchor (None when the update's first forward gives it:
    reuses_anchor), the reference's (None off its cadence: needs_reference), and attention credit's gamma [B, R] and
    metrics (its maps taken inside the recompute's forward, not in a pass of their own)."""
    R, plan = response_mask.shape[1], {"rows": cfg.micro_batch, "tokens": cfg.micro_batch_tokens}
    recompute = lambda: trainer_logprobs(cfg, anchor, input_ids, attention_mask, R)[0]  # noqa: E731

    def by_tokens(model):
        """The model's logprobs [B, R], micro-batched as the update is (micro_batch_tokens: its budget and one forward
        per micro-batch, so every rank runs as many: under FSDP2 each is a collective)."""

        def logprobs(ids, mask, r):
            return trainer_logprobs(cfg, model, ids, mask, r, micro_batch=memory.forward_rows(ids, **plan))[0]

        return memory.by_micro_batches(logprobs, input_ids, attention_mask, R, **plan, response_mask=response_mask)

    old, gamma, credit = None, None, {}
    if cfg.credit == "attention":  # its maps are taken in one pass over the batch: micro_batch rows at a time
        batch = (input_ids, attention_mask, response_mask)
        old, gamma, credit = credit_weights(cfg, anchor, *batch, cfg.micro_batch, recompute)
    elif not reuses_anchor(cfg):
        old = by_tokens(anchor)
    with adapters_off(ref, cfg.lora_rank > 0):  # LoRA: the reference is the policy's base (lora.py)
        ref_logp = by_tokens(ref) if needs_reference(cfg, step) else None
    if cfg.fsdp and ref_logp is not None:  # FSDP2's root keeps its gathered weights for a backward that never comes
        ref.reshard()
    return old, ref_logp, gamma, credit


def critic_values(cfg: Config, critics: Critics, input_ids, attention_mask, response_mask):
    """[M, B, R] every critic's values, no gradient, micro-batched as the update is (micro_batch_tokens too)."""
    plan = {"rows": cfg.micro_batch, "tokens": cfg.micro_batch_tokens}
    values = lambda ids, mask, r: critics.values(ids, mask, r, memory.forward_rows(ids, **plan))  # noqa: E731
    R = response_mask.shape[1]
    return memory.by_micro_batches(values, input_ids, attention_mask, R, **plan, response_mask=response_mask)


def needs_reference(cfg: Config, step: int) -> bool:
    """The reference's forward at this iteration: every one for a KL term, every kl_metric_every for stats/kl."""
    return cfg.kl_in_reward or cfg.kl_loss or (cfg.kl_metric_every > 0 and step % cfg.kl_metric_every == 0)


def make_batch(cfg: Config, samples, token_scores, group_ids, logps: tuple, all_values, values, kl_beta, critics, gens):
    """Stanza 4: the Batch (off-policy weights and rejections, token rewards and advantages, token weights and
    masks), the token rewards, returns and k1 KL [B, R], and their metrics. logps: (old_logprobs, ref_logprobs,
    attention credit's gamma) [B, R] each or None; all_values [M, B, R] and values [B, R]: None without critics."""
    old_logprobs, ref_logprobs, gamma = logps
    response_mask = samples.response_mask  # [B, R]
    behav = samples.rollout_logprobs  # [B, R] the sampler's logprobs
    mask = response_mask.float()  # [B, R]
    is_weights, loss_mask, off_stats = offpolicy.corrections(cfg, old_logprobs, behav, mask)  # weights, rejections
    token_rewards, adv, returns, kl, adv_stats = compute_advantages(
        cfg, token_scores, response_mask, old_logprobs, ref_logprobs, kl_beta, group_ids, values
    )
    weights, pg_mask, ent_mask, shaped = shape_advantages(
        cfg, response_mask, adv, all_values, gens["shuffle_gen"], gamma
    )
    batch = Batch(
        input_ids=samples.input_ids, attention_mask=samples.attention_mask, response_mask=response_mask,
        loss_mask=loss_mask, old_logprobs=old_logprobs,
        clip_anchor=behav if cfg.off_policy == "behav" else old_logprobs, ref_logprobs=ref_logprobs,  # (a) behav
        advantages=adv, token_weights=weights, pg_mask=pg_mask, ent_mask=ent_mask, is_weights=is_weights,
        old_values=all_values.transpose(0, 1) if critics else None,  # [B, M, R] batch-first for minibatches
        critic_returns=critic_targets(cfg, token_rewards, all_values, mask, returns) if critics else None,
        shares=partition_shares(group_ids, len(critics.models), gens["part_gen"]) if critics else None,  # [B, M]
    )  # fmt: skip
    return batch, token_rewards, returns, kl, {**adv_stats, **shaped, **off_stats}


def logprob_stats(cfg: Config, old_logprobs, ref_logprobs, samples, episodes, step: int, multi: bool) -> dict:
    """Stanza 6's logprob metrics: stats/kl (old vs reference, on an iteration with its pass) and the sampler's gap
    to the trainer (offpolicy.gap_stats; multi, a multi-turn run: the first turn's too). old_logprobs: the batch's
    (reuse: the update's first forward filled them)."""
    mask, m = samples.response_mask.float(), {}  # [B, R]
    if ref_logprobs is not None:
        kl = ppo_math.kl_estimate(old_logprobs, ref_logprobs) * mask  # [B, R]
        m["stats/kl"] = float(masked_mean(kl, mask, global_=True))
    first = first_action_mask(episodes, samples.response_mask) if multi else None  # [B, R] the first turn's
    behav = samples.rollout_logprobs  # [B, R] the sampler's logprobs
    return {
        **m,
        **offpolicy.gap_stats(old_logprobs, behav, mask, samples.policy_version, step, cfg.reports_gap(), first),
    }


def build_models(cfg: Config, source: str, device, world: int):
    """(policy (the checkpoint's on resume), the module it trains through (DDP's replica, or itself: alone or sharded
    by FSDP2), AdamW, frozen reference (with LoRA the policy itself, adapters off), tokenizer, stop ids, critics, the
    run's fingerprint (checkpoint.py: a resume is refused unless its checkpoint has the same))."""
    torch.manual_seed(cfg.seed)  # identical init on every rank
    whole = cfg.resume and not (cfg.fsdp or cfg.lora_rank)  # else the source, then the shards or adapters on it
    policy, tokenizer = load_policy(cfg.resume + "/policy" if whole else source, device)
    ref, ref_tokenizer = (policy, tokenizer) if cfg.lora_rank else load_policy(source, device)
    fingerprint = run_fingerprint(cfg, world, source, ref, ref_tokenizer)
    if cfg.resume:  # before anything trains: same model, tokenizer, data, estimator, layout, world size, config
        check_resume(cfg.resume, cfg, fingerprint)
    bf16 = cfg.dtype == "bfloat16" and device.type == "cuda"  # FSDP2's compute weights (fp32 on CPU)

    def prepare(model, fp32=()):  # checkpointing first: FSDP2 shards around the checkpointed layers
        if cfg.grad_checkpointing:
            memory.checkpoint_layers(model)  # memory.py: each decoder layer's activations recomputed in backward
        return common.shard_or_replicate(model, world, cfg.fsdp, bf16, fp32=fp32)

    gae_critics = cfg.adv_estimator == "gae"  # M = 1 critic for PPO, M mini-critics for AsyPPO
    wrap = lambda m: prepare(m, fp32=[m.head])  # noqa: E731 (the value head in fp32: critics.py detail 5)
    critics = make_critics(cfg, policy, tokenizer, device, adam_eps=cfg.adam_eps, wrap=wrap) if gae_critics else None
    if cfg.lora_rank:  # lora.py: adapters only train; on resume the checkpoint's (FSDP2's: in its shards)
        torch.manual_seed(cfg.seed)  # A's init the same on every rank, whether the warm start was built just now or not
        add_adapters(policy, cfg, cfg.resume + "/policy" if cfg.resume and not cfg.fsdp else None)
    elif cfg.fsdp:  # the reference frozen and sharded too (in place: `ref` is the sharded module)
        common.shard_or_replicate(ref.requires_grad_(False), world, True, bf16)
    else:
        ref.requires_grad_(False)
    policy_train = prepare(policy)
    trained = [p for p in policy.parameters() if p.requires_grad]  # LoRA: the adapters only
    opt = torch.optim.AdamW(trained, lr=cfg.lr, eps=cfg.adam_eps, weight_decay=0.0)
    eos_ids = tasks.stop_token_ids(policy, tokenizer)
    return policy, policy_train, opt, ref, tokenizer, eos_ids, critics, fingerprint


def open_run_log(cfg: Config, task, policy, start: int, rank: int, world: int, device, n_local: int) -> MetricsLogger:
    """The run's metrics logger (the printed columns; TensorBoard and W&B get veRL's names too, val-core/<source>
    with the data's source), its folder (opened by rank 0, then cfg.out_dir on every rank), config.json, header."""
    table = "step rollout/reward_mean rollout/acc eval/acc rollout/response_len stats/kl stats/entropy stats/clipfrac"
    table += " loss/policy loss/value critic/explained_var stats/grad_norm perf/tokens_per_s"  # the printed columns
    name = cfg.task if task is None else task.name
    logger = MetricsLogger.of(
        cfg, table.split(), rank == 0, start, partial(verl_aliases, source=getattr(task, "source", name))
    )
    folder = [str(logger.dir) if rank == 0 else None]
    if world > 1:  # every rank writes its checkpoint files there
        torch.distributed.broadcast_object_list(folder)
    cfg.out_dir = folder[0]
    if rank == 0:
        (Path(cfg.out_dir) / "config.json").write_text(json.dumps(asdict(cfg), indent=1))
        where = f"{cfg.adv_estimator}, {name}, world {world}, {device}"
        print(f"[minrl] {where}, {params_line(policy, cfg.lora_rank)}, {n_local} seqs")
    return logger


def train(cfg: Config, hooks=(), sampler=None) -> dict:
    """The RL loop: the last metrics row plus "eval_history" [(step, acc)], also in out_dir/result.json. sampler:
    None samples here with the current policy; else `sampler(step, policy)` returns (rollout with policy_version,
    episode infos, group_ids, metrics) from elsewhere (async_loop.py's rollout ranks)."""
    with repro.planted(cfg.inject, sys.modules[__name__]):  # --inject: the bug's functions for the run
        # --- 0. processes, models (policy, frozen reference, critics), optimizer, random streams, resume
        rank, _, world, device = common.setup_dist(timeout_s=cfg.dist_timeout, device=cfg.device, group=cfg.fsdp)
        n_local, autocast = sequences_per_rank(cfg, world), make_autocast(cfg.dtype, device)
        sampling = rollout_kw(cfg)  # rollout_env's limits and sampling settings (envs.py)
        model = cfg.model or str(sft_warm_start(sft_config_for(cfg.task, cfg.sft_target)))  # the embedded: SFT first
        models = build_models(cfg, model, device, world)  # the policy, its optimizer, the reference, critics...
        policy, policy_train, opt, ref, tokenizer, eos_ids, critics, fingerprint = models
        multi = multi_turn(cfg)  # an environment's episodes (envs.py), not a single-turn task
        task = None if multi else load_task(cfg, tokenizer, device)  # a procedural task, or --data's rows
        kl_beta = cfg.kl_coef  # beta of KL in the reward (ppo_math.kl_controller)
        rng = np.random.default_rng(cfg.seed + rank)  # tasks and env seeds: seed + rank
        sample_gen = torch.Generator(device=device).manual_seed(cfg.seed + rank)  # the sampler: seed + rank
        shuffle_gen = torch.Generator().manual_seed(cfg.seed)  # minibatches: the same on every rank
        part_gen = torch.Generator().manual_seed(cfg.seed + rank)  # AsyPPO's partition: its own stream
        gens = {"sample_gen": sample_gen, "shuffle_gen": shuffle_gen, "part_gen": part_gen}  # (checkpointed)
        make_env = env_client.env_maker(cfg.env_url, cfg.env_timeout)  # make_env, or --env-url's RemoteEnvs
        eval_sets = held_out(task, cfg.task, cfg.eval_n, cfg.eval_samples, make_env)  # (greedy, sampled N times)
        start, history, diag = 0, {"eval": []}, LiveDiagnoser()
        if cfg.resume:  # checked in build_models; the lr is recomputed every iteration from the (allowed) config
            state = resume_checkpoint(cfg.resume, rank, policy, opt, critics, rng, gens, cfg.fsdp)
            start, history, kl_beta = state["step"], json.loads(state["history"]), state["kl_beta"]
            diag.load_state(state.get("diag", "{}"))  # the live diagnosis goes on from its baselines (older: anew)
        logger = open_run_log(cfg, task, policy, start, rank, world, device, n_local)  # and the run's folder
        out_dir, metrics, footprint = Path(cfg.out_dir), {}, {}
        if critics is not None and not cfg.fsdp:  # critic params and training memory vs an actor-sized one
            footprint = critics_footprint(cfg, critics, policy, eos_ids[0], n_local, device)
        if cfg.eval_every and start == 0 and cfg.steps > 0:  # the starting point, before any update
            with autocast(), common.gathered(policy):
                history["eval"].append((0, evaluate(policy, tokenizer, eval_sets[0], eos_ids, rank, world, **sampling)))
            if rank == 0:
                print(f"[minrl] eval/acc before training: {history['eval'][0][1]:.3f}")
        local = dict(engine=vllm_engine.sampling_engine(cfg, policy, model, sampler), tokenizer=tokenizer, task=task)
        local.update(eos_ids=eos_ids, make_env=make_env, rng=rng, gen=sample_gen, autocast=autocast, rank=rank)
        sampler = sampler or partial(sample_here, cfg, **local, n_local=n_local, sampling=sampling)  # None: here
        for step in range(start, cfg.steps):
            t0 = time.perf_counter()
            update_actor = set_learning_rates(cfg, step, opt, critics)

            # --- 1. rollout: G episodes per prompt or env seed, a rank-local group; rewards come from the envs
            samples, episodes, group_ids, sampled = sampler(step, policy)  # sampled: the sampler's own metrics
            group_ids = env_client.ungroup_failed(group_ids, episodes)  # --env-url: a failed episode joins no group
            t1 = time.perf_counter()

            # --- 2. rewards: each turn's at its last action token (a single-turn task's score at its stop token)
            samples, token_scores, scores = episode_rewards(cfg, samples)  # [B, R], [B] episode return
            response_mask = samples.response_mask  # [B, R]
            t2 = time.perf_counter()

            # --- 3. old logprobs (the PPO anchor), reference logprobs, values: no gradient
            ids, attn = samples.input_ids, samples.attention_mask  # [B, P+R] each
            mask = response_mask.float()  # [B, R]
            with torch.no_grad(), autocast():  # [B, R] each; None: given by the update's first forward, or not due
                old_logprobs, ref_logprobs, gamma, credit = anchor_logprobs(
                    cfg, policy, ref, ids, attn, response_mask, step
                )
                all_values = critic_values(cfg, critics, ids, attn, response_mask) if critics else None  # [M, B, R]
            values = all_values.mean(0) * mask if critics else None  # [B, R] the ensemble mean V̄

            # --- 4. the batch: off-policy weights, token rewards and advantages, then token weights and masks
            logps = (old_logprobs, ref_logprobs, gamma)  # [B, R] each, or None
            batch, token_rewards, returns, kl, stats = make_batch(
                cfg, samples, token_scores, group_ids, logps, all_values, values, kl_beta, critics, gens
            )

            # --- 5. update: ppo_epochs x minibatches; --dump-batch saves its inputs first, then its outcome (repro.py)
            dump = repro.dumping(cfg, step, out_dir, tokenizer, samples, token_rewards, scores)
            with dump(policy_train, opt, critics, batch, shuffle_gen, update_actor) as record:
                upd = ppo_update(cfg, policy_train, opt, critics, batch, world, shuffle_gen, autocast, update_actor)
                record["metrics"] = upd
            if cfg.kl_in_reward:  # adaptive controller: batch mean of per-sequence mean KL, n = sequences
                seq_kl = common.reduce_metrics({"kl": (kl.sum(-1) / mask.sum(-1).clamp(min=1)).mean().item()}, device)
                kl_beta = ppo_math.kl_controller(kl_beta, seq_kl["kl"], n_local * world, cfg.kl_ctrl)
            t3 = time.perf_counter()

            # --- 6. metrics (reduced over ranks), eval, live diagnosis, hooks, checkpoint
            m = {**score_stats(scores, group_ids), **stats, **upd, **credit, **sampled}
            m.update({**footprint, **rollout_metrics(samples, episodes, eos_ids, cfg.max_new_tokens)})
            m.update(logprob_stats(cfg, batch.old_logprobs, ref_logprobs, samples, episodes, step, multi))
            m.update({"stats/kl_coef": kl_beta, "stats/lr": opt.param_groups[0]["lr"], "time/rollout": t1 - t0})
            m.update({"perf/tokens_per_s": mask.sum().item() / (t3 - t0), "time/train": t3 - t2})
            if "time/credit" in credit:  # attention credit: what it adds to the recompute, as a share of the step
                m["perf/credit_overhead"] = credit["time/credit"] / (t3 - t0)
            if device.type == "cuda":
                m["perf/max_mem_allocated_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
            if critics is not None:
                m.update(value_stats(values, returns, mask, all_values, batch.critic_returns))
                m["loss/value"] = float(np.mean([v for k, v in upd.items() if k.startswith("critic/loss_")]))
            metrics = m = common.reduce_metrics(m, device)  # pooled over ranks; the last iteration's row is the result
            if cfg.eval_every and ((step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps):
                with autocast(), common.gathered(policy):
                    m.update(
                        evaluate_all(policy, tokenizer, eval_sets, eos_ids, cfg.eval_samples, rank, world, **sampling)
                    )
                history["eval"].append((step + 1, m["eval/acc"]))
            logger.log(step + 1, m)
            findings = diag.update(step + 1, m)  # diagnose.py, on every rank: one reduced row, so the same findings
            for finding in findings if rank == 0 else []:
                print(f"[minrl] WARNING {finding}", flush=True)
            if cfg.strict and findings:  # every rank stops at this step: none waits in a collective for the others
                raise RuntimeError(f"--strict: stopping at step {step + 1} on {findings[0]}")
            for h in hooks:
                h(step + 1, m)
            if cfg.save_every and (step + 1) % cfg.save_every == 0:  # models as safetensors, the rest in state.pt
                state = {"step": step + 1, "kl_beta": kl_beta, "history": json.dumps(history), "diag": diag.state()}
                ckpt = out_dir / f"ckpt-{step + 1}"  # atomic: ckpt-N.tmp, fsync, completion marker, rename
                save_checkpoint(ckpt, rank, fingerprint, state, policy, tokenizer, opt, critics, rng, gens)
        result = {**metrics, "eval_history": history["eval"]}
        logger.close()  # W&B's offline run folder complete
        if cfg.save_final:  # the policy as a save_pretrained folder (every rank: FSDP2 gathers it), LoRA's adapters
            save_policy(policy, tokenizer, out_dir / "policy", rank, asdict(cfg), cfg.lora_merge)
        release(task, local["engine"])  # the reward workers; a vLLM engine (under torchrun: the process group too)
        if rank == 0:  # result.json, curves.png
            write_result(out_dir, result, curves=cfg.steps > start, saved=cfg.save_final)
        return result


def main(argv=None):
    """`python trainer.py [flags]`: train and print the eval history."""
    cfg = parse_config(Config, argv)
    if cfg.dry_run_memory:  # the per-rank estimate of memory.py; nothing is loaded or trained
        world = int(os.environ.get("WORLD_SIZE", "1"))
        print(memory.report(memory.trainer_estimate(cfg, sequences_per_rank(cfg, world), world)))
        return
    checkpoint.check_out_dir(cfg.out_dir, cfg.overwrite, bool(cfg.resume))  # a run's folder: refused before loading
    with stopping_cleanly(cfg):  # Ctrl-C or SIGTERM: result.json and curves.png as far as the run got
        out = train(cfg)
    if int(os.environ.get("RANK", "0")) == 0 and out["eval_history"]:
        print("eval accuracy by step:", ", ".join(f"{s}: {a:.3f}" for s, a in out["eval_history"]))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
