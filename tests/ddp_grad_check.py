"""DDP correctness check (docs/design.md 5.1, detail 3 of trainer.py), driven by tests/test_distributed.py:

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 tests/ddp_grad_check.py OUT.pt [--fsdp]

Every rank builds the same fixed global batch, keeps its half and runs one `trainer.ppo_update` with
plain SGD at lr = 1 and a grad-norm clip too large to act, so each parameter's change is exactly minus its
gradient (Adam would hide magnitude errors). The micro-batch is smaller than the per-rank batch, so
gradient accumulation under `no_sync` is exercised, and the KL loss, the entropy bonus, separate pg/entropy
masks, ragged and empty responses, and two critics with disjoint shares and their own targets are all on.
Rank 0 saves the parameter changes per loss-aggregation mode; the test compares them with
`update_deltas(mode, 0, 1)`, one process on the whole batch. The same again with micro-batches packed under a
token budget (memory.py), on this batch and on a skewed one whose rank-0 half is long and rank-1 half short, so
that the ranks need different numbers of micro-batches: they must agree on one (the critics' DDP reduces at each).
With --fsdp the same updates run through FSDP2 shards (common.shard_or_replicate) and the changes are gathered whole.
"""

from __future__ import annotations

import contextlib
import sys
from functools import partial
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from batches import full_batch  # noqa: E402

import ppo_math  # noqa: E402
import trainer  # noqa: E402
from common import setup_dist, shard_or_replicate  # noqa: E402
from critics import Critics, make_value_model  # noqa: E402
from memory import checkpoint_layers  # noqa: E402
from rollout import sequence_logprobs  # noqa: E402
from tasks import make_tiny_model, make_tokenizer  # noqa: E402

B, P, R, M = 8, 5, 7, 2  # global batch, prompt length, response length, critics
MICRO = 3  # < B / 2: uneven micro-batches on every rank and in the single process


def make_models(seed: int = 0):
    """The tiny policy and two critics with non-zero heads (a zero head would give the backbone no gradient)."""
    torch.manual_seed(seed)
    tok = make_tokenizer()
    policy = make_tiny_model(tok).eval()
    vms = [make_value_model(policy) for _ in range(M)]
    for vm in vms:
        torch.nn.init.normal_(vm.head.weight, std=0.05)
    return tok, policy, vms


LENGTHS = {  # (prompt, response) lengths per row [B]: rows 0-3 are rank 0's half, rows 4-7 rank 1's
    "ragged": ([5, 3, 4, 2, 5, 1, 3, 4], [7, 2, 5, 1, 4, 0, 6, 3]),  # row 5 (rank 1's half) has no valid token
    "skewed": ([5, 5, 4, 5, 1, 2, 1, 1], [7, 6, 7, 7, 1, 2, 0, 1]),  # rank 0 long, rank 1 short
}
BUDGET = 12  # micro_batch_tokens of the packed runs: rank 0's skewed rows one per micro-batch, rank 1's all in one


@torch.no_grad()
def make_batch(policy, vocab: int, seed: int = 0, lengths: str = "ragged") -> trainer.Batch:
    """A fixed global batch with section-3 tensors: left-padded prompts, ragged (one empty) responses."""
    g = torch.Generator().manual_seed(seed)
    prompt_len, resp_len = map(torch.tensor, LENGTHS[lengths])  # [B] each
    prompt_mask = (torch.arange(P) >= P - prompt_len[:, None]).long()  # [B, P] left padding
    response_mask = (torch.arange(R) < resp_len[:, None]).long()  # [B, R] right padding
    attention_mask = torch.cat([prompt_mask, response_mask], 1)  # [B, P+R]
    input_ids = torch.randint(4, vocab, (B, P + R), generator=g) * attention_mask  # [B, P+R] pad id 0
    logp, _ = sequence_logprobs(policy, input_ids, attention_mask, R)  # [B, R]
    mask = response_mask.float()

    def noise(scale):
        return torch.randn(B, R, generator=g) * scale  # [B, R]

    keep_pg = (torch.rand(B, R, generator=g) > 0.2).long()  # [B, R] an AsyPPO-like advantage mask
    keep_ent = (torch.rand(B, R, generator=g) > 0.3).long()  # [B, R] an entropy filter
    return full_batch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        response_mask=response_mask,
        old_logprobs=(logp + noise(0.15)) * mask,  # ratios around 1: some clipped, most not
        ref_logprobs=(logp + noise(0.3)) * mask,
        advantages=noise(1.0) * mask,
        critic_returns=torch.randn(B, M, R, generator=g) * mask[:, None],  # [B, M, R] a target per critic
        pg_mask=response_mask * keep_pg,
        ent_mask=response_mask * keep_ent,
        old_values=torch.randn(B, M, R, generator=g) * 0.1 * mask[:, None],  # [B, M, R]
        shares=torch.stack([torch.arange(B) % 2 == 0, torch.arange(B) % 2 == 1], 1),  # [B, M] disjoint
    )


def update_deltas(loss_agg: str, rank: int, world: int, tokens: int = 0, lengths: str = "ragged",
                  checkpointing: bool = False, fsdp: bool = False, loss_mode: str = "vanilla",
                  reject: bool = False) -> dict[str, torch.Tensor]:  # fmt: skip
    """Parameter changes of policy and critics after one ppo_update on this rank's half of the batch; tokens > 0:
    micro-batches packed under that budget; checkpointing: every decoder layer checkpointed (memory.py); fsdp:
    through FSDP2's shards instead of DDP's replicas; loss_mode: a loss family (offpolicy.py; sapo's policy term
    has its own per-sequence normaliser); reject: a rollout rejection took every third token and row 1 out of the
    losses (Batch.loss_mask)."""
    tok, policy, vms = make_models()
    batch = make_batch(policy, len(tok), lengths=lengths)
    if reject:
        keep = (torch.arange(R) % 3 != 1).float().expand(B, R).clone()
        keep[1] = 0.0
        batch.loss_mask = batch.loss_mask * keep
    for model in [policy, *(vm.backbone for vm in vms)] if checkpointing else []:
        checkpoint_layers(model)
    half = B // world
    batch = batch.rows(torch.arange(rank * half, (rank + 1) * half))
    cfg = trainer.Config(
        loss_agg=loss_agg,
        micro_batch=MICRO,
        micro_batch_tokens=tokens,
        minibatches=1,
        ppo_epochs=1,
        grad_clip=1e9,
        kl_loss=True,
        kl_loss_coef=0.1,
        ent_coef=0.01,
        temperature=0.9,
        loss_mode=loss_mode,
    )
    wrap = partial(shard_or_replicate, world=world, fsdp=fsdp) if world > 1 or fsdp else None
    named = {f"policy.{n}": p for n, p in policy.named_parameters()}
    named.update({f"critic{k}.{n}": p for k, vm in enumerate(vms) for n, p in vm.named_parameters()})
    before = {n: p.detach().clone() for n, p in named.items()}  # whole, before any sharding
    policy_train = wrap(policy) if wrap else policy
    critics = Critics(vms, lr=1.0, adam_eps=1e-8, wrap=wrap)
    opt = torch.optim.SGD(policy.parameters(), lr=1.0)  # after the wrap: FSDP2's parameters are new (shards)
    critics.opts = [torch.optim.SGD(vm.parameters(), lr=1.0) for vm in vms]  # plain SGD here too
    trainer.ppo_update(
        cfg, policy_train, opt, critics, batch, world, torch.Generator().manual_seed(0), contextlib.nullcontext
    )
    after = {f"policy.{n}": p for n, p in policy.named_parameters()}
    after.update({f"critic{k}.{n}": p for k, vm in enumerate(vms) for n, p in vm.named_parameters()})
    whole = {n: p.full_tensor() if hasattr(p, "full_tensor") else p for n, p in after.items()}  # FSDP2: gathered
    return {n: (whole[n].detach() - before[n]) for n in named}


def no_grad_passes(rank: int, world: int, fsdp: bool = False) -> dict[str, torch.Tensor]:
    """Stanza 3 on this rank's half of the ragged batch under a token budget (34) and micro_batch 2: old and
    reference logprobs [b, R] and both critics' values [M, b, R]. Rank 0 packs its half into 2 micro-batches of 2
    forwards' rows, rank 1 into 2 of 3: each micro-batch must be one forward (under FSDP2 an all-gather apiece)."""
    tok, policy, vms = make_models()
    batch = make_batch(policy, len(tok)).rows(torch.arange(rank * B // world, (rank + 1) * B // world))
    wrap = partial(shard_or_replicate, world=world, fsdp=fsdp) if world > 1 or fsdp else None
    model = wrap(policy) if fsdp else policy  # DDP's no-grad passes run on the model itself
    critics = Critics(vms, lr=1.0, adam_eps=1e-8, wrap=wrap)
    cfg = trainer.Config(micro_batch=2, micro_batch_tokens=34, ppo_epochs=2, fsdp=fsdp, temperature=0.9)
    ids, attn, mask = batch.input_ids, batch.attention_mask, batch.response_mask
    with torch.no_grad():
        old, ref, _, _ = trainer.anchor_logprobs(cfg, model, model, ids, attn, mask, step=0)
        values = trainer.critic_values(cfg, critics, ids, attn, mask)
    m = mask.float()  # valid tokens only: a cut padding column is 0 in one packing, a number in another
    return {"old": old * m, "ref": ref * m, "values": values.transpose(0, 1) * m[:, None]}  # [b, ...] rows first


def main(out: str, fsdp: bool = False) -> None:
    rank, _, world, _ = setup_dist(timeout_s=60, device="cpu")
    result = {mode: update_deltas(mode, rank, world, fsdp=fsdp) for mode in ppo_math.AGG_MODES}
    for lengths in LENGTHS:  # packed under a token budget: the same gradient, ranks with unequal needs
        for mode in ("token-mean", "seq-mean-token-mean"):
            result[f"{lengths}/{mode}/tokens"] = update_deltas(mode, rank, world, BUDGET, lengths, fsdp=fsdp)
    result["checkpointed/token-mean"] = update_deltas("token-mean", rank, world, checkpointing=True, fsdp=fsdp)
    result["sapo/token-mean"] = update_deltas("token-mean", rank, world, fsdp=fsdp, loss_mode="sapo")
    result["rejected/seq-mean-token-mean"] = update_deltas("seq-mean-token-mean", rank, world, fsdp=fsdp, reject=True)
    both = dict(loss_mode="sapo", reject=True, fsdp=fsdp)  # under a token budget, ranks with unequal packings
    result["sapo-rejected/token-mean/tokens"] = update_deltas("token-mean", rank, world, BUDGET, "skewed", **both)
    halves = [None] * world  # every rank's rows of the no-grad passes, for rank 0 to save
    torch.distributed.all_gather_object(halves, no_grad_passes(rank, world, fsdp))
    result["no_grad"] = {k: torch.cat([h[k] for h in halves]) for k in halves[0]}
    if rank == 0:
        torch.save(result, out)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], "--fsdp" in sys.argv[2:])
