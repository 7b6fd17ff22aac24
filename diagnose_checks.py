"""The failure modes diagnose.py looks for: one check per mode, and the one table of thresholds with their reasons.

    python diagnose_checks.py    # every check: its id, the metrics that let it run, its likely cause and fix

A check takes the run's LiveDiagnoser `d` (diagnose.py: this step's values `d.cur`, the windows `d.vals` /
`d.prev`, the starting levels `d.base`) and returns None (it cannot run on this row) or (hit, evidence, start
step | None); its docstring is "<cause> Try: <fix>", the text of the finding. Thresholds are named
`<id>.<what>`; `<id>.persist` = the consecutive steps a condition must hold before it is reported.
"""

from __future__ import annotations

import math
from statistics import median  # stdlib: faster than numpy on a window of ~20 values
from typing import NamedTuple

import numpy as np

from diagnose_logs import CORRECTED, FIRST_TURN, MISMATCH


class Threshold(NamedTuple):
    name: str
    value: float
    why: str  # one named threshold, its reason


# The one table of thresholds; `<id>.persist` = consecutive steps a condition must hold before it is reported.
THRESHOLDS = (
    Threshold("window", 40, "trend/reference window: covers a 20-step lr warm-up and batch noise; fits CPU runs"),
    Threshold("baseline_n", 5, "values in a median level (start, recent) and least history for a reference median"),
    Threshold("clear_steps", 3, "steps without the condition before a reported failure clears (no flicker)"),
    # diagnose.rank: reward_decline is dated inside its 20-step window and kl_blowup fires at the end of a drift
    Threshold("rank_lag", 20, "a cause may be dated up to 20 steps after a symptom it explains and still rank first"),
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


# Checks return None (cannot run on this row) or (hit, evidence, start step | None); docstring: "<cause> Try: <fix>"


def _nan_inf(d):
    """A NaN/inf loss or gradient: lr too high, log(0), a zero std in a division, fp16 overflow.
    Try: lower lr, check reward outputs and std eps, use fp32/bf16, keep grad clipping on."""
    return bool(d.nonfinite), "non-finite values: " + ", ".join(d.nonfinite[:6]), None


def _logprob_mismatch(d):
    """Sampler and trainer logprobs differ: temperature not applied in both, logits one position off, stale
    old_logprobs, dropout on, top-p/top-k, a low-precision sampler. Try: recompute old_logprobs right before
    the update (dropout off, sampling temperature) and compare per-token logprobs of one batch."""
    got = [(k, TH[f"logprob_mismatch.{k[6:]}"]) for k in MISMATCH if k in d.cur]  # threshold of stats/<x>: <id>.<x>
    got = [(k, t) for k, t in got if not (k == "stats/rollout_vs_old_logp_diff" and _drifts(d))]  # template_drift's
    bad = [f"{k}={d.cur[k]:.3g} (> {t:g})" for k, t in got if d.cur[k] > t]
    return (bool(bad), "; ".join(bad), None) if got else None


def _drifts(d) -> bool | None:
    """Multi-turn: is the sampler-trainer gap over logprob_mismatch's threshold while the first turn's is a small
    share of it? (None: not a multi-turn log.)"""
    g, first = d.cur.get("stats/rollout_vs_old_logp_diff"), d.cur.get(FIRST_TURN)
    if g is None or first is None:
        return None
    return g > TH["logprob_mismatch.rollout_vs_old_logp_diff"] and first < TH["template_drift.first_turn_share"] * g


def _template_drift(d):
    """Multi-turn: the sampler's logprobs match the trainer's on each episode's first turn, not after it: the history
    the trainer scores is not the token sequence the sampler wrote (the conversation re-rendered by the chat template
    and re-tokenised: end-of-turn tokens dropped, tokens merged or split at turn boundaries, whitespace stripped). Try:
    build the training sequence from the sampled ids (observations tokenised once) and compare the two id sequences
    of one episode."""
    if (drifts := _drifts(d)) is not None:
        ev = f"mean |sampler - trainer logprob| {d.cur['stats/rollout_vs_old_logp_diff']:.3g}, first turn only "
        return drifts, ev + f"{d.cur[FIRST_TURN]:.3g}", None


def _reward_scale(d):
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


def _zero_variance(d):
    """Most prompts are all-solved or all-failed: identical rewards in a group give zero advantage. A reward of
    exactly 0 everywhere is a reward that never matches (answer format, parser, a wrong ground truth) more often than
    a task too hard. Try: print a few samples with their rewards (the run's command with `--dump-batch N --steps N`
    saves step N's batch; `python repro.py OUT_DIR/batch-N.pt` prints four of its samples with their rewards), then
    prompts of the right difficulty, larger groups, partial-credit rewards, or dynamic sampling."""
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


def _flat_reward(d):
    """No learning signal reaches the policy (reward scale, zero-variance groups, lr too low, a masking bug); not
    reported while another finding (which explains it) is. Try: print a few samples with their rewards (`--dump-batch
    N --steps N`, then `python repro.py OUT_DIR/batch-N.pt`), check lr, reproduce on a tiny task."""
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


def _reward_decline(d):
    """The reward falls steadily: the update climbs the loss instead of descending it (the sign of the advantages or
    of the policy loss), a KL or entropy term that outweighs the task (see kl_blowup / entropy_blowup), hacking of a
    learned reward that its score hides. Try: on one batch, check that a step raises the logprob of samples with
    A > 0 (`--dump-batch N --steps N` saves that update, `python replay.py OUT_DIR/batch-N.pt` re-runs it, in a
    debugger if need be); read the other findings; print samples with their rewards (`python repro.py
    OUT_DIR/batch-N.pt` prints four; the file holds all)."""
    w, n = int(TH["reward_decline.window"]), int(TH["baseline_n"])
    win = list(d.hist.get("rollout/reward_mean", ()))[-w:]
    if "rollout/reward_mean" not in d.cur or len(win) < w:
        return None
    r = [v for _, v in win]
    slope, t = _trend(r)
    drop = d.base("rollout/reward_mean") - median(r[-n:])
    hit = t < -TH["reward_decline.t_stat"] and drop > TH["reward_decline.min_drop"] * d.reward_unit()
    # dated to where the fall began: the highest reward kept (the last HISTORY steps; a fall is seen only once the
    # reward is below its start, which after a rise can be long after this window's first step)
    peak = max(d.hist["rollout/reward_mean"], key=lambda sv: sv[1])[0]
    return hit, f"reward {drop:.3g} below its start; trend {slope:+.2g}/step over {w} steps, t = {t:.2g}", peak


def _kl_blowup(d):
    """The policy runs away from the reference: lr too high, too many epochs, KL coefficient too low, reward
    hacking. Try: lower lr or ppo_epochs, raise the KL coefficient (or adaptive KL), read samples with their rewards
    (`--dump-batch N --steps N`, then `python repro.py OUT_DIR/batch-N.pt`)."""
    k, prev = d.cur.get("stats/kl"), d.prev("stats/kl")
    if k is None:
        return None
    ref = median(prev) if len(prev) >= TH["baseline_n"] else math.inf
    hit = k > TH["kl_blowup.max"] or (k > TH["kl_blowup.jump_floor"] and k > TH["kl_blowup.jump"] * ref)
    return hit, f"KL to reference {k:.3g} nat/token, median of the previous {len(prev)} steps {ref:.3g}", None


def _policy_frozen(d):
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


def _entropy_collapse(d):
    """The policy turned (nearly) deterministic before solving the task: too large updates, no entropy bonus,
    clip_high too tight. Try: lower lr, raise clip_high (clip-higher), add an entropy bonus, sample hotter."""
    if (e := d.cur.get("stats/entropy")) is not None and (base := d.base("stats/entropy")) is not None:
        low = e < TH["entropy_collapse.rel"] * base or e < TH["entropy_collapse.abs"]
        return low and not d.saturated(), f"entropy {e:.3g} nat/token vs {base:.3g} at the start", None


def _entropy_blowup(d):
    """The policy's entropy climbs far above its start (towards uniform noise): an entropy bonus that outweighs the
    task (ent_coef too large), lr too high (then the KL to the reference climbs too), sampling hotter than the
    trainer's temperature. Try: lower or drop the entropy bonus (or cap it, clip-higher instead), lower lr, check the
    temperature on both sides."""
    if (e := d.cur.get("stats/entropy")) is not None and (base := d.base("stats/entropy")) is not None:
        k = d.cur.get("stats/kl")
        ev = f"entropy {e:.3g} nat/token vs {base:.3g} at the start" + ("" if k is None else f"; KL {k:.3g}")
        return e > TH["entropy_blowup.rel"] * base + TH["entropy_blowup.abs"], ev, None


def _sampler_gap(d):
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


def _high_truncation(d):
    """Responses do not end with EOS. Usually: max_new_tokens too small for the task's answers, a model out of its
    domain or not instruction-tuned that never learned to stop (no chat template), sampling too hot (noise seldom
    picks EOS), a policy that drifted (kl_blowup, entropy_blowup); less often a framework bug: a wrong EOS id, EOS
    masked out of the loss (eos_mask). Try: print a few samples and see where they stop (`--dump-batch N --steps N`,
    then `python repro.py OUT_DIR/batch-N.pt`); raise max_new_tokens, use an instruction-tuned model with its chat
    template, lower the temperature, give truncated responses a score of 0 (--no-eos-penalty 0); then check the EOS
    id and the response mask."""
    if (t := d.cur.get("rollout/truncated_frac")) is not None:
        return t > TH["high_truncation.frac"], f"{t:.0%} of responses hit the length limit", None


def _eos_mask(d):
    """The response mask does not end at the first EOS: EOS masked out (pad == eos with masks rebuilt from ids),
    or the padding after it trained. Try: build the mask from the sampler's stop position, pad with a non-EOS id."""
    if (e := d.cur.get("stats/eos_mask_err_frac")) is not None:
        return e > TH["eos_mask.frac"], f"{e:.0%} of responses have a mask that does not end at their first EOS", None


def _value_divergence(d):
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


def _grad_spike(d):
    """One batch produced an outsized gradient: outlier advantages, a near-zero-probability token, a bad sample.
    Try: keep grad clipping on, lower lr, look at the advantages and stats/ratio_max of that step."""
    g, prev = d.cur.get("stats/grad_norm"), d.prev("stats/grad_norm")
    if g is None or len(prev) < TH["baseline_n"]:
        return None
    ref = median(prev)
    return ref > 0 and g > TH["grad_spike.factor"] * ref, f"grad norm {g:.3g} vs median {ref:.3g} before", None


# What each failure mode can cause (its symptoms), from the mechanisms in the docstrings above and the symptoms the
# benchmark saw (bench/diagnose_bench.py's SYMPTOMS); diagnose.rank puts a cause before what it explains, and
# flat_reward is not reported while a finding that explains it is. A reward that falls and a KL that runs away explain
# each other (a policy that unlearns leaves its reference, one that leaves it unlearns): the earlier ranks first; so
# do high_truncation and kl_blowup. Outcomes (high_truncation, zero_variance_groups, reward_decline, flat_reward)
# explain little; bugs explain much. One way only, on purpose: entropy_* -> reward_decline (an entropy term moves the
# reward before the entropy crosses its threshold; a policy that unlearns seldom blows its entropy up), entropy_* ->
# kl_blowup (an entropy bonus drags the policy off its reference, and the KL crosses its threshold first; a KL that
# runs away does not by itself raise the entropy) and reward_scale -> kl_blowup (a KL term in the reward that
# outweighs the score drives the KL).
EXPLAINS = {
    "nan_inf": ("value_divergence", "kl_blowup", "entropy_blowup", "entropy_collapse", "reward_decline"),
    # trained on the wrong token probabilities: the policy drifts, loses its EOS, unlearns
    "logprob_mismatch": ("kl_blowup", "entropy_blowup", "entropy_collapse", "reward_decline", "high_truncation",
                         "zero_variance_groups", "grad_spike", "flat_reward"),
    # the KL term outweighs the score: the policy follows it (off its reference when its sign is wrong)
    "reward_scale": ("kl_blowup", "reward_decline", "value_divergence", "flat_reward"),
    "zero_variance_groups": ("flat_reward",),  # no advantage, no update
    "reward_decline": ("kl_blowup", "high_truncation", "zero_variance_groups", "flat_reward"),  # unlearning
    "kl_blowup": ("reward_decline", "high_truncation", "zero_variance_groups", "grad_spike",
                  "flat_reward"),  # far from the reference: it unlearns, loses its EOS
    "policy_frozen": ("flat_reward",),
    "entropy_collapse": ("kl_blowup", "reward_decline", "high_truncation", "zero_variance_groups", "flat_reward"),
    "entropy_blowup": ("kl_blowup", "reward_decline", "high_truncation", "zero_variance_groups", "flat_reward"),
    "sampler_precision_gap": (),  # small and steady: it slows learning, it does not break it
    "template_drift": ("eos_mask", "logprob_mismatch", "kl_blowup", "reward_decline", "flat_reward"),
    "eos_mask": ("logprob_mismatch", "kl_blowup", "high_truncation", "reward_decline", "flat_reward"),
    "high_truncation": ("kl_blowup", "zero_variance_groups", "flat_reward"),  # trained past where EOS belonged
    "value_divergence": ("reward_decline", "grad_spike", "flat_reward"),  # advantages from a broken critic
    "grad_spike": ("nan_inf", "kl_blowup", "entropy_blowup"),  # one outsized step
    "flat_reward": (),
}  # fmt: skip
EXPLAINS_FLAT = tuple(cid for cid, effects in EXPLAINS.items() if "flat_reward" in effects)


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


def main() -> None:
    """`python diagnose_checks.py`: each check in the order it runs, with what it reads and what it says."""
    for cid, check, needs in CHECKS:
        cause, fix = " ".join(check.__doc__.split()).split(" Try: ")
        print(f"{cid} (reads {' or '.join(needs)})\n  cause: {cause}\n  try: {fix}")
    print(f"{len(THRESHOLDS)} thresholds; each metric keeps its last {HISTORY} values")


if __name__ == "__main__":
    main()
