"""The training-inference gap checker: sample with the sampler, recompute with the trainer, under each variation
that makes their logprobs differ; a verdict per variation and correction thresholds that fit the gap measured.

    python mismatch.py                                   # the embedded tiny model (random init), every variation
    python mismatch.py --model PATH_OR_HUB_ID --prompts 64 --max-new-tokens 128 --task add
    python mismatch.py --variations baseline sampler_bf16 --json out.json --device cuda   # on the training GPU
    VENV/bin/python mismatch.py --engine vllm            # vLLM's engine as the sampler (scripts/install_vllm.sh VENV)

Run it before training (a pre-flight check): the trainer's PPO ratio assumes that the logprobs it recomputes are
those the sampler drew from. The sampler is `rollout.generate` (KV cache, the sampling temperature); the trainer is
`rollout.sequence_logprobs` as trainer.trainer_logprobs calls it. Against the baseline (both fp32, the sampler's
batch and padding, the sampler with its KV cache against the trainer's one full forward) each variation changes one
thing (VARIATIONS):
  autocast_bf16        both under bf16 autocast, fp32 weights: what `trainer.py --dtype bfloat16` runs
  sampler_bf16         the sampler holds the weights in bf16 (rollout.inference_copy, --rollout-dtype), trainer fp32
  trainer_bf16         an fp32 engine against a trainer under bf16 autocast
  both_bf16            bf16 sampler weights and a bf16-autocast trainer (not the same kernels: still a gap)
  no_kv_cache          the sampler's logprobs of its tokens from a full forward over each prefix (cache off): what
                       is left of the baseline's gap without the cache
  sampler_batch_1      the sampler generates one row at a time (batch-variant kernels on the sampler's side)
  trainer_micro_batch_1  the trainer recomputes one row at a time (on the trainer's side)
  extra_padding        the trainer sees `pad` more left-padding tokens per row (positions from the mask)
  bug_no_temperature   a control: the trainer forgets the sampling temperature (a bug, not numerics)
Batch-variant kernels, padding-dependent attention and the cache show on the GPU the run trains on (--device); on a
CPU their rows are mostly exact.
With `--engine vllm` the sampler is what `trainer.py --rollout-engine vllm` samples with: a vllm_engine.Engine on the
model (saved to a folder, its weights synced), in fp32, or in bf16 for sampler_bf16 / both_bf16 (vLLM's dtype
bfloat16: its own kernels, not a rounded copy of ours). Its baseline is then the real engine-trainer gap: other
kernels, another attention, another sampler. autocast_bf16 and no_kv_cache describe our own sampler and are not
measured with it.

Statistics over the valid response tokens, rho = log pi_trainer - log pi_sampler per token (offpolicy.py's rho):
quantiles of |rho| (p50, p90, p99, max), veRL's k3 KL E[exp(rho) - 1 - rho] (rollout_corr/k3_kl, KL(sampler ||
trainer) >= 0), the share of extreme tokens (exp(rho) outside [0.5, 2]) and the largest |mean rho| of a sequence.
Verdict (our thresholds): `exact` when max |rho| <= 1e-4 (fp32 rounding: no correction needed); `numerics` when
p99 <= 0.3 and at most 1 in 1000 tokens is extreme (a bf16-like gap: the rollout corrections of offpolicy.py fit
it; bf16 on a trained, peaky policy reached p99 ~0.1 and no extreme token in notebook 01, a forgotten temperature
p99 0.9-1.5 and 3-10 % extreme tokens); `broken` otherwise (a recompute that is not the sampler's distribution:
temperature, masks, positions, a chat template; fix it, do not correct it). For a numerics gap the suggestions
are the offpolicy.py flags that would act on about 1 token in 1000 (the TIS cap: the 99.9 % quantile of rho, TIS
cuts one side; token_k1: of |rho|) and on about 1 sequence in 100 (seq_mean_k1, the geometric mask: the 99 %
quantile of |mean rho|), with 4 significant digits of their distance from 1 (1.0004123, not 1.000), and the
share each one acts on when offpolicy.py applies it to the measured samples. They need enough samples
(SUGGEST_MIN: 1000 tokens, 100 sequences): fewer are reported. The printed table has a legend of its columns;
bug_no_temperature is marked as the control it is.
"""

from __future__ import annotations

import json
import math
import tempfile
from dataclasses import asdict, dataclass
from typing import Literal

import numpy as np
import torch

import vllm_engine
from cli import check_fields, parse_config
from common import make_autocast
from logits import _last_logits_kw
from offpolicy import gap_metrics, rollout_is_weights, rollout_rejection_mask
from rollout import cat_rollouts, generate, inference_copy, position_ids_from_mask, sequence_logprobs
from tasks import (
    TASKS,
    format_prompt,
    load_policy,
    make_task,
    make_tiny_model,
    make_tokenizer,
    stop_token_ids,
    tokenize_prompts,
)

VARIATIONS = ("baseline", "autocast_bf16", "sampler_bf16", "trainer_bf16", "both_bf16", "no_kv_cache",
              "sampler_batch_1", "trainer_micro_batch_1", "extra_padding", "bug_no_temperature")  # fmt: skip
NOT_VLLM = ("autocast_bf16", "no_kv_cache")  # variations of our own sampler, not of vLLM's engine
EXACT, P99_NUMERICS, EXTREME_NUMERICS = 1e-4, 0.3, 1e-3  # the verdict's thresholds (module docstring)
SUGGEST_MIN = (1000, 100)  # tokens, sequences below which the quantiles behind the suggestions are the maxima


@dataclass
class MismatchArgs:
    """What to sample and which variations to measure."""

    model: str | None = None
    """HF model name or local folder (None = the embedded tiny model, random init)."""
    task: Literal[TASKS] = "sort"
    """Procedural task whose prompts are sampled (tasks.py)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where to run (auto: cuda if available): measure on the device the run trains on."""
    prompts: int = 128
    """Prompts (one response each) per variation (the suggestions need >= 100 sequences, 1000 tokens)."""
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
    variations: list[str] | None = None
    """Variations to measure (VARIATIONS), each once (None: all, or with --engine vllm all that apply to it)."""
    json: str | None = None
    """Also write the results as JSON to this file."""
    engine: Literal["hf", "vllm"] = "hf"
    """The sampler: hf (rollout.generate) or vllm (vllm_engine.Engine, as --rollout-engine vllm; its venv)."""

    def __post_init__(self):
        ranges = {"[1, inf)": ("prompts", "max_prompt_len", "max_new_tokens", "pad")}
        check_fields(self, {**ranges, "(0, inf)": ("temperature",), "[0, inf)": ("seed",)})
        if self.variations is None:  # the default: every variation that applies to the engine
            self.variations = [v for v in VARIATIONS if self.engine == "hf" or v not in NOT_VLLM]
        if self.engine == "vllm" and (ours := [v for v in self.variations if v in NOT_VLLM]):
            raise ValueError(f"config field 'variations': {ours} vary our own sampler, not --engine vllm's: drop them")
        if unknown := [v for v in self.variations if v not in VARIATIONS]:
            raise ValueError(f"config field 'variations': {unknown} are not among {list(VARIATIONS)}")
        if not self.variations or len(set(self.variations)) < len(self.variations):
            raise ValueError(f"config field 'variations' = {self.variations}: name each variation once, at least one")


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
    k3 = gap_metrics(trainer_logprobs.double(), sampler_logprobs.double(), mask)["rollout_corr/k3_kl"]  # veRL's own
    out = {"p50": q[0], "p90": q[1], "p99": q[2], "max": float(tok.max()), "k3_kl": k3, "extreme": extreme}
    out.update(seq_mean_max=float(seq.abs().max()), tokens=int(valid.sum()), seqs=int(rows.sum()))
    return {**out, "_rho": rho[valid], "_seq": seq.abs()}


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
    w = max(float(torch.quantile(s["_rho"], 0.999)), 0.0)  # rho of the 1-in-1000 token from above: TIS cuts there
    t = float(torch.quantile(s["_rho"].abs(), 0.999))  # |rho| of the 1-in-1000 token: token_k1 is two-sided
    q = float(torch.quantile(s["_seq"], 0.99))  # |mean rho| of the 1-in-100 sequence
    return {
        "rollout_is_threshold": near_one(w),
        "token_k1": near_one(t),
        "seq_mean_k1": f"{near_one(-q)}_{near_one(q)}",
    }


def near_one(x: float) -> str:
    """exp(x) as text with 4 significant digits of its distance from 1: 1.0004123, 0.9995877, 1.1538 (4 significant
    digits of exp(x) itself would print exp(4e-4) as 1.000, a threshold that acts on nothing)."""
    v = math.exp(x)
    return f"{v:.{max(3, 3 - math.floor(math.log10(abs(v - 1))))}f}" if v != 1 else "1"


def acts_on(trainer_logprobs, sampler_logprobs, mask, suggested: dict) -> dict:
    """The share each suggested flag acts on when offpolicy.py applies it to these samples: tokens TIS truncates,
    tokens token_k1 rejects, sequences seq_mean_k1 rejects."""
    if not suggested:
        return {}
    old, rollout = trainer_logprobs.double(), sampler_logprobs.double()
    w = rollout_is_weights(old, rollout, mask, level="token", threshold=suggested["rollout_is_threshold"])[1]
    tok = rollout_rejection_mask(old, rollout, mask, kind="token_k1", threshold=suggested["token_k1"])[1]
    seq = rollout_rejection_mask(old, rollout, mask, kind="seq_mean_k1", threshold=suggested["seq_mean_k1"])[1]
    return {
        "rollout_is_threshold": w["rollout_corr/rollout_is_ratio_fraction_high"],
        "token_k1": tok["rollout_corr/rollout_rs_masked_fraction"],
        "seq_mean_k1": seq["rollout_corr/rollout_rs_seq_masked_fraction"],
    }


def uncached_logprobs(model, ids, mask, response_mask, temperature: float):
    """The sampler's logprobs [B, R] of its own tokens without a KV cache: one full forward over each prefix (the
    last position's logits only)."""
    B, R = response_mask.shape
    P, out, last = ids.shape[1] - R, torch.zeros(B, R, device=ids.device), _last_logits_kw(model, 1)
    for t in range(R):
        prefix, pmask = ids[:, : P + t], mask[:, : P + t]
        pos = position_ids_from_mask(pmask)
        logits = model(input_ids=prefix, attention_mask=pmask, position_ids=pos, use_cache=False, **last).logits
        logp = torch.log_softmax(logits[:, -1].float() / temperature, -1)
        out[:, t] = logp.gather(-1, ids[:, P + t, None]).squeeze(1)
    return out * response_mask


def measure(args: MismatchArgs, model, tokenizer, prompt_ids, prompt_mask, variation: str, engine=None) -> dict:
    """One variation: sample, recompute, the gap's statistics, verdict and suggestions. `engine`: a vLLM Engine of
    the variation's dtype (--engine vllm), synced here; None: rollout.generate."""
    sampler, sample = model, generate  # rollout.generate; or the engine's, with the weights just synced
    if engine is not None:
        vllm_engine.sync_weights(engine, model)  # (a module function: repro.py's stale_sampler may replace it)
        sample = engine.generate
    elif variation in ("sampler_bf16", "both_bf16"):
        sampler = inference_copy(model, "bfloat16")
    stops = {"eos_token_ids": stop_token_ids(model, tokenizer), "pad_token_id": tokenizer.pad_token_id}
    dev = prompt_ids.device
    g = torch.Generator(device=dev).manual_seed(args.seed)
    sampler_cast = make_autocast("bfloat16" if variation == "autocast_bf16" else "float32", dev)
    rows, kw = 1 if variation == "sampler_batch_1" else prompt_ids.shape[0], {**stops, "generator": g}
    kw.update(max_new_tokens=args.max_new_tokens, temperature=args.temperature)
    with torch.no_grad(), sampler_cast():
        chunks = [slice(i, i + rows) for i in range(0, len(prompt_ids), rows)]
        parts = [sample(sampler, prompt_ids[c], prompt_mask[c], **kw) for c in chunks]
    with torch.no_grad():
        out = cat_rollouts(parts, tokenizer.pad_token_id, dev)  # one batch (sampler_batch_1: of single rows)
        ids, mask, resp_mask, behav = out.input_ids, out.attention_mask, out.response_mask, out.rollout_logprobs
        R = resp_mask.shape[1]
        if variation == "no_kv_cache":
            behav = uncached_logprobs(sampler, ids, mask, resp_mask, args.temperature)
        if variation == "extra_padding":  # more left padding: ids and mask shifted, positions from the mask
            ids = torch.cat([ids.new_full((len(ids), args.pad), tokenizer.pad_token_id), ids], 1)
            mask = torch.cat([mask.new_zeros(len(mask), args.pad), mask], 1)
        bf16 = variation in ("autocast_bf16", "trainer_bf16", "both_bf16")
        autocast = make_autocast("bfloat16" if bf16 else "float32", dev)
        temperature = 1.0 if variation == "bug_no_temperature" else args.temperature
        micro = 1 if variation == "trainer_micro_batch_1" else len(ids)
        with autocast():
            trainer, _ = sequence_logprobs(model, ids, mask, R, temperature=temperature, micro_batch=micro)
    s = gap_statistics(trainer.float(), behav, resp_mask.float())
    suggested = suggestions(s)
    out = {"variation": variation, **{k: v for k, v in s.items() if not k.startswith("_")}, "verdict": verdict(s)}
    return {**out, "suggest": suggested, "acts_on": acts_on(trainer.float(), behav, resp_mask.float(), suggested)}


def check(args: MismatchArgs, model=None, tokenizer=None) -> list[dict]:
    """Every requested variation's result (measure), on the same prompts; model and tokenizer: one already loaded
    (a notebook's policy), else --model's, else the embedded tiny model (random init, seeded)."""
    dev = torch.device(
        "cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()) else "cpu"
    )
    if model is None and args.model is None:
        torch.manual_seed(args.seed)
        tokenizer = make_tokenizer()
        model = make_tiny_model(tokenizer).to(dev).eval()
    elif model is None:
        model, tokenizer = load_policy(args.model, dev)
    problems = make_task(args.task).sample(args.prompts, "train", np.random.default_rng(args.seed))
    texts = [format_prompt(tokenizer, p["prompt"]) for p in problems]
    prompt_ids, prompt_mask = (t.to(dev) for t in tokenize_prompts(tokenizer, texts, args.max_prompt_len))
    inputs = (args, model, tokenizer, prompt_ids, prompt_mask)
    if args.engine == "hf":
        return [measure(*inputs, v) for v in args.variations]
    results = {}  # vLLM: one engine per dtype at a time (a process holds one), its variations in a row
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)  # the engine's config and tokenizer; its weights are synced from `model`
        tokenizer.save_pretrained(folder)
        for dtype in ("float32", "bfloat16"):
            mine = [v for v in args.variations if (v in ("sampler_bf16", "both_bf16")) == (dtype == "bfloat16")]
            if mine:
                length = prompt_ids.shape[1] + args.max_new_tokens
                kw = dict(max_model_len=length, dtype=dtype, sleep=False, seed=args.seed)
                engine = vllm_engine.Engine(folder, vllm_engine.EngineArgs(**kw))
                try:
                    results.update({v: measure(*inputs, v, engine=engine) for v in mine})
                finally:
                    engine.close()  # before the next dtype's engine: one at a time
    return [results[v] for v in args.variations]


LEGEND = f"""\
  rho = log pi_trainer - log pi_sampler of each response token (nats; 0 = the trainer recomputes what was sampled)
  p50 p90 p99 max   quantiles of |rho| over the response tokens
  k3_kl             veRL's k3 estimate of KL(sampler || trainer), per token (>= 0)
  extreme           share of tokens whose ratio exp(rho) is outside [0.5, 2]
  seq_mean_max      the largest |mean rho| of one sequence
  tokens            response tokens measured
  verdict           exact: max <= {EXACT:g} | numerics: p99 <= {P99_NUMERICS:g} and extreme <= {EXTREME_NUMERICS:g}
                    (a correction fits) | broken: fix the recompute, do not correct it
  (control)         a bug planted on purpose: its verdict must be broken, else the checker misses bugs"""
CONTROLS = ("bug_no_temperature",)  # variations that are planted bugs, not numerics


def report(results: list[dict]) -> str:
    """The results as an aligned table and its legend, then each non-exact variation's suggested flags."""
    cols = ["p50", "p90", "p99", "max", "k3_kl", "extreme", "seq_mean_max"]
    lines = [f"{'variation':22s} " + " ".join(f"{c:>12s}" for c in cols) + f" {'tokens':>7s}  verdict"]
    for r in results:
        values = " ".join(f"{r[c]:12.3g}" for c in cols)
        mark = ""
        if r["variation"] in CONTROLS:  # must be broken
            mark = "  (control)" + ("" if r["verdict"] == "broken" else ": NOT broken, the checker missed a bug")
        lines.append(f"{r['variation']:22s} {values} {r['tokens']:7d}  {r['verdict']}{mark}")
    lines.append(LEGEND)
    flags = {
        "rollout_is_threshold": "--rollout-is token --rollout-is-threshold",
        "token_k1": "--rollout-rs token_k1 --rollout-rs-threshold",
        "seq_mean_k1": "--rollout-rs seq_mean_k1 --rollout-rs-threshold",
    }
    for r in results:
        few = r["tokens"] < SUGGEST_MIN[0] or r["seqs"] < SUGGEST_MIN[1]
        for name, value in r["suggest"].items():
            unit = "sequences" if name == "seq_mean_k1" else "tokens"
            lines.append(
                f"  {r['variation']}: {flags[name]} {value}   (acts on {r['acts_on'][name]:.2%} of the {unit})"
            )
        if r["suggest"] and few:
            lines.append(
                f"  WARNING {r['variation']}: {r['tokens']} tokens / {r['seqs']} sequences are too few for "
                f"these quantiles (>= {SUGGEST_MIN[0]} / {SUGGEST_MIN[1]}): raise --prompts"
            )
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    """`python mismatch.py [flags]`: measure, print the table and suggestions (and write --json)."""
    args = parse_config(MismatchArgs, argv, description=__doc__)
    results = check(args)
    print(
        f"sampler: {'vllm_engine.Engine (vLLM)' if args.engine == 'vllm' else 'rollout.generate'}; trainer: "
        "rollout.sequence_logprobs"
    )
    print(report(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": asdict(args), "results": results}, f, indent=1)
    return results


if __name__ == "__main__":
    main()
