"""What the policy's samples score: the training batch's rollout metrics, and held-out evaluation as users know it
(greedy accuracy, mean@N and pass@k, unbiased), sharded over ranks.

    python evaluation.py --model runs/a/policy --task sort --eval-samples 8   # a trained policy (saved folder)
    python evaluation.py --model runs/a/policy --data my.parquet --reward my_reward.py --eval-samples 8
    python evaluation.py --model runs/a/policy --task sort --print-samples 3  # what it writes, beside the truth
    python evaluation.py                          # the embedded model at random init: the metrics' floor, in seconds

- `rollout_metrics`, `score_stats`: the rollout/* metrics of a training batch; `eos_mask_errors`: responses whose
  mask breaks the stop-token rule (stats/eos_mask_err_frac, the symptom of pad == eos).
- `evaluate`: greedy success (eval/acc) on held-out episodes, the trainer's every `eval_every` iterations.
- `sampled_eval`: N samples per episode at the training sampling settings (`--eval-samples N`):
  eval/mean@N, the mean return (veRL's val-core/<data source>/reward/mean@N); eval/acc_mean@N, the mean success;
  eval/pass@k for k = 1, 2, 4, ..., N, the unbiased estimator of Chen et al. 2021 (eq. 1): with c of n samples
  right, pass@k = 1 - C(n - c, k) / C(n, k), averaged over episodes (less variance than k draws per episode).
- A response is "right" when its episode succeeds: a task's exact answer, a solved environment, a --data row whose
  weighted reward is >= 1 (data.py, detail 3).

Implementation details (our choices)
1. The held-out episodes are the same at every evaluation (a fixed seed), and the sampled ones draw from a
   generator of their own, also re-seeded each time: evaluation never moves the training stream (resume and
   replay stay bit-exact) and two evaluations differ only by the policy.
2. Ranks take every world-th episode (sampled: every world-th group of N) and the counts are summed over ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from tqdm.auto import tqdm

import ppo_math
from cli import check_fields, parse_config
from common import all_reduce_sum, masked_mean, masked_var
from data import DataArgs, load_task
from envs import EnvArgs, make_env, multi_turn, rollout_kw, sample_episodes
from rewards import RewardArgs
from rollout import Rollout, SampleArgs, rollout_env
from tasks import TaskArgs, load_policy, make_tiny_model, make_tokenizer, stop_token_ids


def eos_mask_errors(response_ids, response_mask, eos_ids, max_len: int, rows=None, global_: bool = False) -> float:
    """Share of responses (of `rows` [B] bool, default all; of every rank's with global_) whose mask breaks the
    stop-token rule (docs/design.md 3): every run of mask-1 tokens (an action) ends at its first stop token, unless it
    is max_len tokens long (cut by the length limit). Catches EOS masked out (pad == eos with masks rebuilt from
    ids) and padding trained after EOS."""
    m = response_mask.bool()  # [B, R]
    stop = torch.isin(response_ids, torch.tensor(eos_ids, device=response_ids.device))  # [B, R]
    after_stop = (m[:, 1:] & m[:, :-1] & stop[:, :-1]).any(-1)  # [B] a trained token right after a stop token
    idx = torch.arange(m.shape[1], device=m.device).expand_as(m)  # [B, R]
    starts = m & ~torch.cat([torch.zeros_like(m[:, :1]), m[:, :-1]], 1)  # [B, R] first token of each run
    run_len = idx - torch.where(starts, idx, -1).cummax(-1).values + 1  # [B, R] length of the run so far
    ends = m & ~torch.cat([m[:, 1:], torch.zeros_like(m[:, :1])], 1)  # [B, R] last token of each run
    open_end = (ends & ~stop & (run_len < max_len)).any(-1)  # [B] an action ends early without a stop token
    rows = torch.ones_like(open_end) if rows is None else rows
    return masked_mean((after_stop | open_end).float(), rows.float(), global_=global_).item()


def first_action_mask(episodes: list[dict], response_mask):
    """[B, R] the response mask on each episode's first action only (its info's first action span); None when an
    episode's info has no spans (a sampler that does not keep them): no first-turn gap is then measured."""
    if any("action_spans" not in ep for ep in episodes):
        return None
    first = torch.zeros_like(response_mask)
    for b, ep in enumerate(episodes):
        if ep["action_spans"]:
            lo, hi = ep["action_spans"][0]
            first[b, lo:hi] = response_mask[b, lo:hi]
    return first


def rollout_metrics(rollout: Rollout, episodes: list[dict], eos_ids, max_new_tokens: int) -> dict:
    """The rollout/* metrics of a batch of episodes (docs/metrics.md), stats/eos_mask_err_frac, time/env and, for
    --data, each episode's reward_info: reward/<term> averaged over the episodes it scored, time/reward summed."""
    mask = rollout.response_mask.float()  # [B, R]
    terms = {}
    for e in episodes:
        for k, v in e.get("reward_info", {}).items():  # set by the first turn
            terms.setdefault(k, []).append(v)
    full = torch.tensor([not e["context_cut"] for e in episodes], device=mask.device)  # [B] no action cut short
    mean = lambda key: float(np.mean([e[key] for e in episodes]))
    acc = torch.tensor([float(e["success"]) for e in episodes], device=mask.device)  # [B] exact answers / solved
    return {
        "rollout/acc": acc.mean().item(),
        "rollout/response_len": mask.sum(-1).mean().item(),
        "rollout/truncated_frac": rollout.truncated.float().mean().item(),
        "rollout/turns": mean("turns"),
        "rollout/episode_cut_frac": mean("cut"),  # ended without the environment terminating them
        "rollout/malformed": mean("malformed"),  # malformed actions per episode
        "stats/eos_mask_err_frac": eos_mask_errors(  # of the episodes of all ranks without an action cut short
            rollout.response_ids, rollout.response_mask, eos_ids, max_new_tokens, rows=full, global_=True
        ),
        "time/env": float(sum(sum(e["env_s"]) for e in episodes)),  # inside env.step (part of time/rollout)
        "time/reward": 0.0,  # the reward functions' seconds (an environment's: inside time/env)
        **(
            {"rollout/env_error_frac": float(np.mean([e.get("env_error") is not None for e in episodes]))}
            if any("env_error" in e for e in episodes)
            else {}
        ),  # remote envs only: episodes their server failed
        **{k: float(np.sum(v) if k.startswith("time/") else np.mean(v)) for k, v in terms.items()},
    }


@dataclass
class EvalArgs:
    """When and how the trainer evaluates on held-out episodes; its Config inherits these fields."""

    eval_every: int = 10
    """Greedy evaluation on held-out prompts every this many iterations (0 = never)."""
    eval_n: int = 500
    """Held-out prompts per evaluation."""
    eval_samples: int = 0
    """Also N samples per held-out prompt at the sampling settings: eval/mean@N and eval/pass@k (0 = greedy only)."""

    def __post_init__(self):
        check_fields(self, {"[0, inf)": ("eval_every", "eval_samples"), "[1, inf)": ("eval_n",)}, EvalArgs)


@torch.no_grad()
def greedy_success(model, tokenizer, envs, seeds, eos_ids, *, batch: int = 256, quiet=False, **limits) -> int:
    """Number of episodes solved (info["success"]) with greedy decoding, `batch` episodes per rollout_env call (a
    progress bar beyond one call, unless quiet). limits: rollout_env's max_prompt_len, max_new_tokens, max_turns,
    max_context."""
    hits = 0
    for i in tqdm(range(0, len(envs), batch), desc="greedy eval", disable=quiet or len(envs) <= batch, leave=False):
        _, info = rollout_env(model, tokenizer, envs[i : i + batch], seeds[i : i + batch], eos_ids, **limits)
        hits += sum(e["success"] for e in info)
    return hits


def greedy_accuracy(model, tokenizer, envs, seeds, *, max_new_tokens: int = 16, max_turns: int = 1) -> float:
    """Share of episodes solved greedily, bounded only by the model's own context (warm starts, experiments)."""
    limits = dict(max_prompt_len=10_000, max_new_tokens=max_new_tokens, max_turns=max_turns)
    limits["max_context"] = getattr(model.config, "max_position_embeddings", 1 << 30)
    return greedy_success(model, tokenizer, envs, seeds, [tokenizer.eos_token_id], **limits) / len(envs)


class Imitated:
    """An env whose first action succeeds when it is one the scripted solver may type (env.demonstrations()),
    nothing executed: the greedy check of a demonstrator that slips (warm_start.py detail 4)."""

    def __init__(self, env):
        self.env = env

    def reset(self, seed=None):
        return self.env.reset(seed)

    def step(self, action: str):
        hit = action.strip() in self.env.demonstrations()
        return "", float(hit), True, False, {"success": hit}

    def close(self):
        self.env.close()


def evaluate(model, tokenizer, episodes: list, eos_ids, rank: int = 0, world: int = 1, **limits) -> float:
    """Greedy success on held-out episodes [(env, seed)], sharded over the ranks and summed over them."""
    mine = episodes[rank::world]
    hits = greedy_success(
        model, tokenizer, [e for e, _ in mine], [s for _, s in mine], eos_ids, quiet=rank > 0, **limits
    )
    t = all_reduce_sum(torch.tensor([hits, len(mine)], dtype=torch.float64, device=next(model.parameters()).device))
    return (t[0] / t[1]).item()


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of c right among n samples (Chen et al. 2021, eq. 1): 1 - C(n - c, k) / C(n, k)."""
    return 1.0 if n - c < k else 1.0 - math.comb(n - c, k) / math.comb(n, k)


@torch.no_grad()
def sampled_eval(model, tokenizer, episodes: list, eos_ids, n: int, rank=0, world=1, seed=12345, batch=256, **limits):
    """eval/mean@n, eval/acc_mean@n and eval/pass@k (k = 1, 2, 4, ..., n) of held-out episodes [(env, seed)] in
    groups of n consecutive ones (sample_episodes(repeat=n)), sampled with the settings in `limits` (temperature,
    top_p, top_k and the lengths) from a generator of its own (detail 1)."""
    groups = [episodes[i : i + n] for i in range(0, len(episodes), n)][rank::world]
    mine = [e for g in groups for e in g]
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed + rank)
    infos = []
    for i in tqdm(range(0, len(mine), batch), desc=f"eval@{n}", disable=rank > 0 or len(mine) <= batch, leave=False):
        part = mine[i : i + batch]
        infos += rollout_env(model, tokenizer, *zip(*part), eos_ids, **limits, generator=gen)[1]
    ks = sorted({min(2**j, n) for j in range(n.bit_length() + 1)})  # 1, 2, 4, ..., and n itself
    hits = [sum(e["success"] for e in infos[j * n : (j + 1) * n]) for j in range(len(groups))]  # c per episode
    sums = [sum(e["return"] for e in infos), sum(hits), *(sum(pass_at_k(n, c, k) for c in hits) for k in ks)]
    t = all_reduce_sum(torch.tensor([*sums, len(groups)], dtype=torch.float64, device=gen.device)).tolist()
    out = {f"eval/mean@{n}": t[0] / (t[-1] * n), f"eval/acc_mean@{n}": t[1] / (t[-1] * n)}
    return {**out, **{f"eval/pass@{k}": x / t[-1] for k, x in zip(ks, t[2:-1])}}


def held_out(task, name: str, n: int, samples: int = 0, make=make_env) -> tuple[list, list]:
    """The held-out episodes [(env, seed)] of every evaluation: n for greedy accuracy and, with samples > 0, the same n
    repeated `samples` times each for sampled_eval (a fixed draw: detail 1); envs made by `make` (envs.make_env, or
    env_client.env_maker's remote ones)."""
    greedy = sample_episodes(task, name, "eval", n, np.random.default_rng(12345), make=make)
    again = sample_episodes(task, name, "eval", n, np.random.default_rng(12345), samples, make=make) if samples else []
    return greedy, again


def evaluate_all(model, tokenizer, sets: tuple[list, list], eos_ids, samples: int, rank=0, world=1, **limits) -> dict:
    """eval/acc on the greedy set and, with samples > 0, sampled_eval's metrics on the repeated one (held_out)."""
    out = {"eval/acc": evaluate(model, tokenizer, sets[0], eos_ids, rank, world, **limits)}
    return {
        **out,
        **(sampled_eval(model, tokenizer, sets[1], eos_ids, samples, rank, world, **limits) if samples else {}),
    }


@dataclass
class EvalConfig(TaskArgs, DataArgs, RewardArgs, SampleArgs, EnvArgs, EvalArgs):
    """A saved policy (--model) on a task's or --data's held-out episodes; the trainer's flags, the same defaults."""

    print_samples: int = 0
    """Also print this many held-out episodes (at most eval_n) as the policy plays them greedily: prompt, answer,
    truth, return."""

    def __post_init__(self):
        check_fields(self, {"[0, inf)": ("print_samples",)}, EvalConfig)
        for base in EvalConfig.__bases__:
            if "__post_init__" in vars(base):
                base.__post_init__(self)


def score_stats(scores, group_ids) -> dict:
    """Returns [B] -> rollout/reward_mean, reward_std (all ranks' samples), zero_std_frac (in groups of >= 2, equal)."""
    _, group_std, group_n = ppo_math.group_stats(scores, group_ids)  # [B] per sample
    std = masked_var(scores, torch.ones_like(scores), global_=True).sqrt().item()
    zero = ((group_std < 1e-8) & (group_n > 1)).float().mean().item()
    return {"rollout/reward_mean": scores.mean().item(), "rollout/reward_std": std, "rollout/zero_std_frac": zero}


@torch.no_grad()
def show_samples(model, tokenizer, episodes: list, eos_ids, **limits) -> None:
    """Print held-out episodes [(env, seed)] played greedily: the prompt and everything after it (a multi-turn
    episode's observations included), the task's ground truth where it has one, the return and whether it solved."""
    envs, seeds = zip(*episodes)
    rollout, info = rollout_env(model, tokenizer, list(envs), list(seeds), eos_ids, **limits)  # greedy: no generator
    P = rollout.prompt_ids.shape[1]  # prompt columns (left-padded), then the response's

    def text(ids):
        return repr(tokenizer.decode(ids, skip_special_tokens=True))

    for j, (env, e) in enumerate(zip(envs, info)):
        real = rollout.attention_mask[j].bool()
        truth = getattr(env, "problem", {}).get("ground_truth")  # a task's (TaskEnv); environments judge by playing
        print(f"sample {j + 1}: prompt {text(rollout.prompt_ids[j][real[:P]])}")
        said = "" if truth is None else f"  truth {truth!r}"
        print(f"  answer {text(rollout.response_ids[j][real[P:]])}{said}")
        print(f"  return {e['return']:.3g}, {'solved' if e['success'] else 'not solved'}")


def main(argv=None) -> None:
    """Greedy accuracy and, with --eval-samples N, mean@N and pass@k of a policy on held-out episodes; with
    --print-samples N, N of those episodes as the policy plays them."""
    cfg = parse_config(EvalConfig, argv)
    torch.manual_seed(0)
    if cfg.model:
        policy, tokenizer = load_policy(cfg.model, "cpu")
    else:  # the trainer's warm start lives above this file; a random init shows the metrics' floor
        tokenizer = make_tokenizer()
        policy = make_tiny_model(tokenizer).eval()
        print("[minrl] no --model: the embedded tiny model at random init (pass a trained one: runs/a/policy)")
    task = None if multi_turn(cfg) else load_task(cfg, tokenizer)
    sets = held_out(task, cfg.task, cfg.eval_n, cfg.eval_samples)
    out = evaluate_all(policy, tokenizer, sets, stop_token_ids(policy, tokenizer), cfg.eval_samples, **rollout_kw(cfg))
    print("  ".join(f"{k} {v:.3f}" for k, v in out.items()))
    if cfg.print_samples:  # the first of the same held-out episodes, again (detail 1: a fixed draw)
        show = held_out(task, cfg.task, min(cfg.print_samples, cfg.eval_n))[0]
        show_samples(policy, tokenizer, show, stop_token_ids(policy, tokenizer), **rollout_kw(cfg))
    if task is not None and hasattr(task, "close"):
        task.close()


if __name__ == "__main__":
    main()
