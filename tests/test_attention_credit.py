"""Attention credit (attention_credit.py): known answers for every stage, padding, the loss, a training run."""

import itertools
import json
import math
import re
from fractions import Fraction

import numpy as np
import pytest
import torch

import attention_credit as ac
import offpolicy
import rewards
import tasks
import trainer
from cli import parse_config
from experiments import credit
from rollout import sequence_logprobs

# ------------------------------------------------------------------------------------------------
# maps built by hand


def causal_map(n, kind):
    """[1, 1, n, n] row-stochastic causal maps with a known structure."""
    A = torch.zeros(n, n, dtype=torch.float64)
    for t in range(n):
        if kind == "identity":
            A[t, t] = 1
        elif kind == "previous":
            A[t, max(t - 1, 0)] = 1
        elif kind == "first":
            A[t, 0] = 1
        elif kind == "uniform":
            A[t, : t + 1] = 1 / (t + 1)
    return A[None, None]


def random_map(B, H, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, H, n, n, generator=g, dtype=torch.float64)
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    return logits.masked_fill(~causal, float("-inf")).softmax(-1)  # [B, H, n, n]


def test_select_layers_known_answers():
    # round(linspace(L//3, 2L//3, 5)), half to even: L=6 -> [2, 2.5, 3, 3.5, 4] -> {2, 3, 4}
    assert ac.select_layers(6) == [2, 3, 4]
    assert ac.select_layers(36) == [12, 15, 18, 21, 24]  # Qwen3-8B: 12..24 step 3
    assert ac.select_layers(2) == [0, 1]  # [0, .25, .5, .75, 1] -> {0, 1}
    assert ac.select_layers(1) == [0]


def test_waad_identity_previous_first():
    n, W = 25, 10
    assert torch.equal(ac.waad(causal_map(n, "identity"), W)[0, 0], torch.zeros(n, dtype=torch.float64))
    prev = ac.waad(causal_map(n, "previous"), W)[0, 0]
    assert prev[0] == 0 and torch.equal(prev[1:], torch.ones(n - 1, dtype=torch.float64))  # t >= 2 (1-indexed)
    first = ac.waad(causal_map(n, "first"), W)[0, 0]
    assert first.tolist() == [min(t, W) for t in range(n)]  # min(t - 1, W) with 1-indexed t


def test_waad_uniform_matches_brute_force():
    n, W = 30, 10
    got = ac.waad(causal_map(n, "uniform"), W)[0, 0]
    for t in range(n):  # 1-indexed t' = t + 1: (1/t') sum_{d=0}^{t'-1} min(d, W)
        expect = sum(min(d, W) for d in range(t + 1)) / (t + 1)
        assert abs(got[t].item() - expect) < 1e-12


def naive_fai(A, row_mask, h_lo, h_hi):
    """Double loop over columns s and rows t, windows [s + h_lo, min(N, s + h_hi)] (0-indexed, N - 1)."""
    B, H, N, _ = A.shape
    out = torch.zeros(B, H, N, dtype=A.dtype)
    for b in range(B):
        for s in range(N):
            rows = [t for t in range(s + h_lo, min(N - 1, s + h_hi) + 1) if row_mask[b, t]]
            for h in range(H):
                out[b, h, s] = sum(A[b, h, t, s] for t in rows) / len(rows) if rows else 0.0
    return out


@pytest.mark.parametrize("h_lo,h_hi", [(10, 100), (3, 7), (1, 1), (0, 4)])
def test_fai_vectorised_equals_double_loop(h_lo, h_hi):
    A = random_map(2, 3, 24)
    row_mask = torch.zeros(2, 24, dtype=torch.bool)
    row_mask[0, 5:] = True  # prompt 0..4, response 5..23
    row_mask[1, 9:20] = True  # a right-padded response
    got, has_window = ac.fai(A, row_mask, h_lo, h_hi)
    assert torch.allclose(got, naive_fai(A, row_mask, h_lo, h_hi), atol=1e-12)
    for b in range(2):
        for s in range(24):  # non-empty iff some valid t lies in [s + h_lo, s + h_hi]
            assert bool(has_window[b, s]) == any(row_mask[b, t] for t in range(s + h_lo, s + h_hi + 1) if t < 24)


def test_fai_single_column_known_answer():
    n, c = 30, 4
    A = torch.zeros(1, 1, n, n, dtype=torch.float64)
    A[0, 0, :c, 0] = 1  # rows before c cannot attend to c (causal): to position 0
    A[0, 0, c:, c] = 1
    rows = torch.ones(1, n, dtype=torch.bool)
    f, hw = ac.fai(A, rows, 10, 100)
    assert f[0, 0, c] == 1 and f[0, 0, 0] == 0  # rows 10.. never attend to 0
    assert torch.equal(f[0, 0, c + 1 :], torch.zeros(n - c - 1, dtype=torch.float64))
    assert hw[0].tolist() == [s + 10 <= n - 1 for s in range(n)]  # empty windows for the last 10 tokens


def test_head_spans_known_answers():
    n = 12
    A = torch.cat([causal_map(n, "identity"), causal_map(n, "first"), causal_map(n, "previous")], 1)  # [1, 3, n, n]
    rows = torch.zeros(1, n, dtype=torch.bool)
    rows[0, 5:] = True  # response rows 5..11
    d = ac.head_spans(A, rows)
    assert d[0] == 0  # a head that attends to itself
    assert abs(d[1].item() - np.mean(range(5, 12))) < 1e-12  # A[t, 1] = 1: d = mean_{t in R} (t - 1), 1-indexed
    assert d[2] == 1


def test_head_groups_rounding_and_ties():
    spans = torch.tensor([5.0, 1, 3, 9, 7, 2, 8, 4, 6, 0])
    local, glob = ac.head_groups(spans, 0.3)  # ceil(0.3 * 10) = 3 despite 0.3 * 10 = 3.0000000000000004
    assert local.tolist() == [9, 1, 5] and glob.tolist() == [3, 6, 4]
    local, glob = ac.head_groups(torch.tensor([2.0, 2.0, 1.0]), 0.3)  # >= 1 head each; ties by index
    assert local.tolist() == [2] and glob.tolist() == [0]


def test_deltas_and_median():
    w = torch.tensor([[5.0, 1, 4, 2, 9, 9]])
    m = torch.tensor([[1, 1, 1, 1, 0, 0]])
    assert ac.deltas(w, m).tolist() == [[4, 3, 2, 0, 0, 0]]  # the last valid token and padding get 0
    x = torch.tensor([[3.0, 1, 2, 100, float("nan")], [4.0, 1, 3, 2, 9], [7.0, 7, 7, 7, 7]])
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [0, 0, 0, 0, 0]])
    assert ac.masked_median(x, mask).tolist() == [2.0, 2.5, 0.0]


def test_topq_mask_counts_ties_and_candidates():
    score = torch.tensor([[1.0, 3, 3, 2, 0, 5]])
    valid = torch.tensor([[1, 1, 1, 1, 1, 0]]).bool()  # 5 valid -> ceil(0.4 * 5) = 2
    assert ac.topq_mask(score, valid, 0.4).tolist() == [[False, True, True, False, False, False]]
    assert ac.topq_mask(score, valid, 0.2).tolist() == [[False, True, False, False, False, False]]  # tie: earlier
    assert ac.topq_mask(score, valid, 0.01).sum() == 1  # at least one
    cand = torch.tensor([[1, 0, 0, 1, 1, 0]]).bool()  # n counts valid tokens, selection only among candidates
    assert ac.topq_mask(score, cand, 0.4, valid).tolist() == [[True, False, False, True, False, False]]
    assert ac.topq_mask(score, cand, 1.0, valid).sum() == 3  # capped at the candidates
    assert ac.topq_mask(score, torch.zeros_like(cand), 0.4, valid).sum() == 0  # no candidate: nothing


# a 12-token response, every quantity derived by hand (q = 0.4, k = 2, alpha = 0.5, amp = 1.5, b = 0.5)
W12 = [5.0, 1, 4, 2, 2, 6, 1, 4, 1, 0, 2, 5]
# Delta_t = |w_t - w_{t+1}|, last 0:  [4, 3, 2, 0, 4, 5, 3, 3, 1, 2, 3, 0]
FAI12 = [0.1, 0.5, 0.2, 0.9, 0.3, 0.05, 0.6, 0.4, 0.8, 0.15, 0.95, 0.0]
CAND12 = [1] * 10 + [0, 0]  # tokens 10, 11 have empty windows: never anchors, even with FAI 0.95
# anchors: ceil(0.4 * 12) = 5 largest FAI among candidates: t3 .9, t8 .8, t6 .6, t1 .5, t7 .4
# tau_waad = median(0,1,1,1,2,2,2,4,4,5,5,6) = (2 + 2) / 2 = 2; tau_Delta = median(0,0,1,2,2,3,3,3,3,4,4,5) = 3
# t1: w 1 <= 2, window {t0: 4} >= 3 -> dominated, introducer t0
# t3: w 2 <= 2, window {t2: 2, t1: 3}, max 3 >= 3 -> dominated, introducer t1
# t6: w 1 <= 2, window {t5: 5, t4: 4} -> dominated, introducer t5
# t7: w 4 > 2 -> plain anchor (+0.5); it is also the introducer of t8 (+0.25): 1.75, the maximum
# t8: w 1 <= 2, window {t7: 3, t6: 3} tie -> nearest t7; dominated
# gamma: dominated +0.25, introducers (t0, t1, t5, t7) +0.25, plain anchors +0.5
GAMMA12 = [1.25, 1.5, 1.0, 1.25, 1.0, 1.25, 1.25, 1.75, 1.25, 1.0, 1.0, 1.0]


def test_gamma_hand_built_12_tokens():
    w, f = torch.tensor([W12]), torch.tensor([FAI12])
    mask, cand = torch.ones(1, 12, dtype=torch.bool), torch.tensor([CAND12]).bool()
    delta = ac.deltas(w, mask)
    assert delta.tolist() == [[4, 3, 2, 0, 4, 5, 3, 3, 1, 2, 3, 0]]
    gamma, parts = ac.gamma_coupled(w, delta, f, cand, mask, q=0.4, k=2, alpha=0.5, amp=1.5)
    assert gamma.tolist() == [GAMMA12]
    assert parts["anchor"][0].nonzero().flatten().tolist() == [1, 3, 6, 7, 8]
    assert parts["dominated"][0].nonzero().flatten().tolist() == [1, 3, 6, 8]
    assert parts["intro"][0].nonzero().flatten().tolist() == [0, 1, 5, 7]
    # local: top 5 Delta = t5 (5), t0, t4 (4), then the 3s by index: t1, t6
    assert ac.gamma_local(delta, mask, 0.4, 1.5).tolist() == [[1.5 if t in (0, 1, 4, 5, 6) else 1.0 for t in range(12)]]
    assert ac.gamma_global(f, cand, mask, 0.4, 1.5).tolist() == [
        [1.5 if t in (1, 3, 6, 7, 8) else 1.0 for t in range(12)]
    ]


def test_gamma_padding_never_enters():
    """Garbage (NaN, huge values) at padded positions changes neither the quantiles nor the weights."""
    pad = 4
    w = torch.tensor([W12 + [1e9, float("nan"), -1e9, 0.0]])
    f = torch.tensor([FAI12 + [1e9, float("nan"), 5.0, 5.0]])
    mask = torch.tensor([[1] * 12 + [0] * pad]).bool()
    cand = torch.tensor([CAND12 + [1] * pad]).bool() & mask
    delta = ac.deltas(w, mask)
    assert delta[0, :12].tolist() == [4, 3, 2, 0, 4, 5, 3, 3, 1, 2, 3, 0] and delta[0, 12:].abs().sum() == 0
    gamma, _ = ac.gamma_coupled(w, delta, f, cand, mask, q=0.4, k=2, alpha=0.5, amp=1.5)
    assert gamma.tolist() == [GAMMA12 + [1.0] * pad]


def test_gamma_introducer_counts_once_and_window_stays_in_response():
    mask = torch.ones(1, 6, dtype=torch.bool)
    w = torch.zeros(1, 6)  # every WAAD <= its median 0
    delta = torch.tensor([[0.0, 9, 0, 0, 0, 0]])  # median 0
    f = torch.tensor([[6.0, 0, 5, 4, 0, 0]])  # anchors (ceil(0.5 * 6) = 3): t0, t2, t3
    gamma, parts = ac.gamma_coupled(w, delta, f, mask, mask, q=0.5, k=2, alpha=0.5, amp=1.5)
    # t0 has no earlier response token: plain anchor 1.5; t2 and t3 are dominated, both introduced by t1 (once)
    assert gamma.tolist() == [[1.5, 1.25, 1.25, 1.25, 1.0, 1.0]]
    gamma, _ = ac.gamma_coupled(w, delta, f, mask, mask, q=0.5, k=2, alpha=1.0, amp=1.5)  # alpha 1: all to t1
    assert gamma.tolist() == [[1.5, 1.5, 1.0, 1.0, 1.0, 1.0]]


def test_gamma_coupled_bound_on_random_inputs():
    """Additive terms: every gamma is 1 + 0.25 * {0, 1, 2, 3} and never above 1 + b + alpha b = 1.75."""
    g = torch.Generator().manual_seed(0)
    w, f = torch.rand(200, 30, generator=g) * 10, torch.rand(200, 30, generator=g)
    mask = torch.arange(30)[None] < torch.randint(1, 31, (200, 1), generator=g)  # [200, 30] random lengths
    gamma, parts = ac.gamma_coupled(w, ac.deltas(w, mask), f, mask, mask, q=0.4, k=3, alpha=0.5, amp=1.5)
    assert set(((gamma - 1) / 0.25).round().unique().tolist()) <= {0, 1, 2, 3} and gamma.max() <= 1.75
    assert (gamma == 1.75).any()  # the bound is reached: an undominated anchor that also introduces
    assert torch.equal(parts["anchor"].sum(1), torch.ceil(0.4 * mask.sum(1) - 1e-9).long())  # TopQ count


# ------------------------------------------------------------------------------------------------
# the attention pass on a tiny model


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    tok = tasks.make_tokenizer()
    model = tasks.make_tiny_model(tok, **{**dict(ac.MODEL), "hidden_size": 32, "intermediate_size": 64}).eval()
    return model, tok


def make_batch(tok, prompts, responses, extra_left=0, extra_right=0):
    """Left-padded prompts and right-padded responses, built by hand (varying lengths on both sides)."""
    P = max(map(len, prompts)) + 1 + extra_left
    R = max(map(len, responses)) + 1 + extra_right
    ids = torch.full((len(prompts), P + R), tok.pad_token_id)
    attention_mask = torch.zeros(len(prompts), P + R, dtype=torch.long)
    rm = torch.zeros(len(prompts), R, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        pi = [tok.bos_token_id] + tok(p, add_special_tokens=False).input_ids
        ri = tok(r, add_special_tokens=False).input_ids + [tok.eos_token_id]
        ids[i, P - len(pi) : P], ids[i, P : P + len(ri)] = torch.tensor(pi), torch.tensor(ri)
        attention_mask[i, P - len(pi) : P + len(ri)], rm[i, : len(ri)] = 1, 1
    return ids, attention_mask, rm


PROMPTS = ["12+34+56+78+90=", "1+2=", "555>", "s123456>"]
RESPONSES = [
    "012+34=046,046+56=102,102+78=180,180+90=270",
    "003 and then some more words",
    "x" * 40,
    "1 2 3 4 5 6 7 8 9",
]


def test_hooks_match_output_attentions(tiny):
    """Per-head WAAD / FAI / spans from the hooks equal those from the model's own output_attentions."""
    model, tok = tiny
    ids, attention_mask, rm = make_batch(tok, PROMPTS, RESPONSES)
    st = ac.attention_stats(model, ids, attention_mask, rm, micro_batch=3)
    assert model.config._attn_implementation == "sdpa"  # restored after the pass
    model.set_attn_implementation("eager")
    pos = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        maps = model(input_ids=ids, attention_mask=attention_mask, position_ids=pos, output_attentions=True).attentions
    model.set_attn_implementation("sdpa")
    assert len(maps) == model.config.num_hidden_layers
    N, R = ids.shape[1], rm.shape[1]
    rows = torch.cat([torch.zeros_like(attention_mask[:, : N - R]), rm], 1).bool()
    A = torch.cat([maps[layer] for layer in st["layers"]], 1).float()  # [B, nH, N, N]
    A = A.masked_fill(~attention_mask.bool()[:, None, None, :], 0).masked_fill(~rows[:, None, :, None], 0)
    assert torch.allclose(st["waad"], ac.waad(A)[..., N - R :], atol=1e-5)
    assert torch.allclose(st["fai"], ac.fai(A, rows)[0][..., N - R :], atol=1e-6)
    assert torch.allclose(st["spans"], ac.head_spans(A, rows), atol=1e-5)


def test_padding_never_enters_maps(tiny):
    """Extra left / right padding and junk ids under the padding leave WAAD, FAI, spans and gamma unchanged."""
    model, tok = tiny
    ids, attention_mask, rm = make_batch(tok, PROMPTS, RESPONSES)
    ref = ac.compute_credit(model, ids, attention_mask, rm, micro_batch=4)
    ids2, attention_mask2, rm2 = make_batch(tok, PROMPTS, RESPONSES, extra_left=3, extra_right=5)
    ids2 = torch.where(attention_mask2.bool(), ids2, torch.randint(4, len(tok), ids2.shape))  # junk under padding
    got = ac.compute_credit(model, ids2, attention_mask2, rm2, micro_batch=3)
    R = rm.shape[1]
    assert torch.allclose(got["spans"], ref["spans"], atol=1e-5)
    for key in ("waad", "fai", "delta"):
        assert torch.allclose(got[key][:, :R], ref[key], atol=1e-5) and got[key][:, R:].abs().sum() == 0
    assert torch.equal(got["gamma"][:, :R], ref["gamma"]) and torch.equal(got["gamma"][:, R:], torch.ones(4, 5))
    assert got["local"].tolist() == ref["local"].tolist() and got["global"].tolist() == ref["global"].tolist()


def test_token_weights_metrics_and_bound(tiny):
    model, tok = tiny
    ids, attention_mask, rm = make_batch(tok, PROMPTS, RESPONSES)
    for mode in ("local", "global", "coupled"):
        g, m = ac.token_weights(model, ids, attention_mask, rm, mode=mode, micro_batch=2)
        assert g.shape == rm.shape and not g.requires_grad
        assert g.min() >= 1 and g.max() <= 1.75 and torch.equal(g[rm == 0], torch.ones(int((rm == 0).sum())))
        assert abs(m["stats/credit_amplified_frac"] - float((g[rm.bool()] > 1).float().mean())) < 1e-6
        assert m["time/credit"] > 0
    g1, _ = ac.token_weights(model, ids, attention_mask, rm, amp=1.0)
    assert torch.equal(g1, torch.ones_like(g1))


def test_maps_inside_the_recompute_equal_a_pass_of_their_own(tiny, monkeypatch):
    """The trainer's path: the maps of the kept layers are taken inside its recompute of old_logprobs (the model's
    own sdpa attention everywhere else), so the logprobs are bit for bit those without credit, the maps those of an
    eager pass of their own within fp32 rounding (its earlier layers ran eager), gamma the same."""
    model, tok = tiny
    ids, attention_mask, rm = make_batch(tok, PROMPTS, RESPONSES)
    R, cfg = rm.shape[1], trainer.Config(credit="attention", credit_mode="global")
    recompute = lambda: sequence_logprobs(model, ids, attention_mask, R, micro_batch=3)[0]  # noqa: E731
    with torch.no_grad():
        plain = recompute()
        logp, gamma, metrics = ac.credit_weights(cfg, model, ids, attention_mask, rm, 3, recompute)
    assert torch.equal(logp, plain) and model.config._attn_implementation == "sdpa"
    inside = ac.attention_stats(model, ids, attention_mask, rm, micro_batch=3, forward=recompute)
    own = ac.attention_stats(model, ids, attention_mask, rm, micro_batch=3)
    for key in ("waad", "fai", "spans"):
        assert torch.allclose(inside[key], own[key], atol=1e-5, rtol=1e-5), key
    own_gamma, _ = ac.token_weights(model, ids, attention_mask, rm, mode="global", micro_batch=3)
    assert torch.equal(gamma, own_gamma) and metrics["time/credit"] >= metrics["time/credit_maps"] > 0
    with pytest.raises(RuntimeError, match="every row once"):  # a forward that skips rows is refused
        ac.attention_stats(model, ids, attention_mask, rm, micro_batch=3, forward=lambda: model(input_ids=ids[:2]))
    assert model.config._attn_implementation == "sdpa"
    assert not any(hasattr(m, "_minrl_maps") for m, _ in ac.attention_modules(model))  # also after the error
    # a model the inside path cannot serve takes the eager pass of its own, then the forward on its own attention
    # again (here the sdpa model with maps_inside said no: its logprobs are sdpa's, bit for bit)
    monkeypatch.setattr(ac, "maps_inside", lambda m: False)
    with torch.no_grad():
        logp_e, gamma_e, metrics_e = ac.credit_weights(cfg, model, ids, attention_mask, rm, 3, recompute)
    assert torch.equal(logp_e, plain) and model.config._attn_implementation == "sdpa"
    assert torch.equal(gamma_e, own_gamma) and metrics_e["time/credit_maps"] == 0.0


def test_which_models_take_the_maps_inside_their_forward(tiny):
    """sdpa with full attention only; eager, a sliding window (Mistral: no layer_types) or soft-capping do not."""
    from transformers import MistralConfig, MistralForCausalLM

    model, _ = tiny
    assert ac.maps_inside(model)
    small = dict(vocab_size=60, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, attn_implementation="sdpa")  # fmt: skip
    assert not ac.maps_inside(MistralForCausalLM(MistralConfig(**small, sliding_window=16)))
    assert ac.maps_inside(MistralForCausalLM(MistralConfig(**small, sliding_window=None)))
    eager = MistralForCausalLM(MistralConfig(**{**small, "attn_implementation": "eager"}, sliding_window=None))
    assert not ac.maps_inside(eager)


def test_model_without_maps_names_its_class():
    class NoMaps(torch.nn.Module):
        config = None

    with pytest.raises(TypeError, match="NoMaps"):
        ac.attention_modules(NoMaps())


def test_pass_restores_attention_implementation_on_error(tiny):
    model, tok = tiny
    ids, attention_mask, rm = make_batch(tok, PROMPTS, RESPONSES)

    def boom(sl, j, A):
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        ac.run_with_maps(model, ids, attention_mask, [2, 3], boom)
    assert model.config._attn_implementation == "sdpa"


# ------------------------------------------------------------------------------------------------
# the shaped loss


def loss_and_grads(model, ids, attention_mask, rm, adv, old, token_weights):
    model.zero_grad(set_to_none=True)
    logp, _ = sequence_logprobs(model, ids, attention_mask, rm.shape[1])
    shaped = adv if token_weights is None else adv * token_weights  # gamma_t A_t, as the trainer's update shapes it
    loss, _ = offpolicy.policy_loss(logp, old, shaped, rm.float())
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def test_amp_one_reproduces_grpo_exactly(tiny):
    model, tok = tiny
    ids, attention_mask, rm = make_batch(tok, PROMPTS, RESPONSES)
    adv = torch.tensor([1.0, -0.5, 0.3, -1.2])[:, None] * rm  # [B, R] group advantages
    with torch.no_grad():
        old = sequence_logprobs(model, ids, attention_mask, rm.shape[1])[0] + 0.05 * torch.randn(rm.shape)
    g, _ = ac.token_weights(model, ids, attention_mask, rm, amp=1.0)
    l0, g0 = loss_and_grads(model, ids, attention_mask, rm, adv, old, None)
    l1, g1 = loss_and_grads(model, ids, attention_mask, rm, adv, old, g)
    assert torch.equal(l0, l1) and all(torch.equal(a, b) for a, b in zip(g0, g1))


def test_constant_gamma_scales_gradient(tiny):
    model, tok = tiny
    ids, attention_mask, rm = make_batch(tok, PROMPTS, RESPONSES)
    adv = torch.tensor([1.0, -0.5, 0.3, -1.2])[:, None] * rm
    with torch.no_grad():
        old = sequence_logprobs(model, ids, attention_mask, rm.shape[1])[0] + 0.3 * torch.randn(rm.shape)  # clips
    c = 1.5
    l0, g0 = loss_and_grads(model, ids, attention_mask, rm, adv, old, None)
    l1, g1 = loss_and_grads(model, ids, attention_mask, rm, adv, old, torch.full(rm.shape, c))
    assert torch.allclose(l1, c * l0, rtol=1e-6)
    for a, b in zip(g0, g1):  # equal up to fp32 rounding, relative to each tensor's scale
        assert (b - c * a).abs().max() <= 1e-5 * (c * a).abs().max() + 1e-12


# ------------------------------------------------------------------------------------------------
# the method acts inside a training run


def test_training_run_amplifies_and_fai_positive(tmp_path):
    tok = tasks.make_tokenizer()
    torch.manual_seed(0)
    model = tasks.make_tiny_model(tok, **{**dict(ac.MODEL), "hidden_size": 32, "intermediate_size": 64})
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    rows = []
    cfg = trainer.Config(model=str(tmp_path / "m"), task="chain", adv_estimator="grpo", credit="attention",
                             steps=3, prompts_per_step=4, group_size=4, max_new_tokens=48, eval_every=0,
                             warmup_steps=0, micro_batch=8, out_dir=str(tmp_path / "run"))  # fmt: skip
    trainer.train(cfg, hooks=[lambda step, m: rows.append(m)])
    assert len(rows) == 3
    for m in rows:
        assert 0.3 <= m["stats/credit_amplified_frac"] <= 0.5
        assert m["stats/fai_pos_frac"] > 0.5
        assert 1 < m["stats/credit_gamma_mean"] <= 1.75
        assert 0 < m["perf/credit_overhead"] < 1
        assert m["stats/credit_span_global"] > m["stats/credit_span_local"]


def test_chain_task_answers_are_long():
    task = tasks.make_task("chain")
    probs = task.sample(50, "train", np.random.default_rng(0))
    for p in probs:
        nums = [int(x) for x in p["prompt"][:-1].split("+")]
        steps = p["ground_truth"].split(",")
        assert len(p["ground_truth"]) >= 40 and len(steps) == 4
        assert int(steps[-1].split("=")[1]) == sum(nums)  # the last partial sum is the total
        assert task.compute_score(p["ground_truth"], p["ground_truth"]) == 1.0
    assert not any(tasks.is_eval_problem(p["prompt"]) for p in probs)
    assert math.isclose(task.compute_score(probs[0]["ground_truth"][:-1] + "x", probs[0]["ground_truth"]), 42 / 43)


def tiny_credit_model(path):
    """A random model of MODEL's shape (narrower), saved with the embedded tokenizer at `path`."""
    tok = tasks.make_tokenizer()
    torch.manual_seed(0)
    model = tasks.make_tiny_model(tok, **{**dict(ac.MODEL), "hidden_size": 32, "intermediate_size": 64})
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_main_shows_the_credit_of_one_batch(tmp_path, capsys):
    """`python attention_credit.py` on a random model: the head groups, the amplified share and the token figure."""
    c = ac.main(["--model", str(tiny_credit_model(tmp_path / "m")), "--prompts", "4", "--out-dir", str(tmp_path)])
    mask = c["response_mask"].bool()
    assert c["layers"] == [2, 3, 4] and len(c["local"]) == len(c["global"]) == math.ceil(0.3 * 24)
    assert 0.3 <= float(((c["gamma"] > 1) & mask).sum() / mask.sum()) <= 0.5  # q = 0.4 of each response
    assert (tmp_path / "tokens.png").stat().st_size > 0 and "amplified (gamma > 1)" in capsys.readouterr().out


def test_experiment_main_smoke(tmp_path, capsys):
    """`python experiments/credit.py` end to end at tiny flags on a random model: the table, results.json, curves and
    the token figure; the credit run reports its overhead and amplified share, the GRPO run none."""
    out = tmp_path / "exp"
    argv = f"--model {tiny_credit_model(tmp_path / 'm')} --steps 2 --eval-every 1 --eval-n 4 --out-dir {out}".split()
    credit.main([*argv, "--train-args", "--prompts-per-step 2 --group-size 2 --ppo-epochs 1"])
    res = json.loads((out / "results.json").read_text())
    assert [(r["method"], r["seed"]) for r in res["runs"]] == [("grpo", 0), ("coupled", 0)]
    grpo, coupled = res["runs"]
    assert [s for s, _ in grpo["eval"]] == [0, 1, 2] and all(0 <= a <= 1 for _, a in grpo["eval"])
    assert math.isnan(grpo["overhead"]) and 0 < coupled["overhead"] < 1 and 0.3 <= coupled["amplified"] <= 0.5
    assert (out / "curves.png").stat().st_size > 0 and (out / "tokens.png").stat().st_size > 0
    assert "final_acc" in capsys.readouterr().out


def test_full_runs_take_the_trainers_learning_recipe():
    """--full: 4 methods x 5 seeds, each run the trainer's default recipe (what trainer parses from run_argv) on
    chain with 48 new tokens; train_args win over it."""
    cfg = credit.Config(full=True)
    assert cfg.methods == list(credit.METHODS) and cfg.seeds == 5
    run = parse_config(trainer.Config, credit.run_argv(cfg, "coupled", 3, "M"))
    default = trainer.Config()
    assert (run.task, run.max_new_tokens, run.seed, run.adv_estimator, run.model) == ("chain", 48, 3, "grpo", "M")
    assert (run.credit, run.credit_mode) == ("attention", "coupled")
    assert trainer.Config(task="chain", max_new_tokens=48).credit == "none"
    for k in (
        "temperature",
        "lr",
        "lr_schedule",
        "ppo_epochs",
        "minibatches",
        "prompts_per_step",
        "group_size",
        "steps",
    ):
        assert getattr(run, k) == getattr(default, k), k
    grpo = parse_config(
        trainer.Config, credit.run_argv(credit.Config(full=True, train_args="--lr 1e-4 --steps 7"), "grpo", 0, "M")
    )
    assert (grpo.lr, grpo.steps, grpo.credit) == (1e-4, 7, "none")
    cd = parse_config(trainer.Config, credit.run_argv(credit.Config(full=True, task="countdown"), "local", 1, "M"))
    assert (cd.task, cd.max_new_tokens, cd.credit_mode) == ("countdown", 64, "local")
    with pytest.raises(ValueError, match="target_acc"):  # the default target is relative to GRPO's runs
        credit.Config(methods=["coupled"])
    with pytest.raises(ValueError, match="add --full"):  # --name names the result folder of --full runs
        credit.Config(name="pilot")
    with pytest.raises(ValueError, match="'name'"):
        credit.Config(full=True, name="../x")


def test_summarize_known_answer(tmp_path, capsys):
    """The table from a hand-written results.json: step 0 (the start model) counts for neither final nor best; sample
    std over seeds; steps to the target among the runs that reach it; the bootstrap row of the one pair."""
    nan = float("nan")
    runs = [
        {"method": "grpo", "seed": 0, "eval": [[0, 0.9], [10, 0.1], [20, 0.2]], "wall_s": 2.0, "overhead": nan,
         "amplified": nan},
        {"method": "grpo", "seed": 1, "eval": [[0, 0.9], [10, 0.4], [20, 0.0]], "wall_s": 4.0, "overhead": nan,
         "amplified": nan},
        {"method": "coupled", "seed": 0, "eval": [[0, 0.3], [10, 0.5], [20, 0.5]], "wall_s": 3.0, "overhead": 0.1,
         "amplified": 0.4},
        {"method": "coupled", "seed": 1, "eval": [[0, 0.3], [10, 0.3], [20, 0.5]], "wall_s": 3.0, "overhead": 0.1,
         "amplified": 0.4},
    ]  # fmt: skip
    path = tmp_path / "results.json"
    config = {"methods": ["grpo", "coupled"], "target_acc": 0.5}
    path.write_text(json.dumps({"config": config, "start_acc": 0.9, "runs": runs}))
    grpo, coupled = credit.summarize(path)
    # grpo finals 0.2, 0.0: mean 0.1, sample std sqrt(0.02) = 0.141; bests 0.2, 0.4: 0.3 +- 0.141
    assert grpo["final_acc"] == "0.100 ± 0.141" and grpo["best_acc"] == "0.300 ± 0.141"
    assert coupled["final_acc"] == "0.500 ± 0.000" and coupled["best_acc"] == "0.500 ± 0.000"
    assert grpo["steps_to_0.5"] == "- (0/2)"  # the start model (step 0) is at 0.9, but counts for nothing
    assert coupled["steps_to_0.5"] == "15 ± 7 (2/2)"  # steps 10 and 20
    assert grpo["wall_s"] == 3.0 and math.isnan(grpo["overhead"]) and coupled["amplified"] == 0.4
    out = capsys.readouterr().out
    assert "coupled - grpo" in out and "+0.400 [" in out  # finals 0.5 vs 0.1: each method against GRPO
    assert (tmp_path / "curves.png").stat().st_size > 0
    path.write_text(json.dumps({"config": {**config, "target_acc": None}, "start_acc": 0.9, "runs": runs}))
    grpo, coupled = credit.summarize(path)  # None: GRPO's mean final (0.1) minus 0.05
    assert grpo["steps_to_0.05"] == "10 ± 0 (2/2)" and coupled["steps_to_0.05"] == "10 ± 0 (2/2)"


def reachable(numbers: list[int]) -> set[int]:
    """Every value Countdown's rules reach using all of `numbers` (positive integer steps), by splitting the
    multiset in two in every way: an enumeration independent of tasks.countdown_solve's order of steps."""
    if len(numbers) == 1:
        return {numbers[0]}
    out = set()
    for mask in range(1, 2 ** len(numbers) - 1):
        left = [n for k, n in enumerate(numbers) if mask >> k & 1]
        right = [n for k, n in enumerate(numbers) if not mask >> k & 1]
        for x in reachable(left):
            for y in reachable(right):
                out |= {x + y, x * y} | ({x - y} if x > y else set()) | ({x // y} if x % y == 0 else set())
    return out


def test_countdown_solver_finds_a_solution_iff_one_exists():
    rng = np.random.default_rng(0)
    for _ in range(30):
        numbers = [int(x) for x in rng.integers(1, 13, size=int(rng.integers(2, 5)))]
        values = reachable(numbers)
        for target in range(1, 60):
            found = tasks.countdown_solve(numbers, target)
            assert (found is not None) == (target in values), (numbers, target, found)
            if found:
                assert rewards.countdown_score(found, f"{target}|{','.join(map(str, numbers))}") == 1.0


def test_countdown_problems_and_their_demonstrations():
    """Every problem is solvable and its demonstration is the solver's: steps that are right arithmetic on the
    numbers left, ending at the target, then an expression that scores 1. Responses average >= 40 tokens (byte
    tokenizer: a character each, + EOS), and the two splits are disjoint."""
    task = tasks.make_task("countdown")
    probs = task.sample(300, "train", np.random.default_rng(1))
    for p in probs:
        numbers, target = [int(x) for x in p["prompt"].split(">")[0].split()], int(p["prompt"][:-1].split(">")[1])
        assert p["ground_truth"] == f"{target}|{','.join(map(str, numbers))}" and 1 <= target <= task.max_target
        assert len(numbers) == task.n_numbers and all(1 <= n <= task.max_number for n in numbers)
        steps, expr = p["demonstration"].split(" => ")
        left = sorted(numbers)
        for step in steps.split(", "):
            a, op, b, c = re.fullmatch(r"(\d+)([-+*/])(\d+)=(\d+)", step).groups()
            a, b, c = int(a), int(b), int(c)
            assert c == {"+": a + b, "-": a - b, "*": a * b, "/": a / b}[op] and c > 0
            left.remove(a), left.remove(b), left.append(c)
        assert left == [target] and rewards.arithmetic_value(expr) == target
        assert task.compute_score(p["demonstration"], p["ground_truth"]) == 1.0
    assert np.mean([len(p["demonstration"]) + 1 for p in probs]) >= 40
    held = task.sample(50, "eval", np.random.default_rng(1))
    for split, ps in (("train", probs), ("eval", held)):  # the split hashes the multiset: reorderings share it
        for p in ps:
            numbers, target = [int(x) for x in p["prompt"].split(">")[0].split()], int(p["prompt"][:-1].split(">")[1])
            keys = {task.key(list(q), target) for q in itertools.permutations(numbers)}
            assert len(keys) == 1 and tasks.is_eval_problem(keys.pop()) == (split == "eval")
    with pytest.raises(ValueError, match="n_numbers"):
        tasks.CountdownTask(n_numbers=0)


@pytest.mark.parametrize(
    "response, score",
    [
        ("25-5=20, 20*4=80, 80+3=83 => (25-5)*4+3", 1.0),  # the steps are not scored, the expression is
        ("anything => 3+(25-5)*4", 1.0),
        ("=> (25-5)*4+3 ", 1.0),
        ("=> 25-5*4+3", 0.1),  # every number once, the wrong value: the format bonus
        ("=> (25-5)*4", 0.1),  # a number left out
        ("=> (25-5)*4+3+3", 0.1),  # a number used twice
        ("=> (25-5)*4+3.0", 0.1),  # not an integer expression
        ("=> (25-5)/(4-4)+3", 0.1),
        ("=> 25**5+4+3", 0.1),  # no powers, and never evaluated by Python
        ("=> __import__('os').system('true')", 0.1),
        ("25-5=20, 20*4=80, 80+3=83", 0.0),  # no "=>": no answer
        ("=>   ", 0.0),
    ],
)
def test_countdown_score_known_answers(response, score):
    assert rewards.countdown_score(response, "83|25,5,4,3") == score


def test_arithmetic_value_known_answers_and_refusals():
    """Exact values in Fractions; anything but integers, + - * / and parentheses is None, never evaluated."""
    assert rewards.arithmetic_value("7/2") == Fraction(7, 2) and rewards.arithmetic_value("(25-5)*4+3") == 83
    assert rewards.arithmetic_value(" 2 * (3 + 4) ") == 14
    for expr in ("__import__('os')", "2**3", "1//1", "-5", "05", "1/0", "1+", "1e3", "١+1", "1" * 201, "(" * 150):
        assert rewards.arithmetic_value(expr) is None, expr
    long_digits = "=> " + "9" * 5000  # more digits than int() takes: the reward is the format score, not an error
    assert rewards.countdown_score(long_digits, "83|25,5,4,3") == 0.1
