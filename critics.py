"""Value models for PPO: one critic, or AsyPPO's ensemble of M mini-critics (arXiv 2510.01656).

    python critics.py          # two mini-critics fitted on their shares of one batch: AsyPPO's masks, the footprint
    python experiments/asyppo.py --full   # the experiment: GRPO, PPO, AsyPPO over seeds (trainer runs)
    torchrun --standalone --nproc_per_node=2 trainer.py --critic asyppo  # each critic data-parallel

A critic is a causal-LM backbone (Hugging Face `AutoModel`) with a scalar head; `V(s_t)`, the value BEFORE
token t, reads the hidden state at position P + t - 1. Interface (docs/design.md 5.6): `Critics.values(...)` ->
[M, B, R] under no_grad; the trainer's `critic_update` (trainer.py) steps critic m on the rows of its share
with the clipped value loss. `CriticArgs` holds the knobs (the trainer's Config inherits them).

AsyPPO (Liu et al. 2025; docs/design.md section 5.2), one iteration in the trainer's order:
  1. V_m(s_t) of every critic [M, B, R], from the critics BEFORE their update (docs/design.md 5.2, "ordering");
  2. GAE on V̄ = mean_m V_m (mean beat min, Fig. 9d); critic m's value target is R^(m) = GAE(V_m) + V_m;
  3. `asyppo_masks`, after whitening: sigma_t = std_m V_m(s_t); the PPO term is dropped on the lowest-k
     fraction of sigma (critics agree), the entropy bonus on the highest-h fraction (1a, "advantage masking",
     "entropy filtering"); 4. actor step; critic m steps on its share of each group only.

Implementation details (our choices where the paper is silent)
1. The value head is zero-initialised (the first values are 0); dropout is off (`.eval()` throughout).
2. Critic: the actor's first round(critic_depth * L) decoder layers, copied (tokenizer and warm-start come
   along); critic_depth 1.0 for plain PPO, 0.5 for AsyPPO ("mini"). `--critic-model PATH` loads another
   model whose tokenizer must equal the actor's (vocabularies compared; docs/design.md 5.2).
3. Value loss: the clipped loss of docs/design.md 5.1 per critic (ppo_math.value_loss, in the trainer's critic_update).
4. Partition (1a): per prompt group, a seeded shuffle split into M equal shares, with its own generator
   (seed + rank), so M = 1 draws nothing; G % M != 0 is a config error (pitfall 3).
5. sigma is the population std over critics (correction 0: M = 1 gives 0, not NaN), detached (pitfall 5), of
   fp32 values: the head runs outside bf16 autocast (bf16-rounded values would tie often). Critics are fp32.
6. Quantiles over the batch's valid tokens, gathered over ranks (pitfall 1): the round(k n) lowest sigma lose the
   PPO term, the round(h n) highest (at most n - round(k n)) the entropy bonus, from one ascending order whose ties
   (the samples of a group share their prompt's states) are in random order (the trainer's minibatch stream, the
   same on every rank), never by position. Sigma without spread (identical critics before their first step)
   masks nothing.
7. Normaliser (docs/design.md 5.2, pitfall 4): the masks multiply the per-token losses and the denominator
   still counts every valid token, so masking shrinks the step (by about 1 - k) instead of re-weighting.
8. Critic warm-up (pitfall 7): `--critic-warmup-steps` iterations train the critics only; the actor's
   optimizer does not step and its lr warm-up starts afterwards (the slime-fork script uses 10).
9. Memory (`critic_footprint`, an actor-sized critic counted alike): weights + AdamW moments of all critics
   (12 B/param, fp32) plus gradients and saved activations of one critic and one micro-batch at a time.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn

import ppo_math
from cli import check_fields, parse_config
from common import collective, masked_mean, masked_var, world_size
from rollout import decode_responses, generate
from tasks import format_prompt, load_policy, make_task, score_responses, stop_token_ids, tokenize_prompts
from warm_start import SFTConfig, sft_warm_start


@dataclass
class CriticArgs:
    """The critic's knobs (docs/design.md 5.2); the trainer's Config inherits them."""

    critic: Literal["value", "asyppo"] = "value"
    """Critic for gae: one value model, or AsyPPO mini-critics (critics.py)."""
    critic_model: str | None = None
    """Critic backbone (HF name or folder, same tokenizer as the actor); None = the policy's own layers."""
    critic_depth: float | None = None
    """Share of the policy's decoder layers a critic copies (None = 1.0, or 0.5 mini-critics with asyppo)."""
    n_critics: int = 2
    """AsyPPO: number of mini-critics M (group_size must divide by M)."""
    asyppo_k: float = 0.2
    """AsyPPO: fraction of valid tokens (lowest critic disagreement) whose policy term is dropped."""
    asyppo_h: float = 0.2
    """AsyPPO: fraction of valid tokens (highest critic disagreement) whose entropy bonus is dropped."""
    critic_warmup_steps: int = 0
    """Critic-only iterations (no actor update) at the start of a run."""
    critic_lr: float = 1e-3
    """Critic learning rate (AdamW)."""

    def __post_init__(self):
        if self.critic_depth is None:  # derived once here, printed with the config
            self.critic_depth = 0.5 if self.critic == "asyppo" else 1.0
        ranges = {"(0.0, 1.0]": ("critic_depth",), "[0.0, 1.0]": ("asyppo_k", "asyppo_h"), "[0.0, inf)": ("critic_lr",)}
        check_fields(self, {**ranges, "[0, inf)": ("critic_warmup_steps",), "[1, inf)": ("n_critics",)}, CriticArgs)


class ValueModel(nn.Module):
    """A causal-LM backbone with a scalar value head."""

    def __init__(self, backbone: nn.Module, hidden_size: int):
        super().__init__()
        self.backbone = backbone  # base model: returns hidden states, no LM head
        self.head = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.head.weight)  # detail 1: V = 0 at the start
        nn.init.zeros_(self.head.bias)

    def forward(self, input_ids, attention_mask, response_len: int):
        """Values [B, R]: V(s_t) from the hidden state at position P + t - 1."""
        pos = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # [B, P+R] left padding aware
        h = self.backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=pos, use_cache=False)
        h = h.last_hidden_state[:, -response_len - 1 : -1]  # [B, R, H]
        with torch.autocast(h.device.type, enabled=False):  # the head in fp32 also under bf16 autocast (detail 5)
            return self.head(h.float()).sum(-1)  # [B, R] (a sum over the size-1 axis: exact, not a view for FSDP2)

    def save_pretrained(self, path):
        """The backbone as save_pretrained writes it, the value head beside it (value_head.safetensors)."""
        from safetensors.torch import save_file

        path = Path(path)
        self.backbone.save_pretrained(path)
        save_file({k: v.contiguous() for k, v in self.head.state_dict().items()}, str(path / "value_head.safetensors"))

    @staticmethod
    def from_pretrained(path, dtype=torch.float32):
        """A critic from a folder: a saved critic, or a plain LM folder with a fresh zero head. fp32 whatever the
        folder's dtype (dtype None would mean "as stored": a bf16 backbone under AdamW loses its 1e-5 steps)."""
        from safetensors.torch import load_file
        from transformers import AutoModel

        backbone = AutoModel.from_pretrained(path, dtype=dtype)
        vm = ValueModel(backbone, backbone.config.hidden_size)
        head = Path(path) / "value_head.safetensors"
        if head.exists():  # a saved critic; a plain LM folder gets a fresh zero head
            vm.head.load_state_dict(load_file(str(head)))
        return vm


def keep_first_layers(backbone: nn.Module, depth: float) -> nn.Module:
    """Truncate a decoder backbone in place to its first max(1, round(depth * L)) layers (detail 2)."""
    name = next((n for n in ("layers", "h") if isinstance(getattr(backbone, n, None), nn.ModuleList)), None)
    if name is None:
        raise ValueError(f"cannot find the decoder layers of {type(backbone).__name__}: pass --critic-model instead")
    n = max(1, round(depth * len(getattr(backbone, name))))
    setattr(backbone, name, nn.ModuleList(list(getattr(backbone, name))[:n]))
    backbone.config.num_hidden_layers = n
    if getattr(backbone.config, "layer_types", None) is not None:  # per-layer attention kinds (transformers 5)
        backbone.config.layer_types = backbone.config.layer_types[:n]
    return backbone


def make_value_model(policy, critic_model: str | None = None, tokenizer=None, depth: float = 1.0) -> ValueModel:
    """A critic: the policy's first layers (copied, `depth` of them, detail 2), or the model `critic_model`,
    whose saved tokenizer must have exactly the actor's vocabulary (pitfall 8)."""
    if critic_model is None:
        backbone = keep_first_layers(copy.deepcopy(policy.base_model), depth)
        return ValueModel(backbone, policy.config.hidden_size).eval()
    if not Path(critic_model).exists() and "/" not in critic_model:
        raise FileNotFoundError(f"critic model {critic_model!r} is neither a local folder nor a hub name")
    if tokenizer is not None:
        from transformers import AutoTokenizer

        try:
            other, mine = AutoTokenizer.from_pretrained(critic_model).get_vocab(), tokenizer.get_vocab()
        except (OSError, ValueError) as e:
            raise ValueError(f"critic model {critic_model!r}: no loadable tokenizer ({e})") from e
        if mine != other:
            diff = sorted(set(mine.items()) ^ set(other.items()))[:4]
            raise ValueError(
                f"critic model {critic_model!r} has another tokenizer than the actor ({len(other)} vs {len(mine)} "
                f"tokens; first differences {diff}): critics must share the actor's tokenizer"
            )
    return ValueModel.from_pretrained(critic_model).eval()


def partition_shares(group_ids, n_critics: int, generator: torch.Generator):
    """[B, M] bool: each group's samples split without overlap into M equal shares (seeded shuffle).

    M = 1 gives every row to the one critic and draws nothing from the generator (detail 4).
    """
    B = group_ids.numel()
    shares = torch.zeros(B, n_critics, dtype=torch.bool, device=group_ids.device)  # [B, M]
    if n_critics == 1:
        return shares.fill_(True)
    for g in group_ids.unique():
        idx = (group_ids == g).nonzero().squeeze(1)  # [G] rows of this group
        if len(idx) % n_critics:
            raise ValueError(f"group {int(g)} has {len(idx)} samples: not divisible by {n_critics} critics")
        perm = idx[torch.randperm(len(idx), generator=generator).to(idx.device)]
        for m, part in enumerate(perm.chunk(n_critics)):
            shares[part, m] = True
    return shares


def all_gather_cat(t):
    """Concatenate a 1-D tensor of any length from every rank (rank order). Returns (cat, offset of mine)."""
    w = world_size()
    if w == 1:
        return t, 0
    n = torch.tensor([t.numel()], device=t.device)
    sizes = [torch.zeros_like(n) for _ in range(w)]
    collective(dist.all_gather, sizes, n)
    sizes = [int(s) for s in sizes]
    padded = torch.zeros(max(sizes), dtype=t.dtype, device=t.device)
    padded[: t.numel()] = t
    parts = [torch.zeros_like(padded) for _ in range(w)]
    collective(dist.all_gather, parts, padded)
    return torch.cat([p[:s] for p, s in zip(parts, sizes)]), sum(sizes[: dist.get_rank()])


def masked_ranks(x, mask, global_: bool = False, generator: torch.Generator | None = None):
    """(rank, n, spread): the ascending rank [like mask, long] of each valid entry of x among the n valid entries
    (every rank's, gathered, with global_), -1 where masked; whether the values differ at all. Ties are ordered at
    random (`generator`: the same stream on every rank under DDP), never by position (detail 6)."""
    flat_mask = mask.reshape(-1).bool()
    vals = x.reshape(-1)[flat_mask].detach().double()
    all_vals, offset = all_gather_cat(vals) if global_ else (vals, 0)
    n = all_vals.numel()
    shuffle = torch.randperm(n, generator=generator).to(x.device)  # a random order, then a stable sort by value
    order = shuffle[torch.sort(all_vals[shuffle], stable=True).indices]
    ranks = torch.empty(n, dtype=torch.long, device=x.device)
    ranks[order] = torch.arange(n, device=x.device)
    out = torch.full(flat_mask.shape, -1, dtype=torch.long, device=x.device)
    out[flat_mask] = ranks[offset : offset + vals.numel()]
    return out.reshape(mask.shape), n, bool(n and all_vals.max() > all_vals.min())


def asyppo_masks(all_values, response_mask, k: float, h: float, generator: torch.Generator | None = None):
    """AsyPPO token masks from critic disagreement. all_values [M, B, R], response_mask [B, R] (0/1); generator
    orders ties (the same on every rank).

    Returns pg_mask [B, R] (0 where the PPO term is dropped: the lowest-k fraction of sigma), ent_mask
    [B, R] (0 where the entropy bonus is dropped: the highest-h fraction; none where sigma has no spread) and a
    metrics dict.
    """
    mask = response_mask.bool()
    # sigma_t = std_m V_m(s_t), population std (docs/design.md 5.2; detail 5)
    sigma = all_values.detach().float().std(0, correction=0) * mask  # [B, R]
    rank, n, spread = masked_ranks(sigma, mask, global_=True, generator=generator)  # [B, R] over all ranks' tokens
    n_low = round(k * n) if spread else 0  # identical critics (sigma = 0, before their first step): no mask
    n_top = min(round(h * n), n - n_low) if spread else 0  # disjoint from Low_k also when rounding would overlap
    low = (rank >= 0) & (rank < n_low)  # I^A_t = 0 if sigma_t in Low_k(sigma)  (advantage masking; detail 6)
    top = rank >= n - n_top  # I^H_t = 0 if sigma_t in Top_h(sigma)  (entropy filtering)
    pg_mask, ent_mask = (mask & ~low).to(response_mask.dtype), (mask & ~top).to(response_mask.dtype)  # [B, R] each
    fmask, sigma_mean = mask.float(), masked_mean(sigma, mask.float(), global_=True)
    v_std = masked_var(all_values.detach().float().mean(0), fmask, global_=True).sqrt()  # spread of V̄ over tokens
    metrics = {
        "stats/sigma_mean": float(sigma_mean),
        "stats/sigma_max": float(sigma.max()) if sigma.numel() else 0.0,
        "stats/sigma_rel": float(sigma_mean / (v_std + 1e-8)),  # critic disagreement relative to that spread
        "stats/asyppo_pg_masked_frac": float(masked_mean(low.float(), fmask, global_=True)),
        "stats/asyppo_ent_filtered_frac": float(masked_mean(top.float(), fmask, global_=True)),
    }
    return pg_mask, ent_mask, metrics


def explained_variance(values, returns, mask) -> float:
    """1 - Var[R - V] / Var[R] over valid tokens (global under DDP); 1 is a perfect fit."""
    var_r = masked_var(returns, mask, global_=True)
    return float(1.0 - masked_var(returns - values, mask, global_=True) / (var_r + 1e-8))


class Critics:
    """M value models with their optimizers (trained through `wrap(model)`: DDP's replica, FSDP2's shards or the model
    itself, common.shard_or_replicate). M = 1 is plain PPO."""

    def __init__(self, models: list[ValueModel], *, lr: float, adam_eps: float, wrap=None):
        self.models = models
        self.train_models = [wrap(m) if wrap else m for m in models]  # first: FSDP2 makes the parameters shards
        self.opts = [torch.optim.AdamW(m.parameters(), lr=lr, eps=adam_eps, weight_decay=0.0) for m in models]

    @torch.no_grad()
    def values(self, input_ids, attention_mask, response_len: int, micro_batch: int):
        """[M, B, R] values of every critic, computed in micro-batches without gradient."""
        mbs = [slice(i, i + micro_batch) for i in range(0, input_ids.shape[0], micro_batch)]
        values = [torch.cat([m(input_ids[s], attention_mask[s], response_len) for s in mbs]) for m in self.models]
        return torch.stack(values)  # [M, B, R]

    def state(self) -> dict:
        """The optimizer states for a checkpoint (the models are saved as critic_{m} folders)."""
        return {f"critic_opt_{k}": o.state_dict() for k, o in enumerate(self.opts)}

    def load(self, path, state: dict):
        """Restore weights (the critic_{m} folders of a checkpoint) and optimizer states (from `state`)."""
        for k, (m, o) in enumerate(zip(self.models, self.opts)):
            m.load_state_dict(ValueModel.from_pretrained(Path(path) / f"critic_{k}").state_dict())
            o.load_state_dict(state[f"critic_opt_{k}"])


def make_critics(cfg: CriticArgs, policy, tokenizer, device, *, adam_eps: float, wrap=None) -> Critics:
    """One value model (PPO), or cfg.n_critics mini-critics trained on disjoint shares (AsyPPO); detail 2."""
    n = cfg.n_critics if cfg.critic == "asyppo" else 1
    models = [make_value_model(policy, cfg.critic_model, tokenizer, cfg.critic_depth).to(device) for _ in range(n)]
    return Critics(models, lr=cfg.critic_lr, adam_eps=adam_eps, wrap=wrap)


def critic_targets(cfg, token_rewards, all_values, mask, returns):
    """Each critic's value target R^(m) = GAE(V_m) + V_m [B, M, R]; for M = 1 that is `returns` already."""
    if len(all_values) == 1:
        return returns[:, None]  # [B, 1, R]
    return torch.stack([ppo_math.gae(token_rewards, v * mask, mask, cfg.gamma, cfg.lam)[1] for v in all_values], 1)


def value_stats(values_mean, returns, mask, all_values, critic_returns) -> dict:
    """Fit of the ensemble mean [B, R] to the returns, and of each critic [M, B, R] to its own targets [B, M, R]."""
    m = {
        f"critic/explained_var_{k}": explained_variance(v, critic_returns[:, k], mask) for k, v in enumerate(all_values)
    }
    m["stats/value_mean"] = float(masked_mean(values_mean, mask, global_=True))
    m["critic/explained_var"] = explained_variance(values_mean, returns, mask)
    return m


def _never_unpacked(_):
    raise RuntimeError("saved_activation_bytes measures a forward; it never backpropagates")


def saved_activation_bytes(model: nn.Module, input_ids, attention_mask, response_len: int) -> int:
    """Bytes of the tensors autograd saves for backward in one forward of `model` (parameters excluded)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved, kept = {}, []  # kept: the saved storages, alive until the end as in a graph (no pointer reused)

    def pack(t):
        """Record a saved tensor's storage size, keyed by storage: views of one buffer count once. Keeps the storage,
        never the tensor: the graph holds this hook through C++, and hook -> tensor -> grad_fn -> hook is a cycle gc
        cannot see (keeping tensors leaked each forward's activations: 0.7 GB per default run, in the test process)."""
        if (ptr := t.untyped_storage().data_ptr()) not in params:
            saved[ptr] = t.untyped_storage().nbytes()
        kept.append(t.untyped_storage())

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, _never_unpacked):
        model(input_ids, attention_mask, response_len)
    return sum(saved.values())


def critic_footprint(models: list[nn.Module], policy, input_ids, attention_mask, response_len: int) -> dict:
    """Parameters and training memory (MB) of the critics vs one actor-sized critic (detail 9):
    memory = sum_m P_m (weights + 2 AdamW moments) + max_m (P_m gradients + activations of this micro-batch)."""
    actor_sized = ValueModel(policy.base_model, policy.config.hidden_size).to(policy.device)  # shares the actor weights

    def usage(ms):
        """(parameters, training MB) of the critics ms, as the docstring's formula."""
        n = [sum(p.numel() for p in m.parameters()) for m in ms]
        size = [next(m.parameters()).element_size() for m in ms]
        act = [saved_activation_bytes(m, input_ids, attention_mask, response_len) for m in ms]
        transient = max(p * s + a for p, s, a in zip(n, size, act))
        return sum(n), (sum(3 * p * s for p, s in zip(n, size)) + transient) / 2**20

    keys = ("critic/params", "critic/mem_mb", "critic/actor_sized_params", "critic/actor_sized_mem_mb")
    return dict(zip(keys, map(float, [*usage(models), *usage([actor_sized])])))


@dataclass
class Config(CriticArgs):
    """`python critics.py`: M mini-critics fitted on their shares of one sampled batch, then AsyPPO's masks."""

    critic: Literal["value", "asyppo"] = "asyppo"
    """Critic for the demonstration: AsyPPO mini-critics (or one value model: its sigma is 0, nothing is masked)."""
    model: str | None = None
    """Policy folder (None: the SFT warm start of the embedded model on `reverse`, built once and cached)."""
    prompts: int = 8
    """Prompts (groups) in the batch."""
    group_size: int = 4
    """Samples per prompt (must divide by n_critics)."""
    fit_steps: int = 30
    """AdamW steps of each critic on its share (the demonstration's own plain squared error to the score)."""
    seed: int = 0
    """Seed of the prompts, the samples and the partition."""

    def __post_init__(self):
        super().__post_init__()
        check_fields(self, {"[1, inf)": ("prompts", "group_size"), "[0, inf)": ("fit_steps",)})


def sample_batch(cfg: Config, policy, tokenizer):
    """One batch of the task `reverse`: (Rollout, group ids [B], returns [B, R]: every token's return is the score)."""
    task, rng = make_task("reverse"), np.random.default_rng(cfg.seed)
    problems = [p for p in task.sample(cfg.prompts, "train", rng) for _ in range(cfg.group_size)]
    ids, attn = tokenize_prompts(tokenizer, [format_prompt(tokenizer, p["prompt"]) for p in problems], 64)
    gen = torch.Generator(policy.device).manual_seed(cfg.seed)
    stop = dict(eos_token_ids=stop_token_ids(policy, tokenizer), pad_token_id=tokenizer.pad_token_id)
    with torch.no_grad():
        samples = generate(
            policy, ids.to(policy.device), attn.to(policy.device), max_new_tokens=16, **stop, generator=gen
        )
    scores = torch.tensor(score_responses(task, decode_responses(tokenizer, samples), problems))  # [B]
    returns = scores[:, None].to(policy.device) * samples.response_mask  # [B, R] no KL, gamma = lambda = 1
    return samples, torch.arange(len(problems), device=policy.device) // cfg.group_size, returns


def fit_on_shares(critics: Critics, samples, returns, shares, steps: int) -> None:
    """Critic m's steps on the rows of its share only (detail 4): trained on different samples, the critics come to
    disagree (sigma > 0), which AsyPPO's masks read. A plain squared error (the trainer's clipped value loss needs the
    old values of an iteration)."""
    for m, (model, opt) in enumerate(zip(critics.models, critics.opts)):
        mask = samples.response_mask.float() * shares[:, m, None]  # [B, R] critic m's tokens
        for _ in range(steps):
            values = model(samples.input_ids, samples.attention_mask, returns.shape[1])  # [B, R]
            loss = masked_mean((values - returns) ** 2, mask)
            opt.zero_grad()
            loss.backward()
            opt.step()


def main(argv=None):
    """`python critics.py [flags]`: one batch, the critics fitted on their shares, sigma and the masks, one response
    with its masked tokens, and the critics' memory against one actor-sized critic."""
    cfg = parse_config(Config, argv)
    torch.manual_seed(cfg.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    policy, tokenizer = load_policy(cfg.model or str(sft_warm_start(SFTConfig(task="reverse"))), device)
    samples, group_ids, returns = sample_batch(cfg, policy, tokenizer)
    critics = make_critics(cfg, policy, tokenizer, device, adam_eps=1e-8)
    shares = partition_shares(group_ids, len(critics.models), torch.Generator().manual_seed(cfg.seed))  # [B, M]
    print(f"{len(critics.models)} critic(s) of {cfg.critic_depth:g} x the policy's layers; group 0's rows per critic:",
          [shares[group_ids == 0, m].nonzero().squeeze(1).tolist() for m in range(shares.shape[1])])  # fmt: skip
    fit_on_shares(critics, samples, returns, shares, cfg.fit_steps)
    R = returns.shape[1]
    all_values = critics.values(samples.input_ids, samples.attention_mask, R, micro_batch=64)  # [M, B, R]
    gen = torch.Generator().manual_seed(cfg.seed)  # orders sigma's ties (detail 6)
    pg_mask, ent_mask, metrics = asyppo_masks(all_values, samples.response_mask, cfg.asyppo_k, cfg.asyppo_h, gen)
    mask = samples.response_mask.float()
    metrics |= value_stats(
        all_values.mean(0), returns, mask, all_values, returns[:, None].expand(-1, len(all_values), -1)
    )
    metrics |= critic_footprint(critics.models, policy, samples.input_ids, samples.attention_mask, R)
    for k, v in metrics.items():
        print(f"{k:32s} {v:.4g}")
    row = int(samples.response_mask.sum(1).argmax())  # the longest response
    tokens = tokenizer.convert_ids_to_tokens(samples.response_ids[row][samples.response_mask[row].bool()].tolist())
    marks = ["P" if not p else "E" if not e else "." for p, e in zip(pg_mask[row].tolist(), ent_mask[row].tolist())]
    print(f"response {row} (score {float(returns[row, 0]):g}), P: PPO term dropped, E: entropy bonus dropped:")
    print(" ".join({"\n": "\\n", " ": "_"}.get(t, t) + m for t, m in zip(tokens, marks)))
    return metrics


if __name__ == "__main__":
    main()
