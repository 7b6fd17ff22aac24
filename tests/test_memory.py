"""Memory (memory.py, rollout.py detail 4): chunked token statistics, micro-batches by tokens, activation
checkpointing, the estimate. Peak memory itself is measured by bench/memory_bench.py, not here (no timed or
memory-bound tests); these check that each piece computes the same numbers and does what it claims."""

import contextlib
import functools
import json

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import memory
import trainer
import vllm_engine
from critics import saved_activation_bytes
from memory import checkpoint_layers, micro_batches
from rollout import inference_copy, lm_head, position_ids_from_mask, sequence_logprobs
from tasks import make_tiny_model, make_tokenizer


def padded_batch(B=6, P=5, R=9, seed=0, vocab=None):
    """ids, attention mask [B, P+R]: left-padded prompts, right-padded responses of ragged lengths; ids drawn from
    the embedded tokenizer's vocabulary (or `vocab`), specials left out."""
    vocab = vocab or len(make_tokenizer())
    g = torch.Generator().manual_seed(seed)
    p_len = torch.randint(1, P + 1, (B,), generator=g)
    r_len = torch.randint(1, R + 1, (B,), generator=g)
    mask = torch.cat([torch.arange(P) >= P - p_len[:, None], torch.arange(R) < r_len[:, None]], 1).long()
    return torch.randint(4, vocab, (B, P + R), generator=g) * mask, mask


def stats_and_grads(model, ids, mask, R, chunk, entropy_grad=True):
    """Logprobs, entropies and the parameters' gradient of logp.sum() + 0.3 entropy.sum() at T = 0.7."""
    model.zero_grad()
    kw = {"temperature": 0.7, "micro_batch": 4, "with_entropy": True, "entropy_grad": entropy_grad}
    logp, ent = sequence_logprobs(model, ids, mask, R, logit_chunk=chunk, **kw)
    (logp.sum() + 0.3 * ent.sum() * entropy_grad).backward()
    return logp.detach(), ent.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])


@pytest.mark.parametrize("chunk", [1, 7, 1024])
def test_chunked_stats_equal_whole_logits(chunk):
    """Chunks of 1, 7 and all tokens give the whole logits' logprobs, entropies and gradients (fp32 rounding)."""
    torch.manual_seed(0)
    model = make_tiny_model(make_tokenizer()).eval()
    ids, mask = padded_batch()
    whole = stats_and_grads(model, ids, mask, 9, chunk=0)
    chunked = stats_and_grads(model, ids, mask, 9, chunk=chunk)
    assert lm_head(model) == (model.model, model.lm_head)  # the chunked path is the one taken
    for name, a, b in zip(("logp", "entropy", "gradient"), whole, chunked):
        scale = a.abs().max().item()
        assert scale > 1e-3, f"{name} is ~0: the comparison would be vacuous"
        assert (a - b).abs().max().item() <= 1e-5 * scale, name


class LargestTensor(TorchDispatchMode):
    """Records the largest number of elements of any tensor an operator returns."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("entropy_grad", [False, True])
def test_logits_never_whole(entropy_grad):
    """Through forward and backward no tensor reaches [b, R, V] with chunks of 8 tokens (the control, whole logits,
    does), and the entropy has a gradient only when asked (an entropy bonus)."""
    torch.manual_seed(0)
    tok = make_tokenizer()
    model = make_tiny_model(tok, vocab_size=4096, hidden_size=32, intermediate_size=64).eval()  # V >> H, P+R
    ids, mask = padded_batch(B=8, R=32, vocab=len(tok))
    b_r_v = 8 * 32 * 4096  # a quarter of it still exceeds the weights' gradient [V, H]
    for chunk, within in ((0, False), (8, True)):
        with LargestTensor() as seen:
            logp, ent = sequence_logprobs(model, ids, mask, 32, micro_batch=8, with_entropy=True,
                                          entropy_grad=entropy_grad, logit_chunk=chunk)  # fmt: skip
            (logp.sum() + (ent.sum() if entropy_grad else 0)).backward()
        assert (seen.largest < b_r_v / 4) == within, (chunk, seen.largest, b_r_v)
        assert ent.requires_grad == entropy_grad


def test_scaled_heads_take_the_models_logits(capsys):
    """A model whose logits are not head(final hidden state) (a soft-cap, a scale: Gemma 2, Cohere, Granite) is found
    by lm_head, by its config or by its 3-token check, and keeps its own logits, so its logprobs are right; a plain
    one is split; on the meta device (the estimate) only the config can tell."""
    torch.manual_seed(0)
    model = make_tiny_model(make_tokenizer()).eval()
    assert lm_head(model) == (model.model, model.lm_head)
    scaled = make_tiny_model(make_tokenizer()).eval()
    forward = scaled.forward

    @functools.wraps(forward)
    def capped(*args, **kwargs):  # Gemma 2's final soft-cap: 30 tanh(logits / 30)
        out = forward(*args, **kwargs)
        out.logits = 30 * torch.tanh(out.logits / 30) * 4.0
        return out

    scaled.forward = capped
    assert lm_head(scaled) is None
    policy, _ = memory.meta_models(None)
    policy.config.final_logit_softcapping = 30.0
    assert lm_head(policy) is None
    assert "takes its whole logits" in capsys.readouterr().out
    ids, mask = padded_batch()
    with torch.no_grad():
        pos = position_ids_from_mask(mask)
        logits = capped(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, -10:-1]  # [B, R, V]
        want = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, -9:, None]).squeeze(-1)
        got, _ = sequence_logprobs(scaled, ids, mask, 9, logit_chunk=4)
    assert (got - want).abs().max().item() < 1e-5


def test_micro_batches_pack_by_tokens():
    """Every row once; each micro-batch within the budget of padded tokens (b x its longest prompt + response)
    unless it is one sequence; longest first; the cut columns are all padding; tokens 0: slices of `rows`."""
    ids, mask = padded_batch(B=40, P=6, R=20, seed=3)
    P, R = 6, 20
    assert micro_batches(mask, R, rows=16) == [(slice(0, 16), 0, R), (slice(16, 32), 0, R), (slice(32, 48), 0, R)]
    for budget in (1, 30, 64, 200, 10_000):
        plan = micro_batches(mask, R, rows=16, tokens=budget)
        rows = torch.cat([idx for idx, _, _ in plan])
        assert sorted(rows.tolist()) == list(range(40))
        for idx, lo, r in plan:
            assert len(idx) == 1 or len(idx) * (P - lo + r) <= budget, (budget, len(idx), lo, r)
            assert mask[idx][:, :lo].sum() == 0 and mask[idx][:, P + r :].sum() == 0  # only padding is cut
            assert mask[idx][:, lo].any() and mask[idx][:, P + r - 1].any()  # and no real column
        assert len(plan) == {1: 40, 10_000: 1}.get(budget, len(plan))
        longest = [(mask[idx, :P].sum(-1) + mask[idx, P:].sum(-1)).max().item() for idx, _, _ in plan]
        assert longest == sorted(longest, reverse=True)  # longest first


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-sum-norm"])
def test_token_budget_keeps_the_gradient(loss_agg):
    """One update with micro-batches packed under budgets of 5, 12 and 1000 tokens moves every parameter as plain
    micro-batches of 3 sequences do (SGD lr 1: delta = -gradient; tests/ddp_grad_check.py's batch and models)."""
    from test_distributed import load_grad_check

    check = load_grad_check()
    plain = check.update_deltas(loss_agg, 0, 1)
    scale = max(v.abs().max().item() for v in plain.values())
    assert scale > 1e-2
    for tokens in (5, 12, 1000):
        packed = check.update_deltas(loss_agg, 0, 1, tokens=tokens)
        diff = max((packed[n] - plain[n]).abs().max().item() for n in plain)
        assert diff <= 1e-6 * scale, (tokens, diff)


def test_grad_checkpointing_same_gradient_less_saved():
    """checkpoint_layers: the same update of policy and critics (bit for bit here), and a forward that saves far
    fewer activations for backward (each layer keeps its input only)."""
    from test_distributed import load_grad_check

    check = load_grad_check()
    plain = check.update_deltas("token-mean", 0, 1)
    ckpt = check.update_deltas("token-mean", 0, 1, checkpointing=True)
    assert max((ckpt[n] - plain[n]).abs().max().item() for n in plain) <= 1e-6
    torch.manual_seed(0)
    model = make_tiny_model(make_tokenizer()).eval()
    ids, mask = padded_batch(B=8, R=12)
    critic_like = memory.ValueHeadless(model.base_model)
    before = saved_activation_bytes(critic_like, ids, mask, 12)
    assert checkpoint_layers(model) == model.config.num_hidden_layers
    after = saved_activation_bytes(critic_like, ids, mask, 12)
    assert after < 0.2 * before, (before, after)
    with pytest.raises(ValueError, match="no decoder layers"):
        checkpoint_layers(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_activation_estimate_matches_saved_bytes(dtype):
    """The estimate's activations F_0 + L F_1 + b (A_0 + L A_1), measured on 1- and 2-layer probes at 1 and 2 rows,
    equal what a 4-layer model saves for a micro-batch of 6 sequences (within 2 %), in fp32 and under bf16 autocast
    (where the bf16 weight copies matmuls save are per forward, not per row: F_1 > 0)."""
    torch.manual_seed(0)
    tok = make_tokenizer()
    model = make_tiny_model(tok, num_hidden_layers=4).eval()
    ids = torch.randint(3, len(tok), (6, 40))
    mask = torch.ones_like(ids)
    mask[:, 0] = 0  # left padding, as the probe has
    autocast = (lambda: torch.autocast("cpu", dtype=dtype)) if dtype else contextlib.nullcontext
    with autocast():
        measured = saved_activation_bytes(memory.ValueHeadless(model.base_model), ids, mask, 20)
    estimated, _ = memory.micro_batch_activations(model.config, 6, 40, 20, autocast, checkpointing=False)
    a0, a1, f0, f1 = memory.activation_bytes(model.config, 40, 20, autocast)
    assert a1 > 0 and a0 > 0 and (f1 > 0) == (dtype is not None)
    assert abs(estimated - measured) <= 0.02 * measured, (estimated, measured)


def test_estimate_parts_and_dry_run(capsys):
    """Parameter-based parts follow the models' sizes (3 N s, N s, N s, DDP buckets at world 2); the token budget
    bounds the micro-batch (never past the minibatch); checkpointing and a critic change their parts; the KV cache
    follows the config; `--dry-run-memory` prints the table and trains nothing."""
    policy, critics = memory.meta_models(None, n_critics=1)
    N, Nc = (sum(p.numel() for p in m.parameters()) for m in (policy, critics[0]))
    sizes = {"seqs": 32, "prompt_len": 8, "response_len": 24}
    est = memory.estimate(policy, critics, memory.MemoryArgs(), rows=16, world=2, **sizes)
    GiB = 2**30
    assert est["policy weights + AdamW"] == pytest.approx(3 * N * 4 / GiB)
    assert est["reference weights"] == est["policy gradients"] == pytest.approx(N * 4 / GiB)
    assert est["critic weights + AdamW"] == pytest.approx(3 * Nc * 4 / GiB)
    assert est["DDP gradient buckets (world 2)"] == pytest.approx((N + Nc) * 4 / GiB)
    c = policy.config
    kv = 32 * 32 * c.num_hidden_layers * 2 * c.num_key_value_heads * (c.hidden_size // c.num_attention_heads) * 4
    assert est["rollout KV cache (32 x 32 tokens)"] == pytest.approx(kv / GiB)
    assert est["peak"] == max(est["peak: update"], est["peak: optimizer step"], est["peak: rollout"])
    assert memory.largest_micro_batch(16, 64, 0, 32) == 16
    assert memory.largest_micro_batch(16, 64, 256, 32) == 8 and memory.largest_micro_batch(16, 4, 256, 32) == 4
    ckpt = memory.estimate(policy, critics, memory.MemoryArgs(grad_checkpointing=True), rows=16, **sizes)
    a0, a1, f0, f1 = memory.activation_bytes(c, 32, 24, contextlib.nullcontext)
    L, H = c.num_hidden_layers, c.hidden_size  # checkpointing: each layer's input kept, one layer recomputed
    assert est["activations (16 x 32 tokens)"] == pytest.approx((f0 + L * f1 + 16 * (a0 + L * a1)) / GiB)
    assert ckpt["activations (16 x 32 tokens)"] == pytest.approx((f0 + 16 * (a0 + L * 32 * H * 4)) / GiB)
    assert ckpt["activations (16 x 32 tokens)"] < est["activations (16 x 32 tokens)"]
    alone = memory.estimate(policy, [], memory.MemoryArgs(), rows=16, **sizes)
    assert alone["critic weights + AdamW"] == 0 and alone["peak: update"] < est["peak: update"]
    trainer.main(["--dry-run-memory", "--adv-estimator", "grpo", "--micro-batch-tokens", "256"])
    out = capsys.readouterr().out
    assert "activations (3 x 80 tokens)" in out and "peak" in out and "[minrl]" not in out  # no run was started


def test_estimate_under_fsdp_and_lora():
    """FSDP2 at world 4: weights, moments, gradients, reference and critics in quarters, no DDP buckets, the root's
    and two layers' weights whole in the update and every weight in the rollout. LoRA: the adapter count equals what
    add_adapters puts in a real model; moments and gradients are theirs alone, no reference."""
    import lora

    policy, critics = memory.meta_models(None, n_critics=1)
    N, Nc = (sum(p.numel() for p in m.parameters()) for m in (policy, critics[0]))
    sizes, GiB = {"seqs": 32, "prompt_len": 8, "response_len": 24, "rows": 16}, 2**30
    ddp = memory.estimate(policy, critics, memory.MemoryArgs(), world=4, **sizes)
    fsdp = memory.estimate(policy, critics, memory.MemoryArgs(), world=4, fsdp=True, **sizes)
    assert fsdp["policy weights + AdamW (1/4)"] == pytest.approx(ddp["policy weights + AdamW"] / 4)
    for part in ("reference weights", "critic weights + AdamW"):
        assert fsdp[part] == pytest.approx(ddp[part] / 4), part
    layer = sum(p.numel() for p in policy.model.layers[0].parameters())
    L = policy.config.num_hidden_layers  # the root's gradient is whole until the end of the backward
    assert fsdp["policy gradients"] == pytest.approx(ddp["policy gradients"] / 4 + (N - L * layer) * 4 / GiB)
    assert fsdp["DDP gradient buckets (world 4)"] == 0 and ddp["FSDP2 weights gathered whole"] == 0
    assert fsdp["FSDP2 weights gathered whole"] == pytest.approx((N - L * layer + 2 * layer) * 4 / GiB)
    static = lambda est, w: sum(est[k] for k in (w, "reference weights", "critic weights + AdamW")) + est[  # noqa: E731
        "DDP gradient buckets (world 4)"]  # fmt: skip
    grown = static(fsdp, "policy weights + AdamW (1/4)") - static(ddp, "policy weights + AdamW") + N * 4 / GiB
    assert fsdp["peak: rollout"] - ddp["peak: rollout"] == pytest.approx(grown)  # the gathered weights on top
    args = lora.LoraArgs(lora_rank=8)
    real = lora.add_adapters(make_tiny_model(make_tokenizer()), args)
    n_adapters = lora.adapter_params(policy, args)
    assert n_adapters == sum(p.numel() for p in real.parameters() if p.requires_grad) > 0
    adapted = memory.estimate(policy, [], memory.MemoryArgs(), adapters=n_adapters, **sizes)
    assert adapted["reference weights"] == 0
    assert adapted["policy gradients"] == pytest.approx(n_adapters * 4 / GiB)
    assert adapted["policy weights + AdamW"] == pytest.approx((N + 3 * n_adapters) * 4 / GiB)


def test_estimate_counts_the_bf16_sampler_copy():
    """--rollout-dtype bfloat16: the sampler's copy (2 bytes a weight) on every peak, its KV cache in bf16 (measured:
    rollout.inference_copy holds exactly that many bf16 parameters)."""

    policy, critics = memory.meta_models(None, n_critics=1)
    N, GiB = sum(p.numel() for p in policy.parameters()), 2**30
    sizes = {"seqs": 32, "prompt_len": 8, "response_len": 24, "rows": 16}
    fp32 = memory.estimate(policy, critics, memory.MemoryArgs(), **sizes)
    bf16 = memory.estimate(policy, critics, memory.MemoryArgs(), engine="bfloat16", **sizes)
    copy = inference_copy(make_tiny_model(make_tokenizer()), "bfloat16")
    assert bf16["sampler's bf16 copy (--rollout-dtype)"] * GiB == sum(p.numel() * p.element_size() for p in
                                                                     copy.parameters()) == 2 * N  # fmt: skip
    kv = "rollout KV cache (32 x 32 tokens)"
    assert bf16[kv] == pytest.approx(fp32[kv] / 2) and fp32["sampler's bf16 copy (--rollout-dtype)"] == 0
    assert bf16["peak: update"] - fp32["peak: update"] == pytest.approx(2 * N / GiB)


def test_estimate_counts_the_vllm_engine(capsys, monkeypatch):
    """--rollout-engine vllm: on the CPU the engine's weights (4 or 2 bytes each) and KV cache on every peak, the
    sync's source on top in the rollout; on a GPU gpu_memory_utilization of the device, during the rollout alone in
    sleep mode (or its weights + the sync's source, when larger: the KV cache wakes after the sync), throughout
    without it. The trainer's own KV cache and logits are then not counted; --dry-run-memory prints the rows where the
    engine would run (here the CPU), without vLLM installed."""
    policy, _ = memory.meta_models(None)
    N, GiB, kv_cpu = sum(p.numel() for p in policy.parameters()), 2**30, vllm_engine.EngineArgs().kv_cache_bytes
    args, bf16 = vllm_engine.EngineArgs(), vllm_engine.EngineArgs(dtype="bfloat16")
    assert memory.engine_bytes(N, args, sync_bytes=7) == (4 * N + kv_cpu, 4 * N + kv_cpu + 7)
    assert memory.engine_bytes(N, bf16)[0] == 2 * N + kv_cpu
    assert memory.engine_bytes(N, args, 80 * GiB) == (0.0, 0.3 * 80 * GiB)
    assert memory.engine_bytes(N, args, 80 * GiB, sync_bytes=30 * GiB) == (0.0, 4 * N + 30 * GiB)  # the sync's peak
    no_sleep = vllm_engine.EngineArgs(sleep=False)
    assert memory.engine_bytes(N, no_sleep, 80 * GiB, sync_bytes=GiB) == (24 * GiB, 25 * GiB)
    sizes = {"seqs": 32, "prompt_len": 8, "response_len": 24, "rows": 16}
    hf = memory.estimate(policy, [], memory.MemoryArgs(), **sizes)
    cpu = memory.estimate(policy, [], memory.MemoryArgs(), vllm=(3 * GiB, 4 * GiB), **sizes)
    assert cpu["rollout KV cache (32 x 32 tokens)"] == 0 < hf["rollout KV cache (32 x 32 tokens)"]
    for peak in ("peak: update", "peak: optimizer step"):
        assert cpu[peak] - hf[peak] == pytest.approx(3.0)
    assert cpu["peak: rollout"] == pytest.approx(cpu["peak: optimizer step"] - hf["policy gradients"] * 2 + 1.0)
    gpu = memory.estimate(policy, [], memory.MemoryArgs(), vllm=(0, 24 * GiB), world=4, fsdp=True, **sizes)
    plain = memory.estimate(policy, [], memory.MemoryArgs(), world=4, fsdp=True, **sizes)
    assert gpu["peak: update"] == plain["peak: update"]
    kv, logits = plain["rollout KV cache (32 x 32 tokens)"], 4 * 32 * policy.config.vocab_size * 4 / GiB
    # the trainer's sampling buffers and FSDP2's gathered weights out, the engine in (its share counts the sync)
    assert gpu["peak: rollout"] == pytest.approx(plain["peak: rollout"] - kv - logits - N * 4 / GiB + 24)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the CPU engine's rows, on a GPU host too
    trainer.main(["--dry-run-memory", "--adv-estimator", "grpo", "--rollout-engine", "vllm", "--lora-rank", "4"])
    out = capsys.readouterr().out
    row = {r.rsplit(maxsplit=2)[0].strip(): r.split()[-2] for r in out.splitlines() if r.startswith("vLLM engine")}
    assert row["vLLM engine between rollouts (--rollout-engine)"] == f"{(4 * N + kv_cpu) / GiB:.3f}" != "0.000"
    assert row["vLLM engine during a rollout, the sync included"] == f"{(8 * N + kv_cpu) / GiB:.3f}"  # LoRA's merge


def test_memory_flags_validated():
    with pytest.raises(ValueError, match="micro_batch_tokens"):
        trainer.Config(micro_batch_tokens=-1)
    with pytest.raises(ValueError, match="logit_chunk"):
        trainer.Config(logit_chunk=-5)


@pytest.mark.parametrize("estimator", ["gae", "grpo"])
def test_trainer_memory_flags_change_no_number_that_matters(sft_path, tmp_path, estimator, monkeypatch):
    """Two PPO iterations with a token budget (several micro-batches of unequal rows) and activation checkpointing
    of policy and critic: the same samples, and the losses, gradient norms and token-pooled statistics of the plain
    run within fp32 rounding (the packing reorders sums; checkpointing recomputes the same ops). Not compared:
    statistics logged as a mean over micro-batches (stats/entropy, stats/clipfrac), as veRL logs them (memory.py),
    and counts at a threshold (critic/vf_clipfrac: a token at the clip boundary may flip with the rounding)."""
    base = dict(model=str(sft_path), task="reverse", steps=2, prompts_per_step=8, group_size=4, eval_every=0,
                save_final=False, kl_metric_every=1, adv_estimator=estimator)  # fmt: skip
    rows, sizes, plan = {}, [], memory.micro_batches

    def recording(*args, **kwargs):
        """memory.micro_batches, recording the rows of each packed micro-batch."""
        out = plan(*args, **kwargs)
        sizes.extend([[len(idx) for idx, _, _ in out]] if kwargs.get("tokens") else [])
        return out

    monkeypatch.setattr(memory, "micro_batches", recording)
    for name, extra in (("plain", {}), ("memory", {"micro_batch_tokens": 96, "grad_checkpointing": True})):
        out = tmp_path / name
        trainer.train(trainer.Config(**base, **extra, out_dir=str(out)))
        rows[name] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    # the update's minibatches (16 rows) and stanza 3's whole batch (32) were packed, into unequal micro-batches
    assert {sum(s) for s in sizes} == {16, 32} and all(len(set(s)) > 1 for s in sizes), sizes
    for a, b in zip(rows["plain"], rows["memory"]):
        assert a["rollout/reward_mean"] == b["rollout/reward_mean"]  # sampled before any difference
        keys = ("loss/policy", "loss/entropy", "stats/kl", "stats/grad_norm", "stats/ratio_max")
        for k in keys + (("loss/value",) if estimator == "gae" else ()):
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-6), k


def test_chunked_stats_under_bf16_autocast():
    """Chunks under bf16 autocast (the checkpoint recomputes inside the same autocast state) give the whole bf16
    logits' logprobs and gradients within bf16 rounding, and never fp32-exact ones (the autocast is really on)."""
    torch.manual_seed(0)
    model = make_tiny_model(make_tokenizer()).eval()
    ids, mask = padded_batch()
    results = {}
    for chunk in (0, 7):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            results[chunk] = stats_and_grads(model, ids, mask, 9, chunk=chunk)
    fp32 = stats_and_grads(model, ids, mask, 9, chunk=7)
    for name, a, b, c in zip(("logp", "entropy", "gradient"), results[0], results[7], fp32):
        scale = a.abs().max().item()
        assert (a - b).abs().max().item() <= 2e-2 * scale, name
        assert (b - c).abs().max().item() > 1e-5 * scale, f"{name}: the bf16 run equals fp32: autocast not on"
