"""Rollout throughput: rollout.generate (behaviour logprobs included) vs Hugging Face model.generate.

    python bench/rollout_bench.py                                  # tiny and 2.5M configs on CPU
    python bench/rollout_bench.py --preset 0.5b --device cuda --dtype bfloat16
    VENV/bin/python bench/rollout_bench.py --engine vllm          # + vLLM (VENV: bash scripts/install_vllm.sh VENV)

Both sides sample (temperature 1, no top-k / top-p) from the same randomly initialised model, the same
prompts (batch 64, 16 tokens, no padding) and exactly `new_tokens` new tokens each: rollout.generate
gets a stop id no model can emit, model.generate gets min_new_tokens = max_new_tokens. The two run
interleaved (ours, theirs, ours, ...) after one warm-up call each, and the median of the repeats is
reported; the ratio is ours / theirs in tokens per second (docs/design.md 8; target >= 1.1x tiny, >= 1.0x 2.5M).
With --engine vllm a third side joins the interleaving: a vllm_engine.Engine built on the same model saved to a
folder (its weights the folder's, as after a sync), sampling the same prompts to the same forced length (no stop id
at all: vLLM refuses one past the vocabulary; its own EOS ignored); its build (profile and KV cache) and its first
call (warm-up) are timed apart and not in the median; one line per preset gives vllm / rollout.generate (target
>= 3x on 2.5M).

Presets (Qwen2 configs, random init): tiny = tasks.make_tiny_model (0.53M parameters, vocab 260);
2.5m = vocab 512, hidden 256, 4 layers; 0.5b = the Qwen2.5-0.5B shape (hidden 896, 24 layers, 14 heads,
2 KV heads, intermediate 4864, vocab 151936), for a GPU.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cli import check_choice, check_fields, parse_config  # noqa: E402
from rollout import generate  # noqa: E402
from runlog import format_table  # noqa: E402
from tasks import make_tiny_model, make_tokenizer  # noqa: E402
from vllm_engine import Engine, EngineArgs  # noqa: E402

PRESETS = {
    "2.5m": dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4),
    "0.5b": dict(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
    ),
}


@dataclass
class BenchArgs:
    """What every model bench measures on (update_bench.py's Config inherits these too)."""

    preset: list[str] | None = None
    """Model configs to measure: tiny, 2.5m, 0.5b (default: tiny and 2.5m)."""
    device: str = "cpu"
    """cpu | cuda."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """rollout_bench.py casts the weights to it; update_bench.py autocasts to it (weights stay fp32)."""
    repeats: int = 5
    """Timed calls per side (interleaved); the median is reported."""
    threads: int = 0
    """torch CPU threads (0 = leave torch's default)."""
    seed: int = 0
    """Seed of the model init and the inputs."""

    def __post_init__(self):
        for p in self.preset or []:
            check_choice("preset", p, ["tiny", *PRESETS])
        check_fields(self, {"[1, inf)": ("repeats",), "[0, inf)": ("threads",)}, BenchArgs)


@dataclass
class Config(BenchArgs):
    """`python bench/rollout_bench.py`: our generate vs model.generate."""

    batch: int = 64
    """Sequences per generate call."""
    prompt_len: int = 16
    """Prompt tokens per sequence."""
    new_tokens: int = 32
    """New tokens per sequence (forced on both sides)."""
    engine: Literal["hf", "vllm"] = "hf"
    """vllm: also vllm_engine.Engine on the same model (needs the vLLM venv: bash scripts/install_vllm.sh VENV)."""

    def __post_init__(self):
        BenchArgs.__post_init__(self)
        check_fields(self, {"[1, inf)": ("batch", "prompt_len", "new_tokens")})


def make_model(preset: str, device="cpu", tokenizer=None):
    """A randomly initialised Qwen2 causal LM for a preset (tiny: the embedded default model), built on device;
    with a tokenizer, its vocabulary size and special ids (a model that train() can run with that tokenizer)."""
    with torch.device(device):  # initialise the weights where they will live (0.5B on a CPU takes a while)
        if preset == "tiny":
            return make_tiny_model(make_tokenizer())
        base = dict(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True)
        base.update(PRESETS[preset], bos_token_id=1, eos_token_id=2, pad_token_id=0)
        if tokenizer is not None:
            base.update(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id)
            base.update(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        return Qwen2ForCausalLM(Qwen2Config(**base))


def sync(device: torch.device) -> None:
    """Wait for the GPU's queued work (a no-op on CPU), so that a timer reads the work done."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_one(preset: str, cfg: Config) -> dict:
    """Tokens/s of both samplers on one preset's model: the median of cfg.repeats interleaved calls each."""
    device, dtype = torch.device(cfg.device), getattr(torch, cfg.dtype)
    torch.manual_seed(cfg.seed)
    model = make_model(preset, device).to(dtype=dtype).eval()
    vocab = model.config.vocab_size
    prompts = torch.randint(3, vocab, (cfg.batch, cfg.prompt_len), device=device)  # [B, P] no padding
    mask = torch.ones_like(prompts)  # [B, P]
    gen = torch.Generator(device=device).manual_seed(cfg.seed)

    forced = dict(max_new_tokens=cfg.new_tokens, eos_token_ids=[vocab], pad_token_id=0)  # [vocab]: no model samples it

    def ours():
        """rollout.generate: sampled tokens with their logprobs; returns the number of tokens generated."""
        return int(generate(model, prompts, mask, **forced, generator=gen).response_mask.sum())

    def theirs():
        """transformers' model.generate at the same settings; returns the number of tokens generated."""
        out = model.generate(
            input_ids=prompts,
            attention_mask=mask,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=cfg.new_tokens,
            min_new_tokens=cfg.new_tokens,
            pad_token_id=0,
        )
        return (out.shape[1] - cfg.prompt_len) * cfg.batch

    sides, engine, folder = {"ours": ours, "hf": theirs}, None, tempfile.TemporaryDirectory()
    if cfg.engine == "vllm":  # built on the model saved as a folder (a tokenizer beside it: vLLM loads one)
        model.save_pretrained(folder.name)
        make_tokenizer().save_pretrained(folder.name)
        threads = torch.get_num_threads()
        args = EngineArgs(max_model_len=cfg.prompt_len + cfg.new_tokens, dtype=cfg.dtype, sleep=False, seed=cfg.seed)
        engine = Engine(folder.name, args)
        torch.set_num_threads(threads)  # vLLM's CPU worker sets its own count: every side runs with the same
        forced_vllm = {**forced, "eos_token_ids": []}  # no stop id (vLLM refuses ids past the vocabulary)
        sides["vllm"] = lambda: int(
            engine.generate(model, prompts, mask, **forced_vllm, generator=gen).response_mask.sum()
        )
    times = {name: [] for name in sides}
    with torch.no_grad():
        for _ in range(cfg.repeats + 1):  # the first call of every side warms it up (vLLM's: its warm-up)
            for name, fn in sides.items():
                sync(device)
                t0 = time.perf_counter()
                n_tok = fn()
                sync(device)
                if n_tok != cfg.batch * cfg.new_tokens:
                    raise RuntimeError(f"{name} generated {n_tok} tokens, expected {cfg.batch * cfg.new_tokens}")
                times[name].append(time.perf_counter() - t0)
    warmup = {name: t.pop(0) for name, t in times.items()}
    n = cfg.batch * cfg.new_tokens
    tps = {name: n / statistics.median(t) for name, t in times.items()}
    row = {"preset": preset, "params_M": sum(p.numel() for p in model.parameters()) / 1e6}
    row.update(ours_tok_s=tps["ours"], hf_tok_s=tps["hf"], ratio=tps["ours"] / tps["hf"])
    row.update(ours_spread=spread(times["ours"]), hf_spread=spread(times["hf"]))
    if engine is not None:
        row.update(vllm_tok_s=tps["vllm"], vllm_spread=spread(times["vllm"]), vllm_ratio=tps["vllm"] / tps["ours"])
        row.update(vllm_build_s=engine.start_s, vllm_warmup_s=warmup["vllm"])
        engine.close()
    folder.cleanup()
    return row


def spread(times: list[float]) -> float:
    """(max - min) / median of repeated timings: how far to trust their median."""
    return (max(times) - min(times)) / statistics.median(times)


def run_presets(cfg: BenchArgs, measure, title: str) -> list[dict]:
    """measure(preset, cfg), a row per preset (default: tiny and 2.5m), printed as one table under `title`."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    rows = [measure(p, cfg) for p in cfg.preset or ["tiny", "2.5m"]]
    setting = f"{cfg.device} {cfg.dtype}, {torch.get_num_threads()} threads, median of {cfg.repeats}"
    print(f"{title}, {setting} (spread = (max - min) / median)")
    print(format_table(rows))
    return rows


def main(argv=None):
    """`python bench/rollout_bench.py [flags]`: the table of tokens/s, ours vs model.generate."""
    cfg = parse_config(Config, argv)
    title = f"rollout tokens/s, batch {cfg.batch}, prompt {cfg.prompt_len}, {cfg.new_tokens} new tokens"
    rows = run_presets(cfg, bench_one, title)
    for r in rows if cfg.engine == "vllm" else []:
        print(
            f"{r['preset']}: vllm / rollout.generate: {r['vllm_ratio']:.2f}x (vllm {r['vllm_tok_s']:.0f} tok/s, "
            f"rollout.generate {r['ours_tok_s']:.0f}, HF generate {r['hf_tok_s']:.0f}; same run); vLLM engine "
            f"built in {r['vllm_build_s']:.1f} s, its first call (warm-up) {r['vllm_warmup_s']:.1f} s, not timed"
        )
    return rows


if __name__ == "__main__":
    main()
