"""The memory of one update, three ways to make it fit, and an estimate of the per-rank peak before a run.

    python memory.py                                     # the estimate for the embedded model at small sizes
    python trainer.py --dry-run-memory --model PATH --max-new-tokens 1024 --micro-batch-tokens 16384
    python bench/memory_bench.py                         # measured peaks on CPU: chunks, token budget, vs estimate

The three ways (each a trainer flag):
- `--logit-chunk C` (on by default, 256): the LM head and log-softmax per chunk of C tokens, recomputed in backward
  (rollout.py detail 4): no [b, R, V] logits, whose fp32 copies dominate at large vocabularies.
- `--micro-batch-tokens N` (veRL's dynamic batch size): `micro_batches` sorts a minibatch's sequences by length and
  fills micro-batches of at most N padded tokens each (b x (longest prompt + longest response) of the micro-batch;
  its all-padding columns are cut), so memory follows tokens, not sequence counts. The loss keeps its normaliser
  (the minibatch's valid tokens over all ranks, trainer detail 2): the gradient does not depend on the packing.
- `--grad-checkpointing`: every decoder layer of policy and critics keeps only its input and recomputes its
  activations in backward (`checkpoint_layers`).
And two that change what is held: `--fsdp` (common.py) shards weights, gradients and AdamW state over the ranks;
`--lora-rank r` (lora.py) trains adapters only, with the reference as the policy with its adapters off.
What one update holds is a `Batch` (the trainer builds it), cut into micro-batches by `Batch.micro_batches` and
`Batch.part`; `critics_footprint` measures the critics' memory against an actor-sized one. Each optimizer step is
`clipped_step` (clip the gradient norm, refuse a non-finite one, step); `host_floats` copies an update's metrics to
the host at once (one GPU sync).

What one rank holds (s = 4 bytes per fp32 parameter; weights and AdamW state stay fp32):
  static   policy: weights + 2 AdamW moments 3 N s; reference N s; critic m: 3 N_m s; at world > 1, DDP's gradient
           buckets (N + sum N_m) s
  update   + max(policy: N s gradients + A + L,  critic m: N_m s gradients + A_m + its layer transient)
           (gradients are freed at each optimizer step)
  step     + 2 N s: the gradients and foreach AdamW's temporaries (CUDA), once the activations are freed
  rollout  + KV cache of all n sequences: n T layers 2 kv_heads head_dim (4 bytes, 2 under bf16) + the sampling
           logits 4 n V s; with --rollout-engine vllm instead the engine's memory (engine_bytes: on a GPU
           gpu_memory_utilization of it, freed between rollouts by sleep mode; on the CPU its weights and KV
           cache, held throughout) and, under FSDP2 or LoRA, the whole weights its sync sends
  A = the tensors autograd saves for one micro-batch of b rows of T tokens: F_0 + layers F_1 + b (A_0 + layers
      A_1), MEASURED (saved_activation_bytes) on 1- and 2-layer copies of the model's config at T, 1 and 2 rows,
      not modelled (F: per forward, e.g. the bf16 weight copies autocast saves); with checkpointing F_0 + b (A_0 +
      layers T H s), each layer's input only
  L = the larger of the head's backward, 4 min(c, b R) V s + V H s (a chunk's logits, log-softmax and their
      gradients, c = logit_chunk, and the chunk's head-weight gradient; 4 b (R + 1) V s for whole logits), and one
      layer's, F_1 + b A_1 (twice that with checkpointing: the recomputed layer and its gradients)
The peak is max(update, step, rollout). Not counted: the runtime itself (CUDA context, the Python process),
allocator fragmentation, and for a --data run the rows. bench/memory_bench.py prints measured / estimated. The
probes build two decoder layers of the model on the CPU (for a 70B config, GBs): a dry run is not free.

Statistics computed per micro-batch (stats/entropy, stats/clipfrac, stats/approx_kl, ...) are logged as their mean
over micro-batches, as veRL logs them, so they move a little with the packing; the losses, the gradient and the
token-pooled statistics do not. Every rank runs the same number of micro-batches, the maximum over ranks (a rank
with fewer splits its largest; as every rank has as many sequences, it always can): under FSDP every micro-batch is
a collective, and the critics' DDP reduces at each of their micro-batches, so a rank with fewer would leave the
others waiting in one.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, fields
from functools import partial

import torch
from torch.utils.checkpoint import checkpoint

import common
import vllm_engine
from cli import check_fields, parse_config
from critics import ValueModel, critic_footprint, make_value_model, saved_activation_bytes
from envs import rollout_kw
from logits import lm_head
from lora import adapter_params
from tasks import make_tiny_model, make_tokenizer

GiB = 2**30


@dataclass
class MemoryArgs:
    """Memory knobs of the update; the trainer's Config inherits them."""

    micro_batch_tokens: int = 0
    """Padded tokens per forward/backward: micro-batches packed by length (0 = micro_batch sequences each)."""
    grad_checkpointing: bool = False
    """Activation checkpointing of every decoder layer of policy and critics (recomputed in backward)."""
    logit_chunk: int = 256
    """Tokens per chunk of the trainer's LM head and log-softmax (0 = whole logits, as the model's forward)."""
    dry_run_memory: bool = False
    """Print the per-rank peak memory estimate of this config and model, then exit without training."""

    def __post_init__(self):
        check_fields(self, {"[0, inf)": ("micro_batch_tokens", "logit_chunk")}, MemoryArgs)


def micro_batches(attention_mask, response_len: int, *, rows: int, tokens: int = 0, response_mask=None) -> list[tuple]:
    """A minibatch's micro-batches [(row index (a slice or [b] tensor), first prompt column kept, response columns
    kept)]. tokens = 0: slices of `rows` sequences, every column. Else packed by length (module docstring): longest
    first, a micro-batch closed when one more row would take it past `tokens` padded tokens (a sequence longer than
    that alone); then as many on every rank: the maximum over ranks, reached by splitting the largest. A column is
    cut only if it is padding in attention_mask and in response_mask (a trained pad token, a planted bug, stays)."""
    B, W = attention_mask.shape
    P = W - response_len
    if tokens == 0:
        return [(slice(s, s + rows), 0, response_len) for s in range(0, B, rows)]
    real = attention_mask.bool().clone()
    if response_mask is not None:
        real[:, P:] |= response_mask.bool()
    p_len = (real[:, :P] * torch.arange(P, 0, -1, device=real.device)).amax(-1).tolist()  # [B] from the first real
    r_len = (real[:, P:] * torch.arange(1, response_len + 1, device=real.device)).amax(-1).tolist()  # [B] to the last
    groups, cur, long_p, long_r = [], [], 0, 0
    for i in sorted(range(B), key=lambda i: -(p_len[i] + r_len[i])):  # longest first (stable: ties by index)
        grown_p, grown_r = max(long_p, p_len[i]), max(long_r, r_len[i])
        if cur and (len(cur) + 1) * (grown_p + grown_r) > tokens:
            groups.append(cur)
            cur, grown_p, grown_r = [], p_len[i], r_len[i]
        cur, long_p, long_r = [*cur, i], grown_p, grown_r
    groups.append(cur)
    n = int(common.reduce_metrics({"micro_batches_max": len(groups)}, attention_mask.device)["micro_batches_max"])
    while len(groups) < n and max(map(len, groups)) > 1:  # split the largest: each half is within the budget
        g = groups.pop(max(range(len(groups)), key=lambda k: len(groups[k])))
        groups += [g[: len(g) // 2], g[len(g) // 2 :]]
    if len(groups) < n:  # the trainer gives every rank as many sequences: only a caller's uneven split gets here
        raise ValueError(f"{B} sequences on this rank cannot make the {n} micro-batches another rank needs")
    cols = [(P - max(1, *(p_len[i] for i in g)), max(1, *(r_len[i] for i in g))) for g in groups]  # >= 1 column each
    return [(torch.tensor(g, device=real.device), lo, r) for g, (lo, r) in zip(groups, cols)]


def checkpoint_layers(model) -> int:
    """Activation checkpointing of each decoder layer (the outermost `GradientCheckpointingLayer` modules) of a
    Hugging Face model, in eval mode too (transformers' own switch acts only in train mode, which would turn dropout
    on): the layer's forward runs under torch.utils.checkpoint. Returns the number of layers wrapped."""
    if not (layers := common.decoder_layers(model)):
        raise ValueError(
            f"--grad-checkpointing: {type(model).__name__} has no decoder layers transformers marks as "
            f"checkpointable (GradientCheckpointingLayer); run without it"
        )
    for layer in layers:  # no RNG to preserve: dropout is off in every model here
        layer.forward = partial(checkpoint, layer.forward, use_reentrant=False, preserve_rng_state=False)
    return len(layers)


def probe_config(config, layers: int, vocab: int = 64):
    """A copy of a model config with `layers` decoder layers and a small vocabulary: what activations cost per layer
    and outside the layers, without the weights of the real model (its special token ids dropped with its vocab)."""
    c = copy.deepcopy(config)
    c.num_hidden_layers, c.vocab_size = layers, vocab
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        setattr(c, key, None)
    if getattr(c, "layer_types", None) is not None:  # per-layer attention kinds (transformers 5)
        c.layer_types = c.layer_types[:layers]
    return c


def activation_bytes(config, T: int, response_len: int, autocast) -> tuple[int, int, int, int]:
    """(A_0, A_1, F_0, F_1): bytes autograd saves, per sequence of T tokens outside the decoder layers (A_0) and per
    layer (A_1), and per forward whatever the rows (F_0, F_1 per layer: under autocast, the weights' bf16 copies
    that matmuls save). Measured on 1- and 2-layer copies of `config` (probe_config) at 1 and 2 rows:
    saved(L, b) = F_0 + L F_1 + b (A_0 + L A_1)."""
    from transformers import AutoModelForCausalLM

    saved = {}
    for layers in (1, 2):
        torch.manual_seed(0)
        base = AutoModelForCausalLM.from_config(probe_config(config, layers)).eval().base_model
        for rows in (1, 2):
            ids = torch.randint(0, 64, (rows, T))
            attention_mask = torch.ones_like(ids)
            attention_mask[:, 0] = 0  # one padding token: the masked attention path of a padded micro-batch
            with autocast():
                saved[layers, rows] = saved_activation_bytes(ValueHeadless(base), ids, attention_mask, response_len)
    a1 = saved[2, 2] - saved[1, 2] - (saved[2, 1] - saved[1, 1])  # the layer's per-row part
    f1 = saved[2, 1] - saved[1, 1] - a1
    a0 = saved[1, 2] - saved[1, 1] - a1
    return a0, a1, saved[1, 1] - f1 - a0 - a1, f1


def micro_batch_activations(config, b: int, T: int, R: int, autocast, checkpointing: bool) -> tuple[int, int]:
    """(A, the backward's largest per-layer transient) for a micro-batch of b rows of T tokens (module docstring):
    all layers' saved tensors and one layer's activation gradients; with checkpointing each layer's input only (the
    fp32 residual stream, b T H 4 bytes) and, in backward, one recomputed layer with its gradients."""
    a0, a1, f0, f1 = activation_bytes(config, T, R, autocast)
    L, H = config.num_hidden_layers, config.hidden_size
    if checkpointing:
        return f0 + b * (a0 + L * T * H * 4), 2 * (f1 + b * a1)
    return f0 + L * f1 + b * (a0 + L * a1), f1 + b * a1


class ValueHeadless(torch.nn.Module):
    """A backbone called as saved_activation_bytes calls a critic: (input_ids, attention_mask, response_len)."""

    def __init__(self, backbone):
        super().__init__()
        self.backbone = backbone

    def forward(self, input_ids, attention_mask, response_len: int):
        return self.backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state


def meta_models(model: str | None, critic_model: str | None = None, critic_depth: float = 1.0, n_critics: int = 0):
    """(policy, critics) on the meta device: their sizes and configs without reading or allocating any weight.
    model None: the embedded default's architecture; n_critics 0: no critic (GRPO, RLOO)."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    with torch.device("meta"):
        if model is None:
            policy = make_tiny_model(make_tokenizer())
        else:
            policy = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model))
        if critic_model is None:  # the policy's first layers, as make_value_model builds them
            return policy, [make_value_model(policy, None, None, critic_depth) for _ in range(n_critics)]
        config = AutoConfig.from_pretrained(critic_model)  # its config only: the weights stay on disk
        return policy, [ValueModel(AutoModel.from_config(config), config.hidden_size) for _ in range(n_critics)]


def largest_micro_batch(micro_batch: int, minibatch: int, tokens: int, T: int) -> int:
    """Rows of the largest micro-batch of a minibatch of `minibatch` sequences of up to T tokens: micro_batch rows,
    or as many as a budget of `tokens` padded tokens holds (at least one, at most the minibatch)."""
    return min(minibatch, max(1, tokens // T)) if tokens else min(micro_batch, minibatch)


def kv_bytes(config, tokens: int, value_bytes: int) -> int:
    """The KV cache of `tokens` tokens: per layer a key and a value of kv_heads x head_dim each."""
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return tokens * config.num_hidden_layers * 2 * kv_heads * head_dim * value_bytes


def critic_step_bytes(critics, rows: int, T: int, R: int, autocast, checkpointing: bool, shard: int) -> float:
    """A critic's update (bytes): its gradients (fp32, in `shard` shards), its activations for a micro-batch of
    `rows` sequences of T tokens (R response) and its largest layer transient; 0 without critics. Every critic has
    the same config: it is probed once."""
    if not critics:
        return 0
    act, layer = micro_batch_activations(critics[0].backbone.config, rows, T, R, autocast, checkpointing)
    return sum(p.numel() for p in critics[0].parameters()) * 4 / shard + act + layer


def estimate(
    policy,
    critics,
    args: MemoryArgs,
    *,
    seqs: int,
    rows: int,
    prompt_len: int,
    response_len: int,
    dtype: str = "float32",
    world: int = 1,
    reference: bool = True,
    fsdp: bool = False,
    adapters: int = 0,
    engine: str = "float32",
    vllm: tuple[float, float] | None = None,
) -> dict[str, float]:
    """The per-rank peak (GiB) by part (module docstring) of an update on `seqs` sequences per rank of prompt_len +
    response_len tokens whose largest micro-batch has `rows` of them (largest_micro_batch), for models from
    meta_models. Activations are measured on small probes at that length (activation_bytes); nothing is trained.
    reference False: without the frozen reference's weights (the trainer always holds one; a bench not). fsdp:
    weights, moments, gradients and the reference in world shards, plus what is gathered whole at once (the root's
    weights, two layers': one computing, one prefetched; in the rollout all of them) and the root's gradient, whole
    until the end of the backward (not counted: the critics' gathered weights, fewer than the policy's). adapters:
    the LoRA weights (lora.adapter_params) that alone train: moments, gradients, buckets are theirs; no reference.
    engine bfloat16 (--rollout-dtype): the sampler's bf16 copy of the policy, held throughout. vllm: the engine's
    bytes (between rollouts, during one; engine_bytes), in place of the trainer's own KV cache and logits."""
    config, s, kv_s = policy.config, 4, 2 if "bfloat16" in (dtype, engine) else 4  # fp32 weights, moments, gradients
    N, R, T = sum(p.numel() for p in policy.parameters()), response_len, prompt_len + response_len
    b = rows
    autocast = common.make_autocast(dtype, torch.device("cpu"))
    act, layer = micro_batch_activations(config, b, T, R, autocast, args.grad_checkpointing)  # A
    L, H, V = config.num_hidden_layers, config.hidden_size, config.vocab_size
    whole = args.logit_chunk == 0 or lm_head(policy) is None  # a soft-capped or scaled head: the model's logits
    logits = 4 * b * (R + 1) * V * s if whole else 4 * min(args.logit_chunk, b * R) * V * s + V * H * s
    transient = max(logits, layer)  # L: the head's backward (and a chunk's head-weight gradient), then the layers'
    shard = world if fsdp else 1  # FSDP2: parameters, their gradients and moments in world shards
    critic_step = critic_step_bytes(critics, b, T, R, autocast, args.grad_checkpointing, shard)
    n_critic = sum(p.numel() for m in critics for p in m.parameters())
    kv = 0 if vllm else kv_bytes(config, seqs * T, kv_s)  # the engine samples: none of the trainer's sampling buffers
    trained = adapters or N  # LoRA: the adapters alone train
    if fsdp and not (units := common.decoder_layers(policy)):
        raise ValueError(f"--fsdp: {type(policy).__name__} has no decoder layers (GradientCheckpointingLayer) to shard")
    layer_n = sum(p.numel() for p in units[0].parameters()) if fsdp else 0
    g = 2 if dtype == "bfloat16" else s  # FSDP2's gathered weights: bf16 copies under bf16 (on a GPU)
    gathered = (N - L * layer_n + 2 * layer_n) * g if fsdp else 0  # FSDP2: the root's weights and two layers' whole
    root_grad = (N - L * layer_n) * g if fsdp and not adapters else 0  # the root reduces its gradient at the end
    buckets = (trained + n_critic) * s if world > 1 and not fsdp else 0  # DDP's gradient buckets: a copy of each
    ref_n = 0 if adapters or not reference else N  # LoRA's reference is the policy with its adapters off
    copy = (N + adapters) * 2 if engine == "bfloat16" else 0  # rollout.inference_copy (never under FSDP2)
    asleep, awake = vllm or (0, 0)
    static = ((N + adapters + 2 * trained) + ref_n + 3 * n_critic) * s / shard + buckets + copy + asleep
    update = static + gathered + max(trained * s / shard + root_grad + act + transient, critic_step)
    step = static + 2 * trained * s / shard  # opt.step: gradients and foreach AdamW's temporaries, activations freed
    sampling = kv + 4 * seqs * V * s + (N * g if fsdp else 0)  # KV cache, logits; FSDP2: every weight gathered whole
    # vLLM: the engine awake in place of what it holds asleep, and none of the trainer's own sampling memory
    rollout = static + (awake - asleep if vllm else sampling)
    parts = {
        f"policy weights + AdamW{f' (1/{shard})' if fsdp else ''}": (N + adapters + 2 * trained) * s / shard,
        "reference weights": ref_n * s / shard,
        "sampler's bf16 copy (--rollout-dtype)": copy,
        "critic weights + AdamW": 3 * n_critic * s / shard,
        f"DDP gradient buckets (world {world})": buckets,
        "FSDP2 weights gathered whole": gathered,
        "policy gradients": trained * s / shard + root_grad,
        f"activations ({b} x {T} tokens)": act,
        "logits " + ("(whole)" if whole else "chunk") + " + backward transients": transient,
        "critic step, beyond the policy's": max(0, critic_step - (trained * s / shard + root_grad + act + transient)),
        f"rollout KV cache ({seqs} x {T} tokens)": kv,
        "vLLM engine between rollouts (--rollout-engine)": asleep,
        "vLLM engine during a rollout, the sync included": awake,
        "peak: update": update,
        "peak: optimizer step": step,
        "peak: rollout": rollout,
        "peak": max(update, step, rollout),
    }
    return {k: v / GiB for k, v in parts.items()}


def engine_bytes(
    n_params: int, args: vllm_engine.EngineArgs, device_bytes: int | None = None, sync_bytes: int = 0
) -> tuple[float, float]:
    """--rollout-engine vllm's memory on one rank in bytes, (between rollouts, at most during one), for estimate().
    On a GPU of `device_bytes` it takes gpu_memory_utilization of it while awake (its weights, activations and KV
    cache together, as vLLM sizes them). In sleep mode (level 2, vllm_engine detail 4) it holds nothing between
    rollouts, and a rollout wakes its weights, syncs, frees the sync's source, then wakes the KV cache: the larger
    of its weights + `sync_bytes` (what the sync sends: FSDP2's gathered, LoRA's merged weights) and its whole
    share. On the CPU: its weights in its dtype and its KV cache (args.kv_cache_bytes), held throughout, the sync's
    source on top. Not counted: vLLM's own runtime (its imports, a CUDA context; measured on this CPU, building the
    embedded model's engine after vLLM's import grew the process by 0.43 GiB, of which these count 0.25)."""
    weights = n_params * (2 if args.dtype == "bfloat16" else 4)
    if not device_bytes:
        return float(weights + args.kv_cache_bytes), float(weights + args.kv_cache_bytes + sync_bytes)
    share = args.gpu_memory_utilization * device_bytes
    return (0.0, max(share, weights + sync_bytes)) if args.sleep else (share, share + sync_bytes)


def trainer_estimate(cfg, n_local: int, world: int) -> dict[str, float]:
    """`--dry-run-memory`: the estimate for a trainer config (trainer.Config: its models, lengths, micro-batches,
    critics and dtype), n_local sequences per rank."""
    T = rollout_kw(cfg)["max_context"]  # a task's prompt + response, or an environment's whole context
    rows = largest_micro_batch(cfg.micro_batch, n_local // cfg.minibatches, cfg.micro_batch_tokens, T)
    n_critics = (cfg.n_critics if cfg.critic == "asyppo" else 1) if cfg.adv_estimator == "gae" else 0
    policy, critics = meta_models(cfg.model, cfg.critic_model, cfg.critic_depth, n_critics)
    adapters = adapter_params(policy, cfg) if cfg.lora_rank else 0
    sizes = dict(seqs=n_local, rows=rows, prompt_len=cfg.max_prompt_len, response_len=T - cfg.max_prompt_len)
    copy = cfg.rollout_dtype if cfg.rollout_engine == "hf" else "float32"  # vLLM's engine: its own memory, not ours
    layout = dict(dtype=cfg.dtype, world=world, fsdp=cfg.fsdp, adapters=adapters, engine=copy)
    if cfg.rollout_engine == "vllm":  # where vllm_engine.Engine runs: this rank's GPU if there is one (vLLM's build
        gpu = torch.cuda.is_available()  # picks its platform, not --device), else the CPU
        device = torch.cuda.get_device_properties(int(os.environ.get("LOCAL_RANK", 0))).total_memory if gpu else None
        n = sum(p.numel() for p in policy.parameters())
        sync = 4 * n if cfg.fsdp or cfg.lora_rank else 0  # whole weights (LoRA: at most; it merges adapted layers)
        layout["vllm"] = engine_bytes(n, vllm_engine.EngineArgs(dtype=cfg.rollout_dtype), device, sync)
    return estimate(policy, critics, cfg, **sizes, **layout)


def forward_rows(input_ids, rows: int, tokens: int) -> int:
    """Rows per forward of a no-grad pass: a planned micro-batch whole under a token budget (micro_batch_tokens: one
    forward each, as in the update, so every rank runs as many: under FSDP2 each is a collective), else `rows`."""
    return input_ids.shape[0] if tokens else rows


def by_micro_batches(fn, input_ids, attention_mask, response_len: int, *, rows: int, tokens: int, response_mask=None):
    """A no-grad pass under a token budget: fn(ids [b, T'], mask [b, T'], r) -> [..., b, r] on each micro-batch of
    the plan (micro_batches, cut columns), scattered back into [..., B, R] (0 in the cut, all-padding, columns);
    tokens 0: fn on the whole batch, which splits it into rows itself."""
    if not tokens:
        return fn(input_ids, attention_mask, response_len)
    (B, W), R, out = input_ids.shape, response_len, None
    for idx, lo, r in micro_batches(attention_mask, R, rows=rows, tokens=tokens, response_mask=response_mask):
        part = fn(input_ids[idx, lo : W - R + r], attention_mask[idx, lo : W - R + r], r)  # [..., b, r]
        out = part.new_zeros(*part.shape[:-2], B, R) if out is None else out
        out[..., idx, :r] = part
    return out


@dataclass
class Batch:
    """One iteration's training data (docs/design.md 3), built once in train() stanza 4, sliced into minibatches and
    micro-batches (`part`): what one update holds."""

    input_ids: torch.Tensor  # [B, P+R] prompt (left-padded) + response (right-padded)
    attention_mask: torch.Tensor  # [B, P+R] 1 on real prompt, action and observation tokens
    response_mask: torch.Tensor  # [B, R] 1 on action tokens, each action up to and including its stop token
    loss_mask: torch.Tensor  # [B, R] float: what the policy's losses average over (rollout rejection: fewer tokens)
    old_logprobs: torch.Tensor | None  # [B, R] the trainer's recompute; None: the update's first forward fills it
    clip_anchor: torch.Tensor | None  # [B, R] the ratio's denominator: old_logprobs, or the sampler's (behav)
    ref_logprobs: torch.Tensor | None  # [B, R] the frozen reference's; None on an iteration without its pass
    advantages: torch.Tensor  # [B, R] GAE (whitened) or a group baseline broadcast over tokens; 0 where masked
    token_weights: torch.Tensor  # [B, R] gamma_t multiplying A_t (attention credit), else 1
    pg_mask: torch.Tensor  # [B, R] tokens whose policy term counts (AsyPPO), else response_mask
    ent_mask: torch.Tensor  # [B, R] tokens whose entropy bonus counts (AsyPPO), else response_mask
    is_weights: torch.Tensor | None  # [B, R] off-policy importance weights (detached), None without a correction
    old_values: torch.Tensor | None  # [B, M, R] each critic's values before its update; None without a critic
    critic_returns: torch.Tensor | None  # [B, M, R] each critic's own target R^(m) = GAE(V_m) + V_m
    shares: torch.Tensor | None  # [B, M] bool: the rows critic m trains on (AsyPPO's partition)

    def rows(self, idx) -> Batch:
        """The sub-batch of rows idx (an index tensor or a slice)."""
        return Batch(**{f.name: None if (v := getattr(self, f.name)) is None else v[idx] for f in fields(self)})

    def micro_batches(self, cfg) -> list[tuple]:
        """Its micro-batches (micro_batches): cfg.micro_batch rows each, or packed under cfg.micro_batch_tokens."""
        plan = {"rows": cfg.micro_batch, "tokens": cfg.micro_batch_tokens, "response_mask": self.response_mask}
        return micro_batches(self.attention_mask, self.response_mask.shape[1], **plan)

    def part(self, idx, lo: int, r: int) -> Batch:
        """A micro-batch (memory.micro_batches): rows idx, prompt columns from lo, the first r response columns."""
        W, R, out = self.input_ids.shape[1], self.response_mask.shape[1], self.rows(idx)
        for f in fields(out):
            if (v := getattr(out, f.name)) is not None and f.name != "shares":  # [b, M]: no token axis
                setattr(out, f.name, v[:, lo : W - R + r] if f.name in ("input_ids", "attention_mask") else v[..., :r])
        return out


def critics_footprint(cfg, critics, policy, token_id: int, n_local: int, device) -> dict:
    """The critics' parameters and training memory against an actor-sized critic's (critics.critic_footprint), on
    the largest micro-batch of a trainer run (cfg: its Config; whole models)."""
    T = cfg.max_prompt_len + cfg.max_new_tokens
    rows = largest_micro_batch(cfg.micro_batch, n_local // cfg.minibatches, cfg.micro_batch_tokens, T)
    ids = torch.full((rows, T), token_id, device=device)
    return critic_footprint(critics.models, policy, ids, torch.ones_like(ids), cfg.max_new_tokens)


def report(est: dict[str, float]) -> str:
    """The estimate as an aligned table."""
    width = max(map(len, est))
    return "\n".join(f"{k:<{width}}  {v:9.3f} GiB" for k, v in est.items())


@dataclass
class DemoConfig(MemoryArgs):
    """`python memory.py`: the estimate for an update (the trainer prints its own with --dry-run-memory)."""

    model: str | None = None
    """Model folder or hub id whose config sizes the estimate (None = the embedded default)."""
    seqs: int = 128
    """Sequences per rank per iteration."""
    micro_batch: int = 64
    """Sequences per micro-batch (without micro_batch_tokens)."""
    prompt_len: int = 16
    """Prompt tokens."""
    response_len: int = 16
    """Response tokens."""
    critics: int = 1
    """Critics (0 = GRPO)."""


def host_floats(rows: list[dict]) -> None:
    """Every 0-d tensor value of the metric dicts `rows` replaced by its Python float, in one copy (one GPU sync)."""
    keys = [(r, k) for r in rows for k, v in r.items() if isinstance(v, torch.Tensor)]
    dev = next((r[k].device for r, k in keys if r[k].device.type != "cpu"), torch.device("cpu"))  # the GPU's, if any
    values = torch.stack([r[k].detach().to(dev, torch.float64).reshape(()) for r, k in keys]).tolist() if keys else []
    for (r, k), v in zip(keys, values):
        r[k] = v


def clipped_step(model, opt, max_norm: float, where: str, step: bool = True):
    """Clip the gradient norm (returned), refuse a non-finite one (never a NaN into the weights), step, zero grads."""
    gn = common.clip_grad_norm(model.parameters(), max_norm)  # (FSDP2: over every rank's shards)
    if not torch.isfinite(gn):
        raise FloatingPointError(f"{where}: gradient norm is {gn.item()}")
    if step:
        opt.step()
    opt.zero_grad(set_to_none=True)
    return gn


def main(argv=None) -> None:
    """Print the estimate for the demo's sizes."""
    args = parse_config(DemoConfig, argv)
    policy, critics = meta_models(args.model, n_critics=args.critics)
    rows = largest_micro_batch(
        args.micro_batch, args.seqs, args.micro_batch_tokens, args.prompt_len + args.response_len
    )
    sizes = {"seqs": args.seqs, "rows": rows, "prompt_len": args.prompt_len}
    print(report(estimate(policy, critics, args, **sizes, response_len=args.response_len)))


if __name__ == "__main__":
    main()
