"""The bug catalogue: fourteen classic RL-for-LLM bugs to plant on purpose, and one update saved to disk.

    python repro.py                                       # the injections: bug, planted by, config, diagnosis
    python repro.py runs/b/batch-7.pt                     # what a --dump-batch file holds
    python trainer.py --inject reward_scale --steps 40    # plant one; the live diagnosis must name it
    python trainer.py --dump-batch 7 --steps 7 --out-dir runs/b   # save everything update 7 needs (batch-7.pt)
    python replay.py runs/b/batch-7.pt                    # re-run exactly that update, bit for bit (replay.py)

Injections (their regression suite is tests/test_inject.py)
1. A bug is planted from outside the loop: `with planted(cfg.inject, trainer):` wraps trainer.train's run, and for
   its duration each function an injection's `points` names ("module.function"; trainer: the trainer's own
   helpers) is replaced by the bug's version, which its `plant` returns, defined here beside it; the originals are
   put back on the way out. No line of the trainer names a bug. This works because the trainer calls these
   functions through their module at call time (`ppo_math.value_loss(...)`, `rollout.rollout_env(...)`,
   `rollout.sync_weights(...)`, its own helpers by their global name), never through a `from x import f` name
   bound at import time. Other callers that import a function by name (evaluation.py's rollout_env) are out of
   reach on purpose: the bugs live in the training loop only. One plant keeps state across the run's steps
   (stale_old_logprobs: its frozen copy of the policy, one update behind).
2. An injection's stated config, where the bug really hurts (reward_scale: KL in the reward, as group and GAE
   normalisation and Adam are nearly scale-invariant), fills the fields left at their default, each override
   printed. The live diagnosis must name the injection's failure-mode id.

Dump (the trainer writes it, replay.py reads it: it sits above the trainer, this file below)
3. `dumped_update` (`dumping`) saves what one update reads (batch, model / optimizer states, shuffle and global RNG)
   in one weights_only file BEFORE it runs (a crashing update still leaves its inputs, then its error), then its
   metrics and `state_digest` (sha256 of every weight and AdamW moment). World size 1. `python replay.py FILE`
   rebuilds the models, re-runs the update and compares; a batch another framework exported replays there too.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import hashlib
import json
import textwrap
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F

import ppo_math
import rollout
import tasks
import vllm_engine
from cli import check_choice, check_range
from envs import multi_turn
from rollout import decode_responses, last_valid, position_ids_from_mask


class Injection(NamedTuple):
    """One planted bug: what goes wrong, where it hurts, how it is diagnosed, what it replaces and how."""

    bug: str  # what goes wrong
    config: dict  # the stated config where it hurts (detail 2)
    diagnosed_as: str  # the failure-mode id diagnose.py must report (detail 2)
    points: str  # the functions it replaces for the run, "module.function" (trainer: the trainer's own)
    plant: Callable  # plant(trainer module) -> {(module, function name): the bug's version} (detail 1)


def at_last_token(response_mask, scores):
    """[B, R] each episode's return [B] on the last token of `response_mask` (a mask rebuilt by a bug)."""
    return last_valid(response_mask).float() * scores[:, None]


def scaled_scores(trainer, factor: float) -> dict:
    """reward_scale (x 0.01), answer_format (x 0: the parser never matches): every score x factor."""
    episode_rewards = trainer.episode_rewards

    def scaled(cfg, samples):
        samples, token_scores, _ = episode_rewards(cfg, samples)
        token_scores = token_scores * factor  # [B, R]
        return samples, token_scores, token_scores.sum(-1)

    return {(trainer, "episode_rewards"): scaled}


def plant_eos_unmasked(trainer) -> dict:
    """eos_unmasked: the loss mask is all ones (the padding after EOS is trained too); as in the real bug, each
    episode's return moves to the end of the new mask."""
    episode_rewards = trainer.episode_rewards

    def unmasked(cfg, samples):
        samples, _, scores = episode_rewards(cfg, samples)
        samples = replace(samples, response_mask=torch.ones_like(samples.response_mask))  # [B, R]
        return samples, at_last_token(samples.response_mask, scores), scores

    return {(trainer, "episode_rewards"): unmasked}


def pad_with_eos(samples, eos_id: int):
    """The pad_eq_eos bug: the response padded with EOS, then the mask rebuilt as ids != pad drops EOS itself."""
    samples.response_ids = samples.response_ids.masked_fill(samples.response_mask == 0, eos_id)  # [B, R]
    samples.response_mask = (samples.response_ids != eos_id).long()  # [B, R]
    prompt_mask = samples.attention_mask[:, : samples.prompt_ids.shape[1]]  # [B, P]
    samples.attention_mask = torch.cat([prompt_mask, samples.response_mask], 1)  # [B, P+R]
    return samples


def plant_pad_eq_eos(trainer) -> dict:
    """pad_eq_eos: the sampled responses pass through pad_with_eos; each episode's return moves to the end of the
    new mask (its EOS masked out)."""
    rollout_env, episode_rewards = rollout.rollout_env, trainer.episode_rewards

    def padded(model, tokenizer, envs, seeds, eos_ids, **kw):
        samples, episodes = rollout_env(model, tokenizer, envs, seeds, eos_ids, **kw)
        return pad_with_eos(samples, eos_ids[0]), episodes

    def moved(cfg, samples):
        samples, _, scores = episode_rewards(cfg, samples)
        return samples, at_last_token(samples.response_mask, scores), scores

    return {(rollout, "rollout_env"): padded, (trainer, "episode_rewards"): moved}


def retokenized(samples, eos_id: int, pad_id: int):
    """The retokenized_history bug: the episode's text re-encoded (decoded without special tokens, the last
    action's stop token written again by the template) drops the stop token `eos_id` ending each non-empty earlier
    action (other stop ids stay); ids, masks and rewards follow the new tokens (a dropped token's reward moves to the
    action token before it), the sampler's logprobs stay where they were: from the second turn on they belong to
    other tokens. A Python loop over rows and tokens: an injection, not a hot path."""
    P, (B, R) = samples.prompt_ids.shape[1], samples.response_ids.shape
    ids, mask, real = samples.response_ids, samples.response_mask, samples.attention_mask[:, P:]  # [B, R] each
    new = {"ids": torch.full_like(ids, pad_id), "mask": torch.zeros_like(mask), "real": torch.zeros_like(real)}
    scores = torch.zeros_like(samples.token_scores)  # [B, R]
    for b in range(B):
        acts, eos = mask[b].nonzero().flatten(), (ids[b] == eos_id) & mask[b].bool()  # [R] an action's stop token
        last = int(acts[-1]) if len(acts) else -1  # the final action token: the template writes its EOS again
        after_action = F.pad(mask[b, :-1].bool() & ~eos[:-1], (1, 0))  # [R] the token before is an action's own
        drop = eos & after_action & (torch.arange(R, device=ids.device) < last)  # [R] inner end-of-turn tokens
        keep = [t for t in range(int(real[b].sum())) if not drop[t]]
        for k, t in enumerate(keep):  # each kept token takes the rewards of the dropped ones after it
            new["ids"][b, k], new["mask"][b, k], new["real"][b, k] = ids[b, t], mask[b, t], 1
            stop = keep[k + 1] if k + 1 < len(keep) else R
            scores[b, k] = samples.token_scores[b, t:stop].sum()
    attention_mask = torch.cat([samples.attention_mask[:, :P], new["real"]], 1)  # [B, P+R]
    return replace(samples, response_ids=new["ids"], response_mask=new["mask"], attention_mask=attention_mask,
                   token_scores=scores)  # fmt: skip


def plant_retokenized_history(trainer) -> dict:
    """retokenized_history: each multi-turn rollout passes through `retokenized`."""
    rollout_env = rollout.rollout_env

    def retokenizing(model, tokenizer, envs, seeds, eos_ids, **kw):
        samples, episodes = rollout_env(model, tokenizer, envs, seeds, eos_ids, **kw)
        return retokenized(samples, eos_ids[0], tokenizer.pad_token_id), episodes

    return {(rollout, "rollout_env"): retokenizing}


def plant_wrong_stop_id(trainer) -> dict:
    """wrong_stop_id: the stop ids the sampler (and every mask built from them) uses become [pad]."""
    stop_token_ids = tasks.stop_token_ids

    def pad_only(model, tokenizer) -> list[int]:
        eos_ids, pad_id = stop_token_ids(model, tokenizer), tokenizer.pad_token_id
        if pad_id in eos_ids:
            raise ValueError(f"config field 'inject' = 'wrong_stop_id' needs a pad id that is not a stop id {eos_ids}")
        return [pad_id]

    return {(tasks, "stop_token_ids"): pad_only}


def plant_stale_sampler(trainer) -> dict:
    """stale_sampler: the sampler is a frozen copy of the starting policy, and the weight sync never updates it (a
    vLLM engine, built on the starting policy's folder, keeps those weights: its sync does nothing)."""
    frozen_copy = lambda policy, dtype: copy.deepcopy(policy).requires_grad_(False)  # noqa: E731
    stale = {(rollout, "inference_copy"): frozen_copy, (rollout, "sync_weights"): lambda engine, policy: None}
    return {**stale, (vllm_engine, "sync_weights"): lambda engine, policy: 0.0}


def plant_no_temperature(trainer) -> dict:
    """no_temperature: the trainer's logprobs (old, reference, the loss') skip logits / T."""
    sequence_logprobs = rollout.sequence_logprobs

    def untempered(*args, temperature, **kw):
        return sequence_logprobs(*args, temperature=1.0, **kw)

    return {(rollout, "sequence_logprobs"): untempered}


def shifted_logprobs(model, input_ids, attention_mask, response_len, *, temperature, micro_batch, with_entropy, **_):
    """The logprob_shift bug: token t scored by the logits AT t (they predict t+1); as sequence_logprobs', unchunked."""
    pos, logps, ents, R = position_ids_from_mask(attention_mask), [], [], response_len
    for i in range(0, input_ids.shape[0], micro_batch):
        sl = slice(i, i + micro_batch)
        out = model(input_ids=input_ids[sl], attention_mask=attention_mask[sl], position_ids=pos[sl], use_cache=False)
        logp_all = F.log_softmax(out.logits[:, -R:].float() / temperature, -1)  # [b, R, V] one position late
        logps.append(logp_all.gather(-1, input_ids[sl, -R:, None]).squeeze(-1))  # [b, R]
        ents.append(-(logp_all.exp() * logp_all).sum(-1))  # [b, R]
    return torch.cat(logps), (torch.cat(ents) if with_entropy else None)


def plant_logprob_shift(trainer) -> dict:
    """logprob_shift: the trainer's logprobs (old, reference, the loss') come from shifted_logprobs."""
    return {(rollout, "sequence_logprobs"): shifted_logprobs}


def plant_stale_old_logprobs(trainer) -> dict:
    """stale_old_logprobs: old logprobs come from a frozen copy of the policy re-synced only after its logprobs were
    taken, so every step's anchor is one update behind. The copy is this plant's state across the run's steps."""
    anchor_logprobs, held = trainer.anchor_logprobs, []

    def stale(cfg, policy, *args):
        if not held:  # the first step: a copy of the starting policy
            held.append(copy.deepcopy(policy).requires_grad_(False))
        out = anchor_logprobs(cfg, held[0], *args)
        held[0].load_state_dict(policy.state_dict())  # the late re-sync, after its use
        return out

    return {(trainer, "anchor_logprobs"): stale}


def plant_value_not_detached(trainer) -> dict:
    """value_not_detached: the value target R - V_old + V (advantages + the live values): its gradient cancels."""
    value_loss = ppo_math.value_loss

    def undetached(values, old_values, returns, mask, **kw):
        return value_loss(values, old_values, returns - old_values + values, mask, **kw)

    return {(ppo_math, "value_loss"): undetached}


def plant_adv_sign(trainer) -> dict:
    """adv_sign: the advantages [B, R] negated (a gradient ascent on the loss)."""
    compute_advantages = trainer.compute_advantages

    def negated(*args):
        token_rewards, adv, returns, kl, metrics = compute_advantages(*args)
        return token_rewards, -adv, returns, kl, metrics

    return {(trainer, "compute_advantages"): negated}


def plant_kl_sign(trainer) -> dict:
    """kl_sign: the KL-in-reward coefficient enters negated (r_t = score + beta KL_t)."""
    kl_reward = ppo_math.kl_reward
    return {(ppo_math, "kl_reward"): lambda token_scores, kl, beta: kl_reward(token_scores, kl, -beta)}


def plant_ent_sign(trainer) -> dict:
    """ent_sign: the entropy bonus' coefficient negated (loss + c H instead of loss - c H)."""
    entropy_bonus = ppo_math.entropy_bonus
    return {(ppo_math, "entropy_bonus"): lambda loss, entropy, coef: entropy_bonus(loss, entropy, -coef)}


INJECTIONS = {
    "reward_scale": Injection(
        "the task score is multiplied by 0.01",
        {"kl_in_reward": True, "kl_coef": 0.05},
        "reward_scale",
        "trainer.episode_rewards",
        partial(scaled_scores, factor=0.01),
    ),
    "eos_unmasked": Injection(
        "the loss mask is all ones: padding after EOS is trained too",
        {},
        "eos_mask",
        "trainer.episode_rewards",
        plant_eos_unmasked,
    ),
    "logprob_shift": Injection(
        "the trainer scores each token with the logits at its own position",
        {},
        "logprob_mismatch",
        "rollout.sequence_logprobs",
        plant_logprob_shift,
    ),
    "pad_eq_eos": Injection(
        "pad id == EOS id, the mask rebuilt from ids: EOS masked out",
        {},
        "eos_mask",
        "rollout.rollout_env, trainer.episode_rewards",
        plant_pad_eq_eos,
    ),
    "stale_old_logprobs": Injection(
        "old logprobs come from a policy copy synced only after their use: one update behind",
        {},
        "logprob_mismatch",
        "trainer.anchor_logprobs",
        plant_stale_old_logprobs,
    ),
    "no_temperature": Injection(
        "the trainer's logprobs skip logits / T",
        {"temperature": 0.7},
        "logprob_mismatch",
        "rollout.sequence_logprobs",
        plant_no_temperature,
    ),
    "value_not_detached": Injection(
        "the value target is advantages + the live values",
        {},
        "value_divergence",
        "ppo_math.value_loss",
        plant_value_not_detached,
    ),
    "answer_format": Injection(
        "the reward parser expects a format the policy never writes: every score is 0",
        {},
        "zero_variance_groups",
        "trainer.episode_rewards",
        partial(scaled_scores, factor=0.0),
    ),
    "adv_sign": Injection(
        "the advantages enter the loss with the wrong sign: the policy unlearns",
        {},
        "reward_decline",
        "trainer.compute_advantages",
        plant_adv_sign,
    ),
    "kl_sign": Injection(
        "the KL-in-reward penalty is added, not subtracted: the policy is paid to leave the reference",
        {"kl_in_reward": True, "kl_coef": 0.1},
        "kl_blowup",
        "ppo_math.kl_reward",
        plant_kl_sign,
    ),
    "ent_sign": Injection(
        "the entropy term enters the loss with the wrong sign: the policy is paid to be certain",
        {"ent_coef": 1.0},
        "entropy_collapse",
        "ppo_math.entropy_bonus",
        plant_ent_sign,
    ),
    "wrong_stop_id": Injection(
        "the sampler stops at a token the model never writes (pad), not at its end-of-turn token",
        {},
        "high_truncation",
        "tasks.stop_token_ids",
        plant_wrong_stop_id,
    ),
    "retokenized_history": Injection(
        "multi-turn: the history is re-tokenised from its text, losing the end-of-turn tokens between turns",
        {},
        "template_drift",
        "rollout.rollout_env",
        plant_retokenized_history,
    ),
    "stale_sampler": Injection(
        "the sampler never receives the trained weights (a broken weight sync)",
        {},
        "logprob_mismatch",
        "rollout.inference_copy, rollout.sync_weights, vllm_engine.sync_weights",
        plant_stale_sampler,
    ),
}
INJECT_NAMES = tuple(INJECTIONS)


@contextlib.contextmanager
def planted(inject: str | None, trainer):
    """Detail 1: while the block runs, the functions INJECTIONS[inject].points names are the bug's (`trainer`: the
    trainer's module, whose own helpers some bugs replace); put back on the way out, even on an error. None: none."""
    bug = INJECTIONS[inject].plant(trainer) if inject is not None else {}
    saved = {(module, name): getattr(module, name) for module, name in bug}
    try:
        for (module, name), fn in bug.items():
            setattr(module, name, fn)
        yield
    finally:
        for (module, name), fn in saved.items():
            setattr(module, name, fn)


@dataclass
class ReproArgs:
    """Bug injection and one update dumped for replay.py (the trainer's Config inherits these fields)."""

    inject: Literal[INJECT_NAMES] | None = None
    """Plant a classic bug (`python repro.py` lists them); its stated config applies to fields left at their default."""
    dump_batch: int = 0
    """Save everything the update of this iteration needs to out_dir/batch-STEP.pt (0 = never; world size 1;
    `python replay.py FILE` re-runs it)."""

    def __post_init__(self):
        check_range("dump_batch", self.dump_batch, 0, self.steps)  # steps: the trainer's Config


def apply_stated_config(cfg) -> None:
    """Detail 2: put the injection's stated config on the fields of `cfg` still at their class default."""
    if cfg.inject is None:
        return
    check_choice("inject", cfg.inject, INJECT_NAMES)
    for name, value in INJECTIONS[cfg.inject].config.items():
        if getattr(cfg, name) == getattr(type(cfg), name) and value != getattr(cfg, name):
            print(f"[minrl] --inject {cfg.inject}: {name} = {value!r} (its stated config)")
            setattr(cfg, name, value)
    if cfg.inject == "value_not_detached" and cfg.adv_estimator != "gae":
        raise ValueError("config field 'inject' = 'value_not_detached' needs adv_estimator 'gae' (a critic)")
    if cfg.inject == "retokenized_history" and not multi_turn(cfg):
        raise ValueError("config field 'inject' = 'retokenized_history' needs a multi-turn task (--task calc, guess)")


def update_inputs(policy, opt, critics, shuffle_gen) -> dict:
    """Everything ppo_update reads besides the batch, copied (weights detached, on the CPU) before it changes."""
    models, opts = [policy, *(critics.models if critics else [])], [opt, *(critics.opts if critics else [])]
    models = [{k: v.detach().cpu().clone() for k, v in m.state_dict().items()} for m in models]
    opts = [copy.deepcopy(o.state_dict()) for o in opts]
    rng = {"shuffle_gen": shuffle_gen.get_state(), "torch_rng": torch.get_rng_state()}
    return {"policy": models[0], "opt": opts[0], "critics": models[1:], "critic_opts": opts[1:], **rng}


def state_digest(policy, opt, critics) -> str:
    """sha256 over every policy/critic weight and optimizer moment: equal iff two updates agree bit for bit."""
    tensors = [(k, v) for m in [policy, *(critics.models if critics else [])] for k, v in m.state_dict().items()]
    for o in [opt, *(critics.opts if critics else [])]:
        tensors += [(f"{i}.{k}", v) for i, st in o.state_dict()["state"].items() for k, v in st.items()]
    h = hashlib.sha256()
    for k, v in tensors:
        h.update(k.encode() + v.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def dumping(cfg, step: int, out_dir, tokenizer, samples, token_rewards, scores):
    """--dump-batch: at its step, `dumped_update` with this step's file and what a reader wants beside the batch
    (the decoded samples, token rewards and scores); at any other step, a context that saves nothing:
    `with dumping(...)(policy, opt, critics, batch, gen, update_actor) as record: record["metrics"] = ...`."""
    if cfg.dump_batch != step + 1:
        return lambda *state: contextlib.nullcontext({})
    path = Path(out_dir) / f"batch-{step + 1}.pt"
    return partial(dumped_update, path, cfg, tokenizer, samples, {"token_rewards": token_rewards, "scores": scores})


@contextlib.contextmanager
def dumped_update(path, cfg, tokenizer, samples, extra: dict, policy, opt, critics, batch, gen, update_actor: bool):
    """Around one update at world size 1 (policy: the module it trains through): first save what it reads (the
    batch, model / optimizer / RNG states) in one weights_only file, with the decoded prompts and responses and
    `extra` for a reader; then the metrics the block puts in the yielded record and the digest of the state after
    it. An update that raises (a NaN gradient) is saved with its error, and the error re-raised (detail 3)."""
    record = {
        "config": json.dumps(asdict(cfg)),
        "defaults": json.dumps(asdict(type(cfg)())),  # the config class's defaults: what a reader reads changes from
        "threads": torch.get_num_threads(),  # the update's numbers depend on it: replay.py uses the same
        "model_config": policy.config.to_json_string(),
        "batch": {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in vars(batch).items()},
        **{k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in extra.items()},
        "prompts": tokenizer.batch_decode(samples.prompt_ids, skip_special_tokens=True),
        "responses": decode_responses(tokenizer, samples),
        "policy_version": samples.policy_version,  # [B] the weights version each sample started with (async)
        "update_actor": update_actor,
        **update_inputs(policy, opt, critics, gen),
        "metrics": None,
        "error": None,
    }
    torch.save(record, path)  # before the update: a crash inside it still leaves its inputs on disk
    try:
        yield record
    except Exception as e:
        record["error"] = f"{type(e).__name__}: {e}"
        torch.save(record, path)
        raise
    record["state_after"] = state_digest(policy, opt, critics)
    torch.save(record, path)
    print(f"[minrl] saved the update of this step to {path}; rerun it: python replay.py {path}")


def config_changes(config: dict, default: dict, width: int = 100) -> list[str]:
    """A saved config as lines to read: one per field that differs from its class's defaults (as saved with it,
    derived fields derived), long values wrapped."""
    changed = {k: v for k, v in config.items() if k not in default or v != default[k]}
    about = f"{len(changed)} of {len(config)} fields differ from the defaults (all: the run's config.json)"
    lines = [f"  config: {about}"]
    for k, v in changed.items():
        lines += textwrap.wrap(f"{k} = {v!r}", width, initial_indent="    ", subsequent_indent="        ")
    return lines


def describe_dump(path) -> None:
    """Print what a --dump-batch file holds: the run's config changes, tensor shapes, a few samples, the outcome."""
    d = torch.load(path, weights_only=True, map_location="cpu")
    print(f"{path}:")
    print("\n".join(config_changes(json.loads(d["config"]), json.loads(d.get("defaults", "{}")))))  # older: all
    for k, v in d["batch"].items():
        print(f"  batch[{k!r}]: {tuple(v.shape) if isinstance(v, torch.Tensor) else v}")
    for p, r, s in list(zip(d["prompts"], d["responses"], d["scores"].tolist()))[:4]:
        print(f"  prompt {p!r} -> response {r!r}: score {s:.3f}")
    print(f"  error: {d['error']}" if d["error"] else f"  metrics: {d['metrics']}\n  state after: {d['state_after']}")


def main(argv=None) -> None:
    """`python repro.py [DUMP]`: the injection table, or what a --dump-batch file holds."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dump", nargs="?", help="a file written by trainer.py --dump-batch (else: the injections)")
    args = ap.parse_args(argv)
    if args.dump:
        return describe_dump(args.dump)
    print(f"{'--inject':20s} {'diagnosed as':22s} {'stated config':40s} the bug; planted by replacing")
    for name, inj in INJECTIONS.items():
        print(f"{name:20s} {inj.diagnosed_as:22s} {str(inj.config or 'default'):40s} {inj.bug}; {inj.points}")


if __name__ == "__main__":
    main()
