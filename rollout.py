"""Batched sampling from any Hugging Face causal LM with a KV cache, per-token logprobs, masks, episodes.

    python rollout.py        # sample from the random-init tiny model: tokens/s, the logprob gap, a few responses

`generate` samples one turn with a KV cache; `rollout_env` runs multi-turn episodes (envs.py) on it, a single-turn
task being the one-turn case; `sequence_logprobs` is the trainer's recompute; `inference_copy` / `sync_weights`: the
model that samples (the policy, or its bf16 copy as an inference engine holds it: --rollout-dtype). Tensors
(docs/design.md 3): B sequences, P prompt length (left-padded), R response length (right-padded).
- `response_mask` [B, R] is 1 on generated tokens up to AND including the first stop token, 0 after.
- `rollout_logprobs` [B, R]: the sampled tokens' logprobs under the behaviour policy, softmax(logits / T) after
  top-p / top-k truncation, renormalised. With top_p = 1 and top_k = 0 (the training default) that is the policy
  the trainer differentiates; anything else makes PPO's ratio off-policy (offpolicy.py sees the truncation).
  Token t's logprob comes from the logits at position P + t - 1. A row that reaches max_new_tokens without a stop
  token keeps an all-ones mask; `truncated` flags it.

Implementation details (our choices)
1. Our own decode loop instead of `model.generate`: it returns the behaviour logprobs for free and is as fast or
   faster (bench/rollout_bench.py). Position ids are `cumsum(attention_mask) - 1`, so absolute-position models
   (GPT-2) handle left padding too. Temperature 0 is greedy, with the logprobs of the T = 1 softmax.
2. The KV-cache keyword differs between transformers versions (`past_key_values` up to 5.10, `cache` later);
   `_cache_kw` is the one place that knows. Finished rows are fed pad tokens (masked out) until all are done.
3. Multi-turn: episodes advance in lockstep turns; each turn re-encodes the live contexts (no KV cache across turns).
   Sequences are built from the sampled ids: an action's text is decoded for the environment, never re-tokenised;
   each observation is tokenised once (`tasks.observation_ids`; with a chat template, the template's text between
   turns; an action cut without the end-of-turn token gets it, with mask 0). A turn's environments step in order,
   or at once in threads when they wait (`step_concurrently`: shells, remote envs); async_loop.py overlaps them.
4. Token statistics in chunks (`token_stats`, logits.py): the model runs with `logits_to_keep` empty, a hook takes
   its decoder's final hidden states, and the LM head and log-softmax run `logit_chunk` tokens at a time, each chunk
   checkpointed (recomputed in backward): no [b, R, V] logits (V = 152k, R = 1k, b = 128: 79 GB in fp32), the
   entropy without graph unless a bonus needs it; the whole logits' numbers within fp32 rounding. A head that
   soft-caps or scales its logits (Gemma 2, Cohere, Granite, ...) keeps the model's own (`lm_head` checks).
"""

from __future__ import annotations

import copy
import inspect
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from cli import check_fields
from envs import score_turn
from logits import _last_logits_kw, _stats, final_hidden, lm_head, token_stats
from tasks import (
    encode_prompts,
    format_prompt,
    left_pad,
    make_task,
    make_tiny_model,
    make_tokenizer,
    observation_ids,
    tokenize_prompts,
)


@dataclass
class SampleArgs:
    """How the trainer samples (rollout_env's settings); its Config inherits these fields."""

    max_prompt_len: int = 64
    """Longest prompt in tokens; a longer prompt is an error."""
    max_new_tokens: int = 16
    """Response (per-turn action) length limit; one without EOS by then is kept and counted as truncated."""
    temperature: float = 0.6
    """Sampling temperature (logprobs are recomputed with the same temperature)."""
    top_p: float = 1.0
    """Nucleus sampling; < 1 makes the behaviour policy differ from the trained one (off-policy)."""
    top_k: int = 0
    """Top-k sampling (0 = off); > 0 makes the behaviour policy differ from the trained one."""

    def __post_init__(self):
        ranges = {"[1, inf)": ("max_prompt_len", "max_new_tokens"), "(0, inf)": ("temperature",)}
        check_fields(self, {**ranges, "[0, inf)": ("top_k",), "(0, 1]": ("top_p",)}, SampleArgs)


@dataclass
class Rollout:
    """One batch of samples, docs/design.md section 3 tensors. Optional fields are filled by the trainer."""

    prompt_ids: torch.Tensor  # [B, P] left-padded
    response_ids: torch.Tensor  # [B, R] right-padded with pad id after the stop token
    attention_mask: torch.Tensor  # [B, P+R] 1 on real prompt and response tokens
    response_mask: torch.Tensor  # [B, R] 1 up to and including the first stop token
    rollout_logprobs: torch.Tensor  # [B, R] behaviour-policy logprobs of the sampled tokens
    truncated: torch.Tensor  # [B] bool: hit max_new_tokens without a stop token
    token_scores: torch.Tensor | None = None  # [B, R] environment rewards, each turn's at its last action token
    group_ids: torch.Tensor | None = None  # [B] which prompt a sample came from
    policy_version: torch.Tensor | None = None  # [B] weights version that produced the sample

    @property
    def input_ids(self) -> torch.Tensor:
        """[B, P+R] the prompt and the response side by side."""
        return torch.cat([self.prompt_ids, self.response_ids], dim=1)  # [B, P+R]


def cat_rollouts(parts: list[Rollout], pad_id: int, device) -> Rollout:
    """One Rollout of several: prompts re-left-padded to the longest, responses re-right-padded (docs/design.md 3)."""
    P = max(r.prompt_ids.shape[1] for r in parts)
    R = max(r.response_ids.shape[1] for r in parts)
    left = lambda x, n, v: F.pad(x, (n - x.shape[1], 0), value=v)  # noqa: E731
    right = lambda x, n, v: F.pad(x, (0, n - x.shape[1]), value=v)  # noqa: E731
    cat = lambda f: torch.cat([f(r) for r in parts]).to(device)  # noqa: E731
    am_prompt = cat(lambda r: left(r.attention_mask[:, : r.prompt_ids.shape[1]], P, 0))  # [B, P]
    am_response = cat(lambda r: right(r.attention_mask[:, r.prompt_ids.shape[1] :], R, 0))  # [B, R]
    return Rollout(
        prompt_ids=cat(lambda r: left(r.prompt_ids, P, pad_id)),  # [B, P]
        response_ids=cat(lambda r: right(r.response_ids, R, pad_id)),  # [B, R]
        attention_mask=torch.cat([am_prompt, am_response], 1),  # [B, P+R]
        response_mask=cat(lambda r: right(r.response_mask, R, 0)),  # [B, R]
        rollout_logprobs=cat(lambda r: right(r.rollout_logprobs, R, 0.0)),  # [B, R]
        truncated=cat(lambda r: r.truncated),  # [B]
        token_scores=None if parts[0].token_scores is None else cat(lambda r: right(r.token_scores, R, 0.0)),
        policy_version=None if parts[0].policy_version is None else cat(lambda r: r.policy_version),  # [B]
    )


def _cache_kw(model) -> str:
    """Name of the KV-cache argument and output field for this model and transformers version."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def decode_responses(tokenizer, rollout: Rollout) -> list[str]:
    """The text of each response: its valid tokens only (the mask, never the pad id), specials dropped."""
    pairs = zip(rollout.response_ids, rollout.response_mask)
    return [tokenizer.decode(r[m.bool()], skip_special_tokens=True) for r, m in pairs]


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position of each token among the real tokens of its row; 0 on left padding. [B, T]"""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


def last_valid(mask: torch.Tensor) -> torch.Tensor:
    """[B, R] bool: the last position where mask is 1 (a single-turn response's stop token)."""
    return (mask.cumsum(-1) == mask.sum(-1, keepdim=True)) & (mask > 0)


def truncate_logits(logits: torch.Tensor, top_p: float, top_k: int) -> torch.Tensor:
    """Mask (to -inf) logits outside top-k and outside the smallest set with cumulative prob >= top_p."""
    if top_k > 0:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]  # [B, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)  # [B, V]
        cum = sorted_logits.softmax(-1).cumsum(-1)  # [B, V]
        drop_sorted = cum - sorted_logits.softmax(-1) >= top_p  # keep the token that crosses top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)  # back to vocabulary order
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


@torch.no_grad()
def generate(
    model,
    prompt_ids,
    attention_mask,
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    eos_token_ids: list[int],
    pad_token_id: int,
    generator: torch.Generator | list[torch.Generator] | None = None,
) -> Rollout:
    """Sample up to max_new_tokens per row with a KV cache. prompt_ids/attention_mask: [B, P], left-padded. Apart
    from the KV cache, nothing grows per step: the mask, tokens and logprobs are preallocated [B, P+N] / [B, N],
    filled a column per step; each row's next position is a running count (cumsum(mask) - 1, incrementally).
    `generator`: one, or a list of one per row (a row's draws then do not depend on its batch: model_proxy.py)."""
    if not eos_token_ids or max_new_tokens < 1 or (isinstance(generator, list) and len(generator) != len(prompt_ids)):
        needs = "a stop token id, max_new_tokens >= 1 and, as a list, a generator per row"
        raise ValueError(f"generate needs {needs} ({eos_token_ids}, {max_new_tokens}, {len(prompt_ids)} rows)")
    (B, P), dev, N = prompt_ids.shape, prompt_ids.device, max_new_tokens
    kw, last1 = _cache_kw(model), _last_logits_kw(model, 1)
    stop = torch.tensor(eos_token_ids, device=dev)
    mask = attention_mask.new_zeros(B, P + N, dtype=torch.long)  # [B, P+N] column P+t: token t is real (row not done)
    mask[:, :P] = attention_mask
    tokens = prompt_ids.new_full((B, N), pad_token_id)  # [B, N]
    logps = torch.zeros(B, N, device=dev, dtype=torch.float32)  # [B, N]
    pos, n_real = position_ids_from_mask(attention_mask), attention_mask.sum(-1, keepdim=True)  # [B, P], [B, 1]
    inp, cache, n = prompt_ids, None, 0
    done = torch.zeros(B, dtype=torch.bool, device=dev)  # [B] row has emitted its stop token
    if isinstance(generator, list):  # [B, N] each row's uniforms, drawn up front from its own stream
        uniforms = torch.stack([torch.rand(N, generator=g, device=dev, dtype=torch.float64) for g in generator])
    while n < N:
        step = {"input_ids": inp, "attention_mask": mask[:, : P + n], "position_ids": pos}
        out = model(**step, use_cache=True, **{kw: cache}, **last1)
        cache = getattr(out, kw)
        logits = out.logits[:, -1, :].float()  # [B, V]
        if temperature > 0:  # the behaviour distribution: truncated, renormalised; its logprobs are recorded
            scaled = truncate_logits(logits / temperature, top_p, top_k)  # [B, V]
            probs = scaled.softmax(-1)  # [B, V]
            if isinstance(generator, list):  # row i's t-th draw: inverse CDF at its stream's t-th uniform
                cdf = probs.double().cumsum(-1)  # [B, V] (u * total < total: never past a row's last kept token)
                if not (cdf[:, -1] > 0).all():  # NaN or all -inf logits: refused, as torch.multinomial does
                    rows = (~(cdf[:, -1] > 0)).nonzero()[:, 0]
                    why = "no distribution to sample (check the model's outputs)"
                    raise ValueError(f"generate: NaN or all -inf logits in rows {rows}: {why}")
                nxt = torch.searchsorted(cdf, (uniforms[:, n] * cdf[:, -1])[:, None], right=True)[:, 0]
            else:
                nxt = torch.multinomial(probs, 1, generator=generator).squeeze(1)  # [B]
        else:
            scaled, nxt = logits, logits.argmax(-1)  # [B, V], [B]
        nxt = nxt.masked_fill(done, pad_token_id)  # pad after the stop token
        tokens[:, n] = nxt
        logps[:, n] = F.log_softmax(scaled, -1).gather(-1, nxt[:, None]).squeeze(1).masked_fill(done, 0.0)
        mask[:, P + n] = ~done  # the new token is real iff its row was not done
        n_real += (~done)[:, None]
        pos, done, n = (n_real - 1).clamp(min=0), done | torch.isin(nxt, stop), n + 1
        if done.all():
            break
        inp = nxt[:, None]  # [B, 1]
    response_mask = mask[:, P : P + n]  # [B, R] 1 up to and including the stop token
    return Rollout(
        prompt_ids=prompt_ids,
        response_ids=tokens[:, :n],
        attention_mask=mask[:, : P + n],
        response_mask=response_mask,
        rollout_logprobs=logps[:, :n] * response_mask,
        truncated=~done,
    )


def inference_copy(policy, dtype: str):
    """The model that samples: the policy itself (float32), or a frozen copy of it with its weights in `dtype`
    (bfloat16: every weight rounded, the forward in bf16, like an inference engine's), refreshed by `sync_weights`
    before each rollout (the weight sync). Buffers keep their dtype: an engine computes RoPE's angles from fp32
    frequencies too (and rounds only the cos / sin it applies)."""
    if dtype == "float32":
        return policy
    engine = copy.deepcopy(policy).eval().requires_grad_(False)
    for p in engine.parameters():
        p.data = p.data.to(getattr(torch, dtype))
    return engine


@torch.no_grad()
def sync_weights(engine, policy) -> None:
    """Copy the policy's current weights into its inference copy (rounded to its dtype); a no-op for itself."""
    if engine is not policy:
        for dst, src in zip(engine.parameters(), policy.parameters(), strict=True):
            dst.copy_(src)


def sequence_logprobs(
    model,
    input_ids,
    attention_mask,
    response_len: int,
    *,
    temperature: float = 1.0,
    micro_batch: int = 64,
    with_entropy: bool = False,
    entropy_grad: bool | None = None,
    logit_chunk: int = 256,
):
    """Log-probs [B, R] of the last `response_len` tokens (and entropies [B, R] if asked), recomputed.

    The logits at position P + t - 1 predict response token t; they are divided by the sampling temperature
    (forgetting it is a classic silent bug). Gradients flow if called with grad enabled, into the entropies unless
    entropy_grad is False (the trainer without an entropy bonus). logit_chunk > 0: the LM head and log-softmax run
    on chunks of that many tokens (detail 4); 0: the model's own logits (the reference path).
    """
    if temperature <= 0:
        temperature = 1.0  # greedy sampling: logprobs of the plain softmax (implementation detail 2)
    entropy_grad = torch.is_grad_enabled() if entropy_grad is None else entropy_grad
    keep = response_len + 1  # positions P-1 .. P+R-1; the last one is dropped below
    pos = position_ids_from_mask(attention_mask)
    chunked = lm_head(model) if logit_chunk > 0 else None  # (decoder, head), or None: the model's own logits
    logps, ents = [], []
    for i in range(0, input_ids.shape[0], micro_batch):
        sl = slice(i, i + micro_batch)
        target = input_ids[sl, -response_len:]  # [b, R]
        inputs = {"input_ids": input_ids[sl], "attention_mask": attention_mask[sl], "position_ids": pos[sl]}
        if chunked is not None:  # the model's head sees no position (logits_to_keep: none); ours, chunked, all of them
            hidden = final_hidden(model, chunked[0], inputs)[:, -keep:-1]  # [b, R, H]
            logp, ent = token_stats(hidden, chunked[1], target, temperature, logit_chunk, with_entropy, entropy_grad)
        else:
            logits = model(**inputs, use_cache=False, **_last_logits_kw(model, keep)).logits[:, -keep:]  # [b, R+1, V]
            logp, ent = _stats(logits[:, :-1], target, temperature, with_entropy, entropy_grad)  # [b, R] each
        logps.append(logp)
        ents.append(ent)
    return torch.cat(logps), (torch.cat(ents) if with_entropy else None)


def _checked(env, method: str, episode: int, turn: int, **kw):
    """env.reset / env.step with failures named: an env that raises or returns a non-finite reward stops the run."""
    where = f"environment {getattr(env, 'name', type(env).__name__)!r} at turn {turn} of episode {episode}"
    try:
        out = getattr(env, method)(**kw)
        if method == "reset":  # a text, or a data row's chat messages (tasks.format_prompt)
            return out[0] if isinstance(out[0], list) else str(out[0]), dict(out[1] or {})
        obs, reward, terminated, truncated, info = out
        reward = float(reward)
    except Exception as e:
        raise RuntimeError(f"{where} raised in {method}({kw}): {e!r}") from e
    if not math.isfinite(reward):
        raise ValueError(f"{where}: reward {reward} on action {kw['action']!r}")
    return str(obs), reward, bool(terminated), bool(truncated), dict(info or {})


def rollout_env(
    model,
    tokenizer,
    envs,
    seeds,
    eos_ids,
    *,
    max_prompt_len: int,
    max_new_tokens: int,
    max_turns: int = 1,
    max_context: int = 1 << 30,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    generator=None,
    sample=generate,
) -> tuple[Rollout, list[dict]]:
    """Run one episode per env to its end, all in lockstep turns. A single-turn task is one turn (TaskEnv).

    Turn k: each live episode's context (first observation + every earlier turn, as ids) is left-padded and sampled by
    `sample` (`generate`, or an engine's with its signature; the context is re-encoded each turn). The action's sampled
    ids, up to and including its stop token, join the sequence with mask 1 and their behaviour logprobs; its decoded
    text goes to env.step; the observation is tokenised once and joins with mask 0. The turn's reward sits at its last
    action token (`token_scores`). An episode ends when the env says terminated or truncated, after max_turns actions,
    or when its next turn would not fit max_context. Every env is closed at the end, whatever happened.

    envs: B objects with GEM's reset(seed) / step(action); seeds: B seeds (GRPO groups share one). max_new_tokens
    bounds each action; generator None = greedy (the sampling settings are then unused). Returns the Rollout
    (response = everything after the first observation; `truncated`: the last action ended without a stop token, as
    in single-turn) and per episode {"return", "success", "turns", "malformed", "cut" (ended without the env
    terminating it: env truncation, max_turns or max_context), "context_cut" (an action was cut short by
    max_context), "no_stop_actions" (actions without a stop token), "action_spans" [(start, end) in response
    positions], "env_s" [seconds in each env.step], "gen_s" [seconds of each turn's batched generation]}, and for a
    remote env "env_error" (None, or why its server failed it: the episode ends there, its response_mask and
    token_scores are 0: an infrastructure failure teaches nothing, and joins no group: env_client.ungroup_failed).
    """
    dev = next(model.parameters()).device
    sampling = {"temperature": temperature, "top_p": top_p, "top_k": top_k} if generator else {"temperature": 0.0}
    gen_kw = {**sampling, "generator": generator, "eos_token_ids": eos_ids, "pad_token_id": tokenizer.pad_token_id}
    ends = {"eos_ids": eos_ids, "max_new_tokens": max_new_tokens, "max_turns": max_turns}  # an action's, an episode's
    tracks = [{"ids": [], "action": [], "logp": [], "score": [], "no_stop": False, "failed": False} for _ in envs]
    blank = {"return": 0.0, "success": False, "turns": 0, "malformed": 0, "cut": False, "context_cut": False}
    info = [{**blank, "no_stop_actions": 0, "action_spans": [], "env_s": [], "gen_s": []} for _ in envs]
    try:
        first = [_checked(env, "reset", i, 0, seed=seed)[0] for i, (env, seed) in enumerate(zip(envs, seeds))]
        prompts = encode_prompts(tokenizer, [format_prompt(tokenizer, o) for o in first], max_prompt_len)
        ids, attention_mask = left_pad(prompts, tokenizer.pad_token_id)
        live = list(range(len(envs)))
        for turn in range(1, max_turns + 1):
            budget = {i: min(max_new_tokens, max_context - len(prompts[i]) - len(tracks[i]["ids"])) for i in live}
            for i in live:
                if budget[i] < 1 and turn == 1:
                    raise ValueError(f"episode {i}: the first observation leaves no room for an action in max_context")
                info[i]["cut"] = budget[i] < 1  # no room left for another action
            live = [i for i in live if budget[i] >= 1]
            if not live:
                break
            ctx_ids, ctx_mask = left_pad([prompts[i] + tracks[i]["ids"] for i in live], tokenizer.pad_token_id)
            t_gen = time.perf_counter()
            samples = sample(model, ctx_ids.to(dev), ctx_mask.to(dev), max_new_tokens=max(budget.values()), **gen_kw)
            r_ids, r_mask = samples.response_ids.cpu(), samples.response_mask.cpu()  # [b, r] each
            r_logp = samples.rollout_logprobs.cpu()  # [b, r]
            t_gen = time.perf_counter() - t_gen  # this turn's batched generation
            acts = [r_ids[j, : min(int(r_mask[j].sum()), budget[i])].tolist() for j, i in enumerate(live)]
            texts = [tokenizer.decode(a, skip_special_tokens=True) for a in acts]
            score_turn([envs[i] for i in live], texts, acts)  # the user's rewards: one batch call per turn (envs.py)
            stepped = step_envs([envs[i] for i in live], texts, live, turn)
            still = []
            for j, i in enumerate(live):
                info[i]["gen_s"].append(t_gen)
                room = max_context - len(prompts[i])  # tokens this episode's response may still grow to
                logp = r_logp[j, : len(acts[j])].tolist()
                if _take_turn(tokenizer, tracks[i], info[i], acts[j], logp, room, stepped[j], turn, ends):
                    still.append(i)
            live = still
    finally:  # an episode cut short, or a failing one, still frees what its env holds (a workspace, a session)
        errors = close_envs(envs)
    if errors:  # the first failure to close (after a failing episode, that episode's error is the one raised)
        raise errors[0]
    return pack_tracks(ids, attention_mask, tracks, tokenizer.pad_token_id, dev), info


def close_envs(envs: list) -> list[Exception]:
    """Close every env, even after one fails to; returns the failures."""
    errors = []
    for env in envs:
        try:
            getattr(env, "close", lambda: None)()
        except Exception as e:
            errors.append(e)
    return errors


def step_envs(envs: list, texts: list[str], episodes: list[int], turn: int) -> list[tuple[tuple, float]]:
    """(env.step's checked result, its seconds) per env, in order. Envs that wait rather than compute (a class
    attribute `step_concurrently`: the shell sandbox, a remote env) all step at once in threads; others in order."""

    def one(k):
        t0 = time.perf_counter()
        return _checked(envs[k], "step", episodes[k], turn, action=texts[k]), time.perf_counter() - t0

    if len(envs) > 1 and all(getattr(env, "step_concurrently", False) for env in envs):
        with ThreadPoolExecutor(max_workers=min(64, len(envs))) as pool:
            return list(pool.map(one, range(len(envs))))
    return [one(k) for k in range(len(envs))]


def _take_turn(
    tokenizer, track: dict, info: dict, action: list[int], logp: list[float], room, stepped, turn: int, ends: dict
) -> bool:
    """One episode's turn after sampling and stepping its env (`stepped`: step_envs' result): the action's ids join
    its track (mask 1), the observation's ids with mask 0. Returns whether the episode goes on (room: tokens it
    may still hold; ends: rollout_env's eos_ids, max_new_tokens and max_turns)."""
    n, chat = len(action), bool(getattr(tokenizer, "chat_template", None))
    stopped = n > 0 and action[-1] in ends["eos_ids"]
    (obs, reward, terminated, truncated, step_info), seconds = stepped
    info["env_s"].append(seconds)
    if "env_error" in step_info:  # a remote env (env_service.py): None, or why its server failed the episode
        info["env_error"] = step_info["env_error"]
        track["failed"] = step_info["env_error"] is not None  # then no gradient from this episode (mask 0)
    info["action_spans"].append((len(track["ids"]), len(track["ids"]) + n))
    track["ids"] += action
    track["action"] += [1] * n
    track["logp"] += logp
    track["score"] += [0.0] * (n - 1) + [reward]  # the turn's reward at its last action token
    info["return"] += reward
    info["turns"] = turn
    info["malformed"] += int(bool(step_info.get("malformed")))
    info["reward_info"] = step_info.get("reward_info", {})  # --data: reward/<term>, time/reward (rewards.py)
    info["success"] = info["success"] or bool(step_info.get("success"))
    track["no_stop"] = not stopped
    info["no_stop_actions"] += int(not stopped)
    info["context_cut"] |= not stopped and n < ends["max_new_tokens"]  # cut by max_context, not the length limit
    if terminated or truncated or turn == ends["max_turns"]:
        info["cut"] = not terminated
        return False
    obs_ids = observation_ids(tokenizer, obs, first=False)
    if chat and (not action or action[-1] != tokenizer.eos_token_id):  # close the turn as the template
        obs_ids = [tokenizer.eos_token_id] + obs_ids  # would (mask 0: the model did not write it)
    if len(track["ids"]) + len(obs_ids) >= room:  # no room for it and an action
        info["cut"] = True
        return False
    track["ids"] += obs_ids
    track["action"] += [0] * len(obs_ids)
    track["logp"] += [0.0] * len(obs_ids)
    track["score"] += [0.0] * len(obs_ids)
    return True


def pack_tracks(prompt_ids, prompt_mask, tracks: list[dict], pad_id: int, dev) -> Rollout:
    """The Rollout of finished episodes: prompts left-padded as sampled, responses right-padded. A track: "ids" (the
    response's ids), "action" (1 on sampled ids), "logp", "score" (a turn's reward at its last action id), "no_stop",
    "failed" (no gradient: mask 0); model_proxy.py packs its sessions with it too."""
    B, R = len(tracks), max(1, *(len(t["ids"]) for t in tracks))
    response_ids = torch.full((B, R), pad_id, dtype=torch.long)  # [B, R]
    real = torch.zeros(B, R, dtype=torch.long)  # [B, R] attention: every action and observation token
    response_mask = torch.zeros(B, R, dtype=torch.long)  # [B, R] loss: action tokens only
    logp, token_scores = torch.zeros(B, R), torch.zeros(B, R)  # [B, R] each
    for i, t in enumerate(tracks):
        n = len(t["ids"])
        response_ids[i, :n], real[i, :n] = torch.tensor(t["ids"], dtype=torch.long), 1
        response_mask[i, :n] = torch.tensor(t["action"], dtype=torch.long) * (not t["failed"])  # env failed: 0
        logp[i, :n], token_scores[i, :n] = torch.tensor(t["logp"]), torch.tensor(t["score"]) * (not t["failed"])
    return Rollout(
        prompt_ids=prompt_ids.to(dev),
        response_ids=response_ids.to(dev),
        attention_mask=torch.cat([prompt_mask, real], 1).to(dev),
        response_mask=response_mask.to(dev),
        rollout_logprobs=logp.to(dev),
        truncated=torch.tensor([t["no_stop"] for t in tracks], device=dev),
        token_scores=token_scores.to(dev),
    )


def main():
    """Sample 64 reverse prompts from the random-init tiny model: tokens/s and the sampler-trainer logprob gap."""
    torch.manual_seed(0)
    tok, problems = make_tokenizer(), make_task("reverse").sample(64, "train", np.random.default_rng(0))
    model, g = make_tiny_model(tok).eval(), torch.Generator().manual_seed(0)
    ids, mask = tokenize_prompts(tok, [format_prompt(tok, p["prompt"]) for p in problems], 64)
    t0 = time.perf_counter()
    stops = {"eos_token_ids": [tok.eos_token_id], "pad_token_id": tok.pad_token_id}
    s = generate(model, ids, mask, max_new_tokens=32, **stops, generator=g)
    dt, n = time.perf_counter() - t0, int(s.response_mask.sum())
    diff = sequence_logprobs(model, s.input_ids, s.attention_mask, s.response_ids.shape[1])[0] - s.rollout_logprobs
    gap = (diff.abs() * s.response_mask).max().item()
    texts = decode_responses(tok, s)[:4]
    print(f"{n} tokens in {dt:.2f}s = {n / dt:.0f} tok/s; max |rollout - recomputed logp| {gap:.2e}; responses {texts}")


if __name__ == "__main__":
    main()
