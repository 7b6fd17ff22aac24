"""One GRPO step, minrl vs TRL's GRPOTrainer, on the same work: seconds per step, interleaved runs, the ratio; and
minrl's step with its vLLM sampler (--rollout-engine vllm) against its own (hf).

    python bench/trl_bench.py --trl-python /path/to/trl-venv/bin/python          # tiny and 2.5M on CPU
    VLLM/bin/python bench/trl_bench.py --engines hf vllm --preset 2.5m --new-tokens 32 128 --trl-python TRL/bin/python

TRL runs in its own environment (never in CI, never a dependency: it pins other versions):
    python3 -m venv trl-venv && trl-venv/bin/pip install torch==2.13.0
    trl-venv/bin/pip install -c <(echo torch==2.13.0) trl datasets transformers==5.24.0

Equal work on both sides: the same random-init Qwen2 folder and tokenizer (bench/step_profile.write_inputs), the
same sort prompts (each "<bos>" + prompt, as minrl formats a prompt for a tokenizer without a chat template), 8
prompts x 8 samples, up to 32 new tokens at temperature 1 (no top-k / top-p), GRPO with the group std, no KL (TRL
beta 0: no reference model; minrl --kl-metric-every 0), one optimizer step per batch (TRL num_iterations 1,
minrl one epoch of one minibatch), the same lr, AdamW, grad clip 1, fp32 (TRL's bf16 default turned off), the
same partial-credit reward, no evaluation and no checkpoints. Each run is a fresh process of `--steps` steps; a
step's time is the wall time between the ends of two steps (TRL: a callback at on_step_end; minrl: a train() hook),
the first `--warmup` dropped. The sides run interleaved (minrl, TRL, minrl, ...) `--repeats` times; the table has
the median step time of each side over all timed steps and the ratio minrl / TRL, with each side's mean response
length (random-init models sample their own lengths: close values say the work was equal).

With `--engines hf vllm` minrl runs twice per repeat, once per sampler (both under the python running this bench,
which must then be the vLLM venv's: scripts/install_vllm.sh); the table adds the vLLM side's step, `vllm_speedup`
(hf's step / vLLM's: how many times faster the step is with vLLM), the share of its step spent putting the weights
into the engine (`time/sync`) and in the rollout, and each side's first step (its sampler's build and warm-up
included, not in the medians). TRL samples with its own generate here: its vLLM path (`use_vllm=True,
vllm_mode="colocate"`) fails on this CPU build of vLLM at its first weight sync (`'Parameter' object has no
attribute 'weight_loader'`).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from step_profile import write_inputs  # noqa: E402

from cli import check_choice, check_fields, parse_config  # noqa: E402
from runlog import format_table  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

TRL_SCRIPT = r"""
import json, sys, time
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

args = json.loads(sys.argv[1])
torch.set_num_threads(args["threads"])
rows = [json.loads(line) for line in open(args["data"])]
data = Dataset.from_list([{"prompt": "<bos>" + r["prompt"], "ground_truth": r["ground_truth"]} for r in rows])


def digits(completions, ground_truth, **kw):  # minrl's tasks.digits_score
    out = []
    for sol, gt in zip(completions, ground_truth):
        sol, gt = sol.strip(), gt.strip()
        out.append(sum(a == b for a, b in zip(sol, gt)) / max(len(sol), len(gt)))
    return out


class Clock(TrainerCallback):
    def __init__(self):
        self.ends = []

    def on_step_end(self, a, state, control, **kw):
        self.ends.append(time.perf_counter())


start = time.perf_counter()
tok = AutoTokenizer.from_pretrained(args["model"])
model = AutoModelForCausalLM.from_pretrained(args["model"])
cfg = GRPOConfig(
    output_dir=args["out"], per_device_train_batch_size=args["prompts"] * args["group"], num_generations=args["group"],
    max_completion_length=args["new_tokens"], temperature=1.0, top_p=1.0, top_k=0, beta=0.0, num_iterations=1,
    learning_rate=args["lr"], lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=1.0, weight_decay=0.0,
    max_steps=args["steps"], logging_steps=1, report_to="none", save_strategy="no", use_cpu=args["device"] == "cpu",
    seed=args["seed"], gradient_accumulation_steps=1, dataloader_num_workers=0, disable_tqdm=True,
    bf16=False, fp16=False,  # fp32 as minrl (GRPOConfig turns bf16 on when it is not given)
)
clock = Clock()
trainer = GRPOTrainer(model=model, reward_funcs=digits, args=cfg, train_dataset=data, processing_class=tok,
                      callbacks=[clock])
trainer.train()
lengths = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
print("RESULT " + json.dumps({"start": start, "ends": clock.ends, "lengths": lengths}))
"""


@dataclass
class Config:
    """`python bench/trl_bench.py`: minrl's GRPO step vs TRL's on the same work."""

    trl_python: str = ""
    """The python of an environment with TRL installed (see the module docstring); empty: no TRL side."""
    engines: list[str] = field(default_factory=lambda: ["hf"])
    """minrl's samplers: hf (rollout.generate), vllm (--rollout-engine vllm: run this bench in the vLLM venv)."""
    preset: list[str] | None = None
    """Model configs: tiny, 2.5m (default: both)."""
    steps: int = 8
    """Steps per run (the first `warmup` are not timed)."""
    warmup: int = 2
    """Untimed steps at the start of each run."""
    repeats: int = 3
    """Runs per side, interleaved."""
    prompts: int = 8
    """Prompts per step."""
    group: int = 8
    """Samples per prompt."""
    new_tokens: list[int] = field(default_factory=lambda: [32])
    """Maximum new tokens per sample: a row of the table per preset and value."""
    lr: float = 1e-5
    """Learning rate of both sides (constant)."""
    threads: int = 2
    """torch CPU threads of each run."""
    device: str = "cpu"
    """cpu | cuda."""
    seed: int = 0
    """Seed of the model init, the data and both runs."""

    def __post_init__(self):
        if not self.trl_python and self.engines == ["hf"]:
            raise ValueError("config field 'trl_python' is required unless --engines hf vllm: a venv with TRL (--help)")
        for p in self.preset or []:
            check_choice("preset", p, ["tiny", "2.5m"])
        for e in self.engines:
            check_choice("engines", e, ["hf", "vllm"])
        if not self.engines or len(set(self.engines)) < len(self.engines):
            raise ValueError(f"config field 'engines' = {self.engines}: name each of hf, vllm once, at least one")
        if bad := [n for n in self.new_tokens if n < 1]:
            raise ValueError(f"config field 'new_tokens': {bad} must be >= 1")
        check_fields(self, {"[1, inf)": ("steps", "repeats", "prompts", "group", "threads")})
        check_fields(self, {"[0, inf)": ("warmup",), "(0, inf)": ("lr",)})
        if self.warmup >= self.steps - 1:
            raise ValueError(f"config field 'warmup' = {self.warmup}: leaves < 2 steps of {self.steps} to time")


def minrl_argv(cfg: Config, model: str, data: str, out: str, new_tokens: int, engine: str) -> list[str]:
    """The trainer flags of the same work (module docstring)."""
    flags = f"--model {model} --data {data} --reward digits --adv-estimator grpo --steps {cfg.steps} "
    flags += f"--prompts-per-step {cfg.prompts} --group-size {cfg.group} --max-new-tokens {new_tokens} "
    flags += f"--temperature 1 --lr {cfg.lr} --lr-schedule constant --warmup-steps 0 --ppo-epochs 1 --minibatches 1 "
    flags += f"--micro-batch {cfg.prompts * cfg.group} --kl-metric-every 0 --eval-every 0 --no-save-final "
    flags += f"--rollout-engine {engine} --overwrite "
    return (flags + f"--seed {cfg.seed} --device {cfg.device} --out-dir {out}").split()


MINRL_SCRIPT = r"""
import json, sys, time
import torch
sys.path.insert(0, sys.argv[1])
import trainer
from cli import parse_config
torch.set_num_threads(int(sys.argv[2]))
ends, lengths, sync, roll = [], [], [], []
cfg = parse_config(trainer.Config, sys.argv[3:])


def record(step, m):
    ends.append(time.perf_counter())
    lengths.append(m["rollout/response_len"])
    sync.append(m["time/sync"])
    roll.append(m["time/rollout"])


start = time.perf_counter()
trainer.train(cfg, hooks=[record])
print("RESULT " + json.dumps({"start": start, "ends": ends, "lengths": lengths, "sync": sync, "rollout": roll}))
"""


def run_side(python: str, argv: list[str]) -> dict:
    """One run in a fresh process; its step end times and mean response lengths (the RESULT line it prints)."""
    proc = subprocess.run([python, *argv], capture_output=True, text=True, cwd=ROOT)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"{' '.join(argv[:3])} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def bench_preset(preset: str, new_tokens: int, cfg: Config) -> dict:
    """Interleaved runs of every side on one preset's model: median step seconds, the ratios, response lengths, the
    vLLM side's sync and rollout shares, each side's first step."""
    sides, runs = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        model, data = write_inputs(preset, Path(tmp), cfg.seed)
        for engine in cfg.engines:
            script = [sys.executable, "-c", MINRL_SCRIPT, str(ROOT), str(cfg.threads)]
            sides[f"minrl_{engine}"] = script + minrl_argv(cfg, model, data, f"{tmp}/{engine}", new_tokens, engine)
        if cfg.trl_python:
            trl_args = {
                "model": model,
                "data": data,
                "out": tmp + "/trl",
                "prompts": cfg.prompts,
                "group": cfg.group,
                "new_tokens": new_tokens,
                "lr": cfg.lr,
                "steps": cfg.steps,
                "device": cfg.device,
                "seed": cfg.seed,
                "threads": cfg.threads,
            }
            sides["trl"] = [cfg.trl_python, "-c", TRL_SCRIPT, json.dumps(trl_args)]
        for _ in range(cfg.repeats):
            for name, cmd in sides.items():
                runs.setdefault(name, []).append(run_side(cmd[0], cmd[1:]))
    row = {"preset": preset, "new_tokens": new_tokens}
    for name, outs in runs.items():
        steps = [b - a for o in outs for a, b in zip(o["ends"][cfg.warmup :], o["ends"][cfg.warmup + 1 :])]
        row[f"{name}_s"] = statistics.median(steps)
        row[f"{name}_first_s"] = statistics.median(o["ends"][0] - o["start"] for o in outs)
        row[f"{name}_len"] = statistics.mean(x for o in outs for x in o["lengths"][cfg.warmup + 1 :])
        if name == "minrl_vllm":  # where its step goes: the weight sync, the rollout (the sync included)
            row["vllm_sync_share"] = (
                statistics.median(x for o in outs for x in o["sync"][cfg.warmup + 1 :]) / row[f"{name}_s"]
            )
            row["vllm_rollout_share"] = (
                statistics.median(x for o in outs for x in o["rollout"][cfg.warmup + 1 :]) / row[f"{name}_s"]
            )
    if "minrl_hf_s" in row and "minrl_vllm_s" in row:
        row["vllm_speedup"] = row["minrl_hf_s"] / row["minrl_vllm_s"]  # > 1: the step is faster with vLLM
    for engine in cfg.engines if cfg.trl_python else []:
        row[f"{engine}_over_trl"] = row[f"minrl_{engine}_s"] / row["trl_s"]
    row["steps"] = sum(len(o["ends"]) - cfg.warmup - 1 for o in next(iter(runs.values())))
    return row


def main(argv=None):
    """`python bench/trl_bench.py [--trl-python PY] [--engines hf vllm] [flags]`: the table, a row per preset and
    response length."""
    cfg = parse_config(Config, argv)
    rows = [bench_preset(p, n, cfg) for p in cfg.preset or ["tiny", "2.5m"] for n in cfg.new_tokens]
    sides = [f"minrl_{e}" for e in cfg.engines] + ["trl"] * bool(cfg.trl_python)
    print(
        f"GRPO step seconds, sides {', '.join(sides)}, {cfg.prompts} prompts x {cfg.group}, {cfg.device}, "
        f"{cfg.threads} threads, median of {rows[0]['steps']} steps per side (first_s: the first step, its "
        "sampler's build and warm-up included; shares: of a step)"
    )
    if cfg.trl_python:
        print("TRL samples with its own generate: its vLLM colocate path fails on this CPU build at the first sync")
    print(format_table(rows))
    return rows


if __name__ == "__main__":
    main()
