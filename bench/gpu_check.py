"""The GPU check: what one accelerator does with a ~0.5B-parameter model, one script (bench/gpu_check.sh: < 8 min).

    bash bench/gpu_check.sh                   # a machine with one CUDA GPU: the table, and $OUT/gpu_check.json
    python bench/gpu_check.py --tiny          # the same code path on CPU with a 2.5M model (a smoke run, ~1 minute)

The model is the Qwen2-0.5B shape (24 layers, hidden 896, V = 152k, tied head), random init, with the embedded
byte-level tokenizer (its 260 tokens are the first ids of the vocabulary; nothing is downloaded). Four figures:
1. update MFU: one policy update (forward, backward through the chunked head, AdamW) on B x T tokens under bf16
   autocast; model FLOPs per token 6 (N + V H) + 12 L H T (PaLM, appendix B: N without the embedding, the head's
   matmul counted once; the chunks' recompute not), over the time, over the GPU's dense bf16 peak.
2. decode tokens/s of rollout.generate at batch B with bf16 weights (an inference engine's copy) against the
   memory-bandwidth bound: each step reads every weight (2 N bytes) and the KV cache so far, so tokens/s <= B x
   bandwidth / (2 N + KV bytes at the mean length).
3. peak memory of 2 trainer iterations (torch.cuda.max_memory_allocated) against --dry-run-memory's estimate.
4. FSDP2 at world size 1 (one rank, nccl, bf16 compute weights and fp32 reduction) against the plain trainer:
   seconds per iteration and peak memory (FSDP2 adds its hooks and, for one rank, no sharding).
Peaks default to the H200 datasheet (989 TFLOP/s dense bf16, 4.8 TB/s HBM3e); pass --peak-tflops / --hbm-tbps.
"""

from __future__ import annotations

import copy
import gc
import json
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from rollout_bench import PRESETS  # noqa: E402

import memory  # noqa: E402
import trainer  # noqa: E402
from cli import parse_config  # noqa: E402
from rollout import generate, sequence_logprobs  # noqa: E402
from tasks import make_tiny_model, make_tokenizer  # noqa: E402


@dataclass
class Config:
    """`python bench/gpu_check.py`: MFU, decode vs its bound, peak vs estimate, FSDP2 vs plain."""

    tiny: bool = False
    """A 2.5M model on the CPU with small sizes: the same code path, a smoke run."""
    update_batch: int = 16
    """Sequences of the MFU update."""
    update_len: int = 1024
    """Tokens per sequence of the MFU update (64 of prompt)."""
    decode_batch: int = 64
    """Sequences per generate call."""
    decode_tokens: int = 256
    """New tokens per sequence."""
    train_len: int = 512
    """max_new_tokens of the trainer runs (a random model rarely stops: responses run to it)."""
    peak_tflops: float = 989.0
    """Dense bf16 peak of the GPU (H200 SXM)."""
    hbm_tbps: float = 4.8
    """Memory bandwidth of the GPU in TB/s (H200: HBM3e)."""
    out: str = "gpu_check.json"
    """Where the figures go (JSON)."""

    def __post_init__(self):
        if self.tiny:
            self.update_batch, self.update_len, self.decode_batch, self.decode_tokens, self.train_len = 4, 96, 8, 16, 24


def synced(device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def model_folder(cfg: Config, path: Path) -> Path:
    """The random-init model and the embedded tokenizer as a save_pretrained folder (the trainer's --model)."""
    tok = make_tokenizer()
    shape = dict(PRESETS["2.5m" if cfg.tiny else "0.5b"], max_position_embeddings=4096)
    torch.manual_seed(0)
    make_tiny_model(tok, **shape).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def update_mfu(cfg: Config, model, device) -> dict:
    """Figure 1: one update's model FLOP/s over the bf16 peak (the median of 3 after a warm-up)."""
    c, B, T = model.config, cfg.update_batch, cfg.update_len
    R = T - 64
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    ids = torch.randint(3, c.vocab_size, (B, T), device=device)
    times = []
    for _ in range(4):
        t0 = synced(device)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logp, _ = sequence_logprobs(model, ids, torch.ones_like(ids), R, micro_batch=B)
        (-logp.mean()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(synced(device) - t0)
    n = sum(p.numel() for p in model.parameters()) - c.vocab_size * c.hidden_size  # without the embedding
    per_token = 6 * (n + c.vocab_size * c.hidden_size) + 12 * c.num_hidden_layers * c.hidden_size * T
    seconds = sorted(times[1:])[1]
    return {"update_s": seconds, "update_tokens": B * T, "mfu": per_token * B * T / seconds / (cfg.peak_tflops * 1e12)}


def decode_rate(cfg: Config, model, device) -> dict:
    """Figure 2: generate's tokens/s with bf16 weights against the bandwidth bound."""
    c, B, P, N = model.config, cfg.decode_batch, 64, cfg.decode_tokens
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    ids = torch.randint(3, c.vocab_size, (B, P), device=device)
    kw = dict(max_new_tokens=N, eos_token_ids=[c.vocab_size - 1], pad_token_id=0)
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        generate(bf16, ids[:, :8], torch.ones_like(ids[:, :8]), **{**kw, "max_new_tokens": 4}, generator=g)  # warm-up
        t0 = synced(device)
        out = generate(bf16, ids, torch.ones_like(ids), **kw, generator=g)
        seconds = synced(device) - t0
    steps = out.response_ids.shape[1]
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv = B * (P + steps / 2) * c.num_hidden_layers * 2 * c.num_key_value_heads * head_dim * 2  # bytes, mean length
    weights = 2 * sum(p.numel() for p in bf16.parameters())
    bound = B * cfg.hbm_tbps * 1e12 / (weights + kv)
    del bf16
    return {"decode_tokens_per_s": B * steps / seconds, "decode_bound_tokens_per_s": bound, "decode_steps": steps}


def trainer_run(cfg: Config, folder: Path, device, fsdp: bool) -> dict:
    """Figures 3 and 4: 2 GRPO iterations of the trainer (bf16 autocast; FSDP2's bf16 weights with fsdp), their
    seconds per iteration and peak memory, and the --dry-run-memory estimate of the same config."""
    tc = trainer.Config(model=str(folder), adv_estimator="grpo", steps=2, prompts_per_step=16, group_size=4,
                   max_new_tokens=cfg.train_len, micro_batch=16, eval_every=0, kl_metric_every=1, save_final=False,
                   dtype="bfloat16" if device.type == "cuda" else "float32", device=device.type, fsdp=fsdp,
                   out_dir=tempfile.mkdtemp(prefix="gpu_check_"), warmup_steps=0)  # fmt: skip
    gc.collect()  # the earlier run's cycles (hooks, patched forwards) freed before the peak is reset
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    rows, stamps = [], []
    trainer.train(tc, hooks=[lambda step, m: (rows.append(m), stamps.append(time.perf_counter()))])
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    est = memory.trainer_estimate(tc, trainer.sequences_per_rank(tc, 1), 1)["peak"]
    iteration = stamps[-1] - stamps[-2]  # the second iteration, hook to hook
    return {
        "iteration_s": iteration,
        "peak_gib": peak,
        "estimate_gib": est,
        "tokens_per_s": rows[-1]["perf/tokens_per_s"],
    }


def main(argv=None) -> None:
    cfg = parse_config(Config, argv)
    device = torch.device("cpu" if cfg.tiny else "cuda")
    out = {"config": asdict(cfg), "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        folder = model_folder(cfg, Path(tmp) / "model")
        model = trainer.load_policy(str(folder), device)[0]
        out["params"] = sum(p.numel() for p in model.parameters())
        out.update(update_mfu(cfg, model, device))
        out.update(decode_rate(cfg, model, device))
        del model
        out["plain"] = trainer_run(cfg, folder, device, fsdp=False)
        out["fsdp"] = trainer_run(cfg, folder, device, fsdp=True)
        out["wall_s"] = time.perf_counter() - t0
    if torch.distributed.is_initialized():  # the FSDP2 run's process group (nccl)
        torch.distributed.destroy_process_group()
    Path(cfg.out).write_text(json.dumps(out, indent=1))
    p, f = out["plain"], out["fsdp"]
    print(f"{out['device']}, {out['params'] / 1e6:.0f}M parameters, {out['wall_s']:.0f} s")
    print(f"update MFU (bf16 autocast, {out['update_tokens']} tokens): {out['mfu']:.3f} ({out['update_s']:.3f} s)")
    print(f"decode {out['decode_tokens_per_s']:.0f} tokens/s, bound {out['decode_bound_tokens_per_s']:.0f} "
          f"({out['decode_tokens_per_s'] / out['decode_bound_tokens_per_s']:.2f} of it)")  # fmt: skip
    for name, r in (("plain", p), ("FSDP2 world 1", f)):
        ratio = r["peak_gib"] / r["estimate_gib"]
        print(f"trainer {name}: {r['iteration_s']:.2f} s/iteration, peak {r['peak_gib']:.2f} GiB, estimate "
              f"{r['estimate_gib']:.2f} GiB (measured / estimated {ratio:.2f})")  # fmt: skip
    print(f"FSDP2 / plain: {f['iteration_s'] / p['iteration_s']:.2f}x time, {f['peak_gib'] / p['peak_gib']:.2f}x peak")


if __name__ == "__main__":
    main()
