"""The trainer Config's checks across fields: one table of (bad, why), each why naming the field and the fix.

    python checks.py runs/a/config.json       # a run's saved config against every check: the ones it fails

Each concept's Args class checks its own fields (cli.check_fields, in its __post_init__); what no single class
can check, because it ties fields of several concepts together, is here. trainer.Config runs `check_config(cfg)`
after its concepts' checks and its derived values; the first check that fails raises ValueError("config field
<why>"). `RANGES` holds the allowed intervals of PPO's own fields (cli.check_fields); `sequences_per_rank(cfg,
world)` the checks that need the world size, at the start of a run. This file sits above the concept files (it
reads envs.py's and tasks.py's names) and below the trainer.
"""

from __future__ import annotations

import argparse
import functools
import json
from types import SimpleNamespace

import numpy as np

from cli import check_range
from envs import ENVS, multi_turn
from tasks import TASKS, answer_text, make_task
from warm_start import sft_target_for

RANGES = {  # allowed interval -> trainer.Config's own fields, checked at construction (cli.check_fields)
    "[0, inf)": ("steps", "warmup_steps", "lr", "kl_coef", "kl_loss_coef", "ent_coef", "seed", "kl_metric_every"),
    "[1, inf)": ("prompts_per_step", "group_size", "ppo_epochs", "minibatches", "micro_batch"),
    "(0, inf)": ("clip_high", "value_clip", "adam_eps", "grad_clip", "loss_scale_factor"),
    "[0, 1]": ("gamma", "lam", "min_lr_ratio"),
    "(0, 1]": ("sft_target",),
    "(0, 1)": ("clip_low",),
    "(1, inf)": ("dual_clip",),
    "(-inf, inf)": ("no_eos_penalty",),
}


def action_tokens(cfg) -> int:
    """The longest scripted action of cfg's embedded environment, in tokens (0: not an embedded env)."""
    return getattr(ENVS.get(cfg.task), "action_tokens", 0)


def answer_tokens(cfg) -> int:
    """The longest answer + EOS among 256 problems of cfg's procedural task, in the embedded tokenizer's tokens (a
    byte each): 0 for the user's data, an environment, or a model of one's own (its tokenizer may differ)."""
    if cfg.data is not None or cfg.model is not None or cfg.task not in TASKS:
        return 0
    return longest_answer(cfg.task) + 1


@functools.cache
def longest_answer(task: str) -> int:
    """Bytes of the longest answer among 256 training problems of a procedural task (measured once per process:
    countdown's solver takes 0.2 s for them)."""
    return max(len(answer_text(p).encode()) for p in make_task(task).sample(256, "train", np.random.default_rng(0)))


def one_advantage_per_sequence(cfg) -> bool:
    """An estimator and credit that give each sequence one advantage (GMPO's geometric mean needs it)."""
    return cfg.adv_estimator not in ("gae", "reinforce_plus_plus") and cfg.credit == "none"


CHECKS = (  # (bad(cfg), why(cfg)), in the order they are checked
    (
        lambda c: c.data is None and not c.task.startswith("gem:") and c.task not in TASKS + tuple(ENVS),
        lambda c: f"'task' = {c.task!r}: must be one of {[*TASKS, *ENVS]} or gem:<id>",
    ),
    (
        lambda c: c.task.startswith("gem:") and c.data is None and c.model is None,
        lambda c: f"'task' = {c.task!r}: a gem environment needs --model (it has no SFT solver)",
    ),
    (
        lambda c: c.min_lr_ratio and c.lr_schedule != "cosine",
        lambda c: f"'min_lr_ratio' = {c.min_lr_ratio} needs lr_schedule 'cosine' (a constant lr has no floor)",
    ),
    (
        lambda c: c.critic == "asyppo" and c.group_size % c.n_critics,
        lambda c: f"'group_size' = {c.group_size} must divide by n_critics = {c.n_critics}",
    ),
    (
        lambda c: c.critic_warmup_steps and c.adv_estimator != "gae",
        lambda c: (
            f"'critic_warmup_steps' = {c.critic_warmup_steps} needs adv_estimator 'gae', "
            f"not {c.adv_estimator!r} (it has no critic)"
        ),
    ),
    (
        lambda c: c.critic_warmup_steps and c.critic_warmup_steps >= c.steps,
        lambda c: (
            f"'critic_warmup_steps' = {c.critic_warmup_steps} >= steps = {c.steps}: "
            "the actor would never update (lower it)"
        ),
    ),
    (
        lambda c: c.critic == "asyppo" and c.adv_estimator != "gae",
        lambda c: (
            f"'critic' = 'asyppo' needs adv_estimator 'gae', not {c.adv_estimator!r}: "
            f"{c.adv_estimator} has no critic, the flag would do nothing"
        ),
    ),
    (
        lambda c: c.kl_ctrl == "adaptive" and not c.kl_in_reward,
        lambda c: (
            "'kl_ctrl' = 'adaptive' needs --kl-in-reward: the controller adapts the KL-in-reward "
            "coefficient (the KL loss' kl_loss_coef is fixed)"
        ),
    ),
    (
        lambda c: c.adv_estimator not in ("gae", "reinforce_plus_plus") and c.group_size < 2,
        lambda c: f"'group_size' = {c.group_size}: {c.adv_estimator} needs >= 2",
    ),
    (
        lambda c: c.loss_mode == "geo_mean" and not one_advantage_per_sequence(c),
        lambda c: (
            "'loss_mode' = 'geo_mean' needs one advantage per sequence (GMPO): adv_estimator grpo, rloo "
            f"or reinforce_plus_plus_baseline and no credit, not {c.adv_estimator!r} / {c.credit!r}"
        ),
    ),
    (
        lambda c: c.prompts_per_step * c.group_size < 2,
        lambda c: (
            f"'prompts_per_step' x 'group_size' = {c.prompts_per_step * c.group_size}: "
            "a batch needs >= 2 samples (reward std, whitening)"
        ),
    ),
    (
        lambda c: c.lora_merge and not c.save_final,
        lambda c: "'lora_merge' needs --save-final: it shapes that folder alone",
    ),
    (
        lambda c: multi_turn(c) and c.max_new_tokens < action_tokens(c),
        lambda c: (
            f"'max_new_tokens' = {c.max_new_tokens}: {c.task}'s actions need {action_tokens(c)} tokens (raise it)"
        ),
    ),
    (
        lambda c: c.max_new_tokens < answer_tokens(c),  # else every answer is cut before its end and scores ~0
        lambda c: (
            f"'max_new_tokens' = {c.max_new_tokens}: {c.task}'s answers need up to {answer_tokens(c)} tokens with "
            f"EOS in 256 problems, longer in others (raise it: --max-new-tokens {1 << answer_tokens(c).bit_length()})"
        ),
    ),
    (
        lambda c: getattr(c, "env_url", None) and not multi_turn(c),  # (configs saved before it: none)
        lambda c: f"'env_url' needs a multi-turn environment as --task, not {c.task!r}",
    ),
    (
        lambda c: (c.fsdp or c.lora_rank) and (c.dump_batch or c.credit != "none" or c.inject),
        lambda c: (
            "'fsdp' / 'lora_rank' do not combine with dump_batch, credit or inject yet (one process, whole models)"
        ),
    ),
    (
        lambda c: c.fsdp and c.rollout_dtype != "float32" and c.rollout_engine == "hf",
        lambda c: f"'rollout_dtype' = {c.rollout_dtype!r} needs whole weights to copy: not with --fsdp yet",
    ),
)


def failed(cfg) -> list[str]:
    """The why of every check `cfg` fails, in order (empty: all pass)."""
    return [why(cfg) for bad, why in CHECKS if bad(cfg)]


def derive(cfg) -> None:
    """The trainer Config's fields derived from others, where left at None: the entropy bonus (1e-3 with AsyPPO's
    entropy filter), the SFT warm start's target, the constant C of seq-mean-token-sum-norm; and max_context, which a
    multi-turn run needs above max_prompt_len."""
    if cfg.ent_coef is None:
        cfg.ent_coef = 1e-3 if cfg.critic == "asyppo" and cfg.adv_estimator == "gae" else 0.0
    cfg.sft_target = sft_target_for(cfg.task) if cfg.sft_target is None else cfg.sft_target
    if multi_turn(cfg):  # single-turn runs use max_prompt_len + max_new_tokens
        check_range("max_context", cfg.max_context, cfg.max_prompt_len + 1)
    if cfg.loss_agg == "seq-mean-token-sum-norm" and cfg.loss_scale_factor is None:
        cfg.loss_scale_factor = cfg.max_context if multi_turn(cfg) else cfg.max_new_tokens


def check_config(cfg) -> None:
    """Raise ValueError("config field <why>") for the first check `cfg` fails."""
    for bad, why in CHECKS:
        if bad(cfg):
            raise ValueError(f"config field {why(cfg)}")


def sequences_per_rank(cfg, world: int) -> int:
    """Sequences each rank samples per iteration; the batch split must be exact (and a dump needs one process)."""
    n_local = cfg.prompts_per_step // world * cfg.group_size
    if cfg.prompts_per_step % world:
        raise ValueError(f"config field 'prompts_per_step' = {cfg.prompts_per_step} must divide by world size {world}")
    if n_local % cfg.minibatches:
        raise ValueError(f"config field 'minibatches' = {cfg.minibatches} must divide the {n_local} sequences per rank")
    if cfg.dump_batch and world > 1:
        raise ValueError(f"config field 'dump_batch' needs world size 1, not {world} (the replay is one process)")
    return n_local


def main(argv=None) -> None:
    """`python checks.py CONFIG_JSON`: the checks a run's saved config (out_dir/config.json) fails, or ok."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config", help="a run's config.json (trainer.py writes it to its out_dir)")
    args = ap.parse_args(argv)
    with open(args.config) as f:
        cfg = SimpleNamespace(**json.load(f))
    bad = failed(cfg)
    print("\n".join(f"config field {why}" for why in bad) if bad else f"{args.config}: all {len(CHECKS)} checks pass")


if __name__ == "__main__":
    main()
