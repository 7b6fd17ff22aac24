"""vLLM as the sampler: a colocated engine on the policy's weights, synced before every rollout, returning a Rollout.

    python vllm_engine.py        # in the vLLM environment (requirements-vllm.txt): the embedded model's engine, a
                                 # sync, then its samples and logprobs beside rollout.generate's and the trainer's

`python trainer.py --rollout-engine vllm` samples with this engine instead of `rollout.generate` (the readable HF
decode loop, the default). What a reader learns here: what an RL trainer must do to sample from an inference engine
and still train on-policy. Five things, each a few lines below (4 and 5 for GPUs and torchrun):
1. The engine is built from the policy's model folder (`LLM(model=DIR)`), in this process
   (VLLM_ENABLE_V1_MULTIPROCESSING=0, colocated: the trainer and the engine share the CPU or the GPU), with
   `logprobs_mode="processed_logprobs"`: vLLM's logprob of a sampled token is then log softmax(logits / T) after
   top-k / top-p, the behaviour policy's as docs/design.md section 3 defines it and as `rollout.generate` records
   it. Its default, "raw_logprobs", gives the logprobs of the raw logits (T = 1) whatever T it samples at: a run
   trained on those would see a sampler-trainer gap of the temperature's making.
2. The weights are synced before each rollout (`sync_weights`): the policy's current tensors (a LoRA policy's merged,
   an FSDP2 policy's gathered whole) go to the engine's model through
   `collective_rpc("reload_weights", ...)`, vLLM's public call to a worker method (written for vLLM 0.32; the
   worker's `model.load_weights` is not used: on CPU its parameters lack the `weight_loader` it needs), then the
   prefix cache is reset (cached KV of the old weights would answer a repeated prompt). Without the sync the engine
   samples from the weights it was built with: a stale sampler, which `stats/rollout_vs_old_logp_diff` shows at once
   (repro.py's `stale_sampler` plants it; the doctor names it: tests_vllm/).
3. Sampling takes the trainer's parameters (temperature, top-p, top-k, max tokens, stop ids) and one seed per
   request drawn from the trainer's generator (a run repeats for a seed), and returns the Rollout of
   `rollout.generate`: prompts left-padded, responses right-padded, the mask up to and including the first stop
   token, the engine's logprobs, `truncated` where it ran out of tokens.
4. On a GPU the engine and the trainer share the device: the engine takes `gpu_memory_utilization` of it, and in
   vLLM's sleep mode (level 2) it frees its weights and KV cache after each rollout; `sampling` wakes the weights'
   memory, syncs, then wakes the KV cache, so that the sync's source tensors and the KV cache are not held at once.
5. Under torchrun every rank builds its own engine (tensor parallel 1) with vLLM's `external_launcher` backend: no
   processes of its own, its data-parallel group made from the trainer's ranks (`data_parallel_size` = the world
   size), each rank's engine sampling that rank's prompts (tests_vllm: two ranks under gloo on CPU). The engines
   all-reduce at every step, so every rank must call generate as often as the others, which multi-turn episodes
   do not (a rank whose episodes end in 2 turns would leave one that needs 5 waiting on it). So before each call
   the ranks agree (an all-reduce of "I sample"), and a rank done with its rollout (`drain`) joins its peers'
   remaining calls with a one-token stand-in request until none samples.
`--rollout-dtype bfloat16` makes no copy of ours with an engine: it is the engine's dtype (vLLM's bf16 kernels, a real
sampler-trainer gap that mismatch.py --engine vllm measures and --rollout-is corrects). With --fsdp the sync gathers
the whole weights on every rank (`full_state`). Where the flag is refused: `async_loop.py`, whose rollout ranks sample
on clocks of their own, while an engine built in a process of a torchrun world takes that whole world for its own (vLLM
0.32's init_distributed_environment), so that every rank would step with it. `agent_train.py` (an agent program through
model_proxy.py) takes it at world size 1 (a seed per request, weights synced between batches). A `--dump-batch` replay
recomputes the update from the dumped batch, which does not depend on the engine. In the trainer's process vLLM's CPU
worker sets torch's thread count, the engine's build reseeds torch's global RNG (the run's seed: the same every run),
and its close destroys the default process group (its own, or under torchrun the trainer's: `release` comes last).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from dataclasses import dataclass

import torch

import common
import rollout
import tasks
from lora import adapter_state
from rollout import Rollout, generate, left_pad, sequence_logprobs

INSTALL = "bash scripts/install_vllm.sh makes a venv with it (requirements-vllm.txt: it pins transformers 5.19)"


@dataclass
class EngineArgs:
    """The engine's own settings (the sampling ones are the trainer's)."""

    max_model_len: int | None = None  # prompt + response tokens per sequence (None: the model config's limit)
    kv_cache_bytes: int = 256 << 20  # CPU: the KV cache's size (vLLM's default takes most of the host's memory)
    dtype: str = "float32"  # the engine's weights and compute (the trainer's --rollout-dtype)
    gpu_memory_utilization: float = 0.3  # GPU only: the engine's share of the device, the trainer keeps the rest
    sleep: bool = True  # GPU only: the engine frees its weights and KV cache between rollouts (vLLM's sleep mode)
    seed: int = 0


class Engine:
    """A vLLM engine on the model in `folder` (its config and tokenizer; the weights are synced from the policy).
    `lora`: a LoRA run's LoraArgs (its adapters are merged for the sync), else None."""

    def __init__(self, folder: str, args: EngineArgs | None = None, lora=None):
        args, self.lora = args or EngineArgs(), lora
        try:
            import vllm
        except ImportError as e:
            raise ImportError(f"--rollout-engine vllm needs vLLM: {INSTALL}") from e
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # detail 1: in this process, beside the trainer
        self.vllm, t0 = vllm, time.perf_counter()
        gpu = torch.cuda.is_available()
        self.sleeps = gpu and args.sleep  # detail 4
        kw = {"gpu_memory_utilization": args.gpu_memory_utilization, "enable_sleep_mode": self.sleeps} if gpu else {}
        # CPU: vLLM's default KV cache would take most of the RAM; chunked prefill off, because after a chunk vLLM
        # 0.32 rewinds a seeded request's generator, which a CPU generator cannot do ("does not use offset")
        kw = kw or {"kv_cache_memory_bytes": args.kv_cache_bytes, "enable_chunked_prefill": False}
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        if world > 1:  # detail 5: one engine per rank, in the trainer's process group, each sampling its own prompts
            kw.update(
                distributed_executor_backend="external_launcher", tensor_parallel_size=1, data_parallel_size=world
            )
        self.llm = vllm.LLM(
            model=str(folder),
            dtype=args.dtype,
            enforce_eager=True,
            max_model_len=args.max_model_len,
            seed=args.seed,
            logprobs_mode="processed_logprobs",
            **kw,
        )
        self.start_s = time.perf_counter() - t0  # build, profile and warm-up
        self.world = world
        if self.sleeps:  # asleep until the first rollout: the trainer has the device
            self.llm.sleep(level=2)

    def agree(self, sampling: bool) -> bool:
        """Detail 5: whether any rank samples now (an all-reduce of `sampling`; at world 1 just `sampling`)."""
        if self.world == 1:
            return sampling
        nccl = torch.distributed.get_backend() == "nccl"
        flag = torch.tensor([int(sampling)], device=torch.cuda.current_device() if nccl else "cpu")
        common.collective(torch.distributed.all_reduce, flag, op=torch.distributed.ReduceOp.MAX)  # names a lost rank
        return bool(flag.item())

    def drain(self) -> None:
        """Detail 5, at the end of a rollout: one-token stand-in calls while any other rank still samples."""
        while self.agree(False):
            standin = self.vllm.SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
            self.llm.generate([self.vllm.TokensPrompt(prompt_token_ids=[0])], standin, use_tqdm=False)

    def close(self) -> None:
        """Stop the engine's core; vLLM then destroys its own process groups and the default one, whoever made it
        (under torchrun the trainer's: the trainer releases the engine last)."""
        self.llm.llm_engine.engine_core.shutdown()

    def generate(
        self,
        model,
        prompt_ids,
        attention_mask,
        *,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        eos_token_ids: list[int],
        pad_token_id: int,
        generator: torch.Generator | list[torch.Generator] | None = None,
    ) -> Rollout:
        """rollout.generate's signature and Rollout (detail 3); generator None or temperature 0: greedy, a list: one
        stream per row (model_proxy's requests), each row's seed drawn from its own. `model`: the policy whose weights
        were synced (unused: it keeps rollout.generate's signature, for rollout_env and model_proxy)."""
        rows = [ids[m.bool()].tolist() for ids, m in zip(prompt_ids.cpu(), attention_mask.cpu())]  # unpadded
        greedy = generator is None or temperature == 0
        draw = lambda g, n: torch.randint(2**62, (n,), generator=g, device=g.device).tolist()  # noqa: E731
        if greedy:
            seeds = [None] * len(rows)
        else:
            seeds = [draw(g, 1)[0] for g in generator] if isinstance(generator, list) else draw(generator, len(rows))
        params = [
            self.vllm.SamplingParams(
                n=1,
                temperature=0.0 if greedy else temperature,
                top_p=1.0 if greedy else top_p,
                top_k=0 if greedy else top_k,
                max_tokens=max_new_tokens,
                stop_token_ids=list(eos_token_ids),
                seed=seed,
                logprobs=0,
                detokenize=False,
                ignore_eos=True,  # the stop ids are eos_token_ids alone, as for rollout.generate
            )
            for seed in seeds
        ]
        prompts = [self.vllm.TokensPrompt(prompt_token_ids=r) for r in rows]
        self.agree(True)  # detail 5: the ranks done with their rollout make a stand-in call beside this one
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        return to_rollout(prompt_ids, attention_mask, outs, max_new_tokens, eos_token_ids, pad_token_id)


@torch.no_grad()
def sync_weights(engine: Engine, policy) -> float:
    """Detail 2: load the policy's current weights into the engine; returns the seconds it took (a module function,
    as rollout.sync_weights: repro.py's stale_sampler replaces both)."""
    t0 = time.perf_counter()
    weights = [(name, t.detach()) for name, t in full_state(policy, engine.lora).items()]  # copied into its own
    engine.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights)})
    if not engine.llm.reset_prefix_cache():
        raise RuntimeError("vLLM did not reset its prefix cache after the sync: the old weights' KV would answer")
    return time.perf_counter() - t0


def sampling_engine(cfg, policy, source: str, sampler=None, sleep: bool = True):
    """The trainer's sampler: the policy itself, its --rollout-dtype copy (rollout.inference_copy), or with
    --rollout-engine vllm an Engine on the model folder `source`, with the run's seed (`sleep`: detail 4). Given a
    `sampler` of its own: the policy (that sampler samples by its own means: agent_train.py's proxy builds its
    engine, async_loop.py's rollout ranks refuse the flag)."""
    if sampler is not None:
        return policy
    if cfg.rollout_engine == "vllm":
        args = EngineArgs(dtype=cfg.rollout_dtype, seed=cfg.seed, sleep=sleep)
        return Engine(source, args, lora=cfg if cfg.lora_rank else None)
    return rollout.inference_copy(policy, cfg.rollout_dtype)


def release(engine) -> None:
    """The end of a run: an Engine's close (the policy or its copy hold nothing to release)."""
    if isinstance(engine, Engine):
        engine.close()


@contextlib.contextmanager
def sampling(engine, policy, autocast=contextlib.nullcontext):
    """One rollout's sampler: the policy's current weights into `engine`, then yields the (model, sample) that
    rollout.rollout_env takes and the sync's metric {"time/sync": seconds}. For the policy or its copy
    (rollout.sync_weights): rollout.generate under the trainer's `autocast`, FSDP2 weights whole inside (ranks'
    forwards may differ in number). For an Engine: woken (GPU), synced, and its generate outside any autocast (it
    runs in its own dtype) with the policy left sharded; asleep again after (detail 4). time/sync includes waking."""
    t0 = time.perf_counter()
    if not isinstance(engine, Engine):
        rollout.sync_weights(engine, policy)  # --rollout-dtype bfloat16: the trained weights, rounded
        with autocast(), common.gathered(policy):
            yield engine, rollout.generate, {"time/sync": time.perf_counter() - t0}
        return
    try:
        if engine.sleeps:
            engine.llm.wake_up(tags=["weights"])  # the weights' memory first, the KV cache once they are in
        sync_weights(engine, policy)
        if engine.sleeps:  # the sync's freed source back to the device (torch's cache), for the KV cache vLLM maps
            torch.cuda.empty_cache()
            engine.llm.wake_up(tags=["kv_cache"])
        yield policy, engine.generate, {"time/sync": time.perf_counter() - t0}
        engine.drain()  # under torchrun, until every rank's rollout is done (detail 5)
    finally:
        if engine.sleeps:  # level 2: weights and KV cache dropped (the next sync reloads the weights)
            engine.llm.sleep(level=2)


def full_state(policy, lora=None) -> dict[str, torch.Tensor]:
    """The policy's weights as its checkpoint names them, whole: an FSDP2 policy's DTensors gathered, a LoRA policy's
    adapters merged (W0 + (alpha / r) B A under the base model's names: lora.adapter_state, as --lora-merge saves)."""
    state = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in policy.state_dict().items()}
    return adapter_state(policy, state, merge=True, args=lora) if lora is not None else state


def to_rollout(prompt_ids, attention_mask, outs, max_new_tokens, eos_token_ids, pad_token_id) -> Rollout:
    """vLLM's RequestOutputs as rollout.generate's Rollout: each response cut after its first stop token."""
    dev, stops = prompt_ids.device, set(eos_token_ids)
    ids, logps, done = [], [], []
    for out in outs:
        o = out.outputs[0]
        toks = list(o.token_ids)
        n = next((i + 1 for i, t in enumerate(toks) if t in stops), len(toks))  # up to and including the stop token
        ids.append(toks[:n])
        logps.append([lp[t].logprob for t, lp in zip(toks[:n], o.logprobs)])
        done.append(n > 0 and toks[n - 1] in stops)
    R = max(1, max(len(x) for x in ids))
    response = torch.full((len(ids), R), pad_token_id, dtype=prompt_ids.dtype)
    mask, logp = torch.zeros(len(ids), R, dtype=attention_mask.dtype), torch.zeros(len(ids), R)
    for j, (x, lp) in enumerate(zip(ids, logps)):
        response[j, : len(x)], mask[j, : len(x)], logp[j, : len(x)] = torch.tensor(x), 1, torch.tensor(lp)
    return Rollout(
        prompt_ids=prompt_ids,
        response_ids=response.to(dev),
        attention_mask=torch.cat([attention_mask, mask.to(dev)], dim=1),
        response_mask=mask.to(dev),
        rollout_logprobs=logp.to(dev),
        truncated=torch.tensor([not d for d in done], device=dev),
    )


def main() -> None:
    """The embedded model's engine: its greedy tokens and sampled logprobs against rollout.generate and the trainer."""
    tok = tasks.make_tokenizer()
    torch.manual_seed(0)
    policy = tasks.make_tiny_model(tok).eval()
    with tempfile.TemporaryDirectory() as folder:
        policy.save_pretrained(folder)
        tok.save_pretrained(folder)
        engine = Engine(folder, EngineArgs(max_model_len=128))
        print(f"engine built in {engine.start_s:.1f} s")
        torch.manual_seed(1)
        for p in policy.parameters():  # new weights: the engine must follow them after a sync
            p.data += 0.02 * torch.randn_like(p)
        print(f"weights synced in {sync_weights(engine, policy):.2f} s")
        prompts = [tok(tok.bos_token + f"{i}+{2 * i}=", add_special_tokens=False).input_ids for i in range(4)]
        ids, mask = left_pad(prompts, tok.pad_token_id)
        stops = {"eos_token_ids": [tok.eos_token_id], "pad_token_id": tok.pad_token_id, "max_new_tokens": 8}
        ours = generate(policy, ids, mask, temperature=0.0, **stops)
        theirs = engine.generate(policy, ids, mask, **stops)
        print("greedy tokens equal rollout.generate's:", torch.equal(ours.response_ids, theirs.response_ids))
        out = engine.generate(policy, ids, mask, temperature=0.6, generator=torch.Generator().manual_seed(0), **stops)
        recompute, _ = sequence_logprobs(
            policy, out.input_ids, out.attention_mask, out.response_ids.shape[1], temperature=0.6
        )
        gap = ((out.rollout_logprobs - recompute).abs() * out.response_mask).max().item()
        print(f"T 0.6: the engine's logprobs against the trainer's recompute: max |diff| {gap:.2e}")


if __name__ == "__main__":
    main()
