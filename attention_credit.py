"""Attention-based token credit (WAAD / FAI): the policy's own attention picks the tokens whose advantage counts more.

    python attention_credit.py           # one batch of the start model: head groups, gamma, the token figure
    python experiments/credit.py --full  # the experiment: GRPO vs each strategy (local, global, coupled), 5 seeds
    python trainer.py --adv-estimator grpo --credit attention --credit-mode coupled   # inside any run

"Attention Illuminates LLM Reasoning: the preplan-and-anchor rhythm enables fine-grained policy optimization"
(Li et al., arXiv 2510.13554; docs/design.md 5.3). After the rollout, the trainer's no-grad recompute of
old_logprobs also gives the per-head maps A[t, s] of a few middle layers (detail 2); for every head and response row:
  span     d_h = mean_{t in R} sum_s A_h[t,s] (t - s)                                     (Eq. 7)
  groups   local = bottom 30% of heads by d, global = top 30% (>= 1 head each); maps averaged (Eq. 8)
  WAAD     WAAD_t = sum_s A_loc[t,s] min(t - s, W), W = 10                                 (Def. 4.1, Eq. 9)
  FAI      FAI_s = mean_{t in R, s+H_lo <= t <= s+H_hi} A_glob[t,s], H_lo = 10, H_hi = 100 (Def. 4.2, Eq. 10)
  Delta    Delta_t = |WAAD_t - WAAD_{t+1}| (0 for the last token)                          (Eq. 14)
  gamma    local 1 + b 1[TopQ(Delta)]; global 1 + b 1[TopQ(FAI)]                           (Eq. 15, 17)
           coupled 1 + b 1[anchor, not dominated] + (1-alpha) b 1[dominated] + alpha b 1[introducer]  (Eq. 19)
with b = amp - 1; the trainer multiplies the final advantage (GRPO's group-normalised one, GAE's after
whitening): A~_t = gamma_t A_t (Eq. 12/13).

Implementation details ("our choice" where the paper is silent; docs/design.md 5.3 fixes most)
1. Layers kept: unique(round(linspace(L // 3, 2L // 3, 5))), numpy rounding (half to even): 6 layers -> 2, 3, 4.
2. In the trainer, the maps come from inside the forward it runs anyway (the recompute of old_logprobs): for that
   forward of an sdpa model of full-attention layers (`maps_inside`) the attention implementation is
   `attention_with_maps` (registered with transformers), which runs sdpa on every layer and, on the kept layers
   only, also the map softmax(q k^T * scaling) over causal, non-padded keys in fp32, as eager attention computes
   it; the logits are bit for bit those without credit. Other models (eager, flash, sliding windows, soft-capping)
   and standalone calls (`compute_credit(model, ...)`) take a no-grad eager pass of the backbone of its own, hooks
   on the attention modules (the class transformers records as "attentions"), then the forward. Either way each
   map [b, H, N, N] is reduced at once to per-head WAAD, FAI [b, H, R] and span sums [H]: at most one layer's maps
   of one micro-batch exist. WAAD and FAI are linear in A (the FAI window does not
   depend on the head), so those of a group's mean map are the mean of its heads' values: the groups can be
   chosen after the whole batch. Heads are query heads (GQA); spans pool all valid response rows of the batch
   (summed over ranks under DDP: all ranks use the same groups); ties go to the lower head index.
3. Padding: attention to padded columns is zeroed and only valid response rows count (masked_fill: not even
   NaN leaks). Distances are index differences, which are true distances as a row's real tokens are contiguous.
4. A token with an empty FAI window (the last H_lo) gets FAI 0 and is never a TopQ candidate. our choice:
   TopQ keeps ceil(q * n) candidates with n = all valid tokens of the response (>= 1, <= the candidates), so
   the amplified share stays q as in the paper, where the zero-FAI tail ranks last. ceil has a 1e-9 tolerance
   (0.3 * 10 gives 3, not 4); ties go to the earlier token.
5. Coupled: tau_waad, tau_Delta are per-response medians over valid tokens (even n: mean of the middle two);
   an anchor t is dominated if WAAD_t <= tau_waad and max Delta over the valid tokens t-k..t-1 >= tau_Delta;
   its introducer is that argmax (our choice: ties go to the token nearest the anchor). Terms add up, an
   introducer counts once: gamma <= 1 + b + alpha b (1.75 at the defaults); gamma = 1 on padding.
6. Signed advantages by default (revised paper); trainer's `--credit-nonneg-only` keeps gamma = 1 where
   A < 0 (v1). The maps come from the policy that sampled (before the update), like old_logprobs.
7. Metrics: stats/credit_amplified_frac (valid tokens with gamma > 1), stats/credit_gamma_mean,
   stats/fai_pos_frac (valid tokens with FAI > 0), stats/credit_dominated_frac (of the anchors),
   stats/credit_span_local / _global, time/credit (seconds: in the trainer, what credit adds to the recompute:
   the maps inside it, time/credit_maps, and gamma); the trainer adds perf/credit_overhead (its share of the step).
8. Start model (our choice; main() and experiments/credit.py): task `chain` (five 2-digit numbers summed step by
   step, 43-character answers: responses of >= 40 tokens, docs/design.md 5.3), the tiny Qwen2 with 6 layers, 8 query / 4
   key-value heads, hidden 64 (MODEL), after an SFT warm start (SFT).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from cli import check_fields, parse_config
from common import all_reduce_sum, masked_mean
from logits import lm_head
from rollout import generate, position_ids_from_mask
from tasks import format_prompt, load_policy, make_task, tokenize_prompts
from warm_start import SFTConfig, sft_warm_start

W, H_LO, H_HI, HEAD_FRAC = 10, 10, 100, 0.3  # WAAD window, FAI horizons, head-group quantile (paper defaults)
MODEL = (("num_hidden_layers", 6), ("num_attention_heads", 8), ("num_key_value_heads", 4), ("hidden_size", 64),
         ("intermediate_size", 256))  # fmt: skip
SFT = dict(task="chain", model_overrides=MODEL, lr=3e-3, batch_size=64, max_steps=4000, check_every=25)  # SFTConfig


@dataclass
class CreditArgs:
    """The trainer's knobs of attention credit (docs/design.md 5.3); its Config inherits them."""

    credit: Literal["none", "attention"] = "none"
    """Token credit: none, or attention-based re-weighting of advantages (attention_credit.py)."""
    credit_mode: Literal["local", "global", "coupled"] = "coupled"
    """Attention credit: local-chunk (WAAD), global-anchor (FAI) or coupled weights."""
    credit_q: float = 0.4
    """Attention credit: top-q fraction of each response's tokens amplified."""
    credit_intro_window: int = 2
    """Attention credit: tokens before an anchor searched for its introducing token."""
    credit_alpha: float = 0.5
    """Attention credit: share of an anchor's bonus passed to its introducing token."""
    credit_amp: float = 1.5
    """Attention credit: amplification of selected tokens (1 = off, reproduces the plain loss)."""
    credit_nonneg_only: bool = False
    """Attention credit: re-weight only tokens with non-negative advantage."""

    def __post_init__(self):
        ranges = {"[0.0, 1.0]": ("credit_alpha",), "(0.0, 1.0]": ("credit_q",), "[1.0, inf)": ("credit_amp",)}
        check_fields(self, {**ranges, "[1, inf)": ("credit_intro_window",)}, CreditArgs)


# ------------------------------------------------------------------------------------------------
# Pure functions, one per stage. Maps are [..., N, N] (row t attends to columns s <= t).


def select_layers(n_layers: int) -> list[int]:
    """Layers whose maps are kept: unique(round(linspace(L // 3, 2L // 3, 5))) (paper Sec. 5.1; detail 1)."""
    return sorted({int(x) for x in np.rint(np.linspace(n_layers // 3, 2 * n_layers // 3, 5))})


def lookback(attn, max_dist: int | None = None):
    """[..., N] attention-weighted look-back per row: sum_s A[t,s] min(t - s, max_dist) (unclipped if None)."""
    idx = torch.arange(attn.shape[-1], device=attn.device)
    d = (idx[:, None] - idx[None, :]).clamp(min=0, max=max_dist).to(attn.dtype)  # [N, N] t - s, 0 above diagonal
    return (attn * d).sum(-1)  # [..., N]


def waad(attn, window: int = W):
    """WAAD_t = sum_s A[t,s] min(t - s, W) for every row t (Def. 4.1, Eq. 9). [..., N, N] -> [..., N]."""
    return lookback(attn, window)


def head_spans(attn, row_mask):
    """d_h = mean over valid rows t of sum_s A_h[t,s] (t - s) (Eq. 7). attn [B, H, N, N], row_mask [B, N] -> [H]."""
    per_row = lookback(attn).masked_fill(~row_mask.bool()[:, None, :], 0.0)  # [B, H, N]
    return per_row.sum((0, 2)) / row_mask.sum().clamp(min=1)  # [H]


def head_groups(spans, frac: float = HEAD_FRAC):
    """(local, global) head indices: the ceil(frac * n) smallest / largest spans (>= 1 each; ties by index)."""
    k = max(1, math.ceil(frac * spans.numel() - 1e-9))
    return torch.sort(spans, stable=True).indices[:k], torch.sort(-spans, stable=True).indices[:k]


def fai(attn, row_mask, h_lo: int = H_LO, h_hi: int = H_HI):
    """FAI_s = mean of A[t,s] over valid rows t with s + h_lo <= t <= s + h_hi (Def. 4.2, Eq. 10).

    attn [B, H, N, N], row_mask [B, N]: the rows that count. Returns (fai [B, H, N], has_window [B, N]);
    a column whose window is empty gets FAI 0 (detail 4).
    """
    idx = torch.arange(attn.shape[-1], device=attn.device)
    dist = idx[:, None] - idx[None, :]  # [N, N] signed t - s (row t, column s)
    win = ((dist >= h_lo) & (dist <= h_hi))[None] & row_mask.bool()[:, :, None]  # [B, N, N] valid rows only
    count = win.sum(1)  # [B, N] |T(s)|
    total = attn.masked_fill(~win[:, None], 0.0).sum(-2)  # [B, H, N]
    return total / count.clamp(min=1)[:, None], count > 0


def deltas(waad_r, mask):
    """Delta_t = |WAAD_t - WAAD_{t+1}| where both are valid, else 0 (Eq. 14). [B, R] -> [B, R]."""
    m = mask.bool()
    d = (waad_r[:, :-1] - waad_r[:, 1:]).abs().masked_fill(~(m[:, :-1] & m[:, 1:]), 0.0)  # [B, R-1]
    return torch.cat([d, d.new_zeros(d.shape[0], 1)], 1)  # [B, R] last token: 0


def topq_mask(score, candidates, q: float, valid=None):
    """Bool [B, R]: per row the ceil(q * n) highest-scoring candidates, n = valid (default: candidate) tokens."""
    cand = candidates.bool()
    n = (cand if valid is None else valid.bool()).sum(1)  # [B]
    k = torch.minimum(torch.ceil(q * n.double() - 1e-9).long().clamp(min=1), cand.sum(1))  # [B] detail 4
    order = score.double().masked_fill(~cand, -math.inf).sort(dim=1, descending=True, stable=True).indices  # [B, R]
    pos = torch.arange(order.shape[1], device=order.device).expand_as(order)  # [B, R]
    rank = torch.empty_like(order).scatter_(1, order, pos)  # [B, R] rank of each token
    return (rank < k[:, None]) & cand  # ties: the earlier token ranks first (stable sort)


def masked_median(x, mask):
    """Per-row median over valid entries (mean of the middle two for even n; 0 for an empty row). [B, R] -> [B]."""
    m = mask.bool()
    n = m.sum(1)  # [B]
    srt = x.double().masked_fill(~m, math.inf).sort(1).values  # [B, R] valid values first
    lo, hi = ((n - 1).clamp(min=0) // 2)[:, None], (n // 2).clamp(max=x.shape[1] - 1)[:, None]  # [B, 1]
    med = (srt.gather(1, lo) + srt.gather(1, hi)).squeeze(1) / 2  # [B]
    return torch.where(n > 0, med, torch.zeros_like(med)).to(x.dtype)


def gamma_local(delta, mask, q: float = 0.4, amp: float = 1.5):
    """Local-chunk credit (Eq. 15): gamma = 1 + (amp - 1) 1[t in TopQ(Delta)]. [B, R]."""
    return 1.0 + (amp - 1.0) * topq_mask(delta, mask, q).to(delta.dtype)


def gamma_global(fai_r, candidates, mask, q: float = 0.4, amp: float = 1.5):
    """Global-anchor credit (Eq. 17): gamma = 1 + (amp - 1) 1[t in TopQ(FAI)]. [B, R]."""
    return 1.0 + (amp - 1.0) * topq_mask(fai_r, candidates, q, mask).to(fai_r.dtype)


def gamma_coupled(waad_r, delta, fai_r, candidates, mask, q=0.4, k: int = 2, alpha: float = 0.5, amp: float = 1.5):
    """Coupled rhythm credit (Eq. 18-19, detail 5). All [B, R]. Returns (gamma, {anchor, dominated, intro})."""
    m, R = mask.bool(), delta.shape[1]
    anchor = topq_mask(fai_r, candidates, q, mask)  # [B, R] T_glob
    tau_w, tau_d = masked_median(waad_r, mask)[:, None], masked_median(delta, mask)[:, None]  # [B, 1]
    # back[:, t, j - 1] = Delta_{t-j} for j = 1..k (nearest first), -inf outside the response
    d_pad = torch.cat([delta.new_full((delta.shape[0], k), -math.inf), delta.masked_fill(~m, -math.inf)], 1)
    back = torch.stack([d_pad[:, k - j : k - j + R] for j in range(1, k + 1)], -1)  # [B, R, k]
    win_max, win_arg = back.max(-1)  # [B, R]; the first (nearest) of equal values
    # dominated anchor: WAAD_t <= tau_waad and max_{u in t-k..t-1} Delta_u >= tau_Delta (Eq. 18)
    dominated = anchor & (waad_r <= tau_w) & (win_max >= tau_d) & torch.isfinite(win_max)  # [B, R]
    intro = torch.zeros_like(m)  # [B, R] I(D); a token introducing several anchors counts once
    for j in range(1, k + 1):
        intro[:, :-j] |= (dominated & (win_arg == j - 1))[:, j:]
    b, f = amp - 1.0, waad_r.dtype
    # gamma_t = 1 + b 1[T_glob \ D] + (1 - alpha) b 1[D] + alpha b 1[I(D)]   (Eq. 19, additive)
    gamma = 1.0 + b * (anchor & ~dominated).to(f) + (1 - alpha) * b * dominated.to(f) + alpha * b * intro.to(f)
    return gamma.masked_fill(~m, 1.0), {"anchor": anchor, "dominated": dominated, "intro": intro}


# ------------------------------------------------------------------------------------------------
# The attention pass: hooks on the kept layers, each map reduced as it is produced


def attention_modules(model) -> list:
    """[(module, index of the weights in its output)] per layer: the class transformers records as "attentions"."""
    target = (getattr(model, "_can_record_outputs", None) or {}).get("attentions")
    if target is None:
        raise TypeError(f"{type(model).__name__} declares no module returning attention weights, so no maps")
    cls, suffix = getattr(target, "target_class", target), getattr(target, "layer_name", None)  # class or recorder
    mods = [m for n, m in model.named_modules() if isinstance(m, cls) and (suffix is None or n.endswith(suffix))]
    n_layers = model.config.num_hidden_layers
    if len(mods) != n_layers:  # exactly one attention module per layer
        raise RuntimeError(f"{type(model).__name__}: {len(mods)} attention modules for {n_layers} layers")
    return [(m, getattr(target, "index", 1)) for m in mods]


MAPS_IMPL = "minrl_maps"  # the attention implementation of a pass that takes maps inside a forward (detail 2)


def attention_with_maps(module, query, key, value, attention_mask, **kw):
    """sdpa, and on a kept layer also its map as eager attention computes it, softmax(q k^T * scaling) over causal,
    non-padded keys (in fp32), handed to the pass; registered with transformers as MAPS_IMPL by run_with_maps."""
    out = ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, **kw)
    j, state = module._minrl_maps  # set on every attention module for the pass (run_with_maps)
    if j is not None:
        if bad := [k for k in ("sliding_window", "softcap", "s_aux") if kw.get(k) is not None]:
            raise NotImplementedError(f"attention credit inside a forward: {bad} (maps_inside should have said no)")
        if query.device.type == "cuda":
            torch.cuda.synchronize(query.device)  # time/credit_maps: this work only, not the forward queued before
        t0 = time.perf_counter()
        sl = state["rows"](j, query.shape[0])
        with torch.autocast(query.device.type, enabled=False):  # fp32 maps, also from a bf16 forward
            q, k = query.float(), key.float().repeat_interleave(query.shape[1] // key.shape[1], dim=1)  # GQA
            scores = torch.matmul(q, k.transpose(2, 3)) * (kw.get("scaling") or query.shape[-1] ** -0.5)
            causal = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).tril()  # [N, N]
            allowed = causal & state["mask"][sl].bool()[:, None, None, :]  # [b, 1, N, N]
            state["take"](sl, j, scores.masked_fill(~allowed, torch.finfo(torch.float32).min).softmax(-1))
        if query.device.type == "cuda":
            torch.cuda.synchronize(query.device)  # time/credit counts the work, not its launch
        state["spent"] += time.perf_counter() - t0
    return out


def maps_inside(model) -> bool:
    """Whether a forward's own attention calls can give the maps: an sdpa model of full-attention layers only (eager,
    flash, sliding windows and soft-capping take the eager pass of its own)."""
    cfg, types = model.config, getattr(model.config, "layer_types", None)  # without layer types: a window or none
    full = all(t == "full_attention" for t in types) if types else not getattr(cfg, "sliding_window", None)
    return cfg._attn_implementation == "sdpa" and full and not getattr(cfg, "attn_logit_softcapping", None)


def run_with_maps(model, input_ids, attention_mask, layers: list[int], on_map, micro_batch: int = 64, forward=None):
    """on_map(rows slice, j, A [b, H, N, N] fp32) for kept layer layers[j] of each micro-batch; returns forward()'s
    output and the seconds spent on maps inside it.

    forward: the forward the maps are taken in when maps_inside(model) (the trainer's recompute of old_logprobs:
    every row once, in order): for it the attention implementation is `attention_with_maps`, the logits bit for bit
    sdpa's. Otherwise (forward None, or another model) a no-grad eager pass of the backbone (no LM head) of its own,
    whose attention modules return the maps (forward hooks read them), then forward(). Restored after, on error too.
    """
    mods, name, prev = attention_modules(model), type(model).__name__, model.config._attn_implementation
    state = {"next": 0, "sl": None, "seen": [], "spent": 0.0, "mask": attention_mask}

    def rows(j, b):
        """The rows of the current micro-batch: the first kept layer (j = 0) moves on to the next b rows."""
        if j == 0:
            state["sl"], state["next"] = slice(state["next"], state["next"] + b), state["next"] + b
        state["seen"].append(j)
        return state["sl"]

    def take(sl, j, w):
        """Check that an attention map came out, then pass it on."""
        if not isinstance(w, torch.Tensor) or w.dim() != 4 or w.shape[-1] != w.shape[-2]:
            raise RuntimeError(f"{name} returned no attention map under eager attention")
        on_map(sl, j, w.float())

    def hook(j, index):  # kept layer j under eager attention: its map is output[index]
        return lambda module, args, out: take(rows(j, out[0].shape[0]), j, out[index] if len(out) > index else None)

    lm_head(model)  # its one-time check runs forwards of its own: before the map hooks, which expect this batch
    inside = forward is not None and maps_inside(model)
    state.update(rows=rows, take=take)
    kept = {layer: j for j, layer in enumerate(layers)}
    handles = [] if inside else [mods[la][0].register_forward_hook(hook(j, mods[la][1])) for la, j in kept.items()]
    if inside:
        AttentionInterface.register(MAPS_IMPL, attention_with_maps)
        AttentionMaskInterface.register(MAPS_IMPL, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])  # sdpa's masks
        for layer, (m, _) in enumerate(mods):
            m._minrl_maps = (kept.get(layer), state)
    try:
        model.set_attn_implementation(MAPS_IMPL if inside else "eager")
        if model.config._attn_implementation != (MAPS_IMPL if inside else "eager"):
            raise RuntimeError(f"{name} cannot switch its attention implementation, which attention credit needs")
        backbone, pos = getattr(model, "base_model", model), position_ids_from_mask(attention_mask)
        for i in range(0, input_ids.shape[0], micro_batch) if not inside else ():
            sl = slice(i, i + micro_batch)
            rows_in = {"input_ids": input_ids[sl], "attention_mask": attention_mask[sl], "position_ids": pos[sl]}
            with torch.no_grad():
                backbone(**rows_in, use_cache=False)
        if not inside:  # the pass of its own is over: the model as it was for forward()
            model.set_attn_implementation(prev)
            for h in handles:  # (removing twice is a no-op)
                h.remove()
        out = None if forward is None else forward()
        n = len(state["seen"]) // len(layers)  # micro-batches seen: each has every kept layer once, in order
        if state["next"] != input_ids.shape[0] or not n or state["seen"] != list(range(len(layers))) * n:
            order = f"came in the order {state['seen'][:12]} for {state['next']} of {input_ids.shape[0]} rows"
            raise RuntimeError(f"{name}: maps of kept layers {layers} {order} (every row once, in order)")
        return out, state["spent"]
    finally:
        for h in handles:
            h.remove()
        for m, _ in mods if inside else ():
            del m._minrl_maps
        model.set_attn_implementation(prev)


def attention_stats(model, input_ids, attention_mask, response_mask, micro_batch: int = 64, forward=None) -> dict:
    """Per-head WAAD, FAI on the response [B, nH, R] (nH = kept layers x heads), spans [nH], has_window [B, R]; the
    maps are taken inside `forward` (run_with_maps; None: a pass of their own)."""
    (B, N), R = input_ids.shape, response_mask.shape[1]
    layers = select_layers(model.config.num_hidden_layers)
    row_mask = torch.cat([torch.zeros_like(attention_mask[:, : N - R]), response_mask], 1).bool()  # [B, N]
    parts, span_sum = {}, {}  # (micro-batch start, j) -> (WAAD, FAI) [b, H, R]; j -> [H]
    has_window = torch.zeros(B, R, dtype=torch.bool, device=input_ids.device)  # [B, R]

    def on_map(sl, j, A):
        """Reduce layer j's attention map [b, H, N, N] of micro-batch sl to WAAD and FAI as it is computed."""
        rows = row_mask[sl]  # [b, N]
        A = A.masked_fill(~attention_mask[sl].bool()[:, None, None, :], 0.0)  # [b, H, N, N] no attention to pads
        A = A.masked_fill(~rows[:, None, :, None], 0.0)  # only valid response rows count (detail 3)
        f, hw = fai(A, rows)  # [b, H, N], [b, N]
        parts[sl.start, j] = waad(A)[..., N - R :], f[..., N - R :]  # [b, H, R] each
        has_window[sl] = hw[:, N - R :]
        span_sum[j] = span_sum.get(j, 0) + lookback(A).sum((0, 2))  # [H] (other rows are zero)

    _, map_s = run_with_maps(model, input_ids, attention_mask, layers, on_map, micro_batch, forward)
    n_rows = all_reduce_sum(response_mask.sum().double().reshape(1))  # over ranks (detail 2)
    spans = all_reduce_sum(torch.cat([span_sum[j].double() for j in range(len(layers))])) / n_rows.clamp(min=1)
    js, starts = range(len(layers)), sorted({start for start, _ in parts})  # the forward's own micro-batches
    cat = lambda i: torch.cat([torch.cat([parts[s, j][i] for j in js], 1) for s in starts])  # [B, nH, R], nH = j*H + h
    maps = {"waad": cat(0), "fai": cat(1), "spans": spans.float(), "has_window": has_window}
    return {**maps, "layers": layers, "map_s": map_s}


def compute_credit(model, input_ids, attention_mask, response_mask, *, mode="coupled", q=0.4, intro_window=2,
                   alpha=0.5, amp=1.5, micro_batch=64, forward=None) -> dict:  # fmt: skip
    """Every stage for one batch: WAAD_loc, FAI_glob, Delta, candidates, gamma ([B, R]), the head groups; the maps
    from inside `forward` (attention_stats)."""
    mask = response_mask.bool()  # [B, R]
    st = attention_stats(model, input_ids, attention_mask, response_mask, micro_batch, forward)
    local, glob = head_groups(st["spans"])
    waad_r = st["waad"][:, local].mean(1).masked_fill(~mask, 0.0)  # [B, R] group mean (Eq. 8, detail 2)
    fai_r = st["fai"][:, glob].mean(1).masked_fill(~mask, 0.0)  # [B, R]
    if not (torch.isfinite(waad_r).all() and torch.isfinite(fai_r).all()):
        raise FloatingPointError("attention credit: non-finite WAAD or FAI on valid tokens (NaN in the model?)")
    delta, cand = deltas(waad_r, mask), st["has_window"] & mask  # [B, R]; FAI candidates have a window
    parts = {}
    if mode == "local":
        gamma = gamma_local(delta, mask, q, amp)
    elif mode == "global":
        gamma = gamma_global(fai_r, cand, mask, q, amp)
    elif mode == "coupled":
        gamma, parts = gamma_coupled(waad_r, delta, fai_r, cand, mask, q, intro_window, alpha, amp)
    else:
        raise ValueError(f"config field 'credit_mode' = {mode!r}: must be one of ['local', 'global', 'coupled']")
    out = dict(gamma=gamma.masked_fill(~mask, 1.0), waad=waad_r, fai=fai_r, delta=delta, candidates=cand, **parts)
    return {**out, "local": local, "global": glob, **{k: st[k] for k in ("spans", "layers", "map_s")}}


def token_weights(model, input_ids, attention_mask, response_mask, forward=None, **credit_kw):
    """gamma [B, R] (detached, 1 on padding) and metrics; the maps from inside `forward` (None: a pass of their own).

    input_ids / attention_mask [B, P+R] (left-padded prompt, right-padded response), response_mask [B, R];
    credit_kw: mode, q, intro_window, alpha, amp, micro_batch (see compute_credit).
    """
    t0 = time.perf_counter()
    c = compute_credit(model, input_ids, attention_mask, response_mask, forward=forward, **credit_kw)
    mask, gamma = response_mask.float(), c["gamma"].detach()
    mean = lambda x, m=mask: float(masked_mean(x.float(), m.float(), global_=True))  # noqa: E731  (of all ranks)
    return gamma, {
        "stats/credit_amplified_frac": mean(gamma > 1),
        "stats/credit_gamma_mean": mean(gamma),
        "stats/fai_pos_frac": mean(c["fai"] > 0),
        "stats/credit_dominated_frac": mean(c["dominated"], c["anchor"]) if "anchor" in c else 0.0,
        "stats/credit_span_local": float(c["spans"][c["local"]].mean()),
        "stats/credit_span_global": float(c["spans"][c["global"]].mean()),
        "time/credit": time.perf_counter() - t0,
        "time/credit_maps": c["map_s"],  # of time/credit: the maps inside `forward`
    }


def credit_weights(cfg: CreditArgs, model, input_ids, attention_mask, response_mask, micro_batch: int, forward):
    """The trainer's call (its Config holds CreditArgs): runs forward() (its recompute of old_logprobs) with the maps
    of the kept layers taken inside it; (forward's output, gamma, metrics), time/credit without forward's own."""
    kw, ran = {k: getattr(cfg, "credit_" + k) for k in ("mode", "q", "intro_window", "alpha", "amp")}, {}

    def timed():
        t0 = time.perf_counter()
        ran["out"] = forward()
        ran["s"] = time.perf_counter() - t0

    gamma, metrics = token_weights(
        model, input_ids, attention_mask, response_mask, timed, **kw, micro_batch=micro_batch
    )
    own = metrics["time/credit"] - ran["s"] + metrics["time/credit_maps"]  # what credit adds to the forward
    return ran["out"], gamma, {**metrics, "time/credit": own}


def plot_tokens(tokens: list[str], c: dict, row: int, path) -> None:
    """One response's tokens coloured by WAAD (top) and FAI (bottom); amplified tokens (gamma > 1) framed red."""
    import matplotlib.pyplot as plt

    n = len(tokens)
    fig, axes = plt.subplots(2, 1, figsize=(max(6.0, 0.3 * n), 2.4))
    for ax, key in zip(axes, ("waad", "fai")):
        v = c[key][row, :n].float().cpu().numpy()
        ax.imshow(v[None], cmap="viridis", aspect="auto", extent=(0, n, 0, 1))
        light = (v - v.min()) > 0.6 * (v.max() - v.min())  # black text on the bright end of viridis
        for t, ch in enumerate(tokens):
            label = {"\n": "\\n", " ": "_"}.get(ch, ch)
            ax.text(t + 0.5, 0.5, label, ha="center", va="center", color="k" if light[t] else "w", size=8)
            if c["gamma"][row, t] > 1:
                ax.add_patch(plt.Rectangle((t + 0.05, 0.05), 0.9, 0.9, fill=False, ec="red", lw=2))
        title = f"{key.upper()} {v.min():.3g} (dark) .. {v.max():.3g} (bright); red frame: amplified (gamma > 1)"
        ax.set_yticks([]), ax.set_title(title, fontsize=9, loc="left")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def sample_and_plot(policy, tokenizer, problems: list[dict], path) -> dict:
    """One response per problem (48 new tokens, seed 0), the coupled credit of that batch (compute_credit), and the
    token figure of the first response at `path`. Returns compute_credit's stages."""
    device = policy.device
    ids, attn = tokenize_prompts(tokenizer, [format_prompt(tokenizer, p["prompt"]) for p in problems], 64)
    gen = dict(max_new_tokens=48, eos_token_ids=[tokenizer.eos_token_id], pad_token_id=tokenizer.pad_token_id)
    samples = generate(policy, ids.to(device), attn.to(device), **gen, generator=torch.Generator(device).manual_seed(0))
    c = compute_credit(policy, samples.input_ids, samples.attention_mask, samples.response_mask)
    row0 = samples.response_ids[0][samples.response_mask[0].bool()]  # row 0, valid tokens
    plot_tokens(tokenizer.convert_ids_to_tokens(row0.tolist()), c, 0, path)
    return {**c, "response_mask": samples.response_mask}


@dataclass
class Config:
    """`python attention_credit.py`: the coupled credit of one batch of the start model, and its token figure."""

    model: str | None = None
    """Model folder (None: the SFT warm start of MODEL on the chain task, built once and cached)."""
    prompts: int = 16
    """Held-out chain prompts sampled (one response each)."""
    out_dir: str = "runs/attention_credit"
    """Where the token figure goes."""

    def __post_init__(self):
        check_fields(self, {"[1, inf)": ("prompts",)})


def main(argv=None):
    """`python attention_credit.py [flags]`: the head groups, what the credit amplifies and the token figure."""
    import matplotlib

    matplotlib.use("Agg")
    cfg = parse_config(Config, argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model_path = cfg.model or str(sft_warm_start(SFTConfig(**SFT, target_acc=0.3), device=device))  # credit.py's
    policy, tok = load_policy(model_path, device)
    problems = make_task("chain").sample(cfg.prompts, "eval", np.random.default_rng(12345))  # the held-out set
    path = Path(cfg.out_dir) / "tokens.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    c = sample_and_plot(policy, tok, problems, path)
    mask = c["response_mask"].bool()
    local, glob = c["local"].tolist(), c["global"].tolist()
    print(f"{model_path}: layers kept {c['layers']}; local heads {local}, global heads {glob} (layer-major index)")
    amplified, gamma = float(((c["gamma"] > 1) & mask).sum() / mask.sum()), float(c["gamma"][mask].mean())
    print(f"{int(mask.sum())} valid tokens: {amplified:.1%} amplified (gamma > 1), mean gamma {gamma:.3f}")
    dominated, intro = int((c["dominated"] & mask).sum()), int((c["intro"] & mask).sum())
    print(f"{int((c['anchor'] & mask).sum())} anchors, {dominated} dominated, {intro} introducers; figure: {path}")
    return c


if __name__ == "__main__":
    main()
