"""Train an unmodified agent program: its processes play through the model proxy, the trainer learns what it sampled.

    python agent_train.py --agent examples/calc_agent.py --agents 16 --adv-estimator grpo
    python agent_train.py --agents 4 --steps 2 --rollout-engine vllm     # the proxy samples with vLLM (its venv)

The agent program knows nothing of minrl: it talks to an OpenAI-compatible endpoint and to the environment server
(`examples/calc_agent.py`: the official `openai` client, a calculator tool). Each iteration:
1. the policy's current weights go to the proxy (model_proxy.py: it records every sampled id and its logprob);
2. the agent processes (agent_pool.py) play G sessions per environment seed, a GRPO group, against the environment
   server (env_service.py), and post each session's return to the proxy;
3. what the proxy recorded becomes the batch (model_proxy.sessions_rollout: token in token out, one sample per
   session), and trainer.train updates on it: this file is train()'s sampler (`train(cfg, sampler=...)`).
Before and after training, the agent's greedy success on eval_n held-out seeds, through the same proxy.

Implementation details (our choices)
1. Staleness 0: the weights load before an iteration's agents start, and the iteration waits for every agent.
2. The proxy generates on the trainer's thread while the agents play (ModelProxy.serve_while: on CPU a second thread
   running torch ops would own a second OpenMP team, model_proxy.py detail 1).
3. The sampler: a copy of the policy (rollout.inference_copy: --rollout-dtype's, or a plain copy in float32), its
   weights copied in each iteration; or with `--rollout-engine vllm` a vLLM engine on the policy's model folder
   (vllm_engine.py), synced each iteration (vllm_engine.sync_weights), each request's vLLM seed drawn from that
   request's own stream (model_proxy.py detail 1). On a GPU the engine is built without sleep mode: it holds its
   gpu_memory_utilization share during the trainer's update too (simpler; waking it in load_weights and putting it
   to sleep after the play would give that share back: not done, GPU only). Under torchrun it is refused: each
   rank's proxy would call its engine as its agents' requests come, while the ranks' engines must step together
   (vllm_engine.py detail 5).
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

import rollout
import vllm_engine
from agent_pool import AgentPool
from cli import check_fields, parse_config
from common import make_autocast
from env_service import ServiceArgs, start_server, stop_server
from model_proxy import ModelProxy, ProxyArgs, sessions_rollout
from openai_api import start_proxy, stop_proxy
from runlog import stopping_cleanly
from tasks import load_tokenizer
from trainer import Config, train
from warm_start import sft_config_for, sft_warm_start


@dataclass
class AgentConfig(Config):
    """`python agent_train.py`: the trainer's knobs, and the agent processes'."""

    help_first = ("AgentConfig", *Config.help_first)

    agent: str = str(Path(__file__).resolve().parent / "examples" / "calc_agent.py")
    """The agent program: `python AGENT --base-url URL/v1 --env-url URL --max-turns N`, SEED:SESSION:SPLIT on stdin."""
    agents: int = 16
    """Agent processes (each plays its share of an iteration's episodes, concurrently: agent_pool.py)."""
    agent_timeout: float = 600.0
    """Seconds an iteration's agents may take (then the run stops, naming them)."""
    gather_ms: float = 5.0
    """The proxy's batching window (ProxyArgs.gather_ms)."""
    task: str = "calc"

    def __post_init__(self):
        super().__post_init__()
        ranges = {"[1, inf)": ("agents", "steps"), "(0.0, inf)": ("agent_timeout",), "[0.0, inf)": ("gather_ms",)}
        check_fields(self, ranges, AgentConfig)
        if self.rollout_engine == "vllm" and int(os.environ.get("WORLD_SIZE", "1")) > 1:  # detail 3
            raise ValueError(
                "config field 'rollout_engine' = 'vllm' needs world size 1 here: each rank's proxy would call its "
                "engine as its agents' requests come, while the ranks' engines must step together (vllm_engine.py)"
            )


class AgentSampler:
    """train()'s sampler: each iteration the weights go to the proxy, the agent processes (agent_pool.py) play the
    episodes, G sessions per env seed (a GRPO group), and what the proxy recorded becomes the batch."""

    def __init__(self, cfg: AgentConfig, proxy: ModelProxy, proxy_url: str, env_url: str):
        self.cfg, self.proxy, self.rng = cfg, proxy, np.random.default_rng(cfg.seed)  # rng: training env seeds
        args = ["--base-url", proxy_url + "/v1", "--env-url", env_url, "--max-turns", str(cfg.max_turns)]
        self.pool = AgentPool(cfg.agent, cfg.agents, args, cfg.agent_timeout)

    def play(self, seeds: list[int], tag: str, split: str = "train") -> list[dict]:
        """Play `seeds` (one session each) on the agent processes; the sessions the proxy recorded, in order."""
        names = [f"{tag}-{i}" for i in range(len(seeds))]
        self.proxy.serve_while(self.pool.play, list(zip(seeds, names)), split)  # (their returns: as posted)
        return [self.proxy.session(n, pop=True) for n in names]

    def __call__(self, step: int, policy):
        synced = self.proxy.load_weights(policy, step)  # iteration `step` samples from its weights (staleness 0)
        G, n = self.cfg.group_size, self.cfg.prompts_per_step
        seeds = [int(s) for s in self.rng.integers(2**31, size=n) for _ in range(G)]
        sessions = self.play(seeds, f"it{step}")
        dev = next(policy.parameters()).device
        rollout, owner, stats = sessions_rollout(sessions, self.proxy.tokenizer.pad_token_id, dev)
        blank = {"cut": False, "context_cut": False, "malformed": 0, "env_s": []}  # what an agent does not tell
        played = [sessions[k] for k in owner]  # each sample's session
        episodes = [
            {**blank, "return": s["reward"], "success": s["reward"] >= 1, "turns": len(s["records"])} for s in played
        ]
        return rollout, episodes, torch.tensor(owner, device=dev) // G, {**stats, "time/sync": synced}

    def greedy_success(self, n: int, tag: str) -> float:
        """Success of the agent on n held-out env seeds with the proxy's policy greedy."""
        sampling, self.proxy.sampling = self.proxy.sampling, {"temperature": 0.0}
        seeds = [int(s) for s in np.random.default_rng(12345).integers(2**31, size=n)]  # evaluation.held_out's draw
        try:
            return float(np.mean([s["reward"] >= 1 for s in self.play(seeds, tag, "eval")]))
        finally:
            self.proxy.sampling = sampling


def train_agent(cfg: AgentConfig, hooks=()) -> dict:
    """Train the policy on what `cfg.agent`'s processes do through a proxy, an environment server in this process.
    Returns train()'s result and "agent_success": the agent's greedy success on eval_n held-out seeds, before, after."""
    # room for every episode the agents may open at once: an iteration's, or an evaluation's (eval_n at once)
    at_once = max(256, cfg.eval_n, cfg.prompts_per_step * cfg.group_size)
    env_server = start_server(ServiceArgs(port=0, max_sessions=at_once))
    box = {}

    def sampler(step, policy):
        if "s" not in box:  # the proxy samples with a copy of the policy or an engine, synced every iteration
            source = cfg.model or str(sft_warm_start(sft_config_for(cfg.task, cfg.sft_target)))
            limits = dict(max_tokens=cfg.max_new_tokens, max_context=cfg.max_context, max_sessions=at_once)
            args = ProxyArgs(**limits, gather_ms=cfg.gather_ms, idle_timeout=0)
            sampling = {k: getattr(cfg, k) for k in ("temperature", "top_p", "top_k")}  # the trainer's, always
            if cfg.rollout_engine == "vllm":  # detail 3: awake throughout (no sleep mode), its own dtype
                box["engine"] = vllm_engine.sampling_engine(cfg, policy, source, sleep=False)
                model = policy  # (the proxy reads its device and stop ids from it; the engine samples)
            else:
                model = rollout.inference_copy(policy, cfg.rollout_dtype)  # float32: the policy itself, so copied
                model = copy.deepcopy(policy) if model is policy else model
            proxy = ModelProxy(
                model,
                load_tokenizer(source),
                args,
                sampling,
                seed=cfg.seed,
                autocast=make_autocast(cfg.dtype, next(policy.parameters()).device),  # train()'s (not an engine's)
                batch_thread=False,  # it generates on this thread, the trainer's, while agents play (detail 2)
                engine=box.get("engine"),
            )
            proxy.load_weights(policy, step)  # the policy's weights (an engine holds its folder's, a resume moved on)
            box["server"] = start_proxy(proxy)
            box["s"] = AgentSampler(cfg, proxy, box["server"].url, env_server.url)
            box["before"] = box["s"].greedy_success(cfg.eval_n, "eval0")
        box["policy"] = policy
        return box["s"](step, policy)

    try:
        out = train(cfg, hooks=hooks, sampler=sampler)
        box["s"].proxy.load_weights(box["policy"], cfg.steps)
        out["agent_success"] = (box["before"], box["s"].greedy_success(cfg.eval_n, "eval1"))
        return out
    finally:
        if "s" in box:
            box["s"].pool.close()
        if "server" in box:
            stop_proxy(box["server"])
        stop_server(env_server)
        vllm_engine.release(box.get("engine"))  # last: its close also ends the process group vLLM made


def main(argv=None) -> None:
    """Train the agent program, then print its greedy success before and after."""
    cfg = parse_config(AgentConfig, argv)
    with stopping_cleanly(cfg):  # Ctrl-C or SIGTERM: result.json and curves.png as far as the run got
        out = train_agent(cfg)
    before, after = out["agent_success"]
    print(f"[minrl] greedy success of the agent on {cfg.eval_n} held-out episodes: {before:.3f} -> {after:.3f}")


if __name__ == "__main__":
    main()
