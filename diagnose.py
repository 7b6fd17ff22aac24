"""Failure-mode diagnosis of an RL post-training run from its per-step metrics (numpy + stdlib, no torch).

    python diagnose.py runs/ppo/    # a run dir; or a .jsonl (ours, veRL's), a .csv, TRL's trainer_state.json

One line per failure mode found (stable id, step where it started, evidence, likely cause, what to try), then the
checks that ran and those skipped. Exit code 0: nothing flagged; 1: something flagged; 2: unreadable input (the
message names the file and line). Live: `diag = LiveDiagnoser()`; `diag.update(step, metrics)` returns what is new.

Implementation details (our choices):
1. NAME_MAP maps veRL and TRL GRPOTrainer names onto ours (checked against veRL's metric_utils.py, ray_trainer.py,
   dp_actor.py, TRL's grpo_trainer.py); not TRL's PPOTrainer, whose objective/kl is a sum.
2. A check is a condition on one step plus a bounded window of the past; a failure is reported once it holds on
   `<id>.persist` consecutive steps where the check could run, dated to the FIRST step of that streak, cleared
   after `clear_steps` steps without it. `diagnose(rows)` is `LiveDiagnoser` fed row by row; an update is O(window).
3. Levels are medians of `baseline_n` values. flat_reward = no progress since the start and no trend in the window
   (a plateau after a rise is convergence). A reward >= 0.9 reward_max (or accuracy >= 0.9) is saturated.
4. Non-finite values raise nan_inf and stay out of windows. Unknown columns are an input error only when NO column
   is known (veRL logs hundreds we do not use). Numbers written as text ("0.5", "nan") are read.
5. Files are streamed (memory: the table's few columns per step, not the file). A step is a whole number, never below
   the previous one (a second run appended to the same file is an input error, not a silent merge).
"""

from __future__ import annotations

import csv
import json
import math
import sys
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from statistics import median  # stdlib: faster than numpy on a window of ~20 values
from typing import NamedTuple

import numpy as np

from cli import check_fields, parse_config
from runlog import format_table


@dataclass
class Config:
    path: str = ""
    """run directory (with metrics.jsonl), .jsonl/.csv metrics file, or TRL trainer_state.json (or 1st positional)"""
    reward_max: float = 1.0
    """largest reward the task gives; a reward within a tenth of it counts as saturated"""

    def __post_init__(self):
        check_fields(self, {"(0, inf)": ("reward_max",)})


class Threshold(NamedTuple):
    name: str
    value: float
    why: str  # one named threshold, its reason


# The one table of thresholds; `<id>.persist` = consecutive steps a condition must hold before it is reported.
THRESHOLDS = (
    Threshold("window", 40, "trend/reference window: covers a 20-step lr warm-up and batch noise; fits CPU runs"),
    Threshold("baseline_n", 5, "values in a median level (start, recent) and least history for a reference median"),
    Threshold("clear_steps", 3, "steps without the condition before a reported failure clears (no flicker)"),
    Threshold("saturated_frac", 0.9, "reward >= 0.9 reward_max or acc >= 0.9: at the ceiling, not stuck"),
    Threshold(
        "flat_reward.window", 60, "a flat reward is judged on 60 steps: a healthy 40-step CPU run may not rise yet"
    ),
    Threshold("flat_reward.min_gain", 0.1, "a rise < 0.1 reward std (0.05 reward_max without std) is no progress"),
    Threshold("flat_reward.t_stat", 2.0, "a window slope under 2 standard errors is no trend (noise)"),
    Threshold("zero_variance_groups.frac", 0.75, "3/4 of groups all-equal: < 1/4 of the batch has any advantage"),
    Threshold("zero_variance_groups.persist", 3, "one batch of easy prompts happens; three in a row is a pattern"),
    # a reverse run (score std 0.22, 7 tokens, KL <= 0.5/token, beta 0.05-0.1) sits at 1-3; 0.01x scores ~100x lower
    Threshold("reward_scale.kl_ratio", 0.25, "score std < len*mean|beta*kl|/4: the KL term swamps the task signal"),
    Threshold("reward_scale.adv_tiny", 1e-2, "mean |adv| < 0.01 while groups differ: an unnormalised tiny reward"),
    Threshold("reward_scale.huge", 10.0, "|return| or return std > 10: beyond the O(1) scale of value heads/clip"),
    Threshold("reward_scale.value_err", 10.0, "sqrt(2 value loss) > 10x score std: the critic's noise rules"),
    Threshold("reward_scale.persist", 3, "KL is ~0 on the first steps; the ratio must stay low, not dip once"),
    Threshold("kl_blowup.max", 2.0, "KL > 2 nat/token: tokens ~7x likelier than the reference (default run: < 0.6)"),
    Threshold("kl_blowup.jump", 10.0, "KL 10x its median over the previous window: a jump, not a drift"),
    Threshold(
        "kl_blowup.jump_floor", 0.3, "jumps count above 0.3 nat/token only: healthy runs climb from 0 to 0.1-0.3"
    ),
    Threshold("kl_blowup.persist", 2, "one noisy batch can spike; two steps in a row"),
    Threshold("entropy_collapse.rel", 0.2, "entropy < 20% of its starting value: sampling is nearly greedy"),
    Threshold("entropy_collapse.abs", 0.01, "entropy < 0.01 nat/token: no exploration left"),
    Threshold("entropy_collapse.persist", 3, "entropy is noisy per batch; three steps in a row"),
    Threshold("entropy_blowup.rel", 2.0, "entropy > 2x its starting value + entropy_blowup.abs: sampling turns noise"),
    Threshold("entropy_blowup.abs", 0.5, "... + 0.5 nat/token: a low starting entropy may double in healthy runs"),
    Threshold("entropy_blowup.persist", 3, "entropy is noisy per batch; three steps in a row"),
    Threshold("reward_decline.window", 20, "a fall is judged on the last 20 steps (flat_reward's window is 60)"),
    Threshold("reward_decline.t_stat", 3.0, "a window slope below -3 standard errors: a fall, not noise"),
    Threshold("reward_decline.min_drop", 0.25, "and the recent level > 0.25 reward std below the start"),
    Threshold("reward_decline.persist", 3, "a 20-step window of noise crosses t = -3 now and then; a fall stays"),
    Threshold("sampler_precision_gap.min", 5e-4, "mean |dlogp| > 5e-4: fp32 ~1e-7; bf16 3e-3 (tiny model), 1e-2+"),
    Threshold("sampler_precision_gap.steady", 3.0, "and < 3x its start: a sampler that misses syncs grows instead"),
    Threshold("sampler_precision_gap.persist", 3, "a precision gap is there on every step"),
    Threshold("policy_frozen.kl_max", 1e-8, "|KL to the reference| < 1e-8: the policy still IS the reference"),
    Threshold("policy_frozen.persist", 5, "five steps with gradients in a row: any update (lr > 0) moves KL by more"),
    Threshold("template_drift.first_turn_share", 0.25, "first-turn gap < 1/4 of the whole (over logprob_mismatch's)"),
    Threshold("template_drift.persist", 2, "a re-tokenised history shows on every multi-turn batch"),
    Threshold("logprob_mismatch.first_mb_clipfrac", 1e-3, "ratio == 1 before the first step: any clipping is a bug"),
    Threshold("logprob_mismatch.first_mb_ratio_dev", 0.1, "max |ratio-1| there: ~1e-6 fp32, a few % bf16 at most"),
    # a sampling temperature of 0.7 missing on one side gives 0.08-0.26 (0.02-0.09 in probability)
    Threshold("logprob_mismatch.rollout_vs_old_logp_diff", 0.05, "mean |dlogp|: 1e-7 fp32, 0.01-0.03 bf16 sampler"),
    Threshold("logprob_mismatch.rollout_vs_old_prob_diff", 0.02, "veRL mean |dp|: ~0.003 bf16, ~0.012 fp8 sampler"),
    Threshold("logprob_mismatch.persist", 2, "old logprobs are recomputed each step; a bug shows every step"),
    Threshold("eos_mask.frac", 0.0, "any response whose mask does not end at its first EOS: masks are exact"),
    Threshold("eos_mask.persist", 2, "a masking bug shows on every batch"),
    Threshold("high_truncation.frac", 0.2, "a fifth of responses without EOS: their reward and mask are suspect"),
    Threshold("high_truncation.persist", 3, "early policies truncate briefly; three steps is a pattern"),
    Threshold("value_divergence.ev_min", -0.5, "explained variance < -0.5: far worse than a constant critic"),
    Threshold("value_divergence.ev_warmup", 10, "a fresh critic starts negative; judge it after 10 values"),
    Threshold("value_divergence.loss_factor", 10.0, "value loss > 10x max(start, 0.5 return var): diverging"),
    Threshold("value_divergence.grad_zero", 1e-12, "critic grad norm ~0, value loss > 0: its target moves with it"),
    Threshold("value_divergence.persist", 3, "value loss is noisy per batch; three steps in a row"),
    Threshold("grad_spike.factor", 10.0, "grad norm 10x the median of the previous window; noise is 2-3x"),
)
TH = {t.name: t.value for t in THRESHOLDS}
HISTORY = int(max(v for k, v in TH.items() if k.endswith("window"))) + 1  # values kept per metric: the longest window
# (flat_reward's); the other checks read the last `window` + 1 of them (vals, prev)

# (their name, our name), the first present wins (ours first). veRL: critic/rewards/mean = score - in-reward KL,
# actor/kl_loss = raw KL loss, training/rollout_probs_diff_* = |p_rollout - p_actor|; TRL GRPOTrainer from `reward` on.
NAME_MAP = (
    ("critic/score/mean", "rollout/reward_mean"), ("critic/score/max", "rollout/score_max"),
    ("critic/score/min", "rollout/score_min"), ("critic/rewards/mean", "rollout/reward_kl_mean"),
    ("critic/advantages/mean", "stats/adv_mean"), ("critic/advantages/max", "stats/adv_max"),
    ("critic/advantages/min", "stats/adv_min"), ("critic/returns/mean", "stats/return_mean"),
    ("critic/vf_explained_var", "critic/explained_var"), ("critic/vf_loss", "loss/value"),
    ("critic/grad_norm", "critic/grad_norm_0"), ("response_length/mean", "rollout/response_len"),
    ("response_length/clip_ratio", "rollout/truncated_frac"), ("actor/pg_clipfrac", "stats/clipfrac"),
    ("actor/ppo_kl", "stats/approx_kl"), ("actor/entropy", "stats/entropy"), ("actor/pg_loss", "loss/policy"),
    ("actor/grad_norm", "stats/grad_norm"), ("actor/kl_loss", "stats/kl"), ("actor/reward_kl_penalty", "stats/kl"),
    ("training/rollout_probs_diff_mean", "stats/rollout_vs_old_prob_diff"),
    ("training/rollout_probs_diff_max", "stats/rollout_vs_old_prob_diff_max"), ("reward", "rollout/reward_mean"),
    ("reward_std", "rollout/reward_std"), ("frac_reward_zero_std", "rollout/zero_std_frac"), ("kl", "stats/kl"),
    ("entropy", "stats/entropy"), ("clip_ratio/region_mean", "stats/clipfrac"),
    ("completions/clipped_ratio", "rollout/truncated_frac"), ("completions/mean_length", "rollout/response_len"),
    ("grad_norm", "stats/grad_norm"), ("loss", "loss/policy"), ("actor/lr", "stats/lr"), ("learning_rate", "stats/lr"),
    ("sampling/sampling_logp_difference/mean", "stats/rollout_vs_old_logp_diff"),
    ("stats/score_std", "rollout/reward_std"),  # our own name for it up to 2026-12 (one name per quantity now)
)  # fmt: skip
# what the trainer's TensorBoard and W&B get beside our names: veRL's (KL: its name depends on where the KL goes)
VERL_PREFIXES = ("critic/", "actor/", "response_length/", "training/")
VERL_ALIASES = {
    ours: theirs for theirs, ours in reversed(NAME_MAP) if theirs.startswith(VERL_PREFIXES) and ours != "stats/kl"
}
VERL_ALIASES.update({"stats/lr": "actor/lr", "time/rollout": "timing_s/gen", "time/reward": "timing_s/reward"})
# what logprob_mismatch reads; the threshold of stats/<x> is logprob_mismatch.<x>
MISMATCH = ("stats/first_mb_clipfrac", "stats/first_mb_ratio_dev", "stats/rollout_vs_old_logp_diff")
MISMATCH += ("stats/rollout_vs_old_prob_diff",)
ONLY_OURS = ("rollout/acc", "stats/token_reward_kl_abs", "stats/adv_abs_mean", "stats/return_std", "stats/lr")
ONLY_OURS += ("critic/grad_norm_0", "stats/eos_mask_err_frac")
CORRECTED = ("rollout_corr/rollout_is_mean", "rollout_corr/rollout_rs_masked_fraction")  # a rollout correction is on
CORRECTED += ("stats/is_weight_mean",)  # ours: --off-policy tis / decoupled / mask
ONLY_OURS += CORRECTED  # (veRL's names, and ours: offpolicy.py logs veRL's)
FIRST_TURN = "stats/rollout_vs_old_logp_diff_first_turn"  # multi-turn: the gap on each episode's first action
ONLY_OURS += (FIRST_TURN,)
KNOWN = frozenset(ONLY_OURS + MISMATCH) | {ours for _, ours in NAME_MAP}  # every name a check reads, and more
FOREIGN = frozenset(theirs for theirs, _ in NAME_MAP)


def verl_aliases(metrics: dict, source: str) -> dict:
    """veRL's names of the metrics that have one; held-out ones as veRL's val-core/<data source>/<var>/<stat>."""
    out = {VERL_ALIASES[k]: v for k, v in metrics.items() if k in VERL_ALIASES}
    for k, v in metrics.items():
        if k == "eval/acc" or k.startswith("eval/mean@"):  # greedy eval/acc: veRL's default validation (n = 1)
            out[f"val-core/{source}/acc/mean@1" if k == "eval/acc" else f"val-core/{source}/reward/{k[5:]}"] = v
    return out


def to_ours(metrics: dict) -> dict:
    """Rename veRL/TRL keys to ours (NAME_MAP); our names and unknown keys pass through unchanged."""
    out = {k: v for k, v in metrics.items() if k not in FOREIGN}
    for theirs, ours in NAME_MAP:
        if metrics.get(theirs) is not None and out.get(ours) is None:
            out[ours] = metrics[theirs]
    return out


@dataclass(frozen=True)
class Finding:
    id: str
    step: int
    evidence: str
    cause: str
    fix: str

    def __str__(self) -> str:
        return f"{self.id} @ step {self.step}: {self.evidence} | likely cause: {self.cause} | try: {self.fix}"


class LiveDiagnoser:
    """Feed one metrics row per step (any supported names); `update` returns the findings new at this step."""

    def __init__(self, reward_max: float = 1.0):
        self.reward_max = reward_max
        self.hist: dict[str, deque] = {}  # name -> (step, value): its last HISTORY finite values
        self.first: dict[str, list[float]] = {}  # name -> its first baseline_n finite values
        self.count: dict[str, int] = {}  # name -> finite values seen so far
        self.cur, self.nonfinite = {}, []  # this step's finite known values; its non-finite ones (any column)
        self.streak: dict[str, list] = {}  # id -> [start step, consecutive hits]
        self.active: dict[str, int] = {}  # reported id -> consecutive misses since
        self.evaluated: set[str] = set()

    def update(self, step: int, metrics: dict) -> list[Finding]:
        """Take one metrics row; return the failure modes that start being reported at this step."""
        step, self.cur, self.nonfinite = int(step), {}, []
        for k, v in to_ours(metrics).items():
            if k == "step" or isinstance(v, bool) or not isinstance(v, (int, float, np.number)):
                continue
            if not math.isfinite(v):
                self.nonfinite.append(f"{k}={v}")
            elif k in KNOWN:
                self.cur[k] = float(v)
                self.hist.setdefault(k, deque(maxlen=HISTORY)).append((step, float(v)))
                self.count[k] = self.count.get(k, 0) + 1
                if len(self.first.setdefault(k, [])) < TH["baseline_n"]:
                    self.first[k].append(float(v))
        new = []
        for cid, check, _ in CHECKS:
            if (res := check(self)) is None:  # its metrics are not in this row, or its window is not full yet
                continue
            self.evaluated.add(cid)
            hit, evidence, start = res
            if not hit:
                self.streak.pop(cid, None)
                if cid in self.active:
                    self.active[cid] += 1
                    if self.active[cid] >= TH["clear_steps"]:
                        del self.active[cid]
                continue
            s = self.streak.setdefault(cid, [step if start is None else min(start, step), 0])
            s[1] += 1
            if cid in self.active:
                self.active[cid] = 0
            elif s[1] >= TH.get(f"{cid}.persist", 1):
                self.active[cid] = 0
                cause, fix = " ".join(check.__doc__.split()).split(" Try: ")
                new.append(Finding(cid, s[0], evidence, cause, fix))
        return new

    def state(self) -> str:
        """What update() carries from step to step, as JSON (deques and sets as lists), for a checkpoint."""
        d = {k: v for k, v in vars(self).items() if k not in ("cur", "nonfinite")}
        return json.dumps({**d, "evaluated": sorted(self.evaluated)}, default=list)  # sorted: the same bytes every run

    def load_state(self, text: str) -> None:
        """Continue from state(): the baselines, windows and streaks of the run so far ("{}": from the start)."""
        d = json.loads(text)
        if unknown := sorted(set(d) - set(vars(self))):
            raise ValueError(f"LiveDiagnoser.load_state: unknown field(s) {unknown}: not a state() of this version")
        vars(self).update(d)
        self.hist = {k: deque(map(tuple, v), maxlen=HISTORY) for k, v in self.hist.items()}
        self.evaluated = set(self.evaluated)

    def skipped(self) -> dict[str, str]:
        """Check id -> why it never ran (none of its metrics logged, or too few steps for its window)."""
        seen = lambda needs: any(n in self.count for n in needs)
        out = {cid: "too few steps for its window" if seen(needs) else "needs " + " or ".join(needs)
               for cid, _, needs in CHECKS if cid not in self.evaluated}  # fmt: skip
        if "logprob_mismatch" in out and "stats/clipfrac" in self.count:  # veRL/TRL average over all minibatches
            out["logprob_mismatch"] += "; an all-minibatch clip fraction mixes in the ratio's normal drift"
        return out

    def vals(self, name: str) -> list[float]:
        """The values of one metric in the window (its last window + 1 values), oldest first."""
        return [v for _, v in self.hist.get(name, ())][-int(TH["window"]) - 1 :]

    def prev(self, name: str) -> list[float]:
        """The window's values before this step."""
        v = self.vals(name)
        return v[:-1] if name in self.cur else v

    def base(self, name: str) -> float | None:
        """The starting level of a metric (median of its first values), None before there are enough."""
        f = self.first.get(name, [])
        return median(f) if len(f) >= TH["baseline_n"] else None

    def reward_unit(self) -> float:
        """The scale rewards move on: the median reward std (half of reward_max when the std is not logged)."""
        std = median(self.vals("rollout/reward_std")) if "rollout/reward_std" in self.hist else 0.0
        return std if std > 0 else 0.5 * self.reward_max

    def saturated(self) -> bool:
        """Recent accuracy (or reward) at the ceiling: median of the last baseline_n values."""
        n, f = int(TH["baseline_n"]), TH["saturated_frac"]
        acc, r = self.vals("rollout/acc")[-n:], self.vals("rollout/reward_mean")[-n:]
        return (bool(acc) and median(acc) >= f) or (bool(r) and median(r) >= f * self.reward_max)


# Checks return None (cannot run on this row) or (hit, evidence, start step | None); docstring: "<cause> Try: <fix>"


def _nan_inf(d: LiveDiagnoser):
    """A NaN/inf loss or gradient: lr too high, log(0), a zero std in a division, fp16 overflow.
    Try: lower lr, check reward outputs and std eps, use fp32/bf16, keep grad clipping on."""
    return bool(d.nonfinite), "non-finite values: " + ", ".join(d.nonfinite[:6]), None


def _logprob_mismatch(d: LiveDiagnoser):
    """Sampler and trainer logprobs differ: temperature not applied in both, logits one position off, stale
    old_logprobs, dropout on, top-p/top-k, a low-precision sampler. Try: recompute old_logprobs right before
    the update (dropout off, sampling temperature) and compare per-token logprobs of one batch."""
    got = [(k, TH[f"logprob_mismatch.{k[6:]}"]) for k in MISMATCH if k in d.cur]  # threshold of stats/<x>: <id>.<x>
    got = [(k, t) for k, t in got if not (k == "stats/rollout_vs_old_logp_diff" and _drifts(d))]  # template_drift's
    bad = [f"{k}={d.cur[k]:.3g} (> {t:g})" for k, t in got if d.cur[k] > t]
    return (bool(bad), "; ".join(bad), None) if got else None


def _drifts(d: LiveDiagnoser) -> bool | None:
    """Multi-turn: is the sampler-trainer gap over logprob_mismatch's threshold while the first turn's is a small
    share of it? (None: not a multi-turn log.)"""
    g, first = d.cur.get("stats/rollout_vs_old_logp_diff"), d.cur.get(FIRST_TURN)
    if g is None or first is None:
        return None
    return g > TH["logprob_mismatch.rollout_vs_old_logp_diff"] and first < TH["template_drift.first_turn_share"] * g


def _template_drift(d: LiveDiagnoser):
    """Multi-turn: the sampler's logprobs match the trainer's on each episode's first turn, not after it: the history
    the trainer scores is not the token sequence the sampler wrote (the conversation re-rendered by the chat template
    and re-tokenised: end-of-turn tokens dropped, tokens merged or split at turn boundaries, whitespace stripped). Try:
    build the training sequence from the sampled ids (observations tokenised once) and compare the two id sequences
    of one episode."""
    if (drifts := _drifts(d)) is not None:
        ev = f"mean |sampler - trainer logprob| {d.cur['stats/rollout_vs_old_logp_diff']:.3g}, first turn only "
        return drifts, ev + f"{d.cur[FIRST_TURN]:.3g}", None


def _reward_scale(d: LiveDiagnoser):
    """The task reward is on the wrong scale for the KL term or the value head (e.g. a score times 0.01).
    Try: rescale the reward to O(1), lower the in-reward KL coefficient, or normalise advantages per group."""
    c, msgs = d.cur, []
    sig = c.get("rollout/reward_std")
    if sig is None and "rollout/score_max" in c and "rollout/score_min" in c:
        sig = (c["rollout/score_max"] - c["rollout/score_min"]) / 2  # veRL: an upper bound of the std
    kl_seq = None  # what the in-reward KL penalty adds to a sequence's return
    if "stats/token_reward_kl_abs" in c:
        kl_seq = c["stats/token_reward_kl_abs"] * c.get("rollout/response_len", 1.0)
    elif "rollout/reward_kl_mean" in c and "rollout/reward_mean" in c:  # veRL: score - reward = KL penalty
        kl_seq = abs(c["rollout/reward_mean"] - c["rollout/reward_kl_mean"])
    if sig and kl_seq and sig / kl_seq < TH["reward_scale.kl_ratio"]:
        msgs.append(f"score std {sig:.3g} vs KL penalty per sequence {kl_seq:.3g} (ratio {sig / kl_seq:.2g})")
    adv, zero = c.get("stats/adv_abs_mean"), c.get("rollout/zero_std_frac", 0.0)
    if adv is not None and adv < TH["reward_scale.adv_tiny"] and zero < TH["zero_variance_groups.frac"] and sig != 0:
        msgs.append(f"mean |advantage| {adv:.3g}")
    err = math.sqrt(2 * c["loss/value"]) if "loss/value" in c else None  # >= the critic's RMS error
    if sig and err is not None and err > TH["reward_scale.value_err"] * sig:
        msgs.append(f"critic RMS error up to {err:.3g} vs score std {sig:.3g}")
    ret = max([abs(c[k]) for k in ("stats/return_mean", "stats/return_std") if k in c], default=None)
    if ret is not None and ret > TH["reward_scale.huge"]:
        msgs.append(f"return magnitude {ret:.3g}")
    ran = sig is not None and (kl_seq is not None or err is not None) or adv is not None or ret is not None
    return (bool(msgs), "; ".join(msgs), None) if ran else None


def _zero_variance(d: LiveDiagnoser):
    """Most prompts are all-solved or all-failed: identical rewards in a group give zero advantage. A reward of
    exactly 0 everywhere is a reward that never matches (answer format, parser, a wrong ground truth) more often than
    a task too hard. Try: print a few samples with their rewards, then prompts of the right difficulty, larger groups,
    partial-credit rewards, or dynamic sampling."""
    if (z := d.cur.get("rollout/zero_std_frac")) is not None:
        r, hi = d.cur.get("rollout/reward_mean"), d.cur.get("rollout/score_max")
        level = "" if r is None else f" (mean reward {r:.3g}" + ("" if hi is None else f", max {hi:.3g}") + ")"
        ev = f"{z:.0%} of groups have equal rewards{level}"
        return z >= TH["zero_variance_groups.frac"] and not d.saturated(), ev, None


def _trend(values: list[float]) -> tuple[float, float]:
    """Least-squares slope per step of a window of values and its t statistic (slope / standard error)."""
    r = np.array(values)
    x = np.arange(len(r)) - (len(r) - 1) / 2
    slope = float(x @ (r - r.mean()) / (x @ x))
    se = float(np.sqrt(np.sum((r - r.mean() - slope * x) ** 2) / (len(r) - 2) / (x @ x)))
    return slope, slope / se if se > 0 else (math.copysign(math.inf, slope) if slope else 0.0)


def _flat_reward(d: LiveDiagnoser):
    """No learning signal reaches the policy (reward scale, zero-variance groups, lr too low, a masking bug); not
    reported while another finding (which explains it) is. Try: print the rewards of a few samples, check lr,
    reproduce on a tiny task."""
    w, n = int(TH["flat_reward.window"]), int(TH["baseline_n"])
    win = list(d.hist.get("rollout/reward_mean", ()))[-w:]
    if "rollout/reward_mean" not in d.cur or len(win) < w:
        return None
    r = [v for _, v in win]
    slope, t = _trend(r)
    tol = TH["flat_reward.min_gain"] * d.reward_unit()
    base, now = d.base("rollout/reward_mean"), median(r[-n:])
    explained = any(cid in d.active or cid in d.streak for cid in EXPLAINS_FLAT)  # another finding says why
    hit = now - base < tol and t < TH["flat_reward.t_stat"] and not d.saturated() and not explained
    ev = f"reward {base:.4g} at the start, {now:.4g} now (rise < {tol:.3g}); trend {slope:+.2g}/step, t = {t:.2g}"
    return hit, ev, win[0][0]


EXPLAINS_FLAT = ("logprob_mismatch", "reward_scale", "zero_variance_groups", "reward_decline", "kl_blowup",
                 "policy_frozen", "entropy_collapse", "entropy_blowup", "template_drift", "eos_mask", "high_truncation",
                 "value_divergence")  # fmt: skip


def _reward_decline(d: LiveDiagnoser):
    """The reward falls steadily: the update climbs the loss instead of descending it (the sign of the advantages or
    of the policy loss), a KL or entropy term that outweighs the task (see kl_blowup / entropy_blowup), hacking of a
    learned reward that its score hides. Try: on one batch, check that a step raises the logprob of samples with
    A > 0; read the other findings; print the highest-reward samples."""
    w, n = int(TH["reward_decline.window"]), int(TH["baseline_n"])
    win = list(d.hist.get("rollout/reward_mean", ()))[-w:]
    if "rollout/reward_mean" not in d.cur or len(win) < w:
        return None
    r = [v for _, v in win]
    slope, t = _trend(r)
    drop = d.base("rollout/reward_mean") - median(r[-n:])
    hit = t < -TH["reward_decline.t_stat"] and drop > TH["reward_decline.min_drop"] * d.reward_unit()
    peak = max(win, key=lambda sv: sv[1])[0]  # dated to where the fall began: the window's highest reward
    return hit, f"reward {drop:.3g} below its start; trend {slope:+.2g}/step over {w} steps, t = {t:.2g}", peak


def _kl_blowup(d: LiveDiagnoser):
    """The policy runs away from the reference: lr too high, too many epochs, KL coefficient too low, reward
    hacking. Try: lower lr or ppo_epochs, raise the KL coefficient (or adaptive KL), read high-reward samples."""
    k, prev = d.cur.get("stats/kl"), d.prev("stats/kl")
    if k is None:
        return None
    ref = median(prev) if len(prev) >= TH["baseline_n"] else math.inf
    hit = k > TH["kl_blowup.max"] or (k > TH["kl_blowup.jump_floor"] and k > TH["kl_blowup.jump"] * ref)
    return hit, f"KL to reference {k:.3g} nat/token, median of the previous {len(prev)} steps {ref:.3g}", None


def _policy_frozen(d: LiveDiagnoser):
    """The policy gets gradients but does not move: its KL to the reference stays exactly 0. lr 0 (or a schedule
    stuck at 0), an optimizer built over other parameters than the trained model (a copy, parameters re-created after
    it), frozen parameters, LoRA adapters outside the optimizer. Try: print lr and the parameter norm before and after
    one optimizer step; check that the optimizer's parameters are the model's."""
    k, g = d.cur.get("stats/kl"), d.cur.get("stats/grad_norm")
    if k is None or g is None or g <= 0:  # no gradient this step (a critic warm-up): nothing to judge
        return None
    lr = d.cur.get("stats/lr")
    ev = f"KL to the reference {k:.3g} with a gradient norm of {g:.3g}" + ("" if lr is None else f", lr {lr:.3g}")
    return abs(k) < TH["policy_frozen.kl_max"], ev, None


def _entropy_collapse(d: LiveDiagnoser):
    """The policy turned (nearly) deterministic before solving the task: too large updates, no entropy bonus,
    clip_high too tight. Try: lower lr, raise clip_high (clip-higher), add an entropy bonus, sample hotter."""
    if (e := d.cur.get("stats/entropy")) is not None and (base := d.base("stats/entropy")) is not None:
        low = e < TH["entropy_collapse.rel"] * base or e < TH["entropy_collapse.abs"]
        return low and not d.saturated(), f"entropy {e:.3g} nat/token vs {base:.3g} at the start", None


def _entropy_blowup(d: LiveDiagnoser):
    """The policy's entropy climbs far above its start (towards uniform noise): an entropy bonus that outweighs the
    task (ent_coef too large), lr too high (then the KL to the reference climbs too), sampling hotter than the
    trainer's temperature. Try: lower or drop the entropy bonus (or cap it, clip-higher instead), lower lr, check the
    temperature on both sides."""
    if (e := d.cur.get("stats/entropy")) is not None and (base := d.base("stats/entropy")) is not None:
        k = d.cur.get("stats/kl")
        ev = f"entropy {e:.3g} nat/token vs {base:.3g} at the start" + ("" if k is None else f"; KL {k:.3g}")
        return e > TH["entropy_blowup.rel"] * base + TH["entropy_blowup.abs"], ev, None


def _sampler_gap(d: LiveDiagnoser):
    """The sampler's logprobs sit a small, steady distance from the trainer's with no rollout correction on: a
    low-precision (bf16 / fp8) inference engine or kernels that differ. A bug (no temperature, a one-position shift)
    gives a far larger gap (logprob_mismatch); a sampler that misses weight syncs, one that grows. Try: a rollout
    correction (--rollout-is token, veRL's rollout_is / TIS), or an fp32 sampler; python mismatch.py measures it."""
    name = "stats/rollout_vs_old_logp_diff"
    if (g := d.cur.get(name)) is None or (base := d.base(name)) is None or any(k in d.cur for k in CORRECTED):
        return None
    hit = TH["sampler_precision_gap.min"] < g <= TH["logprob_mismatch.rollout_vs_old_logp_diff"]
    hit = hit and g < TH["sampler_precision_gap.steady"] * base and not (_logprob_mismatch(d) or (False,))[0]
    return hit, f"mean |sampler - trainer logprob| {g:.3g} per token ({base:.3g} at the start), no correction", None


def _high_truncation(d: LiveDiagnoser):
    """Responses do not end with EOS: wrong EOS id, EOS masked out, max_new_tokens too small.
    Try: check the EOS id and the response mask, raise max_new_tokens, or penalise truncated responses."""
    if (t := d.cur.get("rollout/truncated_frac")) is not None:
        return t > TH["high_truncation.frac"], f"{t:.0%} of responses hit the length limit", None


def _eos_mask(d: LiveDiagnoser):
    """The response mask does not end at the first EOS: EOS masked out (pad == eos with masks rebuilt from ids),
    or the padding after it trained. Try: build the mask from the sampler's stop position, pad with a non-EOS id."""
    if (e := d.cur.get("stats/eos_mask_err_frac")) is not None:
        return e > TH["eos_mask.frac"], f"{e:.0%} of responses have a mask that does not end at their first EOS", None


def _value_divergence(d: LiveDiagnoser):
    """The critic does not fit the returns: critic lr too high, value targets not detached (built from the live
    values, they cancel its gradient), returns on a huge scale. Try: lower the critic lr, keep value clipping,
    detach the returns, rescale rewards, warm up the critic."""
    name, msgs = "critic/explained_var", []
    ev, vl, base = d.cur.get(name), d.cur.get("loss/value"), d.base("loss/value")
    if ev is None and vl is None and "critic/grad_norm_0" not in d.cur:
        return None
    if ev is not None and ev < TH["value_divergence.ev_min"] and d.count[name] > TH["value_divergence.ev_warmup"]:
        msgs.append(f"explained variance {ev:.3g}")
    spread = d.cur.get("stats/return_std", d.cur.get("rollout/reward_std", 0.0))
    ref = max(base or 0.0, 0.5 * spread**2)  # a constant critic's loss: return variance grows with learning
    if vl is not None and base is not None and vl > TH["value_divergence.loss_factor"] * ref:
        msgs.append(f"value loss {vl:.3g} vs {ref:.3g} (start, or 0.5 return variance)")
    if (gn := d.cur.get("critic/grad_norm_0", 1.0)) <= TH["value_divergence.grad_zero"] and (vl or 0.0) > 0:
        msgs.append(f"critic gradient norm {gn:.3g} with value loss {vl:.3g}: the critic cannot move")
    return bool(msgs), "; ".join(msgs), None


def _grad_spike(d: LiveDiagnoser):
    """One batch produced an outsized gradient: outlier advantages, a near-zero-probability token, a bad sample.
    Try: keep grad clipping on, lower lr, look at the advantages and stats/ratio_max of that step."""
    g, prev = d.cur.get("stats/grad_norm"), d.prev("stats/grad_norm")
    if g is None or len(prev) < TH["baseline_n"]:
        return None
    ref = median(prev)
    return ref > 0 and g > TH["grad_spike.factor"] * ref, f"grad norm {g:.3g} vs median {ref:.3g} before", None


# (id, check, metrics any of which lets it run), in the order the checks run.
CHECKS = (
    ("nan_inf", _nan_inf, ("any",)),
    ("logprob_mismatch", _logprob_mismatch, MISMATCH),
    ("reward_scale", _reward_scale, ("stats/token_reward_kl_abs", "stats/adv_abs_mean", "stats/return_std")),
    ("zero_variance_groups", _zero_variance, ("rollout/zero_std_frac",)),
    ("reward_decline", _reward_decline, ("rollout/reward_mean",)),
    ("kl_blowup", _kl_blowup, ("stats/kl",)),
    ("policy_frozen", _policy_frozen, ("stats/kl",)),
    ("entropy_collapse", _entropy_collapse, ("stats/entropy",)),
    ("entropy_blowup", _entropy_blowup, ("stats/entropy",)),
    ("sampler_precision_gap", _sampler_gap, ("stats/rollout_vs_old_logp_diff",)),
    ("template_drift", _template_drift, (FIRST_TURN,)),
    ("eos_mask", _eos_mask, ("stats/eos_mask_err_frac",)),
    ("high_truncation", _high_truncation, ("rollout/truncated_frac",)),
    ("value_divergence", _value_divergence, ("critic/explained_var", "loss/value", "critic/grad_norm_0")),
    ("grad_spike", _grad_spike, ("stats/grad_norm",)),
    ("flat_reward", _flat_reward, ("rollout/reward_mean",)),  # last: the findings that explain it are known
)


def diagnose(rows: list[dict], reward_max: float = 1.0) -> list[Finding]:
    """Every finding of a whole run. rows: one metrics dict per step (any supported names; 'step' optional)."""
    d = LiveDiagnoser(reward_max)
    return [f for i, row in enumerate(rows) for f in d.update(int(row.get("step", i)), row)]


class InputError(ValueError):
    """A metrics file that cannot be read; the message names the file, the line and what was expected."""


def _json(p: Path, text: str, where: str):
    """json.loads of one entry; malformed or absurdly nested text is an InputError naming the place."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        where = where if where != "line 1" or e.lineno == 1 else f"line {e.lineno}"
        raise InputError(f"{p}, {where}: not valid JSON ({e.msg}, column {e.colno}): truncated or corrupt?") from None
    except RecursionError:  # json's C decoder recurses: 100k nested brackets exhaust the stack
        raise InputError(f"{p}, {where}: JSON nested too deep to be a metrics row; expected flat objects") from None


def _entries(p: Path, f):
    """(where, raw dict) for each entry of a CSV, TRL trainer_state.json or JSONL file, read from `f` as a stream."""
    if p.suffix == ".csv":
        reader = csv.reader(f)
        header = next(reader)
        for row in reader:
            if len(row) != len(header) and any(c.strip() for c in row):
                msg = f"{len(row)} fields but the header (line 1) has {len(header)}: truncated? expected one per column"
                raise InputError(f"{p}, line {reader.line_num}: {msg}")
            yield f"line {reader.line_num}", {k: v for k, v in zip(header, row) if v.strip()}
    elif p.suffix == ".json":  # one object: read whole
        obj = _json(p, f.read(), "line 1")
        hist = obj.get("log_history") if isinstance(obj, dict) else obj
        if not isinstance(hist, list) or not all(isinstance(e, dict) for e in hist):
            raise InputError(f"{p}, line 1: expected TRL's trainer_state.json (a 'log_history' list of objects)")
        yield from ((f"log_history[{i}] (step {e.get('step', '?')})", e) for i, e in enumerate(hist))
    else:
        for n, line in enumerate(f, 1):
            obj = _json(p, line, f"line {n}") if line.strip() else {}
            if not isinstance(obj, dict):
                raise InputError(f'{p}, line {n}: expected an object like {{"step": 0, "stats/kl": 0.1}}')
            if isinstance(obj.get("data"), dict):  # veRL's file logger: {"step": s, "data": {...}}
                obj.update(obj.pop("data"))
            yield f"line {n}", obj


def _number(p: Path, where: str, key: str, v) -> float:
    """A metric value as a float, or an InputError naming the file, the place and the key."""
    try:
        return float(v) if type(v) in (int, float) else float(v.strip())  # numbers written as text: "0.5", "nan"
    except (AttributeError, ValueError):
        msg = f"column '{key}' = {v!r:.40} is not a number; expected a float (NaN/inf allowed: they are reported)"
        raise InputError(f"{p}, {where}: {msg}") from None


def _step(p: Path, where: str, v, last: int | None) -> int:
    """The step of an entry: a whole number, not below the last one (else two runs would merge silently)."""
    x = _number(p, where, "step", v)
    if not (math.isfinite(x) and x == int(x)):
        raise InputError(f"{p}, {where}: 'step' = {v!r:.40} is not a whole number; expected the step 0, 1, 2, ...")
    if last is not None and x < last:
        raise InputError(f"{p}, {where}: step {int(x)} after step {last}: two runs in one file? one run per file")
    return int(x)


NAMES = KNOWN | FOREIGN


def iter_metrics(path: str | Path):
    """Rows (one dict per step, our names, 'step' set) from a run dir, .jsonl, .csv or trainer_state.json, read as a
    stream: memory is one row (entries of one step are merged), not the file."""
    p = Path(path)
    if p.is_dir():  # a run directory
        p = next((p / n for n in ("metrics.jsonl", "metrics.csv", "trainer_state.json") if (p / n).is_file()), p)
    if not p.is_file():
        raise InputError(f"{p}: no such file (a run dir needs metrics.jsonl, metrics.csv or trainer_state.json)")
    with open(p, encoding="utf-8", errors="replace", newline="") as f:
        if not any(line.strip() for line in f):  # stops at the first non-blank line
            raise InputError(f"{p}, line 1: the file is empty; expected one row of metrics per training step")
        f.seek(0)
        prev, columns, first = None, {}, None
        for i, (where, raw) in enumerate(_entries(p, f)):
            first, columns = first or (where if raw else None), columns if len(columns) > 6 else columns | raw
            row = to_ours({k: _number(p, where, k, v) for k, v in raw.items() if k in NAMES and v is not None})
            if not row:
                continue  # a blank line, an eval-only entry, TRL's final summary (train_runtime, ...)
            row |= {k: float(v) for k, v in raw.items() if k not in NAMES and type(v) in (int, float)}
            last = None if prev is None else prev["step"]
            row["step"] = _step(p, where, raw["step"], last) if raw.get("step") is not None else i
            if prev is not None and prev["step"] == row["step"]:
                prev.update(row)  # one step logged in several entries
                continue
            if prev is not None:
                yield prev
            prev = row
    if prev is None:
        msg = f"none of the columns {list(columns)[:6]} is a known metric; expected ours (rollout/reward_mean, ...)"
        msg = "no rows (only a header or empty objects)" if first is None else msg + " or veRL/TRL names (NAME_MAP)"
        raise InputError(f"{p}, {first or 'line 2'}: {msg}")
    yield prev


def load_metrics(path: str | Path) -> list[dict]:
    """Every row of iter_metrics, as a list."""
    return list(iter_metrics(path))


TABLE = "rollout/reward_mean rollout/zero_std_frac stats/kl stats/entropy stats/grad_norm".split()


def main(argv: list[str] | None = None) -> int:
    """`python diagnose.py PATH`: print the findings and the checks; exit 1 if any, 2 on unreadable input. The
    metrics are streamed: what is kept per step is the table's few columns."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if pos := [i for i, a in enumerate(argv) if not a.startswith("-") and (i == 0 or not argv[i - 1].startswith("--"))]:
        argv.insert(pos[0], "--path")  # the metrics path as a positional argument
    try:
        cfg = parse_config(Config, argv)
        if not cfg.path:
            raise ValueError("give a run directory or a metrics file: python diagnose.py RUN_DIR_OR_METRICS_FILE")
        d, findings, rows, seen = LiveDiagnoser(cfg.reward_max), [], [], set()
        for r in iter_metrics(cfg.path):
            findings += d.update(r["step"], r)
            rows.append({k: r[k] for k in ("step", *TABLE) if k in r})
            seen |= r.keys()
    except ValueError as e:  # InputError included
        print(f"diagnose.py: bad input: {e}", file=sys.stderr)
        return 2
    print(f"{cfg.path}: {len(rows)} steps ({rows[0]['step']}..{rows[-1]['step']})")
    picks = sorted({int(i) for i in np.linspace(0, len(rows) - 1, min(len(rows), 6))})
    print(format_table([rows[i] for i in picks], ["step", *[c for c in TABLE if any(c in r for r in rows)]]))
    for cid in dict.fromkeys(f.id for f in findings):  # one line per failure mode, in order of appearance
        f, *more = [f for f in findings if f.id == cid]
        print(f"FOUND {f}" + (f" (again at step {', '.join(str(g.step) for g in more)})" if more else ""))
    skipped = d.skipped()
    print("checks run: " + ", ".join(cid for cid, _, _ in CHECKS if cid not in skipped))
    for cid, why in skipped.items():
        print(f"check skipped: {cid}: {why}")
    if unused := sorted(seen - KNOWN - {"step"}):
        print(f"columns not used ({len(unused)}): {', '.join(unused[:8])}{' ...' if len(unused) > 8 else ''}")
    n = len({f.id for f in findings})
    print(f"{n} failure mode(s) flagged" if n else "no failure mode flagged")
    return 1 if n else 0


if __name__ == "__main__":
    sys.exit(main())
