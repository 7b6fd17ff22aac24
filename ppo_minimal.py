"""PPO and GRPO for a language model, in one file to read top to bottom (the textbook).

    python ppo_minimal.py                                     # PPO (critic + GAE), embedded default
    python ppo_minimal.py --adv-estimator grpo                # GRPO: a group baseline, no critic
    python ppo_minimal.py --model ./my_hf_folder --task add   # any Hugging Face causal LM folder
    torchrun --standalone --nproc_per_node=2 ppo_minimal.py   # data parallel (gloo CPU, nccl GPU)

A task gives prompts and a checker; the checker scores each answer in [0, 1], and RL moves the
weights towards the answers that scored better than expected. train()'s six stanzas:
1. Rollout. Sample G answers to each of N prompts from the current policy, at temperature T.
2. Rewards. The task scores each answer; the score sits on the answer's last token, others get 0.
3. Anchor, reference, values (no gradient). old_logprobs: the policy's log-probabilities of the
   sampled tokens, recomputed at the sampling temperature; PPO's ratio pi / pi_old is 1 before the
   first step. ref_logprobs (the frozen start) track the drift, stats/kl; the critic gives V(s_t).
4. Advantages: how much better than expected each token's choice turned out. PPO: GAE over the
   critic's values, whitened over the batch (the step size ignores the reward's scale). GRPO: the
   score minus its group's mean, over the group's std: the G answers are each other's baseline.
5. Update. PPO_EPOCHS passes over the batch in MINIBATCHES shuffled minibatches, a step each. The
   clipped loss gives no gradient to a token whose ratio left [1 - eps, 1 + eps] the way its
   advantage pushes: several steps on one batch are safe. The critic regresses V on the returns.
6. Log: a row per iteration (out_dir/metrics.jsonl), a greedy evaluation every eval_every.

Data parallel (torchrun), as in nanoGPT: setup() starts the process group, each rank samples its
own prompts (seed + rank) and trains a DDP replica, which averages the gradients. The loss is the
global token mean: ppo_math.agg_denominator all-reduces the minibatch's token count, each rank
divides its token sum by it and multiplies by the world size, so that DDP's average is the
one-process gradient of the whole minibatch. Whitening and the logged metrics pool every rank; a
GRPO group stays on one rank. Shapes: B answers on this rank, P prompt tokens, R answer tokens.

The math is ppo_math.py's (veRL's semantics); the recipe trainer.py's default (tests/test_parity.py:
both end with the same weights, bit for bit). trainer.py adds LoRA, FSDP2, off-policy corrections,
AsyPPO, attention credit, async sampling, environments, your data and rewards, resume, the doctor.
"""

import copy
import os
import time
from dataclasses import dataclass
from functools import partial
from typing import Literal

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ppo_math
from cli import check_fields, parse_config
from common import all_reduce_sum, masked_mean, masked_whiten, reduce_metrics
from rollout import decode_responses, generate, last_valid, sequence_logprobs
from runlog import MetricsLogger
from tasks import format_prompt, load_policy, make_task, stop_token_ids, tokenize_prompts
from warm_start import sft_config_for, sft_warm_start

# The rest of the recipe: trainer.py's defaults (`python trainer.py --help` says more on each).
PPO_EPOCHS = 2  # passes over a batch: more reuse of expensive samples, until the clip binds
MINIBATCHES = 2  # optimizer steps per pass, on shuffled parts of the batch
CLIP = 0.2  # the ratio's trust region [1 - CLIP, 1 + CLIP] (PPO's epsilon)
DUAL_CLIP = 3.0  # A < 0: the loss is capped at 3 |A|, so a huge ratio cannot blow up one step
VALUE_CLIP = 0.5  # the critic's new values stay within 0.5 of its old ones in the loss
GAMMA = LAM = 1.0  # GAE: an answer's reward is not discounted; lambda 1: A = return - V
GRAD_CLIP = 1.0  # gradient norm clipping, policy and critic
CRITIC_LR = 1e-3  # the critic's fresh head must catch up with the returns: 5x the policy's lr
HELD_OUT_SEED = 12345  # the held-out prompts' draw: the same as trainer.py's (evaluation.held_out)
MAX_PROMPT_LEN = 64
MICRO_BATCH, EVAL_BATCH = 128, 256  # rows per no-grad forward; prompts per greedy generate


@dataclass
class Config:
    """`python ppo_minimal.py`: the textbook's knobs (trainer.py has every other one)."""

    model: str | None = None
    """Hugging Face causal LM folder or hub id (None: the embedded tiny model, warm-started)."""
    task: Literal["sort", "reverse", "add", "chain"] = "sort"
    """Built-in task (tasks.py): prompts with an exact answer, scored with partial credit."""
    adv_estimator: Literal["gae", "grpo"] = "gae"
    """gae: PPO with a critic; grpo: a group baseline, no critic."""
    steps: int = 90
    """RL iterations."""
    prompts_per_step: int = 32
    """Prompts per iteration over all ranks (a multiple of the world size)."""
    group_size: int = 4
    """Answers sampled per prompt (G)."""
    lr: float = 2e-4
    """Policy learning rate (AdamW)."""
    warmup_steps: int = 20
    """Linear lr warm-up (iterations), then a cosine decay to 0."""
    max_new_tokens: int = 16
    """Longest answer, in tokens."""
    temperature: float = 0.6
    """Sampling temperature (the logprobs divide the logits by it too)."""
    seed: int = 0
    """Seed (prompts and sampling: seed + rank)."""
    out_dir: str | None = None
    """The run's folder: metrics, the policy (None: a new runs/ppo_minimal-DATE-N)."""
    eval_every: int = 10
    """Greedy evaluation on held-out prompts every this many iterations (0 = never)."""
    eval_n: int = 500
    """Held-out prompts (the trainer's: the same draw)."""

    def __post_init__(self):  # a field out of its range or choices: an error that names it
        check_fields(self, {"[0, inf)": ("warmup_steps", "eval_every", "lr", "seed")})
        check_fields(self, {"(0, inf)": ("temperature",), "[1, inf)": ("steps", "eval_n")})
        check_fields(self, {"[1, inf)": ("prompts_per_step", "max_new_tokens")})
        least = 2 if self.adv_estimator == "grpo" else 1  # a group baseline needs two answers
        check_fields(self, {f"[{least}, inf)": ("group_size",)})


class ValueModel(nn.Module):
    """The critic: a copy of the policy's decoder and a scalar head: V(s_t) at each answer token."""

    def __init__(self, policy):
        super().__init__()
        self.backbone = copy.deepcopy(policy.base_model)  # the decoder, without the LM head
        self.head = nn.Linear(policy.config.hidden_size, 1)
        nn.init.zeros_(self.head.weight)  # V = 0 at first: the first advantages are the returns
        nn.init.zeros_(self.head.bias)

    def forward(self, input_ids, attention_mask, R: int):
        pos = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # [B, P+R] left padding has no position
        out = self.backbone(input_ids, attention_mask, position_ids=pos, use_cache=False)
        return self.head(out.last_hidden_state[:, -R - 1 : -1]).squeeze(-1)  # [B, R] at P + t - 1


def setup(cfg: Config):
    """Under torchrun: a process group (nccl on GPUs, gloo on CPU), this rank's device and batch."""
    cuda = torch.cuda.is_available()
    rank, world = 0, 1
    if "RANK" in os.environ:  # launched by torchrun
        dist.init_process_group("nccl" if cuda else "gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{os.environ.get('LOCAL_RANK', 0)}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    n_local = cfg.prompts_per_step // world * cfg.group_size  # answers this rank samples
    if cfg.prompts_per_step % world or n_local < MINIBATCHES:
        raise ValueError(f"config field 'prompts_per_step' = {cfg.prompts_per_step}: a multiple "
                         f"of {world} ranks, with {MINIBATCHES} answers per rank at least")
    return rank, world, device, n_local


@torch.no_grad()
def evaluate(policy, tok, task, problems, eos_ids, max_new_tokens, rank, world) -> float:
    """Greedy accuracy (score 1) on held-out problems, each rank its share, summed over ranks."""
    mine = problems[rank::world]  # this rank's share
    solved = []
    for i in range(0, len(mine), EVAL_BATCH):
        batch = mine[i : i + EVAL_BATCH]
        texts = [format_prompt(tok, p["prompt"]) for p in batch]
        ids, mask = tokenize_prompts(tok, texts, MAX_PROMPT_LEN)  # [b, P] each
        out = generate(
            policy, ids.to(policy.device), mask.to(policy.device), temperature=0.0,
            max_new_tokens=max_new_tokens, eos_token_ids=eos_ids, pad_token_id=tok.pad_token_id,
        )
        answers = zip(decode_responses(tok, out), batch)
        solved += [task.compute_score(text, p["ground_truth"]) >= 1.0 for text, p in answers]
    counts = torch.tensor([sum(solved), len(mine)], dtype=torch.float64, device=policy.device)
    counts = all_reduce_sum(counts)  # every rank's
    return (counts[0] / counts[1]).item()


def train(cfg: Config) -> dict:
    """The RL loop. Returns the last metrics row and "eval_history": [(step, greedy accuracy)]."""
    # --- 0. processes, models, optimizers, random streams
    rank, world, device, n_local = setup(cfg)  # n_local: the answers this rank samples
    G = cfg.group_size
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank
    policy, tok = load_policy(cfg.model, device)  # dropout off (.eval()): logprobs are exact
    ref = load_policy(cfg.model, device)[0].requires_grad_(False)  # the frozen start, for stats/kl
    critic = ValueModel(policy).eval().to(device) if cfg.adv_estimator == "gae" else None
    if critic is not None:
        critic_train = DDP(critic) if world > 1 else critic
        critic_opt = torch.optim.AdamW(critic.parameters(), CRITIC_LR, weight_decay=0.0)
    policy_train = DDP(policy) if world > 1 else policy  # DDP all-reduces grads inside backward
    opt = torch.optim.AdamW(policy.parameters(), cfg.lr, weight_decay=0.0)  # eps 1e-8 (torch's)
    eos_ids = stop_token_ids(policy, tok)  # EOS, and a chat model's end-of-turn tokens
    task = make_task(cfg.task)
    rng = np.random.default_rng(cfg.seed + rank)  # prompts: each rank its own
    sample_gen = torch.Generator(device=device).manual_seed(cfg.seed + rank)  # and its samples
    shuffle_gen = torch.Generator().manual_seed(cfg.seed)  # minibatches: the same on every rank
    held_out = task.sample(cfg.eval_n, "eval", np.random.default_rng(HELD_OUT_SEED))
    columns = "step rollout/reward_mean eval/acc loss/policy loss/value stats/kl stats/clipfrac"
    logger = MetricsLogger(cfg.out_dir, columns.split(), rank == 0, entry="ppo_minimal",
                           total_steps=cfg.steps)  # rows end with step / steps and the time left
    evaluation = partial(evaluate, policy, tok, task, held_out, eos_ids, cfg.max_new_tokens)
    history = [(0, evaluation(rank, world))] if cfg.eval_every else []  # the start model
    for step in range(cfg.steps):
        t0 = time.perf_counter()
        factor = ppo_math.lr_factor(step, cfg.steps, cfg.warmup_steps, "cosine")
        opt.param_groups[0]["lr"] = cfg.lr * factor
        if critic is not None:
            critic_opt.param_groups[0]["lr"] = CRITIC_LR * factor

        # --- 1. rollout: G answers to each prompt (a group never spans two ranks)
        problems = [p for p in task.sample(n_local // G, "train", rng) for _ in range(G)]
        group_ids = torch.arange(n_local, device=device) // G + rank * n_local  # [B]
        texts = [format_prompt(tok, p["prompt"]) for p in problems]  # the chat template, if any
        prompt_ids, prompt_mask = tokenize_prompts(tok, texts, MAX_PROMPT_LEN)  # [B, P] left-padded
        ro = generate(
            policy, prompt_ids.to(device), prompt_mask.to(device), generator=sample_gen,
            max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
            eos_token_ids=eos_ids, pad_token_id=tok.pad_token_id,
        )
        ids, attn, R = ro.input_ids, ro.attention_mask, ro.response_ids.shape[1]  # [B, P+R] each
        mask = ro.response_mask.float()  # [B, R] 1 on the answer, up to and with its stop token
        t1 = time.perf_counter()

        # --- 2. rewards: the task's score of each answer, on its last token
        answers = zip(decode_responses(tok, ro), problems)  # the sampled tokens' text, no specials
        scores = [float(task.compute_score(text, p["ground_truth"])) for text, p in answers]
        scores = torch.tensor(scores, device=device)  # [B]
        token_rewards = last_valid(mask).float() * scores[:, None]  # [B, R]
        t2 = time.perf_counter()

        # --- 3. anchor, reference and values, without gradient
        lp = {"temperature": cfg.temperature, "micro_batch": MICRO_BATCH}  # logits / T: as sampled
        with torch.no_grad():
            old_logprobs = sequence_logprobs(policy, ids, attn, R, **lp)[0]  # [B, R] PPO's anchor
            ref_logprobs = sequence_logprobs(ref, ids, attn, R, **lp)[0]  # [B, R]
            old_values = critic(ids, attn, R) if critic is not None else None  # [B, R]

        # --- 4. advantages [B, R], 0 on padding
        if critic is not None:  # GAE (its eq. 16) on the values, then whitened over all ranks
            advantages, returns = ppo_math.gae(token_rewards, old_values * mask, mask, GAMMA, LAM)
            advantages = masked_whiten(advantages, mask, global_=True) * mask
        else:  # GRPO: (score - group mean) / group std, on every token of the answer
            advantages = ppo_math.group_advantages(scores, group_ids)[:, None] * mask

        # --- 5. update: PPO_EPOCHS x MINIBATCHES steps of the policy (and of the critic)
        stats = []  # one dict per minibatch
        for _ in range(PPO_EPOCHS):
            for mb in torch.randperm(len(ids), generator=shuffle_gen).tensor_split(MINIBATCHES):
                m_mask = mask[mb]  # [b, R]
                denom = ppo_math.agg_denominator(m_mask, "token-mean")  # tokens of all ranks
                logp, entropy = sequence_logprobs(
                    policy_train, ids[mb], attn[mb], R, temperature=cfg.temperature,
                    micro_batch=len(mb), with_entropy=True, entropy_grad=False,
                )  # [b, R] each; the entropy only for the log
                loss, m = ppo_math.policy_loss(
                    logp, old_logprobs[mb], advantages[mb], m_mask, clip_low=CLIP, clip_high=CLIP,
                    dual_clip=DUAL_CLIP, denom=denom, world=world,
                )  # PPO's clip + dual clip, token mean
                loss.backward()
                s = {f"stats/{k}": m[k].item() for k in ("clipfrac", "approx_kl")}
                s["loss/policy"] = loss.item()
                s["stats/entropy"] = masked_mean(entropy.detach(), m_mask).item()
                grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), GRAD_CLIP)
                s["stats/grad_norm"] = grad_norm.item()
                opt.step()
                opt.zero_grad(set_to_none=True)
                if critic is not None:  # the clipped value loss towards the returns, same tokens
                    values = critic_train(ids[mb], attn[mb], R)  # [b, R]
                    v_loss, _ = ppo_math.value_loss(
                        values, old_values[mb], returns[mb], m_mask, clip=VALUE_CLIP,
                        denom=denom, world=world,
                    )
                    v_loss.backward()
                    torch.nn.utils.clip_grad_norm_(critic.parameters(), GRAD_CLIP)
                    critic_opt.step()
                    critic_opt.zero_grad(set_to_none=True)
                    s["loss/value"] = v_loss.item()
                stats.append(s)
        t3 = time.perf_counter()

        # --- 6. log: means over minibatches, then over ranks; a greedy evaluation now and then
        row = {k: float(np.mean([s[k] for s in stats])) for k in stats[0]}
        row["rollout/reward_mean"] = scores.mean().item()
        row["rollout/response_len"] = mask.sum(-1).mean().item()
        row["stats/lr"] = opt.param_groups[0]["lr"]
        row.update({"time/rollout": t1 - t0, "time/train": t3 - t2})
        row = reduce_metrics(row, device)  # the mean over ranks
        kl = ppo_math.kl_estimate(old_logprobs, ref_logprobs) * mask  # [B, R] k1, before the update
        row["stats/kl"] = masked_mean(kl, mask, global_=True).item()
        if cfg.eval_every and ((step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps):
            history.append((step + 1, evaluation(rank, world)))
            row["eval/acc"] = history[-1][1]
        logger.log(step + 1, row)
    if rank == 0:  # a folder AutoModelForCausalLM.from_pretrained loads
        policy.save_pretrained(logger.dir / "policy")
        tok.save_pretrained(logger.dir / "policy")
    return {**row, "eval_history": history}


def main(argv=None):
    """Parse the flags, warm-start the embedded model (no --model), train, print the evaluations."""
    cfg = parse_config(Config, argv)
    # RL from ~0 % success has no signal: the tiny model first gets a short SFT (warm_start.py)
    cfg.model = cfg.model or str(sft_warm_start(sft_config_for(cfg.task)))
    out = train(cfg)
    if int(os.environ.get("RANK", 0)) == 0 and out["eval_history"]:
        evals = ", ".join(f"{s}: {a:.3f}" for s, a in out["eval_history"])
        print(f"eval accuracy by step: {evals}")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
