"""Write tests/golden/verl_core_algos.json: seeded fp64 inputs and the outputs of the real veRL 0.9.1 code.

This script is NOT run by the test suite and does NOT run in the project's environment: it needs the
`verl` package, which the project never depends on. tests/test_verl_golden.py reads the committed JSON
and compares minrl's implementation against it (docs/design.md 5.1).

How to regenerate (CPU only, a throwaway venv of about 1.4 GB, never the system python; the script runs in ~10 s):

    python3.11 -m venv /tmp/verl-env
    /tmp/verl-env/bin/pip install torch==2.13.0 numpy==2.4.6  # pinned: an unpinned torch pulls a CUDA build
    /tmp/verl-env/bin/pip install verl==0.9.1 --no-deps
    /tmp/verl-env/bin/pip install packaging==25.0 ray==2.60.0 tensordict==0.10.0 omegaconf==2.4.0 \
        transformers==5.10.4 codetiming==1.4.0
    /tmp/verl-env/bin/python tests/golden/make_verl_golden.py   # from the repository root

(`--no-deps` because verl's full dependency list, vllm/wandb/datasets/..., is not needed to import
`verl.trainer.ppo.core_algos` and `rollout_corr_helper`; the packages on the last pip line are exactly what their
import chain needs. pip prints a dependency-conflict warning about the rest; that is expected.)

What the file holds (every float is fp64, written with `repr`, so it reads back bit for bit; inputs are
rounded to 6 decimals to keep the file small, outputs are not rounded):

1. `masked_stats`: verl.utils.torch_functional masked_mean (all, and along the last axis), masked_var
   (unbiased and biased), masked_whiten (shift_mean True and False), incl. a case offset by 1e3.
2. `gae`: core_algos.compute_gae_advantage_return for several (gamma, lam). Its `advantages` output is
   WHITENED over the batch's valid tokens (0.9.1 whitens inside the function); its `returns` output is
   computed from the raw advantages before whitening. Token rewards and values are random and nonzero
   at masked positions too (veRL must skip them).
3. `grpo`: compute_grpo_outcome_advantage with norm_adv_by_std_in_grpo True and False; `rloo`:
   compute_rloo_outcome_advantage. Inputs are per-sequence rewards (put on one token of each row, so
   veRL's sum over the row returns them exactly), group ids (ints, not contiguous, one singleton group,
   one all-equal group) and the mask; outputs are veRL's [B, T] token advantages.
4. `policy_loss`: compute_policy_loss_vanilla with a real ActorConfig (dual clip, clip-higher), for
   each aggregation mode: loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower. The deprecated
   compute_policy_loss is run too and must agree exactly (checked here). Log-ratios include values
   beyond the +-20 clamp and ratios that trigger the dual clip.
5. `value_loss`: compute_value_loss (loss and vf_clipfrac) per aggregation mode and clip range.
6. `kl_penalty`: kl_penalty with "kl", "mse", "low_var_kl" (k1, k2, k3; the aliases are checked to
   agree), with log-ratios that hit the +-20 input clamp and the +-10 output clamp of k3.
7. `agg_loss`: agg_loss for token-mean, seq-mean-token-mean, seq-mean-token-sum, seq-mean-token-sum-norm (its
   default loss_scale_factor, the padded width T).

8. `rollout_corr` (verl.trainer.ppo.rollout_corr_helper): compute_rollout_correction_weights (token and sequence
   level, TIS "2.0" / "1.2" and IcePop "0.5_5.0"), compute_rollout_rejection_mask (every option alone, two chains,
   veRL's geometric preset 0.999_1.001), compute_offpolicy_metrics; log-ratios beyond the +-20 safety bound.
9. `policy_loss_families`: get_policy_loss_fn(gspo | cispo | sapo | geo_mean | dppo_tv | dppo_kl) per aggregation
   mode, with and without rollout IS weights: the loss, the metrics AND the gradient d loss / d log_prob (the
   stop-gradients of GSPO, CISPO, SAPO and DPPO show only there); ratios beyond exp(20), rows with A = 0.
10. `reinforce_pp`: compute_reinforce_plus_plus_outcome_advantage (gamma 1 and 0.99, observation holes);
    `reinforce_pp_baseline`: compute_reinforce_plus_plus_baseline_outcome_advantage on the GRPO inputs.
Sections 8-10 come after the others from the same seeded stream, so the inputs of 1-7 did not change.

Masks are 0/1 floats, right-padded with ragged lengths, with fully masked rows and rows whose middle
positions are masked (multi-turn observation tokens). At masked positions veRL's outputs hold
pass-through values; the test compares only valid positions.
"""

import json
import platform
import sys
from pathlib import Path

import numpy as np
import torch

SEED = 20261129
OUT = Path(__file__).with_name("verl_core_algos.json")
AGG_MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


def rounded(a: np.ndarray) -> np.ndarray:
    """Inputs rounded to 6 decimals: still exact fp64 numbers, but with a short decimal repr."""
    return np.round(a, 6)


def as_list(t) -> list:
    """Tensor/array -> nested lists of Python floats (fp64, exact through json's repr)."""
    if isinstance(t, torch.Tensor):
        t = t.detach().to(torch.float64).numpy()
    return np.asarray(t, dtype=np.float64).tolist()


def mask_list(m: torch.Tensor) -> list:
    return m.to(torch.int64).tolist()


def actor_config(cls, clip_low: float, clip_high: float, c: float, **kw):
    """A real veRL ActorConfig with the clip settings (clip_ratio = clip_ratio_low, as minrl has no third value)."""
    return cls(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, clip_ratio=clip_low,
               clip_ratio_low=clip_low, clip_ratio_high=clip_high, clip_ratio_c=c, **kw)  # fmt: skip


def loss_inputs(new, old, adv, mask) -> dict:
    """A policy-loss case's inputs as the golden file stores them."""
    return {"logprobs": as_list(new), "old_logprobs": as_list(old), "advantages": as_list(adv), "mask": mask_list(mask)}


def make_mask(rng: np.random.Generator, b: int, t: int, n_empty: int, n_holes: int) -> np.ndarray:
    """[B, T] right-padded ragged 0/1 mask: n_empty fully masked rows, one full row, n_holes rows with a
    masked position strictly inside the valid span; the first of them gets a second hole right before
    its last token (multi-turn observation tokens)."""
    assert t >= 6 and b >= n_empty + 1 + n_holes, "shape too small for the requested rows"
    lengths = rng.integers(1, t + 1, size=b)  # [B]
    rows = rng.permutation(b)
    empty, full, holed = rows[:n_empty], rows[n_empty], rows[n_empty + 1 : n_empty + 1 + n_holes]
    lengths[empty] = 0
    lengths[full] = t
    lengths[holed] = np.maximum(lengths[holed], 3)
    lengths[holed[:1]] = np.maximum(lengths[holed[:1]], 6)
    mask = (np.arange(t)[None, :] < lengths[:, None]).astype(np.float64)  # [B, T]
    for k, i in enumerate(holed):
        mask[i, rng.integers(1, lengths[i] - 1)] = 0.0  # a masked middle position
        if k == 0:
            mask[i, lengths[i] - 2] = 0.0  # a second hole, right before the last token
    return mask


def masked_stats_cases(rng, verl_F) -> list[dict]:
    cases = []
    for name, (b, t), offset in [("small", (4, 6), 0.0), ("medium", (10, 16), 0.0), ("offset1e3", (6, 10), 1e3)]:
        mask = torch.from_numpy(make_mask(rng, b, t, n_empty=1, n_holes=2))
        x = torch.from_numpy(rounded(rng.normal(0.3, 2.0, size=(b, t)) + offset))  # [B, T]
        cases.append(
            {
                "name": name,
                "inputs": {"x": as_list(x), "mask": mask_list(mask)},
                "outputs": {
                    "mean": verl_F.masked_mean(x, mask).item(),
                    "mean_last_dim": as_list(verl_F.masked_mean(x, mask, axis=-1)),
                    "var_unbiased": verl_F.masked_var(x, mask, unbiased=True).item(),
                    "var_biased": verl_F.masked_var(x, mask, unbiased=False).item(),
                    "whiten": as_list(verl_F.masked_whiten(x, mask, shift_mean=True)),
                    "whiten_no_shift": as_list(verl_F.masked_whiten(x, mask, shift_mean=False)),
                },
            }
        )
    return cases


def gae_cases(rng, core) -> list[dict]:
    cases = []
    for name, (b, t) in [("small", (7, 8)), ("medium", (12, 20))]:
        mask = torch.from_numpy(make_mask(rng, b, t, n_empty=2, n_holes=3))
        dense = 0.1 * rng.normal(size=(b, t))  # per-token shaping (e.g. -beta*KL), nonzero at masked slots too
        rewards = dense.copy()  # [B, T]
        lengths = (np.arange(t)[None, :] * mask.numpy()).max(axis=1).astype(int)  # last valid index per row
        rewards[np.arange(b), lengths] += rng.choice([0.0, 1.0], size=b)  # outcome score at the last token
        rewards = torch.from_numpy(rounded(rewards))
        values = torch.from_numpy(rounded(rng.normal(0.2, 0.7, size=(b, t))))  # [B, T]
        settings = []
        for gamma, lam in [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0)]:
            adv, ret = core.compute_gae_advantage_return(rewards, values, mask, gamma=gamma, lam=lam)
            settings.append({"gamma": gamma, "lam": lam, "advantages_whitened": as_list(adv), "returns": as_list(ret)})
        cases.append(
            {
                "name": name,
                "inputs": {"token_rewards": as_list(rewards), "values": as_list(values), "mask": mask_list(mask)},
                "settings": settings,
            }
        )
    return cases


def outcome_inputs(rng) -> list[dict]:
    """Per-sequence rewards, group ids and masks for GRPO/RLOO: groups of sizes 4, 1, 3, 5, 2 with
    non-contiguous ids; the size-3 group is all equal; one row of a larger group is fully masked."""
    out = []
    for name, binary in [("binary", True), ("continuous", False)]:
        sizes = {7: 4, 3: 1, 42: 3, 0: 5, 11: 2}
        ids = np.concatenate([np.full(n, g) for g, n in sizes.items()])
        rng.shuffle(ids)  # interleaved: a group is not a contiguous block
        b, t = len(ids), 7
        scores = rng.integers(0, 2, size=b).astype(np.float64) if binary else rounded(rng.normal(0.5, 1.0, size=b))
        scores[ids == 42] = 1.0 if binary else 0.3  # all-equal group: zero advantage
        if binary:
            grp = np.flatnonzero(ids == 0)
            scores[grp[:2]] = [0.0, 1.0]  # the 5-group is never all equal
            scores[ids == 3] = 1.0  # singleton: advantage = score / (1 + eps), nonzero
        mask = make_mask(rng, b, t, n_empty=1, n_holes=2)
        out.append({"name": name, "scores": scores, "ids": ids, "mask": mask})
    return out


def token_rewards_from_scores(scores: np.ndarray, mask: np.ndarray) -> torch.Tensor:
    """[B, T] zeros with the score on the last valid token (last column for a fully masked row): the
    row sum that veRL takes is then exactly the score."""
    b, t = mask.shape
    last = np.where(mask.sum(1) > 0, (np.arange(t)[None, :] * mask).max(1), t - 1).astype(int)
    tr = np.zeros((b, t))
    tr[np.arange(b), last] = scores
    return torch.from_numpy(tr)


def outcome_cases(rng, core) -> tuple[list[dict], list[dict]]:
    grpo, rloo = [], []
    for c in outcome_inputs(rng):
        tr = token_rewards_from_scores(c["scores"], c["mask"])
        mask = torch.from_numpy(c["mask"])
        assert torch.equal(tr.sum(-1), torch.from_numpy(c["scores"]))
        inputs = {"rewards": as_list(c["scores"]), "group_ids": c["ids"].tolist(), "mask": mask_list(mask)}
        for norm in (True, False):
            adv, ret = core.compute_grpo_outcome_advantage(
                tr.clone(), mask, c["ids"], epsilon=1e-6, norm_adv_by_std_in_grpo=norm
            )
            assert torch.equal(adv, ret)
            grpo.append(
                {"name": c["name"], "norm_std": norm, "epsilon": 1e-6, "inputs": inputs, "advantages": as_list(adv)}
            )
        adv, _ = core.compute_rloo_outcome_advantage(tr.clone(), mask, c["ids"])
        rloo.append({"name": c["name"], "inputs": inputs, "advantages": as_list(adv)})
    return grpo, rloo


def policy_loss_cases(rng, core, actor_config_cls) -> list[dict]:
    cases = []
    for name, (b, t) in [("small", (5, 8)), ("medium", (10, 16))]:
        mask = torch.from_numpy(make_mask(rng, b, t, n_empty=1, n_holes=2))
        old = rounded(-np.abs(rng.normal(1.0, 1.0, size=(b, t))))  # [B, T] old log-probs
        log_ratio = 0.3 * rng.normal(size=(b, t))  # mostly near-on-policy ...
        pick = rng.random(size=(b, t))
        log_ratio[pick < 0.15] = rng.choice([-2.0, -0.5, 0.5, 1.5, 2.5], size=int((pick < 0.15).sum()))
        log_ratio[pick > 0.95] = rng.choice([-25.0, 25.0, 30.0], size=int((pick > 0.95).sum()))  # beyond +-20
        adv = rounded(rng.normal(0.0, 1.0, size=(b, t)))
        adv[pick > 0.9] = -np.abs(adv[pick > 0.9])  # big ratios with A < 0 hit the dual clip
        # make sure valid positions hit both sides of the +-20 log-ratio clamp and the dual clip
        valid = np.argwhere(mask.numpy() > 0)
        for (i, j), lr, a in zip(
            valid[rng.choice(len(valid), 3, replace=False)], [25.0, -25.0, 30.0], [0.7, -0.4, -1.3]
        ):
            log_ratio[i, j], adv[i, j] = lr, a
        new = rounded(old + log_ratio)
        old_t, new_t, adv_t = (torch.from_numpy(a) for a in (old, new, adv))
        settings = []
        for clip_low, clip_high, c in [(0.2, 0.2, 3.0), (0.2, 0.28, 3.0), (0.1, 0.3, 2.0)]:
            per_mode = {}
            for mode in AGG_MODES:
                cfg = actor_config(actor_config_cls, clip_low, clip_high, c)
                loss, m = core.compute_policy_loss_vanilla(old_t, new_t, adv_t, mask, loss_agg_mode=mode, config=cfg)
                loss_d, clipfrac_d, kl_d, lower_d = core.compute_policy_loss(
                    old_t, new_t, adv_t, mask, None, clip_low, clip_high, c, loss_agg_mode=mode
                )
                assert loss.item() == loss_d.item() and m["actor/pg_clipfrac"] == clipfrac_d.item()
                assert m["actor/ppo_kl"] == kl_d.item() and m["actor/pg_clipfrac_lower"] == lower_d.item()
                per_mode[mode] = {
                    "loss": loss.item(),
                    "pg_clipfrac": m["actor/pg_clipfrac"],
                    "ppo_kl": m["actor/ppo_kl"],
                    "pg_clipfrac_lower": m["actor/pg_clipfrac_lower"],
                }
            settings.append({"clip_low": clip_low, "clip_high": clip_high, "clip_ratio_c": c, "outputs": per_mode})
        cases.append({"name": name, "inputs": loss_inputs(new_t, old_t, adv_t, mask), "settings": settings})
    return cases


def value_loss_cases(rng, core) -> list[dict]:
    cases = []
    for name, (b, t) in [("small", (5, 8)), ("medium", (10, 16))]:
        mask = torch.from_numpy(make_mask(rng, b, t, n_empty=1, n_holes=2))
        old_v = rounded(rng.normal(0.0, 1.0, size=(b, t)))  # [B, T]
        new_v = rounded(old_v + rng.normal(0.0, 0.6, size=(b, t)))
        ret = rounded(rng.normal(0.0, 1.5, size=(b, t)))
        old_t, new_t, ret_t = (torch.from_numpy(a) for a in (old_v, new_v, ret))
        settings = []
        for clip in (0.5, 0.2):
            per_mode = {}
            for mode in AGG_MODES:
                loss, clipfrac = core.compute_value_loss(
                    new_t, ret_t, old_t, mask, cliprange_value=clip, loss_agg_mode=mode
                )
                per_mode[mode] = {"loss": loss.item(), "vf_clipfrac": clipfrac.item()}
            settings.append({"clip": clip, "outputs": per_mode})
        cases.append(
            {
                "name": name,
                "inputs": {
                    "values": as_list(new_t),
                    "old_values": as_list(old_t),
                    "returns": as_list(ret_t),
                    "mask": mask_list(mask),
                },
                "settings": settings,
            }
        )
    return cases


def kl_cases(rng, core) -> list[dict]:
    extremes = [
        -40.0,
        -25.0,
        -20.0,
        -15.0,
        -11.0,
        -5.0,
        -1.0,
        -1e-4,
        0.0,
        1e-4,
        1.0,
        2.5,
        5.0,
        11.0,
        15.0,
        20.0,
        25.0,
        40.0,
    ]
    x = np.concatenate([extremes, rng.normal(0.0, 0.5, size=22)]).reshape(5, 8)  # [5, 8] logp - ref_logp
    ref = rounded(-np.abs(rng.normal(2.0, 1.0, size=x.shape)))
    logp = ref + x  # [5, 8]
    logp_t, ref_t = torch.from_numpy(logp), torch.from_numpy(ref)
    outputs = {}
    for ours, name, alias in [("k1", "kl", "k1"), ("k2", "mse", "k2"), ("k3", "low_var_kl", "k3")]:
        v = core.kl_penalty(logp_t, ref_t, name)
        assert torch.equal(v, core.kl_penalty(logp_t, ref_t, alias))
        outputs[ours] = as_list(v)
    k3 = torch.tensor(outputs["k3"])
    assert (k3 == 10.0).any(), "the +-10 clamp of k3 is not exercised"
    return [
        {
            "name": "extremes_and_random",
            "verl_names": {"k1": "kl", "k2": "mse", "k3": "low_var_kl"},
            "inputs": {"logprobs": as_list(logp_t), "ref_logprobs": as_list(ref_t)},
            "outputs": outputs,
        }
    ]


def agg_cases(rng, core) -> list[dict]:
    cases = []
    for name, (b, t) in [("small", (6, 7)), ("medium", (9, 14))]:
        mask = torch.from_numpy(make_mask(rng, b, t, n_empty=2, n_holes=2))
        loss_mat = torch.from_numpy(rounded(rng.normal(0.5, 1.0, size=(b, t))))  # [B, T]
        outputs = {mode: core.agg_loss(loss_mat, mask, mode).item() for mode in AGG_MODES}
        cases.append(
            {"name": name, "inputs": {"loss_mat": as_list(loss_mat), "mask": mask_list(mask)}, "outputs": outputs}
        )
    return cases


def gap_inputs(rng, b: int, t: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(old, rollout, mask) [B, T] for the rollout corrections: a near-on-policy gap (bf16-like, |rho| ~ 0.05), a few
    large ones, and valid tokens beyond the +-20 safety bound; masks with an empty row and holes."""
    mask = torch.from_numpy(make_mask(rng, b, t, n_empty=1, n_holes=2))
    old = rounded(-np.abs(rng.normal(1.0, 1.0, size=(b, t))))
    rho = 0.05 * rng.normal(size=(b, t))
    pick = rng.random(size=(b, t))
    rho[pick < 0.2] = rng.choice([-1.5, -0.7, 0.4, 0.9, 1.8], size=int((pick < 0.2).sum()))
    valid = np.argwhere(mask.numpy() > 0)
    for (i, j), x in zip(valid[rng.choice(len(valid), 2, replace=False)], [24.0, -23.0]):
        rho[i, j] = x  # rho = old - rollout beyond the +-20 clamp
    rollout = rounded(old - rho)
    return torch.from_numpy(old), torch.from_numpy(rollout), mask


def rollout_corr_cases(rng, rc) -> dict:
    """rollout_corr_helper: IS weights (token / sequence x TIS / IcePop thresholds), rejection masks (each option,
    a chain with per-option thresholds, a shared threshold), the off-policy metrics. Metric keys are veRL's, without
    the rollout_corr/ prefix (compute_rollout_correction_and_rejection_mask adds it)."""
    out = {"is": [], "rs": [], "offpolicy_metrics": []}
    rs_settings = [("token_k1", "2.0"), ("token_k1", "0.8_1.5"), ("token_k2", "0.02"), ("token_k3", "0.02")]
    bounds = ((1, "0.5_2.0"), (2, "0.05"), (3, "0.05"))
    rs_settings += [(f"seq_{a}_k{k}", th) for a in ("sum", "mean") for k, th in bounds]
    rs_settings += [("seq_mean_k1", "0.999_1.001"), ("seq_max_k2", "0.1"), ("seq_max_k3", "0.1")]
    rs_settings += [("token_k1,seq_mean_k3", "0.5_2.0,0.02"), ("token_k2,seq_max_k3", "0.05")]
    for name, (b, t) in [("small", (6, 9)), ("medium", (12, 16))]:
        old, rollout, mask = gap_inputs(rng, b, t)
        inputs = {"old_logprobs": as_list(old), "rollout_logprobs": as_list(rollout), "mask": mask_list(mask)}
        settings = []
        for level in ("token", "sequence"):
            for th in ("2.0", "0.5_5.0", "1.2"):
                w, m = rc.compute_rollout_correction_weights(
                    old - rollout, mask, rollout_is=level, rollout_is_threshold=th
                )
                settings.append({"level": level, "threshold": th, "weights": as_list(w), "metrics": m})
        out["is"].append({"name": name, "inputs": inputs, "settings": settings})
        settings = []
        for kind, th in rs_settings:
            keep, m = rc.compute_rollout_rejection_mask(old - rollout, mask, rollout_rs=kind, rollout_rs_threshold=th)
            settings.append({"kind": kind, "threshold": th, "mask": as_list(keep), "metrics": m})
        out["rs"].append({"name": name, "inputs": inputs, "settings": settings})
        m = rc.compute_offpolicy_metrics(old_log_prob=old, rollout_log_prob=rollout, response_mask=mask)
        out["offpolicy_metrics"].append({"name": name, "inputs": inputs, "metrics": m})
    # the unified entry point prefixes every key with rollout_corr/ and swaps the mask: checked once here
    _, keep, m = rc.compute_rollout_correction_and_rejection_mask(
        old,
        rollout,
        mask,
        rollout_is="token",
        rollout_is_threshold=2.0,
        rollout_rs="seq_mean_k1",
        rollout_rs_threshold="0.999_1.001",
    )
    assert all(k.startswith("rollout_corr/") for k in m) and keep.shape == mask.shape
    return out


FAMILIES = ["gspo", "cispo", "sapo", "geo_mean", "dppo_tv", "dppo_kl"]


def family_loss_cases(rng, core, actor_config_cls) -> list[dict]:
    """Each loss family's loss, metrics and gradient d loss / d log_prob, per aggregation mode (sapo and geo_mean
    aggregate per sequence whatever the mode), with and without rollout IS weights. Log-probs stay < 0 (DPPO
    takes probabilities); rows of an all-equal group have A = 0; log-ratios beyond +-20 and dual-clip territory."""
    cases = []
    for name, (b, t) in [("small", (6, 8)), ("medium", (10, 14))]:
        mask = torch.from_numpy(make_mask(rng, b, t, n_empty=1, n_holes=2))
        old = -np.abs(rng.normal(1.2, 1.2, size=(b, t))) - 1e-3  # [B, T] old log-probs < 0
        log_ratio = 0.15 * rng.normal(size=(b, t))
        pick = rng.random(size=(b, t))
        log_ratio[pick < 0.2] = rng.choice([-1.0, -0.3, 0.25, 0.6, 1.2], size=int((pick < 0.2).sum()))
        adv = rng.normal(0.0, 1.0, size=(b,))[:, None].repeat(t, 1)  # sequence-level advantages (GMPO's case)
        adv[0] = 0.0  # a row of an all-equal group
        adv[1] += 0.3 * rng.normal(size=t)  # and a row with token-level advantages
        valid = np.argwhere(mask.numpy() > 0)
        for i, j in valid[rng.choice(len(valid), 2, replace=False)]:
            old[i, j], log_ratio[i, j] = -25.0, 24.9  # a ratio beyond exp(20)
        new = np.minimum(old + log_ratio, -1e-4)
        old_t, new_t, adv_t = (torch.from_numpy(rounded(a)) for a in (old, new, adv))
        is_w = torch.from_numpy(rounded(np.exp(np.clip(0.3 * rng.normal(size=(b, t)), -1, 1)))) * mask
        settings = []
        for kind in FAMILIES:
            modes = AGG_MODES  # sapo and geo_mean ignore the mode (veRL): the same value under each
            clips = [(0.2, 0.28)] if kind not in ("gspo",) else [(3e-4, 4e-4), (0.2, 0.28)]
            for clip_low, clip_high in clips:
                for mode in modes:
                    for weighted in (False, True):
                        cfg = actor_config(actor_config_cls, clip_low, clip_high, 3.0, tau_pos=1.0, tau_neg=1.05,
                                           loss_agg_mode=mode)  # fmt: skip
                        lp = new_t.clone().requires_grad_(True)
                        fn = core.get_policy_loss_fn(kind)
                        loss, m = fn(
                            old_t,
                            lp,
                            adv_t,
                            mask,
                            loss_agg_mode=mode,
                            config=cfg,
                            rollout_is_weights=is_w if weighted else None,
                        )
                        (grad,) = torch.autograd.grad(loss, lp)
                        settings.append(
                            {
                                "kind": kind,
                                "clip_low": clip_low,
                                "clip_high": clip_high,
                                "agg": mode,
                                "weighted": weighted,
                                "loss": loss.item(),
                                "grad": as_list(grad),
                                "metrics": {k.split("/")[1]: v for k, v in m.items()},
                            }
                        )
        inputs = {**loss_inputs(new_t, old_t, adv_t, mask), "is_weights": as_list(is_w)}
        cases.append({"name": name, "inputs": inputs, "settings": settings})
    return cases


def reinforce_pp_cases(rng, core, algo_config_cls) -> dict:
    """reinforce_plus_plus (per-token rewards, gamma 1 and 0.99, masks with holes) and reinforce_plus_plus_baseline
    (the GRPO inputs: a singleton group, an all-equal group)."""
    plain = []
    for name, (b, t) in [("small", (6, 8)), ("medium", (10, 14))]:
        mask = torch.from_numpy(make_mask(rng, b, t, n_empty=1, n_holes=2))
        rewards = torch.from_numpy(rounded(0.2 * rng.normal(size=(b, t)) + (rng.random((b, t)) < 0.1)))
        settings = []
        for gamma in (1.0, 0.99):
            adv, ret = core.compute_reinforce_plus_plus_outcome_advantage(
                rewards.clone(), mask, config=algo_config_cls(gamma=gamma)
            )
            settings.append({"gamma": gamma, "advantages": as_list(adv), "returns": as_list(ret)})
        plain.append(
            {"name": name, "inputs": {"token_rewards": as_list(rewards), "mask": mask_list(mask)}, "settings": settings}
        )
    baseline = []
    for c in outcome_inputs(rng):
        tr, mask = token_rewards_from_scores(c["scores"], c["mask"]), torch.from_numpy(c["mask"])
        adv, ret = core.compute_reinforce_plus_plus_baseline_outcome_advantage(tr.clone(), mask, c["ids"])
        assert torch.equal(adv, ret)
        inputs = {"rewards": as_list(c["scores"]), "group_ids": c["ids"].tolist(), "mask": mask_list(mask)}
        baseline.append({"name": c["name"], "inputs": inputs, "advantages": as_list(adv)})
    return {"reinforce_pp": plain, "reinforce_pp_baseline": baseline}


def main() -> None:
    import verl
    import verl.trainer.ppo.core_algos as core
    import verl.trainer.ppo.rollout_corr_helper as rc
    import verl.utils.torch_functional as verl_F
    from verl.trainer.config import AlgoConfig
    from verl.workers.config import ActorConfig

    rng = np.random.default_rng(SEED)
    grpo, rloo = outcome_cases(rng, core)
    data = {
        "meta": {
            "verl": verl.__version__,
            "torch": torch.__version__,
            "numpy": np.__version__,
            "python": platform.python_version(),
            "seed": SEED,
            "dtype": "float64",
            "generator": "tests/golden/make_verl_golden.py",
            "notes": "gae.advantages_whitened are whitened inside veRL 0.9.1; gae.returns use the raw advantages. "
            "Outputs at masked positions are veRL pass-through values: compare valid positions only.",
        },
        "masked_stats": masked_stats_cases(rng, verl_F),
        "gae": gae_cases(rng, core),
        "grpo": grpo,
        "rloo": rloo,
        "policy_loss": policy_loss_cases(rng, core, ActorConfig),
        "value_loss": value_loss_cases(rng, core),
        "kl_penalty": kl_cases(rng, core),
        "agg_loss": agg_cases(rng, core),
    }
    # issue 22, appended after the sections above so that their inputs (one seeded stream) stay the same
    data["rollout_corr"] = rollout_corr_cases(rng, rc)
    data["policy_loss_families"] = family_loss_cases(rng, core, ActorConfig)
    data.update(reinforce_pp_cases(rng, core, AlgoConfig))
    text = json.dumps(data, separators=(",", ":"))
    OUT.write_text(text + "\n")
    print(
        f"wrote {OUT} ({len(text) / 1024:.1f} KiB) with verl {verl.__version__}, torch {torch.__version__}",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
