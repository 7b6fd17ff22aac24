"""AsyPPO mini-critics (critics.py, docs/design.md 5.2): equivalences, properties, and a learning run.

Expected numbers are derived by hand in comments or recomputed independently (numpy), never by the code
under test. Trainings are tiny and seeded; nothing here is timed.
"""

import contextlib
import gc
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn as nn
from batches import full_batch
from calibrated import REVERSE_T1

import critics
import offpolicy
import ppo_math
import trainer
from rollout import sequence_logprobs
from runlog import read_jsonl
from tasks import make_tiny_model, make_tokenizer

F64 = torch.float64


def ragged_mask(B: int, R: int, seed: int) -> torch.Tensor:
    """[B, R] right-padded 0/1 mask with random lengths in 0..R (row 0 always full, row 1 always empty)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, R + 1, (B,), generator=g)
    lengths[0], lengths[1] = R, 0
    return (torch.arange(R) < lengths[:, None]).to(F64)


# ----------------------------------------------------------------------------------------------
# GAE on the ensemble mean


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.9, 0.95), (0.99, 0.0), (0.5, 0.7)])
def test_gae_of_mean_value_is_mean_of_gae(gamma, lam):
    # GAE is linear in V, so GAE(mean_m V_m) == mean_m GAE(V_m) for advantages and returns (docs/design.md 5.2)
    g = torch.Generator().manual_seed(1)
    M, B, R = 3, 5, 9
    values = torch.randn(M, B, R, generator=g, dtype=F64)
    rewards = torch.randn(B, R, generator=g, dtype=F64)
    mask = ragged_mask(B, R, 2)
    mask[2, 3] = 0.0  # a hole in the middle (an observation token) passes values through
    adv_bar, ret_bar = ppo_math.gae(rewards, values.mean(0), mask, gamma, lam)
    per = [ppo_math.gae(rewards, v, mask, gamma, lam) for v in values]
    assert torch.allclose(adv_bar, torch.stack([a for a, _ in per]).mean(0), atol=1e-12)
    assert torch.allclose(ret_bar, torch.stack([r for _, r in per]).mean(0), atol=1e-12)


# ----------------------------------------------------------------------------------------------
# Partition of each group's responses


@pytest.mark.parametrize("M", [1, 2, 4])
def test_partition_properties(M):
    G, n_groups = 8, 5
    g = torch.Generator().manual_seed(0)
    group_ids = torch.arange(n_groups).repeat(G)[torch.randperm(G * n_groups, generator=g)]  # [B] interleaved
    gen = torch.Generator().manual_seed(7)
    state = gen.get_state()
    shares = critics.partition_shares(group_ids, M, gen)  # [B, M]
    assert shares.shape == (G * n_groups, M) and shares.dtype == torch.bool
    assert (shares.sum(1) == 1).all()  # disjoint and complete: every response in exactly one share
    for grp in range(n_groups):
        counts = shares[group_ids == grp].sum(0)  # [M] responses of this prompt in each share
        assert counts.tolist() == [G // M] * M  # G/M of every prompt in every share
    if M == 1:
        assert torch.equal(gen.get_state(), state)  # M = 1 draws nothing from its generator
    else:
        again = critics.partition_shares(group_ids, M, torch.Generator().manual_seed(7))
        other = critics.partition_shares(group_ids, M, torch.Generator().manual_seed(8))
        assert torch.equal(shares, again)  # seeded
        assert not torch.equal(shares, other)  # and a real shuffle


def test_partition_group_size_not_divisible_is_an_error():
    with pytest.raises(ValueError, match="not divisible by 2"):
        critics.partition_shares(torch.tensor([0, 0, 0, 1, 1, 1]), 2, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="group_size"):
        trainer.Config(critic="asyppo", n_critics=3, group_size=16)


# ----------------------------------------------------------------------------------------------
# sigma and the two masks


def test_masks_known_answer_two_critics():
    # V_1 = 0, V_2 = (2, 4, 6, 8, 10, pad): sigma = |V_1 - V_2| / 2 (population std) = (1, 2, 3, 4, 5)
    # n = 5, k = h = 0.2: the round(0.2 * 5) = 1 lowest (token 0) loses the PPO term, the round(0.2 * 5) = 1
    # highest (token 4) the entropy bonus; the pad column is never selected
    values = torch.tensor([[[0.0, 0, 0, 0, 0, 0]], [[2.0, 4, 6, 8, 10, 99]]])  # [2, 1, 6]
    mask = torch.tensor([[1, 1, 1, 1, 1, 0]])
    pg, ent, m = critics.asyppo_masks(values, mask, 0.2, 0.2)
    assert pg.tolist() == [[0, 1, 1, 1, 1, 0]]
    assert ent.tolist() == [[1, 1, 1, 1, 0, 0]]
    assert m["stats/sigma_mean"] == pytest.approx(3.0)  # (1 + 2 + 3 + 4 + 5) / 5
    assert m["stats/sigma_max"] == pytest.approx(5.0)
    assert m["stats/asyppo_pg_masked_frac"] == pytest.approx(0.2)
    assert m["stats/asyppo_ent_filtered_frac"] == pytest.approx(0.2)


@pytest.mark.parametrize("k,h", [(0.2, 0.2), (0.1, 0.3), (0.5, 0.5), (0.0, 0.0), (1.0, 0.0), (0.35, 0.0)])
def test_masked_fractions_equal_quantiles_on_distinct_sigma(k, h):
    g = torch.Generator().manual_seed(3)
    M, B, R = 3, 7, 11
    values = torch.randn(M, B, R, generator=g, dtype=F64)
    mask = ragged_mask(B, R, 4).long()
    pg, ent, m = critics.asyppo_masks(values, mask, k, h)
    valid = mask.bool()
    n = int(valid.sum())
    sigma = torch.from_numpy(np.std(values.numpy(), axis=0))  # [B, R] independent population std
    low, top = valid & (pg == 0), valid & (ent == 0)
    assert not ((pg | ent).bool() & ~valid).any()  # padding is never kept, selected or counted
    assert int(low.sum()) == round(k * n)  # count rule of critics.py detail 7
    assert int(top.sum()) == min(round(h * n), n - round(k * n))  # the highest, minus a rounding overlap
    if low.any() and (valid & ~low).any():  # the masked tokens are the lowest-sigma ones
        assert sigma[low].max() < sigma[valid & ~low].min()
    if top.any() and (valid & ~top).any():  # the filtered tokens are the highest-sigma ones
        assert sigma[top].min() > sigma[valid & ~top].max()
    assert not (low & top).any()  # k + h <= 1: no token loses both terms
    assert m["stats/asyppo_pg_masked_frac"] == pytest.approx(int(low.sum()) / n)
    assert m["stats/asyppo_ent_filtered_frac"] == pytest.approx(int(top.sum()) / n)
    assert m["stats/sigma_mean"] == pytest.approx(float(sigma[valid].mean()), rel=1e-6)


def test_identical_critics_mask_nothing():
    # before their first step both critics are one backbone with a zero head: sigma = 0 everywhere, no spread,
    # so no token is "lowest" and none loses a term (the old index tie-break dropped the first 20 % by position)
    v = torch.randn(1, 4, 10, generator=torch.Generator().manual_seed(5))
    values = v.expand(2, 4, 10).clone()  # [2, B, R] two identical critics
    mask = ragged_mask(4, 10, 6).long()
    pg, ent, m = critics.asyppo_masks(values, mask, 0.2, 0.2)
    assert m["stats/sigma_mean"] == 0.0 and m["stats/sigma_max"] == 0.0
    assert torch.equal(pg, mask) and torch.equal(ent, mask)
    assert m["stats/asyppo_pg_masked_frac"] == 0.0 and m["stats/asyppo_ent_filtered_frac"] == 0.0


def test_ties_at_the_cut_are_broken_at_random_not_by_position():
    # 10 tokens tie at the lowest sigma, 5 at the start of the row and 5 at its end; k n = 5 of them lose the PPO
    # term. The samples of one group share their prompt's states, so such ties are common. Every draw takes
    # exactly 5; over seeds the early and the late ones are taken equally often (the index order took the early).
    R = 40
    spread = torch.linspace(1.0, 2.0, R - 10)
    sigma = torch.cat([torch.full((5,), 0.1), spread, torch.full((5,), 0.1)])[None]  # [1, R]
    values = torch.stack([sigma, -sigma])  # [2, 1, R]: population std over the two critics = sigma
    mask = torch.ones(1, R)
    early = 0
    for seed in range(200):
        pg, ent, m = critics.asyppo_masks(values, mask, 5 / R, 0.1, torch.Generator().manual_seed(seed))
        dropped = (pg == 0)[0]
        assert int(dropped.sum()) == 5 and dropped[5:-5].sum() == 0  # only tied tokens, exactly k n of them
        assert int((ent == 0).sum()) == 4 and (ent == 0)[0, -9:-5].all()  # the 4 highest sigma: no tie there
        early += int(dropped[:5].sum())
    assert abs(early / (200 * 5) - 0.5) < 0.06, f"early tied tokens dropped {early / 1000:.2f} of the time"


def test_masks_respect_the_sigma_order_under_ties():
    # coarse values (as bf16 rounding makes them) tie often: the counts stay exact and the order of sigma holds
    g = torch.Generator().manual_seed(11)
    values = torch.randint(0, 5, (2, 16, 12), generator=g) * 0.25  # [M, B, R]: sigma takes 5 values
    mask = ragged_mask(16, 12, 12).long()
    sigma = values.std(0, correction=0)
    valid, n = mask.bool(), int(mask.sum())
    assert sigma[valid].unique().numel() <= 5 < n  # ties everywhere: the check is not vacuous
    pg, ent, _ = critics.asyppo_masks(values, mask, 0.2, 0.2, g)
    low, top = valid & (pg == 0), valid & (ent == 0)
    assert int(low.sum()) == round(0.2 * n) and int(top.sum()) == round(0.2 * n) and not (low & top).any()
    assert sigma[low].max() <= sigma[valid & ~low].min() and sigma[top].min() >= sigma[valid & ~top].max()


def test_value_head_is_fp32_under_bf16_autocast():
    # sigma from fp32 values: the head runs outside autocast, so values are not rounded to bf16 (ties)
    torch.manual_seed(0)
    tok = make_tokenizer()
    vm = critics.make_value_model(make_tiny_model(tok).eval())
    torch.nn.init.normal_(vm.head.weight, std=0.1)
    ids, attention_mask = torch.randint(4, len(tok), (3, 9)), torch.ones(3, 9, dtype=torch.long)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        v = vm(ids, attention_mask, 5)
    assert v.dtype == torch.float32
    assert (v.bfloat16().float() != v).float().mean() > 0.5  # not bf16 values in an fp32 tensor


def test_a_bf16_critic_checkpoint_loads_and_trains_in_fp32(tmp_path):
    # --critic-model with a checkpoint stored in bf16: loaded as stored, the fp32 head met bf16 activations
    # (a crash), and a bf16 backbone under AdamW would lose its small steps
    tok = make_tokenizer()
    model = make_tiny_model(tok).to(torch.bfloat16)
    model.save_pretrained(tmp_path / "bf16")
    tok.save_pretrained(tmp_path / "bf16")
    vm = critics.make_value_model(make_tiny_model(tok), str(tmp_path / "bf16"), tok)
    assert {p.dtype for p in vm.parameters()} == {torch.float32}
    ids, attention_mask = torch.randint(4, len(tok), (2, 7)), torch.ones(2, 7, dtype=torch.long)
    assert vm(ids, attention_mask, 3).dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):  # as critic_footprint and the trainer under --dtype bfloat16
        assert vm(ids, attention_mask, 3).shape == (2, 3)


def test_critic_trains_in_the_precision_of_its_old_values(monkeypatch):
    # old_values come from critics.values under the trainer's autocast; the critic's own forward in
    # critic_update must run in the same precision, or the clip is centred off at the very first micro-batch
    torch.manual_seed(0)
    tok = make_tokenizer()
    policy = make_tiny_model(tok).eval()
    vm = critics.make_value_model(policy)
    torch.nn.init.normal_(vm.head.weight, std=0.1)
    crit = critics.Critics([vm], lr=1e-3, adam_eps=1e-8)
    B, P, R = 4, 5, 6
    ids, attention_mask = torch.randint(4, len(tok), (B, P + R)), torch.ones(B, P + R, dtype=torch.long)
    autocast = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731
    with autocast():
        old = crit.values(ids, attention_mask, R, micro_batch=B)  # [1, B, R]
    seen = []
    real = ppo_math.value_loss
    monkeypatch.setattr(
        ppo_math, "value_loss", lambda v, o, *a, **k: (seen.append((v - o).abs().max()), real(v, o, *a, **k))[1]
    )
    mask = torch.ones(B, R)
    batch = full_batch(input_ids=ids, attention_mask=attention_mask, response_mask=mask, old_logprobs=torch.zeros(B, R),
                       ref_logprobs=torch.zeros(B, R), advantages=torch.zeros(B, R), old_values=old.transpose(0, 1),
                       critic_returns=old.transpose(0, 1) + 1.0, shares=torch.ones(B, 1, dtype=torch.bool))  # fmt: skip
    trainer.critic_update(trainer.Config(micro_batch=B), crit, batch, 1, autocast)
    gap = float(seen[0].detach())
    assert gap < 1e-6, f"the critic's first forward is {gap:.2e} away from its old values"


def test_single_critic_sigma_is_zero_not_nan():
    values = torch.randn(1, 3, 5, dtype=F64)
    mask = torch.ones(3, 5)
    pg, ent, m = critics.asyppo_masks(values, mask, 0.0, 0.0)
    assert m["stats/sigma_mean"] == 0.0 and np.isfinite(m["stats/sigma_rel"])
    assert torch.equal(pg, mask) and torch.equal(ent, mask)  # k = h = 0: the plain PPO masks


def _masks_on_rank(rank: int, world: int, init_file: str, values, mask, out_dir: str) -> None:
    """One rank of the DDP test: this rank's half of the rows, quantiles over the whole (global) batch."""
    import os

    import common

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    common.setup_dist(timeout_s=60, device="cpu", init_method=f"file://{init_file}")
    rows = slice(rank * values.shape[1] // world, (rank + 1) * values.shape[1] // world)
    torch.save(critics.asyppo_masks(values[:, rows], mask[rows], 0.2, 0.3), f"{out_dir}/rank{rank}.pt")
    torch.distributed.destroy_process_group()


def test_masks_under_ddp_equal_the_single_process_masks(tmp_path):
    # quantiles are global (docs/design.md 5.2): 2 ranks x half the rows == 1 process x all rows
    import torch.multiprocessing as mp

    values = torch.randn(2, 8, 9, generator=torch.Generator().manual_seed(9), dtype=F64)  # [M, B, R]
    mask = ragged_mask(8, 9, 10).long()  # ragged: the two halves hold different numbers of valid tokens
    mp.spawn(_masks_on_rank, args=(2, str(tmp_path / "init"), values, mask, str(tmp_path)), nprocs=2)
    parts = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    pg, ent, m = critics.asyppo_masks(values, mask, 0.2, 0.3)
    assert torch.equal(torch.cat([p[0] for p in parts]), pg) and torch.equal(torch.cat([p[1] for p in parts]), ent)
    for key in ("stats/sigma_mean", "stats/asyppo_pg_masked_frac", "stats/asyppo_ent_filtered_frac"):
        assert parts[0][2][key] == pytest.approx(m[key]) and parts[1][2][key] == pytest.approx(m[key])


# ----------------------------------------------------------------------------------------------
# The loss: normaliser and gradient isolation, through trainer.ppo_update


def test_policy_loss_pg_mask_keeps_the_valid_token_denominator():
    # ratio 1 (logp == old): per-token loss -A. Row 0: A = (1, 2, 3, 4), mask (1, 1, 1, 0), pg_mask (1, 0, 1, 0)
    # token-mean: -(1 + 3) / 3 valid tokens = -4/3 (not / 2 kept tokens)
    # seq-mean-token-mean with row 1: A = (5, 5, 5, 5), mask (1, 1, 0, 0), pg_mask (0, 1, 0, 0):
    # row 0 -> -4/3, row 1 -> -5/2; mean over 2 rows = -(4/3 + 5/2) / 2 = -23/12
    adv = torch.tensor([[1.0, 2, 3, 4], [5, 5, 5, 5]], dtype=F64)
    mask = torch.tensor([[1.0, 1, 1, 0], [1, 1, 0, 0]], dtype=F64)
    pg_mask = torch.tensor([[1.0, 0, 1, 0], [0, 1, 0, 0]], dtype=F64)
    logp = torch.zeros(2, 4, dtype=F64)
    tok, _ = offpolicy.policy_loss(logp[:1], logp[:1], adv[:1], mask[:1], pg_mask=pg_mask[:1], agg="token-mean")
    seq, _ = offpolicy.policy_loss(logp, logp, adv, mask, pg_mask=pg_mask, agg="seq-mean-token-mean")
    assert float(tok) == pytest.approx(-4 / 3)
    assert float(seq) == pytest.approx(-23 / 12)


class LogitTable(nn.Module):
    """A toy policy whose logits are parameters: a row reads table[row id], the id being its first token."""

    def __init__(self, B: int, T: int, V: int, seed: int = 0):
        super().__init__()
        self.table = nn.Parameter(torch.randn(B, T, V, generator=torch.Generator().manual_seed(seed)))

    def forward(self, input_ids, **kwargs):
        return SimpleNamespace(logits=self.table[input_ids[:, 0]])  # [b, T, V]


B, P, R, V = 6, 3, 5, 7


def toy_batch(seed: int = 0) -> trainer.Batch:
    g = torch.Generator().manual_seed(seed)
    response_mask = ragged_mask(B, R, seed + 1).long()
    input_ids = torch.randint(0, V, (B, P + R), generator=g)  # [B, P+R]
    input_ids[:, 0] = torch.arange(B)  # row id, read by LogitTable
    attention_mask = torch.cat([torch.ones(B, P, dtype=torch.long), response_mask], 1)  # [B, P+R]
    with torch.no_grad():
        logp, _ = sequence_logprobs(LogitTable(B, P + R, V), input_ids, attention_mask, R)  # [B, R]
    mask = response_mask.float()
    return full_batch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        response_mask=response_mask,
        old_logprobs=(logp + 0.1 * torch.randn(B, R, generator=g)) * mask,  # ratios near 1, some clipped
        ref_logprobs=logp * mask,
        advantages=torch.randn(B, R, generator=g) * mask,
        pg_mask=response_mask * (torch.rand(B, R, generator=g) > 0.3),  # [B, R]
        ent_mask=response_mask * (torch.rand(B, R, generator=g) > 0.3),  # [B, R]
    )


def logit_grads(batch: trainer.Batch, ent_coef: float, loss_agg: str = "token-mean") -> torch.Tensor:
    """Gradient of the ppo_update loss w.r.t. the logits that predict each response token: [B, R, V]."""
    policy = LogitTable(B, P + R, V)
    before = policy.table.detach().clone()
    pinned = {k: REVERSE_T1[k] for k in ("temperature", "ppo_epochs", "minibatches")}  # T 1: toy old logprobs
    cfg = trainer.Config(
        ent_coef=ent_coef, loss_agg=loss_agg, micro_batch=4, grad_clip=1e9, **pinned
    )  # 2 micro-batches
    opt = torch.optim.SGD(policy.parameters(), lr=1.0)  # one step: delta = -grad
    trainer.ppo_update(cfg, policy, opt, None, batch, 1, torch.Generator().manual_seed(0), contextlib.nullcontext)
    return (before - policy.table.detach())[:, P - 1 : P + R - 1]  # logits at P + t - 1 predict token t


@pytest.mark.parametrize("loss_agg", ppo_math.AGG_MODES)
def test_gradient_isolation(loss_agg):
    batch = toy_batch()
    full = logit_grads(batch, 0.3, loss_agg)
    pg_only = logit_grads(batch, 0.0, loss_agg)
    ent_only = logit_grads(replace(batch, advantages=torch.zeros(B, R)), 0.3, loss_agg)
    valid = batch.response_mask.bool()
    masked = valid & (batch.pg_mask == 0)  # advantage-masked tokens
    filtered = valid & (batch.ent_mask == 0)  # entropy-filtered tokens
    assert masked.any() and filtered.any() and (masked & ~filtered).any()
    # masked tokens: gradient only from the entropy term; filtered tokens: only from the policy term
    assert pg_only[masked].abs().max() == 0 and torch.allclose(full[masked], ent_only[masked], atol=1e-7)
    assert ent_only[filtered].abs().max() == 0 and torch.allclose(full[filtered], pg_only[filtered], atol=1e-7)
    assert torch.allclose(full, pg_only + ent_only, atol=1e-6)  # the two terms add up everywhere
    assert pg_only[valid & ~masked].abs().amax(-1).min() > 0  # and both act where they are kept
    assert ent_only[valid & ~filtered].abs().amax(-1).min() > 0
    assert full[~valid].abs().max() == 0  # padding gets nothing


def test_masking_a_token_leaves_the_other_tokens_gradient_unchanged():
    # token-mean with the all-valid-tokens denominator: dropping the PPO term of some tokens does not rescale
    # the gradient of the kept ones (a denominator over kept tokens would scale it by n_valid / n_kept)
    batch = toy_batch(1)
    valid = batch.response_mask.bool()
    plain = logit_grads(replace(batch, pg_mask=batch.response_mask), 0.0)
    masked = logit_grads(batch, 0.0)
    kept = valid & (batch.pg_mask == 1)
    assert (valid & ~kept).any()
    assert torch.allclose(plain[kept], masked[kept], atol=1e-7)


def test_single_critic_no_masking_gives_the_plain_ppo_gradient_exactly():
    batch = toy_batch(2)
    plain = replace(batch, pg_mask=batch.response_mask, ent_mask=batch.response_mask)
    values = torch.randn(1, B, R)  # [M = 1, B, R]
    pg, ent, _ = critics.asyppo_masks(values, batch.response_mask, 0.0, 0.0)
    assert torch.equal(logit_grads(plain, 1e-3), logit_grads(replace(batch, pg_mask=pg, ent_mask=ent), 1e-3))


# ----------------------------------------------------------------------------------------------
# Critic construction, memory accounting


def test_mini_critic_keeps_the_actor_first_layers_and_round_trips(tmp_path):
    torch.manual_seed(0)
    tok = make_tokenizer()
    policy = make_tiny_model(tok).eval()  # 2 decoder layers
    mini = critics.make_value_model(policy, depth=0.5)
    assert len(mini.backbone.layers) == 1 and mini.backbone.config.num_hidden_layers == 1
    assert policy.config.num_hidden_layers == 2 and len(policy.model.layers) == 2  # the actor is untouched
    for (n, a), b in zip(mini.backbone.layers[0].named_parameters(), policy.model.layers[0].parameters()):
        assert torch.equal(a, b) and a.data_ptr() != b.data_ptr(), n  # a copy of the actor's first layer
    torch.nn.init.normal_(mini.head.weight, std=0.1)
    ids = torch.randint(4, len(tok), (3, 9))
    attention_mask = torch.ones(3, 9, dtype=torch.long)
    mini.save_pretrained(tmp_path / "c")
    again = critics.ValueModel.from_pretrained(tmp_path / "c").eval()
    assert torch.equal(mini(ids, attention_mask, 4), again(ids, attention_mask, 4))
    full = critics.make_value_model(policy)
    assert len(full.backbone.layers) == 2


def test_critic_model_must_share_the_actor_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tok = make_tokenizer()
    model = make_tiny_model(tok)
    model.save_pretrained(tmp_path / "same")
    tok.save_pretrained(tmp_path / "same")
    vm = critics.make_value_model(model, str(tmp_path / "same"), tok)
    assert vm.backbone.config.vocab_size == len(tok)
    model.save_pretrained(tmp_path / "bare")  # no tokenizer saved with it: none, or a default one, loads
    with pytest.raises(ValueError, match="tokenizer"):
        critics.make_value_model(model, str(tmp_path / "bare"), tok)
    vocab = {t: i for i, t in enumerate(reversed(list(tok.get_vocab())))}  # same tokens, other ids
    other = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>")))
    model.save_pretrained(tmp_path / "other")
    other.save_pretrained(tmp_path / "other")
    with pytest.raises(ValueError, match="another tokenizer than the actor"):
        critics.make_value_model(model, str(tmp_path / "other"), tok)


class Toy(nn.Module):
    def __init__(self, H: int):
        super().__init__()
        self.w = nn.Parameter(torch.randn(H))

    def forward(self, input_ids, attention_mask, response_len):
        x = input_ids.float()  # [B, T] no grad
        return torch.tanh(x[..., None] * self.w)  # mul saves x (w needs grad), tanh saves its output


def test_saved_activation_bytes_known_answer():
    # B = 3, T = 4, H = 5, fp32: x is 3*4*4 = 48 bytes, tanh's output 3*4*5*4 = 240 bytes; w is a parameter
    ids = torch.ones(3, 4, dtype=torch.long)
    assert critics.saved_activation_bytes(Toy(5), ids, ids, 2) == 48 + 240


def test_critic_footprint_counts():
    torch.manual_seed(0)
    tok = make_tokenizer()
    policy = make_tiny_model(tok).eval()
    minis = [critics.make_value_model(policy, depth=0.5) for _ in range(2)]
    ids = torch.randint(4, len(tok), (8, 12))
    attention_mask = torch.ones(8, 12, dtype=torch.long)
    f = critics.critic_footprint(minis, policy, ids, attention_mask, 5)
    n_mini = sum(p.numel() for p in minis[0].parameters())
    n_full = sum(p.numel() for p in policy.model.parameters()) + policy.config.hidden_size + 1  # + head
    assert f["critic/params"] == 2 * n_mini and f["critic/actor_sized_params"] == n_full
    act_mini = critics.saved_activation_bytes(minis[0], ids, attention_mask, 5)
    act_full = critics.saved_activation_bytes(critics.make_value_model(policy), ids, attention_mask, 5)
    assert 0 < act_mini < act_full
    # 4 bytes per fp32 value: weights + 2 AdamW moments for all critics, gradients + activations of one
    assert f["critic/mem_mb"] * 2**20 == pytest.approx(12 * 2 * n_mini + 4 * n_mini + act_mini)
    assert f["critic/actor_sized_mem_mb"] * 2**20 == pytest.approx(16 * n_full + act_full)
    graphs = lambda: sum(1 for o in gc.get_objects() if type(o) is torch.Tensor and o.grad_fn is not None)
    before = graphs()
    critics.saved_activation_bytes(minis[0], ids, attention_mask, 5)
    gc.collect()
    assert graphs() == before  # the measured forward's graph is freed (it leaked 0.7 GB per default run)


# ----------------------------------------------------------------------------------------------
# Trainer-level: M = 1 reduces to PPO, critic warm-up, and the method acting in a learning run

TINY = {
    **REVERSE_T1,
    **dict(prompts_per_step=4, group_size=4, eval_every=3, eval_n=20, ent_coef=1e-3, critic_depth=1.0),
}


def comparable(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(("time/", "perf/"))}


def train_rows(sft_path, out, **overrides) -> list[dict]:
    trainer.train(trainer.Config(model=str(sft_path), out_dir=str(out), **{**TINY, **overrides}))
    return [comparable(r) for r in read_jsonl(out / "metrics.jsonl")]


def test_single_critic_asyppo_without_masks_is_plain_ppo(sft_path, tmp_path):
    plain = train_rows(sft_path, tmp_path / "ppo", steps=3)
    asy = train_rows(sft_path, tmp_path / "asy", steps=3, critic="asyppo", n_critics=1, asyppo_k=0.0, asyppo_h=0.0)
    assert len(plain) == len(asy) == 3
    for a, b in zip(plain, asy):
        extra = set(b) - set(a)  # only the AsyPPO statistics and (if logged only for asyppo) the critic footprint
        footprint = {"critic/params", "critic/mem_mb", "critic/actor_sized_params", "critic/actor_sized_mem_mb"}
        assert extra and all(k.startswith("stats/") or k in footprint for k in extra), extra
        assert b["stats/sigma_mean"] == 0.0 and b["stats/asyppo_pg_masked_frac"] == 0.0
        diff = {k: (a[k], b.get(k)) for k in a if a[k] != b.get(k)}
        assert not diff, f"step {a['step']}: {diff}"  # same losses, gradients, values, eval: bitwise
    assert any(r["loss/policy"] != 0 for r in plain) and "eval/acc" in plain[-1]


def test_critic_warmup_leaves_the_actor_untouched(sft_path, tmp_path):
    # two warm-up iterations at the normal lr == two iterations at lr 0: same rollouts, critics and metrics
    # (except the policy gradient norm, which warm-up does not compute, and the eval after step 3's actor step)
    kw = dict(steps=3, critic="asyppo", eval_every=2)
    warm = train_rows(sft_path, tmp_path / "warm", **kw, critic_warmup_steps=2)
    frozen = train_rows(sft_path, tmp_path / "lr0", **kw, critic_warmup_steps=0, lr=0.0)
    assert "eval/acc" in warm[1] and "eval/acc" in frozen[1]
    for a, b in zip(warm, frozen):
        a, b = dict(a), dict(b)
        gn_warm, gn_frozen = a.pop("stats/grad_norm"), b.pop("stats/grad_norm")
        lr_warm, lr_frozen = a.pop("stats/lr"), b.pop("stats/lr")  # the actor's warm-up starts at its first step
        assert lr_frozen == 0.0 and lr_warm == (0.0 if a["step"] <= 2 else pytest.approx(1e-4 / 20))
        if a["step"] == 3:
            a.pop("eval/acc"), b.pop("eval/acc")
        assert a == b
        assert gn_frozen > 0 and gn_warm == (0.0 if a["step"] <= 2 else gn_frozen)


def test_asyppo_learning_run_acts(sft_path, tmp_path):
    """A short AsyPPO run on the reverse task (tests/calibrated.py): the method must act (a method that silently
    does nothing fails).

    Realised mask fractions ~ k and h at every step, sigma > 0 once the critics have trained on their shares,
    the two critics fit differently, and the actor steps only after the critic warm-up.
    (Whether accuracy rises over an lr = 0 control is the learning tests' job, tests/test_learning.py.)
    """
    kw = dict(critic="asyppo", critic_depth=0.5, prompts_per_step=8, group_size=16, eval_every=0)
    rows = train_rows(sft_path, tmp_path / "asy", **kw, steps=12, critic_warmup_steps=3, asyppo_k=0.3)
    for r in rows:
        n = r["rollout/response_len"] * 128  # valid tokens in the batch; the fractions are counts / n
        assert (r["stats/grad_norm"] > 0) == (r["step"] > 3)  # critic-only iterations first
        if r["step"] == 1:  # identical copies before their first step: sigma has no spread, nothing is masked
            assert r["stats/sigma_max"] == 0.0
            assert r["stats/asyppo_pg_masked_frac"] == r["stats/asyppo_ent_filtered_frac"] == 0.0
            continue
        assert abs(r["stats/asyppo_pg_masked_frac"] - 0.3) <= 1 / n + 1e-6  # round(k n) / n, ties broken at random
        assert abs(r["stats/asyppo_ent_filtered_frac"] - 0.2) <= 1 / n + 1e-6
        if r["step"] > 3:  # after the warm-up the critics, trained on different shares, disagree
            assert r["stats/sigma_mean"] > 0 and r["critic/explained_var_0"] != r["critic/explained_var_1"]
