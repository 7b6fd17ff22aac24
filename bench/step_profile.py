"""Where one RL step's time goes: `trainer.train` as it runs, with a timer around each piece it calls.

    python bench/step_profile.py                       # tiny and 2.5M configs on CPU, GRPO, 8 prompts x 8
    python bench/step_profile.py --adv-estimator gae   # with a critic
    python bench/step_profile.py --preset 0.5b --device cuda --dtype bfloat16

The run is the comparison of bench/trl_bench.py: a random-init Qwen2 saved as a model folder, digit-sorting
prompts as a JSONL file (`--data`, reward `digits`), 8 prompts x 8 samples, up to 32 new tokens at T 1, one
optimizer step per batch, no KL, no evaluation. Timers wrap, without changing them, the functions train() calls:
each model forward (the first of a `generate` call is the prefill, the others the per-token decode steps),
`generate` itself (what is left of it is the sampling step: softmax, multinomial, masks, cache growth), the
trainer's logprob passes (the no-grad recompute of the PPO anchor, the reference's, the training forward),
the critic's values and update, `backward`, the optimizer step and attention credit's own work (its maps are
computed inside the recompute: with `--extra "--credit attention"` compare step_s with a run without). Each timer
counts its own time only (a forward inside `generate` is not counted twice); "python" is the rest of the step:
the loop, advantages, metrics, logging. Median over the timed steps, after `--warmup` untimed ones (>= 1: a step
is timed from the end of the one before). On CUDA each timer synchronises, which adds some time of its own. A
frozen model's forward counts as "reference" (the stale anchor of --inject too), a no-grad one of the policy as
"recompute" (a critic warm-up's policy forward too).
"""

from __future__ import annotations

import functools
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollout_bench import BenchArgs, make_model, run_presets, sync  # noqa: E402

import rollout  # noqa: E402
import trainer  # noqa: E402
from cli import check_fields, parse_config  # noqa: E402
from tasks import DigitTask, make_tokenizer  # noqa: E402

PHASES = ("prefill", "decode", "sampling", "recompute", "reference", "train_forward", "backward", "optimizer",
          "critic", "credit", "python")  # fmt: skip


@dataclass
class Config(BenchArgs):
    """`python bench/step_profile.py`: one RL step's time by piece (BenchArgs: preset, device, dtype, repeats)."""

    adv_estimator: Literal["grpo", "gae"] = "grpo"
    """grpo (no critic) or gae (PPO with a critic: its values and update join the profile)."""
    prompts: int = 8
    """Prompts per step."""
    group_size: int = 8
    """Samples per prompt."""
    new_tokens: int = 32
    """max_new_tokens."""
    warmup: int = 2
    """Untimed steps first (>= 1)."""
    extra: str = ""
    """More trainer flags, one string (e.g. "--credit attention --ppo-epochs 2")."""

    def __post_init__(self):
        BenchArgs.__post_init__(self)
        check_fields(self, {"[1, inf)": ("prompts", "group_size", "new_tokens", "warmup")})


def write_inputs(preset: str, folder: Path, seed: int, n_rows: int = 512) -> tuple[str, str]:
    """A random-init model folder for the preset (the embedded tokenizer's vocabulary) and a JSONL of sort prompts."""
    torch.manual_seed(seed)
    tokenizer = make_tokenizer()
    model = make_model(preset, tokenizer=tokenizer)
    model.save_pretrained(folder / "model")
    tokenizer.save_pretrained(folder / "model")
    task, rng = DigitTask("sort"), np.random.default_rng(seed)
    rows = task.sample(n_rows, "train", rng)
    (folder / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(folder / "model"), str(folder / "data.jsonl")


class Timers:
    """Exclusive wall time per phase: a phase entered inside another is subtracted from the outer one."""

    def __init__(self, device):
        self.device, self.total, self.stack = device, dict.fromkeys(PHASES, 0.0), []

    def wrap(self, fn, phase_of):
        """fn, timed under phase_of(*args) (a phase name, or None: not timed)."""

        @functools.wraps(fn)  # the signature stays inspectable (rollout._cache_kw, _last_logits_kw read it)
        def timed(*args, **kw):
            phase = phase_of(*args, **kw)
            if phase is None:
                return fn(*args, **kw)
            sync(self.device)
            self.stack.append([phase, time.perf_counter(), 0.0])  # [phase, start, children's time]
            try:
                return fn(*args, **kw)
            finally:
                sync(self.device)
                name, t0, inner = self.stack.pop()
                elapsed = time.perf_counter() - t0
                self.total[name] += elapsed - inner
                if self.stack:
                    self.stack[-1][2] += elapsed

        return timed


def install(timers: Timers, patch) -> None:
    """Wrap what train() calls (patch(owner, name, new) restores it afterwards)."""
    in_generate = {"calls": 0}

    def gen_phase(*a, **k):
        in_generate["calls"] = 0
        return "sampling"

    def forward_phase(module, *a, **k):
        if not timers.stack or timers.stack[-1][0] != "sampling":
            return None  # a forward inside another timed piece: counted there
        in_generate["calls"] += 1
        return "prefill" if in_generate["calls"] == 1 else "decode"

    def logprob_phase(cfg, model, *a, **k):
        if torch.is_grad_enabled():
            return "train_forward"
        return "reference" if not next(model.parameters()).requires_grad else "recompute"

    patch(rollout, "generate", timers.wrap(rollout.generate, gen_phase))
    patch(trainer, "trainer_logprobs", timers.wrap(trainer.trainer_logprobs, logprob_phase))
    patch(trainer, "critic_update", timers.wrap(trainer.critic_update, lambda *a, **k: "critic"))
    patch(trainer, "credit_weights", timers.wrap(trainer.credit_weights, lambda *a, **k: "credit"))
    patch(trainer.Critics, "values", timers.wrap(trainer.Critics.values, lambda *a, **k: "critic"))
    patch(torch.autograd, "backward", timers.wrap(torch.autograd.backward, lambda *a, **k: "backward"))
    patch(torch.optim.AdamW, "step", timers.wrap(torch.optim.AdamW.step, lambda *a, **k: "optimizer"))
    from transformers import Qwen2ForCausalLM

    patch(Qwen2ForCausalLM, "forward", timers.wrap(Qwen2ForCausalLM.forward, forward_phase))


def profile_one(preset: str, cfg: Config) -> dict:
    """Median seconds per phase over cfg.repeats steps of one train() run on the preset's model."""
    saved, device = [], torch.device(cfg.device)

    def patch(owner, name, new):
        saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, new)

    with tempfile.TemporaryDirectory() as tmp:
        model, data = write_inputs(preset, Path(tmp), cfg.seed)
        argv = ["--model", model, "--data", data, "--reward", "digits", "--adv-estimator", cfg.adv_estimator]
        argv += ["--steps", str(cfg.warmup + cfg.repeats), "--prompts-per-step", str(cfg.prompts)]
        argv += ["--group-size", str(cfg.group_size), "--max-new-tokens", str(cfg.new_tokens), "--temperature", "1"]
        argv += ["--ppo-epochs", "1", "--minibatches", "1", "--warmup-steps", "0", "--eval-every", "0"]
        argv += ["--device", cfg.device, "--dtype", cfg.dtype, "--seed", str(cfg.seed), "--out-dir", tmp + "/run"]
        argv += ["--no-save-final", *cfg.extra.split()]
        run_cfg = parse_config(trainer.Config, argv)
        timers, rows = Timers(device), []
        last = {"t": None, "snap": None}

        def hook(step, metrics):  # called once per step, at its end: the step's wall time and its phases
            now = time.perf_counter()
            if last["t"] is not None and step > cfg.warmup:
                phases = {k: v - last["snap"][k] for k, v in timers.total.items()}
                phases["python"] = (now - last["t"]) - sum(phases.values())
                rows.append({"step_s": now - last["t"], **phases, "tokens": metrics["rollout/response_len"]})
            last["t"], last["snap"] = now, dict(timers.total)

        install(timers, patch)
        try:
            trainer.train(run_cfg, hooks=[hook])
        finally:
            for owner, name, old in reversed(saved):
                setattr(owner, name, old)
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    out = {"preset": preset, "step_s": med["step_s"]}
    out.update({f"{k}_%": 100 * med[k] / med["step_s"] for k in PHASES if any(r[k] for r in rows)})
    out["resp_len"] = med["tokens"]
    return out


def main(argv=None):
    """`python bench/step_profile.py [flags]`: the table, one row per preset, shares of the median step."""
    cfg = parse_config(Config, argv)
    batch = f"{cfg.prompts} prompts x {cfg.group_size}, <= {cfg.new_tokens} new tokens, {cfg.adv_estimator} {cfg.extra}"
    return run_presets(cfg, profile_one, f"one RL step by piece (% of the median step), {batch}")


if __name__ == "__main__":
    main()
