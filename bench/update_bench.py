"""Update overhead: trainer.ppo_update vs a bare training loop doing the same passes over the same tokens.

    python bench/update_bench.py                                   # tiny and 2.5M configs on CPU
    python bench/update_bench.py --preset 0.5b --device cuda --dtype bfloat16

One PPO update is ppo_epochs x minibatches optimizer steps of the policy and of the critic, each over
micro-batches (gradient accumulation). The baseline does exactly as many forward + backward passes and
optimizer steps over the same rows and micro-batches, with the plainest losses: token cross-entropy of
the response tokens for the policy (logits of the response positions only, as ppo_update asks for), a
masked squared error for the critic, AdamW for both, no shuffling, clipping or metrics. So the ratio
ppo_update / bare is what the algorithm adds (logprob gathering, entropy, clipped losses, global
denominators, grad-norm clipping, metrics); docs/design.md 8 targets <= 1.15x. Median of interleaved repeats
after one warm-up each. --dtype bfloat16 autocasts both sides (weights and AdamW state stay fp32, as in
the trainer).
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollout_bench import BenchArgs, make_model, run_presets, spread, sync  # noqa: E402

import trainer  # noqa: E402
from cli import check_fields, parse_config  # noqa: E402
from common import make_autocast  # noqa: E402
from critics import Critics, make_value_model  # noqa: E402


@dataclass
class Config(BenchArgs):
    """`python bench/update_bench.py`: ppo_update vs the bare update."""

    batch: int = 64
    """Sequences in the update batch."""
    prompt_len: int = 16
    """Prompt tokens per sequence."""
    response_len: int = 32
    """Response length R (responses are ragged: 1..R valid tokens)."""
    ppo_epochs: int = 2
    """Passes over the batch."""
    minibatches: int = 2
    """Optimizer steps per pass."""
    micro_batch: int = 16
    """Sequences per forward/backward."""

    def __post_init__(self):
        BenchArgs.__post_init__(self)
        sizes = ("batch", "prompt_len", "response_len", "ppo_epochs", "minibatches", "micro_batch")
        check_fields(self, {"[1, inf)": sizes})
        if self.batch % self.minibatches:
            raise ValueError(f"config field 'batch' = {self.batch} must divide by minibatches = {self.minibatches}")


def make_batch(vocab: int, cfg: Config, device) -> trainer.Batch:
    """A PPO batch (docs/design.md section 3 tensors) with random tokens and ragged responses, one critic."""
    g = torch.Generator().manual_seed(cfg.seed)
    B, P, R = cfg.batch, cfg.prompt_len, cfg.response_len
    resp_len = torch.randint(1, R + 1, (B,), generator=g)  # [B]
    response_mask = (torch.arange(R) < resp_len[:, None]).long()  # [B, R]
    attention_mask = torch.cat([torch.ones(B, P, dtype=torch.long), response_mask], 1)  # [B, P+R]
    input_ids = torch.randint(3, vocab, (B, P + R), generator=g) * attention_mask  # [B, P+R] pad id 0
    mask = response_mask.float()
    old_logprobs, returns = -torch.rand(B, R, generator=g) * 5 * mask, torch.randn(B, R, generator=g) * mask
    batch = trainer.Batch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        response_mask=response_mask,
        loss_mask=mask,  # [B, R] nothing rejected
        old_logprobs=old_logprobs,  # [B, R]
        clip_anchor=old_logprobs,
        ref_logprobs=-torch.rand(B, R, generator=g) * 5 * mask,  # [B, R]
        advantages=torch.randn(B, R, generator=g) * mask,  # [B, R]
        token_weights=torch.ones(B, R),
        pg_mask=response_mask,
        ent_mask=response_mask,
        is_weights=None,
        old_values=torch.zeros(B, 1, R),  # [B, M=1, R]
        critic_returns=returns[:, None],  # [B, M=1, R]
        shares=torch.ones(B, 1, dtype=torch.bool),  # [B, M=1]
    )
    return trainer.Batch(**{k: v if v is None else v.to(device) for k, v in vars(batch).items()})


def bare_update(policy, policy_opt, critic, critic_opt, batch: trainer.Batch, cfg: Config, autocast) -> None:
    """The baseline: the same passes and optimizer steps with plain losses and nothing else."""
    R = cfg.response_len
    mb_size = cfg.batch // cfg.minibatches
    for _ in range(cfg.ppo_epochs):
        for j in range(cfg.minibatches):
            rows = range(j * mb_size, (j + 1) * mb_size)
            for model, opt in ((policy, policy_opt), (critic, critic_opt)):
                for s in range(rows.start, rows.stop, cfg.micro_batch):
                    sl = slice(s, min(s + cfg.micro_batch, rows.stop))
                    ids, attn, mask = batch.input_ids[sl], batch.attention_mask[sl], batch.response_mask[sl]
                    with autocast():
                        if model is policy:
                            logits = model(input_ids=ids, attention_mask=attn, logits_to_keep=R + 1).logits[:, :-1]
                            tok_loss = F.cross_entropy(
                                logits.float().flatten(0, 1), ids[:, -R:].flatten(), reduction="none"
                            ).view_as(mask)  # [b, R]
                        else:
                            tok_loss = (model(ids, attn, R) - batch.critic_returns[sl, 0]) ** 2  # [b, R]
                        loss = (tok_loss * mask).sum() / mask.sum()
                    loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)


def bench_one(preset: str, cfg: Config) -> dict:
    """Seconds per update of both sides on one preset's model: the median of cfg.repeats interleaved updates."""
    device = torch.device(cfg.device)
    autocast = make_autocast(cfg.dtype, device)
    torch.manual_seed(cfg.seed)
    policy = make_model(preset, device).eval()
    critic = make_value_model(policy).to(device).eval()
    batch = make_batch(policy.config.vocab_size, cfg, device)
    ppo_cfg = trainer.Config(ppo_epochs=cfg.ppo_epochs, minibatches=cfg.minibatches, micro_batch=cfg.micro_batch)
    # each side has its own optimizers over the same parameters (separate AdamW states, same work)
    ppo_opt = torch.optim.AdamW(policy.parameters(), lr=1e-6, weight_decay=0.0)
    critics = Critics([critic], lr=1e-6, adam_eps=1e-8)
    bare_opts = [torch.optim.AdamW(m.parameters(), lr=1e-6, weight_decay=0.0) for m in (policy, critic)]
    shuffle = torch.Generator().manual_seed(cfg.seed)

    def ours():
        """One ppo_update: ppo_epochs x minibatches steps of policy and critic."""
        trainer.ppo_update(ppo_cfg, policy, ppo_opt, critics, batch, 1, shuffle, autocast)

    def bare():
        """The same passes and steps as plain losses."""
        bare_update(policy, bare_opts[0], critic, bare_opts[1], batch, cfg, autocast)

    times = {"ppo_update": [], "bare": []}
    for rep in range(cfg.repeats + 1):  # repeat 0 warms up both sides (and creates the AdamW states)
        for name, fn in (("ppo_update", ours), ("bare", bare)):
            sync(device)
            t0 = time.perf_counter()
            fn()
            sync(device)
            if rep > 0:
                times[name].append(time.perf_counter() - t0)
    ours_s, bare_s = statistics.median(times["ppo_update"]), statistics.median(times["bare"])
    n_tok = int(batch.attention_mask.sum()) * cfg.ppo_epochs
    return {
        "preset": preset,
        "params_M": sum(p.numel() for p in policy.parameters()) / 1e6,
        "ppo_update_s": ours_s,
        "bare_s": bare_s,
        "ratio": ours_s / bare_s,
        "tok_s_ppo": n_tok / ours_s,
        "ppo_spread": spread(times["ppo_update"]),
        "bare_spread": spread(times["bare"]),
    }


def main(argv=None):
    """`python bench/update_bench.py [flags]`: the table of update times, ppo_update vs the bare loop."""
    cfg = parse_config(Config, argv)
    title = (
        f"PPO update vs bare loop: batch {cfg.batch}, prompt {cfg.prompt_len}, response <= {cfg.response_len}, "
        f"{cfg.ppo_epochs} epochs x {cfg.minibatches} minibatches, micro-batch {cfg.micro_batch}, policy + critic"
    )
    return run_presets(cfg, bench_one, title)


if __name__ == "__main__":
    main()
