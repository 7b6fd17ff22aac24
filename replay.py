"""Replay: re-run one saved update bit for bit, or one update of a batch another framework exported.

    python trainer.py --dump-batch 7 --steps 7          # the run saves what update 7 reads (repro.dumped_update)
    python replay.py runs/b/batch-7.pt                # re-run exactly that update: exit 0 iff identical
    python replay.py verl_batch.pt --model M --adv-estimator grpo [trainer flags]   # another framework's batch
    python repro.py runs/b/batch-7.pt                 # what a --dump-batch file holds

This file sits above the trainer (it rebuilds the trainer's models and calls its `ppo_update`); the trainer writes
the dumps through repro.py, below it.

1. `replay(path)` rebuilds the models of a --dump-batch file (restore_update) and re-runs `ppo_update` on its batch
   (set a breakpoint there); `report_replay` prints both rows: the same metrics and digest (or error) on the same
   device, dtype and threads. Earlier versions' dumps replay too (batch_fields).
2. `replay_foreign(path, cfg)`: a batch exported from another framework, with the model that produced it (--model)
   and this project's flags for the update (the estimator, clip, loss_agg, ...). The file is a .pt (torch.save of
   a dict of tensors, read weights_only) or a .npz (numpy.savez), tensors named as in veRL's DataProto
   `batch.batch` (FOREIGN_BATCH); veRL's `uid` strings as integer group ids. From veRL, after compute_advantage in
   the trainer's step: torch.save({**batch.batch, "uid": ids}, "b.pt") with ids =
   torch.from_numpy(np.unique(batch.non_tensor_batch["uid"], return_inverse=True)[1]) (tensors only: weights_only).
   The replay recomputes the old (and reference) logprobs with M and, from the scores, the advantages; prints each
   next to the file's, per token (token_diffs); then runs one update on the batch as given (its old logprobs the
   anchor, its advantages; no critic: its weights are not in the file) and prints its metrics under both names
   (ours, veRL's).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields
from pathlib import Path

import numpy as np
import torch

import common
import offpolicy
import repro
import trainer
from checkpoint import load_pt
from cli import keep_threads, parse_config
from common import make_autocast
from critics import make_critics
from diagnose import verl_aliases
from lora import adapters_off
from memory import Batch
from runlog import format_table
from trainer import Config


def restore_update(d: dict, cfg, device):
    """The policy, its AdamW, the critics and the shuffle generator of a dumped update, as they were before it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_config = json.loads(d["model_config"])
    policy = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_config.pop("model_type"), **model_config))
    policy.load_state_dict(d["policy"])
    policy.to(device).eval()
    opt = torch.optim.AdamW(policy.parameters(), lr=cfg.lr, eps=cfg.adam_eps, weight_decay=0.0)
    opt.load_state_dict(d["opt"])
    critics = make_critics(cfg, policy, None, device, adam_eps=cfg.adam_eps) if d["critics"] else None
    for k, state in enumerate(d["critics"]):
        critics.models[k].load_state_dict(state)
        critics.opts[k].load_state_dict(d["critic_opts"][k])
    return policy, opt, critics, torch.Generator().set_state(d["shuffle_gen"])


def batch_fields(saved: dict, names: list[str], where: str) -> dict:
    """The Batch fields `names` of a dumped batch; a dump from before Batch (a dict with kl_beta, policy_version,
    returns, None for a neutral anchor or weight, no critic keys without a critic) gets them spelled out."""
    if unknown := saved.keys() - {*names, "kl_beta", "policy_version", "returns"}:
        raise ValueError(f"{where}: the batch has fields {sorted(unknown)} that Batch lacks (its fields: {names})")
    mask, old = saved["response_mask"], saved.get("old_logprobs")  # old None: the anchor is the first forward's
    ones = torch.ones_like(mask, dtype=torch.float32)
    neutral = {"clip_anchor": old, "token_weights": ones, "pg_mask": mask, "ent_mask": mask, "loss_mask": mask.float()}
    fields = {k: neutral[k] if saved.get(k) is None and k in neutral else saved.get(k) for k in names}
    optional = ("old_values", "critic_returns", "shares", "old_logprobs", "clip_anchor", "ref_logprobs", "is_weights")
    if missing := [k for k, v in fields.items() if v is None and k not in optional]:
        raise ValueError(f"{where}: the batch lacks {missing}: only critic fields, anchors, ref_logprobs may be None")
    return fields


def report_replay(path, saved: dict, metrics: dict | None, error: str | None, digest: str | None) -> bool:
    """Print how a replay compares with the saved update; True iff identical (or the same error)."""
    if error is not None:
        print(f"[minrl] replay of {path} raised {error}\n[minrl] the original update raised {saved['error']}")
        return error == saved["error"]
    if saved["error"] is not None:
        print(f"[minrl] replay of {path} ran through, but the original update raised {saved['error']}")
        return False
    same = lambda x, y: x == y or (x != x and y != y)  # noqa: E731  NaN (x != x) equals NaN: the same update
    diff = [k for k in sorted(metrics | saved["metrics"]) if not same(metrics.get(k), saved["metrics"].get(k))]
    same_state = digest == saved["state_after"]
    rows = [{"step": "original", **saved["metrics"]}, {"step": "replay", **metrics}]
    print(format_table(rows, ["step", *sorted(metrics)]))
    print(
        f"[minrl] replay of {path}: metrics {'identical' if not diff else 'differ in ' + ', '.join(diff)}; weights and "
        f"optimizer state (sha256) {'identical' if same_state else 'differ'}"
        + ("" if same_state and not diff else " (same device, dtype and OMP_NUM_THREADS as the run?)")
    )
    return same_state and not diff


FOREIGN_BATCH = {  # name (veRL's DataProto) -> (required, what it holds); [B, R]: response tokens, right-padded
    "input_ids": (True, "[B, P+R] int: prompt (left-padded) + response ids"),
    "attention_mask": (True, "[B, P+R] int: 1 on real prompt and response tokens"),
    "responses": (True, "[B, R] int: the response ids (= input_ids[:, -R:])"),
    "response_mask": (False, "[B, R]: 1 on the tokens the loss trains (default: attention_mask[:, -R:], as veRL)"),
    "old_log_probs": (True, "[B, R] float: the trainer's logprobs before the update (the PPO anchor)"),
    "ref_log_prob": (False, "[B, R] float: the reference model's"),
    "rollout_log_probs": (False, "[B, R] float: the sampler's"),
    "values": (False, "[B, R] float: the critic's, before the update (GAE)"),
    "advantages": (False, "[B, R] float: the advantages the update used"),
    "returns": (False, "[B, R] float: the returns (GAE: the critic's target)"),
    "token_level_scores": (False, "[B, R] float: the task's scores (each at its sequence's last token)"),
    "token_level_rewards": (False, "[B, R] float: the scores with the in-reward KL penalty, if any"),
    "uid": (False, "[B] int: the prompt each sample came from (group estimators)"),
}


WHAT = "--dump-batch file, or a dict of tensors only (torch.from_numpy on arrays such as uid)"


def is_foreign_batch(path) -> bool:
    """True for a batch file in FOREIGN_BATCH's layout: a .npz, or a .pt holding any of its keys and no 'config'
    (load_foreign_batch then names what is missing)."""
    if str(path).endswith(".npz"):
        return True
    d = load_pt(Path(path), what=WHAT, map_location="cpu", mmap=True)  # mmap: the keys, not the tensors, are read
    return isinstance(d, dict) and "config" not in d and any(k in d for k in FOREIGN_BATCH)


def _foreign_tensor(k: str, v, fail):
    """One FOREIGN_BATCH entry as a long (ids, masks, uid) or float32 tensor; anything else: an error with the fix."""
    try:
        v = torch.from_numpy(v) if isinstance(v, np.ndarray) else v
        if not isinstance(v, torch.Tensor):
            raise TypeError(type(v).__name__)
        return v.long() if k in ("input_ids", "attention_mask", "responses", "uid") else v.float()
    except (TypeError, ValueError) as e:
        fix = " (uid: integer group ids, np.unique(uids, return_inverse=True)[1])" if k == "uid" else ""
        raise fail(f"'{k}' is not a numeric array ({e}){fix}") from None


def load_foreign_batch(path) -> dict:
    """The tensors of a FOREIGN_BATCH file on the CPU (float32 / long), names, shapes and values checked: a missing
    key, a tensor of another shape or kind, responses that are not input_ids' tail, NaN on a trained token or neither
    advantages nor scores is an error naming the file, the key and the layout. Other keys are ignored."""
    layout = "; ".join(f"{k}{'' if req else ' (optional)'}: {what}" for k, (req, what) in FOREIGN_BATCH.items())
    fail = lambda msg: ValueError(f"{path}: {msg}. Layout (replay.py detail 2): {layout}")  # noqa: E731
    if str(path).endswith(".npz"):
        with np.load(path, allow_pickle=False) as z:  # object arrays (veRL's string uids) refused: no pickles
            try:
                raw = {k: z[k] for k in z.files if k in FOREIGN_BATCH}
            except ValueError as e:
                raise fail(f"an entry is not a numeric array ({e})") from None
    else:
        raw = load_pt(Path(path), what=WHAT, map_location="cpu")
    if missing := [k for k, (req, _) in FOREIGN_BATCH.items() if req and k not in raw]:
        raise fail(f"no {missing}")
    if not any(k in raw for k in ("advantages", "token_level_scores", "token_level_rewards")):
        raise fail("neither advantages nor token_level_scores / token_level_rewards: nothing to train on")
    t = {k: _foreign_tensor(k, v, fail) for k, v in raw.items() if k in FOREIGN_BATCH}
    for k in ("input_ids", "responses"):
        if t[k].dim() != 2:
            raise fail(f"'{k}' has shape {tuple(t[k].shape)}: expected 2 dimensions [B, tokens]")
    (B, W), R = t["input_ids"].shape, t["responses"].shape[-1]
    if tuple(t["attention_mask"].shape) != (B, W):
        raise fail(f"'attention_mask' has shape {tuple(t['attention_mask'].shape)}, expected {[B, W]}")
    t.setdefault("response_mask", t["attention_mask"][:, -R:].float())
    for k, v in t.items():
        want = (B,) if k == "uid" else (B, W) if k in ("input_ids", "attention_mask") else (B, R)
        if tuple(v.shape) != want:
            raise fail(f"'{k}' has shape {tuple(v.shape)}, expected {list(want)} (B = {B}, P+R = {W}, R = {R})")
    if not t["response_mask"].any():
        raise fail("'response_mask' is all 0: no token to train")
    for k, v in t.items():
        if v.is_floating_point() and not torch.isfinite(v[t["response_mask"] > 0] if v.dim() == 2 else v).all():
            raise fail(f"'{k}' is NaN / inf on a trained token (response_mask 1)")
    if not torch.equal(t["input_ids"][:, -R:], t["responses"]):
        raise fail("'responses' differs from input_ids[:, -R:]: the response must be the right end of input_ids")
    return t


def token_diffs(pairs: dict, mask) -> list[dict]:
    """One row per (name -> (ours [B, R], theirs [B, R])): max and mean |ours - theirs| over the trained tokens."""
    rows = []
    for name, (ours, theirs) in pairs.items():
        d = (ours - theirs).abs()[mask > 0]
        rows.append({"quantity": name, "max_abs_diff": d.max().item(), "mean_abs_diff": d.mean().item()})
    return rows


def replay(path: str) -> tuple[dict | None, bool]:
    """Re-run a --dump-batch update (break in ppo_update to step in): (metrics, same metrics + digest or error?)."""
    d = load_pt(Path(path), need=("batch", "config", "policy"), what="--dump-batch file", map_location="cpu")
    saved = json.loads(d["config"])  # a subclass's fields (async_loop.AsyncConfig) do not enter the update
    names = {f.name for f in fields(Config)}  # older dumps lack newer fields: those take their defaults
    cfg = Config(**{**{k: v for k, v in saved.items() if k in names}, "dump_batch": 0, "resume": None})
    _, _, _, device = common.setup_dist(device=cfg.device)
    keep_threads(d.get("threads"), path)  # the update's numbers depend on the thread count (older dumps: unknown)
    policy, opt, critics, gen = restore_update(d, cfg, device)
    saved_batch = batch_fields(d["batch"], [f.name for f in fields(Batch)], path)  # also older dumps
    batch = Batch(**{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in saved_batch.items()})
    torch.set_rng_state(d["torch_rng"])  # last: building the models above draws from the global RNG
    metrics, error, autocast = None, None, make_autocast(cfg.dtype, device)
    try:
        with repro.planted(cfg.inject, trainer):  # an injection planted in the update is planted again
            metrics = trainer.ppo_update(cfg, policy, opt, critics, batch, 1, gen, autocast, d["update_actor"])
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    digest = repro.state_digest(policy, opt, critics) if error is None else None
    return metrics, report_replay(path, d, metrics, error, digest)


def replay_foreign(path: str, cfg: Config) -> tuple[dict, list[dict]]:
    """One update of a batch another framework exported (detail 2): its logprobs (and, from its scores, its
    advantages) recomputed with --model and compared per token, then one update on the batch as given (with this
    config's rollout corrections, from its rollout_log_probs; --inject planted as in a run). Returns (the update's
    metrics, the comparison rows)."""
    with repro.planted(cfg.inject, trainer):
        return foreign_update(path, cfg)


def foreign_update(path: str, cfg: Config) -> tuple[dict, list[dict]]:
    """replay_foreign's work, its injection planted."""
    where = f"replay.py {path}"
    if cfg.model is None:
        raise ValueError(f"{where}: a batch from another framework needs --model (the weights that made it)")
    _, _, _, device = common.setup_dist(device=cfg.device)
    t = {k: v.to(device) for k, v in load_foreign_batch(path).items()}
    # (a critic's weights are not in the file: none trains)
    policy, _, opt, ref, *_ = trainer.build_models(cfg, cfg.model, device, 1)
    ids, attn, mask, theirs = t["input_ids"], t["attention_mask"], t["response_mask"], t["old_log_probs"]
    R, ref_logp, autocast = mask.shape[1], t.get("ref_log_prob"), make_autocast(cfg.dtype, device)
    if ref_logp is None and (cfg.kl_loss or cfg.kl_in_reward):
        raise ValueError(f"{where}: --kl-loss / --kl-in-reward need the batch's 'ref_log_prob'")
    with torch.no_grad(), autocast():
        pairs = {"old_log_probs": (trainer.trainer_logprobs(cfg, policy, ids, attn, R)[0], theirs)}  # [B, R] each
        with adapters_off(ref, cfg.lora_rank > 0 and ref_logp is not None):  # LoRA: the reference is its base
            ours_ref = trainer.trainer_logprobs(cfg, ref, ids, attn, R)[0] if ref_logp is not None else None
    pairs |= {"ref_log_prob": (ours_ref, ref_logp)} if ref_logp is not None else {}
    if "rollout_log_probs" in t:  # the file's own sampler-trainer gap
        pairs["rollout_log_probs (vs their old)"] = (theirs, t["rollout_log_probs"])
    elif cfg.rollout_is or cfg.rollout_rs or cfg.off_policy != "none":
        raise ValueError(f"{where}: a rollout correction needs the batch's 'rollout_log_probs'")
    scores = t.get("token_level_scores" if cfg.kl_in_reward else "token_level_rewards", t.get("token_level_scores"))
    adv = t.get("advantages")
    if scores is not None and (cfg.adv_estimator != "gae" or "values" in t):  # ours from their scores and values
        if "uid" not in t and cfg.adv_estimator in ("grpo", "rloo", "reinforce_plus_plus_baseline"):
            raise ValueError(f"{where}: adv_estimator {cfg.adv_estimator!r} needs the batch's 'uid' (group ids)")
        groups = t.get("uid", torch.arange(len(ids), device=device))  # (gae, reinforce++: no groups)
        values = t.get("values")
        _, ours, returns, _, _ = trainer.compute_advantages(
            cfg, scores, mask, theirs, ref_logp, cfg.kl_coef, groups, values
        )
        pairs |= {k: (v, t[k]) for k, v in (("advantages", ours), ("returns", returns)) if k in t}
        adv = ours if adv is None else adv
    if adv is None:
        raise ValueError(f"{where}: no 'advantages', and adv_estimator 'gae' needs 'values' to compute them")
    is_weights, loss_mask, _ = offpolicy.corrections(cfg, theirs, t.get("rollout_log_probs", theirs), mask)
    m = mask.long()
    batch = Batch(input_ids=ids, attention_mask=attn, response_mask=m, loss_mask=loss_mask, old_logprobs=theirs,
                  clip_anchor=theirs, ref_logprobs=ref_logp, advantages=adv * mask, token_weights=torch.ones_like(mask),
                  pg_mask=m, ent_mask=m, is_weights=is_weights, old_values=None, critic_returns=None,
                  shares=None)  # fmt: skip
    metrics = trainer.ppo_update(cfg, policy, opt, None, batch, 1, torch.Generator().manual_seed(cfg.seed), autocast)
    rows = token_diffs(pairs, mask)
    print(f"[minrl] {path}: per-token |ours - theirs| over {int(mask.sum())} trained tokens")
    print(format_table(rows, ["quantity", "max_abs_diff", "mean_abs_diff"]))
    named = {**metrics, **verl_aliases(metrics, cfg.task)}  # the update's metrics, also under veRL's names
    print(format_table([{"metric": k, "value": v} for k, v in sorted(named.items())], ["metric", "value"]))
    return metrics, rows


def main(argv=None) -> None:
    """`python replay.py BATCH [flags]`: re-run a --dump-batch update (exit 1 unless identical), or one update of
    another framework's batch with these trainer flags."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("batch", help="a file written by trainer.py --dump-batch, or another framework's batch")
    ap.add_argument("flags", nargs=argparse.REMAINDER, help="another framework's batch: trainer flags (--model M ...)")
    args = ap.parse_args(argv)
    if is_foreign_batch(args.batch):  # another framework's batch (detail 2)
        return replay_foreign(args.batch, parse_config(Config, args.flags))
    if args.flags:
        ap.error(f"{args.batch} is a --dump-batch file: it replays with its own config, without flags {args.flags}")
    sys.exit(0 if replay(args.batch)[1] else 1)


if __name__ == "__main__":
    main()
