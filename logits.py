"""The LM head in chunks: per-token logprobs and entropies without [b, R, V] logits (rollout.py detail 4).

`sequence_logprobs` (rollout.py), the trainer's recompute, runs the model with `logits_to_keep` empty; `final_hidden`
takes its decoder's final hidden states by a hook, and `token_stats` runs the LM head and log-softmax `chunk` tokens
at a time, each chunk checkpointed (recomputed in backward). `lm_head` says, once per model, whether that is exact:
a head that soft-caps or scales its logits (Gemma 2, Cohere, Granite, ...) keeps the model's own logits. memory.py
counts what this saves; attention_credit.py runs the check before its map hooks.

    python logits.py     # chunked against whole logits on the tiny model: logprobs, entropies, gradients
"""

from __future__ import annotations

import inspect
import weakref

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from tasks import make_tiny_model, make_tokenizer


def _last_logits_kw(model, n: int) -> dict:
    """Ask the model for the logits of the last n positions only, if its forward supports it."""
    forward = getattr(model, "module", model).forward  # DDP's own forward hides the wrapped model's arguments
    return {"logits_to_keep": n} if "logits_to_keep" in inspect.signature(forward).parameters else {}


def final_hidden(model, base, inputs: dict):
    """The final hidden states [b, T, H] of a forward of `model` (through DDP's wrapper, which must see it) that
    computes no logits, taken from its decoder `base` by a hook (output_hidden_states would keep every layer's)."""
    taken, no_position = [], torch.empty(0, dtype=torch.long, device=inputs["input_ids"].device)
    hook = base.register_forward_hook(lambda module, args, out: taken.append(getattr(out, "last_hidden_state", out[0])))
    try:
        model(**inputs, use_cache=False, logits_to_keep=no_position)
    finally:
        hook.remove()
    return taken[0]


def lm_head(model):
    """(decoder, head) of a causal LM whose logits are exactly head(final hidden state), else None (its own logits
    are used). Checked once per model: known transforms' config keys, then 3 tokens' logits both ways, so no head
    that soft-caps, scales or multiplies (Gemma 2, Cohere, Granite, Falcon-H1 ...) is split."""
    inner = getattr(model, "module", model)  # DDP's wrapper
    if inner not in _HEADS:
        head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
        base = getattr(inner, "base_model", inner)
        scaled = any(getattr(inner.config, k, None) not in (None, 1, 1.0) for k in LOGIT_TRANSFORMS) if head else True
        split = isinstance(head, torch.nn.Linear) and base is not inner and bool(_last_logits_kw(inner, 1))
        split = split and not scaled  # a config that says so (meta models, memory.py's estimate, have no values)
        if split and next(head.parameters()).device.type != "meta":  # and the numbers: an unnamed transform
            ids = (torch.arange(1, 4, device=head.weight.device) % head.out_features)[None]  # [1, 3] (not a pad)
            few = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "position_ids": ids - ids[:, :1]}
            with torch.no_grad():
                ours = head(final_hidden(inner, base, few))  # [1, 3, V] (on the model itself: no DDP collective)
                theirs = inner(**few, use_cache=False, logits_to_keep=3).logits  # [1, 3, V]
            split = torch.allclose(ours.float(), theirs.float(), rtol=1e-4, atol=1e-5)
            if not split:
                why = f"{type(inner).__name__}'s logits are not its head's on the final hidden state"
                print(f"[minrl] {why}: the trainer takes its whole logits (--logit-chunk has no effect)", flush=True)
        _HEADS[inner] = (base, head) if split else None
    return _HEADS[inner]


_HEADS = weakref.WeakKeyDictionary()  # model -> lm_head's verdict, checked once per model
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")  # Gemma 2, Cohere, Granite configs


def token_stats(hidden, head, target, temperature: float, chunk: int, with_entropy: bool, entropy_grad: bool):
    """Logprobs of target [b, R] (and entropies [b, R] or None) from hidden states [b, R, H], chunk tokens at a time.
    With grad enabled each chunk is checkpointed: its logits are recomputed in backward, never kept (detail 4)."""
    b, R, H = hidden.shape
    flat_h, flat_t, keep_graph = hidden.reshape(b * R, H), target.reshape(b * R), torch.is_grad_enabled()  # [n, H], [n]

    def chunk_stats(h, t):  # one chunk's (logprobs [c], entropies [c] or None)
        return _stats(head(h), t, temperature, with_entropy, entropy_grad)

    parts = []
    for i in range(0, b * R, chunk):
        h, t = flat_h[i : i + chunk], flat_t[i : i + chunk]  # [c, H], [c]
        parts.append(checkpoint(chunk_stats, h, t, use_reentrant=False) if keep_graph else chunk_stats(h, t))
    logp = torch.cat([p[0] for p in parts]).view(b, R)  # [b, R]
    return logp, (torch.cat([p[1] for p in parts]).view(b, R) if with_entropy else None)


def _stats(logits, target, temperature: float, with_entropy: bool, entropy_grad: bool):
    """log softmax(logits / T) at target, and the entropy H = -sum p log p (no grad unless entropy_grad)."""
    logp_all = F.log_softmax(logits.float() / temperature, dim=-1)  # [..., V]
    logp = logp_all.gather(-1, target[..., None]).squeeze(-1)  # [...]
    if not with_entropy:
        return logp, None
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        return logp, -(logp_all.exp() * logp_all).sum(-1)  # [...]


def main() -> None:
    """The tiny model's logprobs, entropies and gradients through chunks of 5 tokens against its whole logits."""
    torch.manual_seed(0)
    model = make_tiny_model(make_tokenizer()).eval()
    ids = torch.randint(4, model.config.vocab_size, (4, 24))  # [B, T] random bytes; the last R = 16: the "response"
    base, head = lm_head(model)
    hidden = final_hidden(model, base, {"input_ids": ids})[:, -17:-1]  # [B, R, H] the positions that predict them
    chunked = token_stats(hidden, head, ids[:, -16:], 0.7, 5, True, True)  # [B, R] logprobs, entropies
    whole = _stats(model(ids).logits[:, -17:-1], ids[:, -16:], 0.7, True, True)
    for name, a, b in zip(("logprobs", "entropies"), chunked, whole):
        grad_a = torch.autograd.grad(a.sum(), head.weight, retain_graph=True)[0]
        grad_b = torch.autograd.grad(b.sum(), head.weight, retain_graph=True)[0]
        gap, grad_gap = (a - b).abs().max(), (grad_a - grad_b).abs().max()
        print(f"{name}: max |chunked - whole| {gap:.2e}, head gradient {grad_gap:.2e}")
    print(f"never materialised: [B, R, V] = {tuple(hidden.shape[:2]) + (head.weight.shape[0],)} logits at once")


if __name__ == "__main__":
    main()
