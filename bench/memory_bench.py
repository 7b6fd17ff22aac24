"""Peak memory of one update on CPU, measured, against memory.py's estimate and against the ways to lower it.

    python bench/memory_bench.py                        # the measurements below (about 12 minutes, ~18 GB)
    python bench/memory_bench.py --only chunk budget     # the two small ones (under a minute)

Each case runs in a fresh process (so no earlier allocation lingers): it builds the model and AdamW, runs one
update (trainer.ppo_update, GRPO-shaped: no critic, no reference pass) to create the AdamW state, resets the
kernel's peak-RSS mark (/proc/self/clear_refs), runs a second update on the same batch and reads the peak (VmHWM).
The figure is that peak minus the process's RSS before the model was built (the Python and torch runtime), which is
what memory.estimate counts ("peak: update", here without the reference model, which the cases do not hold). The
cases run with MALLOC_MMAP_THRESHOLD_=65536: glibc otherwise serves blocks below its dynamic mmap threshold (up to
32 MiB, e.g. a 256-token chunk of fp32 logits at V = 32k) from its heap, whose freed pages stay resident, so the
peak RSS would measure the allocator's fragmentation (measured: 2.3 GiB instead of 0.57 for chunks of 256).
- chunk:    V = 32k, R = 256, 16 sequences in one micro-batch: whole logits (--logit-chunk 0) vs chunks of 256
            tokens (the default) and of 1024. Goal (the memory issue): >= 3x lower with the default chunks.
- budget:   the same model, --micro-batch-tokens 4096, a batch of 32 then 64 ragged sequences (one minibatch);
            and the control, micro-batches of whole minibatches. Goal: flat within 10 % under the budget.
- estimate: --grad-checkpointing on the small model (32 ragged sequences in one micro-batch); the Qwen2-0.5B
            shape (24 layers, V = 152k), 3 full-length sequences of 64 + 1216 tokens in one micro-batch, chunks
            of 256 tokens: activations and logits are more than half the peak (the measured peak less the
            parameters' bytes, which are exact). Goal: measured / estimated within 25 %.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from rollout_bench import PRESETS  # noqa: E402

import memory  # noqa: E402
import trainer  # noqa: E402
from cli import parse_config  # noqa: E402

SMALL = dict(PRESETS["2.5m"], vocab_size=32_000)  # V = 32k: the logits dominate a small model's update
CASES = {  # name: (model config overrides, sequences, prompt, response, ragged, micro-batch, MemoryArgs fields)
    "chunk/whole": (SMALL, 16, 16, 256, False, 16, {"logit_chunk": 0}),
    "chunk/256": (SMALL, 16, 16, 256, False, 16, {"logit_chunk": 256}),
    "chunk/1024": (SMALL, 16, 16, 256, False, 16, {"logit_chunk": 1024}),
    "budget/32": (SMALL, 32, 16, 256, True, 64, {"micro_batch_tokens": 4096}),
    "budget/64": (SMALL, 64, 16, 256, True, 64, {"micro_batch_tokens": 4096}),
    "count/32": (SMALL, 32, 16, 256, True, 64, {}),
    "count/64": (SMALL, 64, 16, 256, True, 64, {}),
    "estimate/ckpt": (SMALL, 32, 16, 256, True, 32, {"grad_checkpointing": True}),
    "estimate/0.5b": (PRESETS["0.5b"], 3, 64, 1216, False, 3, {"logit_chunk": 256}),
}


@dataclass
class Config:
    """`python bench/memory_bench.py`: measured peaks of one update."""

    only: list[str] | None = None
    """Case groups to run: chunk, budget, estimate (default: all); budget includes its control (count)."""
    case: str | None = None
    """(internal) run one case in this process and print its JSON."""


def rss_bytes(field: str) -> int:
    """VmRSS or VmHWM (peak) of this process, from /proc/self/status."""
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def make_batch(vocab: int, B: int, P: int, R: int, ragged: bool) -> trainer.Batch:
    """A GRPO-shaped batch (section 3 tensors, no critic fields): full prompts, responses of R tokens or 1..R."""
    g = torch.Generator().manual_seed(0)
    resp_len = torch.randint(1, R + 1, (B,), generator=g) if ragged else torch.full((B,), R)  # [B]
    response_mask = (torch.arange(R) < resp_len[:, None]).long()  # [B, R]
    attention_mask = torch.cat([torch.ones(B, P, dtype=torch.long), response_mask], 1)  # [B, P+R]
    input_ids = torch.randint(3, vocab, (B, P + R), generator=g) * attention_mask  # [B, P+R]
    mask = response_mask.float()
    old = -torch.rand(B, R, generator=g) * 5 * mask
    none = dict(ref_logprobs=None, old_values=None, critic_returns=None, shares=None)
    return trainer.Batch(input_ids=input_ids, attention_mask=attention_mask, response_mask=response_mask,
                    loss_mask=mask,
                    old_logprobs=old, clip_anchor=old, advantages=torch.randn(B, R, generator=g) * mask,
                    token_weights=torch.ones(B, R), pg_mask=response_mask, ent_mask=response_mask,
                    is_weights=None, **none)  # fmt: skip


def make_model(overrides: dict):
    """A randomly initialised Qwen2 causal LM of a preset's shape (rollout_bench.PRESETS), dropout off."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    base = dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    return Qwen2ForCausalLM(Qwen2Config(**{**base, **overrides, "pad_token_id": 0})).eval()


def run_case(name: str) -> dict:
    """One case in this process: the peak of the second update, and the estimate for it (GiB)."""
    overrides, B, P, R, ragged, micro, mem = CASES[name]
    torch.manual_seed(0)
    base = rss_bytes("VmRSS")
    policy = make_model(overrides)
    if mem.get("grad_checkpointing"):
        memory.checkpoint_layers(policy)
    cfg = trainer.Config(ppo_epochs=1, minibatches=1, micro_batch=micro, kl_metric_every=0, **mem)
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-6, weight_decay=0.0)
    batch = make_batch(policy.config.vocab_size, B, P, R, ragged)
    gen = torch.Generator().manual_seed(0)
    for i in range(2):  # the first creates the AdamW moments; the second is measured
        if i == 1:
            Path("/proc/self/clear_refs").write_text("5")  # reset the peak-RSS mark to the current RSS
        trainer.ppo_update(cfg, policy, opt, None, batch, 1, gen, trainer.make_autocast("float32", torch.device("cpu")))
    peak = rss_bytes("VmHWM") - base
    rows = memory.largest_micro_batch(micro, B, cfg.micro_batch_tokens, P + R)
    est = memory.estimate(policy, [], cfg, seqs=B, rows=rows, prompt_len=P, response_len=R, reference=False)
    return {"case": name, "measured_gib": peak / memory.GiB, "estimated_gib": est["peak: update"], "estimate": est}


def main(argv=None) -> None:
    """Run the cases in fresh processes and print measured peaks, their ratios and measured / estimated."""
    cfg = parse_config(Config, argv)
    if cfg.case:
        print(json.dumps(run_case(cfg.case)))
        return
    groups = cfg.only or ["chunk", "budget", "estimate"]
    names = [n for n in CASES if n.split("/")[0] in groups or ("budget" in groups and n.startswith("count/"))]
    out = {}
    for name in names:
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(os.cpu_count()))}
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"  # large blocks mmapped: freed memory leaves the RSS (docstring)
        proc = subprocess.run([sys.executable, __file__, "--case", name], capture_output=True, text=True, env=env)
        if proc.returncode:
            raise RuntimeError(f"case {name} failed:\n{proc.stderr[-3000:]}")
        out[name] = json.loads(proc.stdout.strip().splitlines()[-1])
        r = out[name]
        print(f"{name:<15} measured {r['measured_gib']:7.3f} GiB   estimated {r['estimated_gib']:7.3f} GiB   "
              f"measured / estimated {r['measured_gib'] / r['estimated_gib']:.2f}", flush=True)  # fmt: skip
    ratio = lambda a, b: out[a]["measured_gib"] / out[b]["measured_gib"]  # noqa: E731
    if "chunk" in groups:
        print(f"chunk:  whole logits / chunks of 256 = {ratio('chunk/whole', 'chunk/256'):.2f}x  (goal >= 3); "
              f"/ chunks of 1024 = {ratio('chunk/whole', 'chunk/1024'):.2f}x")  # fmt: skip
    if "budget" in groups:
        print(f"budget: 64 / 32 sequences under 4096 tokens = {ratio('budget/64', 'budget/32'):.3f}  (goal <= 1.10); "
              f"one micro-batch per minibatch: {ratio('count/64', 'count/32'):.3f}")  # fmt: skip
    if "estimate" in groups:
        r = out["estimate/0.5b"]
        est, measured = r["estimate"], r["measured_gib"]
        params = est["policy weights + AdamW"] + est["policy gradients"]  # exact: 16 bytes per parameter
        print(
            f"estimate: 0.5b activations + logits are {(measured - params) / measured:.0%} of the measured peak, "
            f"{(est['peak: update'] - params) / est['peak: update']:.0%} of the estimated (goal > 50 %)"
        )


if __name__ == "__main__":
    main()
