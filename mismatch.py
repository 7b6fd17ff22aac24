"""The training-inference gap checker: sample with the sampler, recompute with the trainer, under each variation
that makes their logprobs differ; a verdict per variation and correction thresholds that fit the gap measured.

    python mismatch.py                                   # the embedded tiny model (random init), every variation
    python mismatch.py --model PATH_OR_HUB_ID --prompts 64 --max-new-tokens 128 --task add
    python mismatch.py --variations baseline sampler_bf16 --json out.json

Run it before training (a pre-flight check): the trainer's PPO ratio assumes that the logprobs it recomputes are
those the sampler drew from. The sampler is `rollout.generate` (KV cache, the sampling temperature); the trainer is
`rollout.sequence_logprobs` as ppo_minimal.trainer_logprobs calls it. Against the baseline (both fp32, the sampler's
batch and padding, a KV cache) each variation changes one thing (VARIATIONS):
  sampler_bf16         the sampler holds the weights in bf16 (offpolicy.inference_copy), the trainer fp32
  trainer_bf16         the trainer recomputes under bf16 autocast, the sampler fp32
  both_bf16            both: bf16 sampler weights, bf16 trainer autocast (not the same kernels: still a gap)
  no_kv_cache          the sampler's logprobs from one full forward per generated token instead of a KV cache
  sampler_batch_1      the sampler generates one row at a time (batch-variant kernels on the sampler's side)
  trainer_micro_batch_1  the trainer recomputes one row at a time (on the trainer's side)
  extra_padding        the trainer sees `pad` more left-padding tokens per row (positions from the mask)
  bug_no_temperature   a control: the trainer forgets the sampling temperature (a bug, not numerics)

Statistics over the valid response tokens, rho = log pi_trainer - log pi_sampler per token (offpolicy.py's rho):
quantiles of |rho| (p50, p90, p99, max), veRL's k3 KL E[exp(rho) - 1 - rho] (rollout_corr/k3_kl, KL(sampler ||
trainer) >= 0), the share of extreme tokens (exp(rho) outside [0.5, 2]) and the largest per-sequence mean |rho|.
Verdict (our thresholds): `exact` when max |rho| <= 1e-4 (fp32 rounding: no correction needed); `numerics` when
p99 <= 0.1 and at most 1 in 1000 tokens is extreme (a bf16-like gap: the rollout corrections of offpolicy.py fit
it); `broken` otherwise (a recompute that is not the sampler's distribution: temperature, masks, positions, a
chat template; fix it, do not correct it). For a non-exact variation the suggestions are the offpolicy.py flags
that would act on about 1 token in 1000 (TIS cap, token_k1 bounds: the 99.9 % quantile of |rho|) and on about 1
sequence in 100 (seq_mean_k1, the geometric mask: the 99 % quantile of the per-sequence mean |rho|).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from cli import check_fields, parse_config
from common import make_autocast
from offpolicy import inference_copy
from rollout import generate, position_ids_from_mask, sequence_logprobs
from tasks import (
    format_prompt,
    load_policy,
    make_task,
    make_tiny_model,
    make_tokenizer,
    stop_token_ids,
    tokenize_prompts,
)

VARIATIONS = ("baseline", "sampler_bf16", "trainer_bf16", "both_bf16", "no_kv_cache", "sampler_batch_1",
              "trainer_micro_batch_1", "extra_padding", "bug_no_temperature")  # fmt: skip
EXACT, P99_NUMERICS, EXTREME_NUMERICS = 1e-4, 0.1, 1e-3  # the verdict's thresholds (module docstring)


@dataclass
class MismatchArgs:
    """What to sample and which variations to measure."""

    model: str | None = None
    """HF model name or local folder (None = the embedded tiny model, random init)."""
    task: str = "sort"
    """Procedural task whose prompts are sampled (tasks.py)."""
    prompts: int = 32
    """Prompts (one response each) per variation."""
    max_prompt_len: int = 64
    """Longest prompt in tokens."""
    max_new_tokens: int = 32
    """Response length limit."""
    temperature: float = 0.6
    """Sampling temperature (the trainer recomputes with it, except in bug_no_temperature)."""
    pad: int = 16
    """extra_padding: left-padding tokens added per row."""
    seed: int = 0
    """Seed of the prompts and the sampler."""
    variations: list[str] = field(default_factory=lambda: list(VARIATIONS))
    """Variations to measure (VARIATIONS; baseline first is the reference)."""
    json: str | None = None
    """Also write the results as JSON to this file."""

    def __post_init__(self):
        check_fields(self, {"[1, inf)": ("prompts", "max_prompt_len", "max_new_tokens", "pad"),
                            "(0, inf)": ("temperature",), "[0, inf)": ("seed",)})  # fmt: skip
        if unknown := [v for v in self.variations if v not in VARIATIONS]:
            raise ValueError(f"config field 'variations': {unknown} are not among {list(VARIATIONS)}")


def gap_statistics(trainer_logprobs, sampler_logprobs, mask) -> dict:
    """The gap's statistics over valid tokens (all inputs [B, R]): |rho| quantiles, k3 KL, extreme share, the largest
    per-sequence mean |rho|, and the per-token and per-sequence |rho| themselves (for the suggestions)."""
    rho = (trainer_logprobs - sampler_logprobs).double()
    valid = mask.bool()
    tok = rho[valid].abs()  # [N] valid tokens
    rows = valid.sum(-1) > 0
    seq = (rho * mask).sum(-1)[rows] / mask.sum(-1)[rows]  # [B'] per-sequence mean rho
    q = torch.quantile(tok, torch.tensor([0.5, 0.9, 0.99], dtype=torch.float64)).tolist()
    r = rho[valid].clamp(-20, 20)
    extreme = float((r.abs() > math.log(2)).double().mean())  # exp(rho) outside [0.5, 2]
    out = {"p50": q[0], "p90": q[1], "p99": q[2], "max": float(tok.max()), "k3_kl": float((r.exp() - 1 - r).mean())}
    return {**out, "extreme": extreme, "seq_mean_max": float(seq.abs().max()), "tokens": int(valid.sum()),
            "_tok": tok, "_seq": seq.abs()}  # fmt: skip


def verdict(s: dict) -> str:
    """exact | numerics | broken (module docstring)."""
    if s["max"] <= EXACT:
        return "exact"
    return "numerics" if s["p99"] <= P99_NUMERICS and s["extreme"] <= EXTREME_NUMERICS else "broken"


def suggestions(s: dict) -> dict:
    """offpolicy.py thresholds that act on ~1 token in 1000 (TIS cap, token_k1) and ~1 sequence in 100 (the geometric
    mask seq_mean_k1), from this gap's |rho| quantiles; only for a numerics gap (exact: nothing to correct; broken:
    a bug to fix, which no correction should hide)."""
    if verdict(s) != "numerics":
        return {}
    t = float(torch.quantile(s["_tok"], 0.999))  # |rho| of the 1-in-1000 token
    q = float(torch.quantile(s["_seq"], 0.99))  # |mean rho| of the 1-in-100 sequence
    up = lambda x: f"{math.exp(x):.4g}"  # noqa: E731
    return {"--rollout-is token --rollout-is-threshold": up(t), "--rollout-rs token_k1 --rollout-rs-threshold": up(t),
            "--rollout-rs seq_mean_k1 --rollout-rs-threshold": f"{math.exp(-q):.4g}_{up(q)}"}  # fmt: skip


def uncached_logprobs(model, ids, mask, response_mask, temperature: float):
    """The sampler's logprobs [B, R] of its own tokens without a KV cache: one full forward over each prefix."""
    B, R = response_mask.shape
    P, out = ids.shape[1] - R, torch.zeros(B, R)
    for t in range(R):
        prefix, pmask = ids[:, : P + t], mask[:, : P + t]
        logits = model(input_ids=prefix, attention_mask=pmask, position_ids=position_ids_from_mask(pmask)).logits
        logp = torch.log_softmax(logits[:, -1].float() / temperature, -1)
        out[:, t] = logp.gather(-1, ids[:, P + t, None]).squeeze(1)
    return out * response_mask


def measure(args: MismatchArgs, model, tokenizer, prompt_ids, prompt_mask, variation: str) -> dict:
    """One variation: sample, recompute, the gap's statistics, verdict and suggestions."""
    sampler = inference_copy(model, "bfloat16") if variation in ("sampler_bf16", "both_bf16") else model
    stops = {"eos_token_ids": stop_token_ids(model, tokenizer), "pad_token_id": tokenizer.pad_token_id}
    g = torch.Generator().manual_seed(args.seed)
    rows, sample = 1 if variation == "sampler_batch_1" else prompt_ids.shape[0], {**stops, "generator": g}
    sample.update(max_new_tokens=args.max_new_tokens, temperature=args.temperature)
    with torch.no_grad():
        parts = [generate(sampler, prompt_ids[i : i + rows], prompt_mask[i : i + rows], **sample)
                 for i in range(0, len(prompt_ids), rows)]  # fmt: skip
        R = max(p.response_ids.shape[1] for p in parts)
        right = lambda t, v: torch.cat([torch.nn.functional.pad(p, (0, R - p.shape[1]), value=v) for p in t])  # noqa: E731
        resp_mask = right([p.response_mask for p in parts], 0)  # [B, R]
        ids = torch.cat([prompt_ids, right([p.response_ids for p in parts], tokenizer.pad_token_id)], 1)
        mask = torch.cat([prompt_mask, resp_mask], 1)  # [B, P + R]
        behav = right([p.rollout_logprobs for p in parts], 0.0)
        if variation == "no_kv_cache":
            behav = uncached_logprobs(sampler, ids, mask, resp_mask, args.temperature)
        if variation == "extra_padding":  # more left padding: ids and mask shifted, positions from the mask
            ids = torch.cat([ids.new_full((len(ids), args.pad), tokenizer.pad_token_id), ids], 1)
            mask = torch.cat([mask.new_zeros(len(mask), args.pad), mask], 1)
        autocast = make_autocast("bfloat16" if variation in ("trainer_bf16", "both_bf16") else "float32", ids.device)
        temperature = 1.0 if variation == "bug_no_temperature" else args.temperature
        micro = 1 if variation == "trainer_micro_batch_1" else len(ids)
        with autocast():
            trainer, _ = sequence_logprobs(model, ids, mask, R, temperature=temperature, micro_batch=micro)
    s = gap_statistics(trainer.float(), behav, resp_mask.float())
    return {"variation": variation, **{k: v for k, v in s.items() if not k.startswith("_")}, "verdict": verdict(s),
            "suggest": suggestions(s)}  # fmt: skip


def check(args: MismatchArgs) -> list[dict]:
    """Every requested variation's result (measure), on the same prompts."""
    torch.manual_seed(args.seed)
    if args.model is None:
        tokenizer = make_tokenizer()
        model = make_tiny_model(tokenizer).eval()
    else:
        model, tokenizer = load_policy(args.model, torch.device("cpu"))
    problems = make_task(args.task).sample(args.prompts, "train", np.random.default_rng(args.seed))
    texts = [format_prompt(tokenizer, p["prompt"]) for p in problems]
    prompt_ids, prompt_mask = tokenize_prompts(tokenizer, texts, args.max_prompt_len)
    return [measure(args, model, tokenizer, prompt_ids, prompt_mask, v) for v in args.variations]


def report(results: list[dict]) -> str:
    """The results as an aligned table, then each non-exact variation's suggested flags."""
    cols = ["p50", "p90", "p99", "max", "k3_kl", "extreme", "seq_mean_max"]
    lines = [f"{'variation':22s} " + " ".join(f"{c:>12s}" for c in cols) + f" {'tokens':>7s}  verdict"]
    for r in results:
        lines.append(f"{r['variation']:22s} " + " ".join(f"{r[c]:12.3g}" for c in cols) + f" {r['tokens']:7d}  "
                     f"{r['verdict']}")  # fmt: skip
    for r in results:
        for flag, value in r["suggest"].items():
            lines.append(f"  {r['variation']}: {flag} {value}")
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    """`python mismatch.py [flags]`: measure, print the table and suggestions (and write --json)."""
    args = parse_config(MismatchArgs, argv, description=__doc__)
    results = check(args)
    print(report(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": asdict(args), "results": results}, f, indent=1)
    return results


if __name__ == "__main__":
    main()
