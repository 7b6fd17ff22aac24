"""Train an unmodified agent: an OpenAI-compatible endpoint on the policy that records the tokens it sampled.

    python model_proxy.py                        # demo: a proxy on a free port, a two-turn chat through it
    python model_proxy.py --serve --port 8200    # serve the embedded policy (or --model) until Ctrl-C
    python model_proxy.py --agent examples/calc_agent.py --agents 16 --adv-estimator grpo   # train an agent program

An agent calls an ordinary chat endpoint (`OpenAI(base_url="http://HOST:PORT/v1", api_key="none")`); the proxy answers
with the current policy and records per request the prompt ids (the chat template applied here, once), the sampled
ids, their logprobs and the policy version, under the caller's session (header `X-Session-Id`, else the `user` field).
A session becomes samples token in token out (`session_samples`), sessions a Rollout (`sessions_rollout`), rewarded
by what the agent posts; `--agent` trains on them (AgentSampler, train()'s sampler). The API (OpenAI's schema where
it has one; every error is {"error": {"message", "type", "code"}} with its status):
    GET  /v1/models                -> {"object": "list", "data": [{"id", "object": "model", "owned_by"}]}
    POST /v1/chat/completions      {"messages", "max_tokens" | "max_completion_tokens", "temperature", "top_p",
                                    "stream", "user", "n" (1)} -> a chat.completion; with "stream": true server-sent
                                    chat.completion.chunk events, then `data: [DONE]`
    POST /v1/sessions/ID/reward    {"reward": number} -> {"session", "reward"}    (the episode's return)
    GET | DELETE /v1/sessions/ID   -> {"session", "reward", "records": [{prompt_ids, ids, logprobs, version, ...}]}
Sampling (DESIGN.md section 3): the behaviour policy must be the trained one, so the client's temperature and top_p
are recorded and replaced by the trainer's; the answer's `minrl` field says what was asked and what was used.

Implementation details (our choices)
1. Batching: requests wait in a queue; one thread takes the first, then the next while each comes within gather_ms
   of the last (at most max_batch), and calls rollout.generate once; each request gets its row, cut at its own
   max_tokens (a prefix of a sample is a sample of the shorter one). A stream sends the answer a token per chunk.
2. Weights: the proxy samples from its own model; `load_weights` copies new ones in between two batches (the batch
   lock): no answer mixes versions. AgentSampler loads them before an iteration's agents start and waits for them
   to finish: staleness 0. Which requests share a batch depends on timing: sampled runs are not bit-reproducible.
3. Token in token out: a rendered prompt that starts with the previous request's prompt text plus the decoded text
   of what was sampled for it reuses those ids (`extends`) and tokenises only what the agent appended. Re-tokenising
   the decoded chat would not give back a segmentation the tokenizer would not choose (a BPE merge the model
   skipped): the trainer would train on a sequence the policy never produced (verl #6719, prime-rl #1334). Content
   keeps special tokens but a final stop token (the template writes it back): an agent resends what was sampled.
4. Sessions to samples: a chain of extending requests is one multi-turn sample (mask 1 on the sampled ids, 0 on the
   rest), the session's reward at its last sampled token; a rewritten history starts another sample, same reward
   (proxy/prefix_breaks). A tokenizer without a chat template (the embedded model) gets TEMPLATE: bos, then each
   message's content, an assistant's followed by eos: rollout_env's layout, so the ids are an env episode's.
"""

from __future__ import annotations

import copy
import json
import math
import queue
import secrets
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

import env_service
from cli import check_fields, parse_config
from env_service import HTTPError, Server, ServiceArgs, request, start_server, stop_server
from ppo_minimal import Config, train
from rollout import Rollout, generate, left_pad, pack_tracks
from tasks import load_policy, make_tiny_model, make_tokenizer, stop_token_ids
from warm_start import sft_config_for, sft_warm_start

TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% if m['role'] == 'assistant' %}{{ eos_token }}"
            "{% endif %}{% endfor %}")  # fmt: skip


@dataclass
class ProxyArgs:
    """`python model_proxy.py`: the proxy's address, batching and limits."""

    host: str = "127.0.0.1"
    """Address to bind (127.0.0.1: this machine only; there is no authentication)."""
    port: int = 8200
    """Port to bind (0 = any free port)."""
    serve: bool = False
    """Serve until Ctrl-C (otherwise: the demo, a two-turn chat through a proxy on a free port)."""
    model: str | None = None
    """A Hugging Face model name or folder to serve (None: the embedded tiny model at random init)."""
    gather_ms: float = 5.0
    """How long the batcher waits for one more request of a batch (after the first, and after each next one)."""
    max_batch: int = 64
    """Requests per generate call at most."""
    max_tokens: int = 64
    """Tokens per answer when the request names none, and the most a request may ask for."""
    max_context: int = 1024
    """Prompt tokens at most (a longer prompt: 400 context_length_exceeded)."""
    max_body_bytes: int = 1 << 20
    """Largest request body (413 beyond)."""
    request_timeout: float = 120.0
    """Seconds a request may wait for its answer (batch queue included) before a 503."""

    def __post_init__(self):
        ints = ("max_batch", "max_tokens", "max_context", "max_body_bytes")
        check_fields(self, {"[0, 65535]": ("port",), "[1, inf)": ints, "[0.0, inf)": ("gather_ms",),
                            "(0.0, inf)": ("request_timeout",)})  # fmt: skip


@dataclass
class Pending:
    """One request in the batch queue: its prompt ids, its token budget, and where its answer goes."""

    prompt_ids: list[int]
    max_tokens: int
    done: threading.Event = field(default_factory=threading.Event)
    ids: list[int] | None = None
    logprobs: list[float] | None = None
    version: int = -1
    error: Exception | None = None


class ModelProxy:
    """The policy behind the API: the batch queue, the sessions' records, weight updates (details 1-3)."""

    def __init__(self, model, tokenizer, args: ProxyArgs, sampling: dict, name: str = "minrl-policy", seed: int = 0):
        self.model, self.tokenizer, self.args, self.name = model.eval(), tokenizer, args, name
        self.sampling = dict(sampling)  # temperature, top_p, top_k: the trainer's
        self.eos_ids, self.version = stop_token_ids(model, tokenizer), 0
        self.template = getattr(tokenizer, "chat_template", None) or TEMPLATE
        self.generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
        self.queue, self.batch_lock, self.lock = queue.Queue(), threading.Lock(), threading.Lock()
        self.sessions = {}  # id -> {"records": [...], "reward": None | float}
        self.stop = threading.Event()
        threading.Thread(target=self.batcher, daemon=True).start()

    def render(self, messages: list[dict]) -> str:  # the chat as the model sees it, ready for the answer
        return self.tokenizer.apply_chat_template(messages, chat_template=self.template, tokenize=False,
                                                  add_generation_prompt=True)  # fmt: skip

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def prompt_ids(self, records: list[dict], text: str) -> tuple[list[int], bool]:
        """(ids of the rendered prompt `text`, whether they extend the session's last record: detail 3)."""
        if records:
            last = records[-1]
            before = last["prompt_text"] + self.tokenizer.decode(last["ids"], skip_special_tokens=False)
            if text.startswith(before):
                return last["prompt_ids"] + last["ids"] + self.encode(text[len(before) :]), True
        return self.encode(text), False

    def complete(self, session: str, messages: list[dict], max_tokens: int, asked: dict) -> dict:
        """Sample an answer to `messages` in `session` and record it; returns the record."""
        try:
            text = self.render(messages)
        except Exception as e:  # the chat template refused the conversation (e.g. roles must alternate)
            raise HTTPError(400, f"the chat template cannot render these messages: {e}") from e
        with self.lock:
            s = self.sessions.setdefault(session, {"records": [], "reward": None})
            ids, extends = self.prompt_ids(s["records"], text)
        if len(ids) > self.args.max_context:
            raise HTTPError(400, f"the prompt has {len(ids)} tokens > max_context {self.args.max_context}")
        p = Pending(ids, max_tokens)
        self.queue.put(p)
        if not p.done.wait(self.args.request_timeout) or p.error is not None:
            raise p.error or HTTPError(503, f"no answer within request_timeout = {self.args.request_timeout} s")
        stopped = bool(p.ids) and p.ids[-1] in self.eos_ids
        record = {"prompt_ids": ids, "prompt_text": text, "ids": p.ids, "logprobs": p.logprobs, "version": p.version,
                  "extends": extends, "finish_reason": "stop" if stopped else "length", "asked": asked}  # fmt: skip
        with self.lock:
            s["records"].append(record)
        return record

    def content(self, record: dict, n: int | None = None) -> str:
        """The answer's text: its first n sampled ids decoded, special ones included but a final stop token, so
        that an agent resending it resends what the model produced (detail 3)."""
        ids = record["ids"][:n]
        return self.tokenizer.decode(ids[:-1] if ids and ids[-1] in self.eos_ids else ids, skip_special_tokens=False)

    def batcher(self) -> None:
        """Detail 1: gather, generate once, answer each request."""
        while not self.stop.is_set():
            try:
                batch = [self.queue.get(timeout=0.1)]
            except queue.Empty:
                continue
            while len(batch) < self.args.max_batch:  # until none arrives for gather_ms (a sliding window)
                try:
                    batch.append(self.queue.get(timeout=self.args.gather_ms / 1000))
                except queue.Empty:
                    break
            try:
                self.generate(batch)
            except Exception as e:  # every waiting request learns why (a 500 naming it), the batcher goes on
                traceback.print_exc()
                for p in batch:
                    p.error = HTTPError(500, f"generate failed on a batch of {len(batch)}: {e!r}")
            for p in batch:
                p.done.set()

    @torch.no_grad()
    def generate(self, batch: list[Pending]) -> None:
        """One rollout.generate call for the batch, under the batch lock (no weight update in between: detail 2)."""
        dev = next(self.model.parameters()).device
        ids, mask = left_pad([p.prompt_ids for p in batch], self.tokenizer.pad_token_id)
        with self.batch_lock:
            out = generate(self.model, ids.to(dev), mask.to(dev), max_new_tokens=max(p.max_tokens for p in batch),
                           eos_token_ids=self.eos_ids, pad_token_id=self.tokenizer.pad_token_id,
                           generator=self.generator, **self.sampling)  # fmt: skip
            version = self.version
        for j, p in enumerate(batch):
            n = min(int(out.response_mask[j].sum()), p.max_tokens)
            p.ids, p.logprobs = out.response_ids[j, :n].tolist(), out.rollout_logprobs[j, :n].tolist()
            p.version = version

    def load_weights(self, policy, version: int) -> None:
        """Detail 2: the trainer's new weights, between two batches."""
        with self.batch_lock:
            self.model.load_state_dict(policy.state_dict())
            self.version = version

    def set_reward(self, session: str, reward) -> dict:
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            raise HTTPError(400, f"'reward' must be a finite number, got {reward!r}")
        with self.lock:
            if session not in self.sessions:
                raise HTTPError(404, f"unknown session {session}: it made no request")
            self.sessions[session]["reward"] = float(reward)
        return {"session": session, "reward": float(reward)}

    def session(self, session: str, pop: bool = False) -> dict:
        """The session's records and reward (copies); pop: removed from the proxy too (the trainer took it)."""
        with self.lock:
            if session not in self.sessions:
                raise HTTPError(404, f"unknown session {session}")
            s = self.sessions.pop(session) if pop else self.sessions[session]
            return {"session": session, "reward": s["reward"], "records": [dict(r) for r in s["records"]]}


def session_samples(records: list[dict], reward: float) -> list[dict]:
    """Detail 4: a sample per chain of records, each one's prompt ids beginning with the sample so far, as
    rollout.pack_tracks takes it ("ids": everything after "prompt_ids", "action": 1 on sampled ids, "logp", "score":
    the reward at the last sampled id, "no_stop"), and "version", the oldest of its records'."""
    samples = []
    for r in records:  # (in the order answers finished: two requests in flight at once may both extend one record)
        s = samples[-1] if samples else None
        if s is None or r["prompt_ids"][: len(s["prompt_ids"]) + len(s["ids"])] != s["prompt_ids"] + s["ids"]:
            s = {"prompt_ids": r["prompt_ids"], "ids": [], "action": [], "logp": [], "version": r["version"],
                 "failed": False}  # fmt: skip
            samples.append(s)
        new = r["prompt_ids"][len(s["prompt_ids"]) + len(s["ids"]) :]  # what the agent appended (an observation)
        s["ids"], s["action"] = s["ids"] + new + r["ids"], s["action"] + [0] * len(new) + [1] * len(r["ids"])
        s["logp"], s["version"] = s["logp"] + [0.0] * len(new) + r["logprobs"], min(s["version"], r["version"])
        s["score"], s["no_stop"] = [0.0] * (len(s["ids"]) - 1) + [reward], r["finish_reason"] == "length"
    return samples


def sessions_rollout(sessions: list[dict], pad_id: int, device) -> tuple[Rollout, list[int], dict]:
    """A Rollout of sessions (ModelProxy.session(pop=True)'s), each sample rewarded with its session's reward at its
    last sampled token; also each sample's session index (GRPO groups go by it) and proxy/* metrics."""
    for k, s in enumerate(sessions):
        if s["reward"] is None:
            raise ValueError(f"session {k} ({s['session']}) has no reward: the agent must POST /v1/sessions/ID/reward")
    samples = [(k, x) for k, s in enumerate(sessions) for x in session_samples(s["records"], s["reward"])]
    ids, mask = left_pad([x["prompt_ids"] for _, x in samples], pad_id)
    rollout = pack_tracks(ids, mask, [x for _, x in samples], pad_id, device)
    rollout.policy_version = torch.tensor([x["version"] for _, x in samples], device=device)
    stats = {"proxy/prefix_breaks": len(samples) - len(sessions), "proxy/samples": len(samples)}
    return rollout, [k for k, _ in samples], stats


# ----------------------------------------------------------------------------------------------
# HTTP


def stream_deltas(proxy: ModelProxy, record: dict) -> list[str]:
    """The answer's text a token at a time (detail 1), holding back a piece that ends inside a character (a byte-level
    tokenizer's half of a UTF-8 sequence decodes to U+FFFD): the deltas join to the content exactly."""
    sent, deltas = "", []
    for i in range(len(record["ids"])):
        text = proxy.content(record, i + 1)
        if text.startswith(sent) and len(text) > len(sent) and not text.endswith("\ufffd"):
            deltas.append(text[len(sent) :])
            sent = text
    whole = proxy.content(record)
    return deltas + ([whole[len(sent) :]] if whole.startswith(sent) and whole != sent else [])


def openai_error(status: int, message: str) -> dict:
    """OpenAI's error body: its type by status, code context_length_exceeded for a prompt over max_context."""
    kind = {400: "invalid_request_error", 404: "not_found_error", 413: "invalid_request_error"}
    code = "context_length_exceeded" if "max_context" in message else None
    return {"error": {"message": message, "type": kind.get(status, "server_error"), "code": code}}


class Handler(env_service.Handler):
    """env_service's handler (its body parsing within max_body_bytes, its JSON answers) on the proxy's routes, with
    OpenAI's error bodies and server-sent events for a stream. `self.server.service` is the ModelProxy."""

    def handle_any(self) -> None:
        path = urllib.parse.urlsplit(self.path).path
        try:
            body, proxy = self.read_body() if self.command == "POST" else {}, self.server.service
            parts = [urllib.parse.unquote(p) for p in path.split("/")]  # ["", "v1", "sessions", ID, ("reward")]
            session = len(parts) in (4, 5) and parts[:3] == ["", "v1", "sessions"]
            if (self.command, path) == ("GET", "/v1/models"):
                return self.answer(200, {"object": "list", "data": [{"id": proxy.name, "object": "model",
                                                                     "owned_by": "minrl"}]})  # fmt: skip
            if (self.command, path) == ("POST", "/v1/chat/completions"):
                return self.chat(proxy, body)
            if session and len(parts) == 5 and parts[4] == "reward" and self.command == "POST":
                return self.answer(200, proxy.set_reward(parts[3], body.get("reward")))
            if session and len(parts) == 4 and self.command in ("GET", "DELETE"):  # DELETE: the session is dropped
                return self.answer(200, proxy.session(parts[3], pop=self.command == "DELETE"))
            raise HTTPError(404, f"no route {self.command} {path}")
        except HTTPError as e:
            self.answer(e.status, openai_error(e.status, str(e)))
        except (BrokenPipeError, ConnectionResetError):  # the client left before its answer
            pass
        except Exception as e:  # a bug of the proxy: a JSON 500 naming it (and the traceback here)
            traceback.print_exc()
            self.answer(500, openai_error(500, f"model_proxy failed on {self.command} {path}: {e!r}"))

    def chat(self, proxy: ModelProxy, body: dict) -> None:
        """POST /v1/chat/completions: validate, complete, answer whole or as a stream."""
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("content"), str) and m.get("role") in ("system", "developer",
            "user", "assistant", "tool") for m in messages):  # fmt: skip
            raise HTTPError(400, "'messages' must be a non-empty list of {role, content: string} objects")
        if body.get("n", 1) != 1:
            raise HTTPError(400, f"'n' must be 1, got {body.get('n')!r} (ask again for another sample)")
        asked_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        asked_tokens = proxy.args.max_tokens if asked_tokens is None else asked_tokens
        if not isinstance(asked_tokens, int) or isinstance(asked_tokens, bool) or asked_tokens < 1:
            raise HTTPError(400, f"'max_tokens' must be a positive integer, got {asked_tokens!r}")
        max_tokens = min(asked_tokens, proxy.args.max_tokens)  # the trainer's limit; a cut answer: finish "length"
        session = self.headers.get("X-Session-Id") or body.get("user") or secrets.token_hex(8)
        asked = {k: body[k] for k in ("temperature", "top_p", "max_tokens", "max_completion_tokens") if k in body}
        r = proxy.complete(str(session), messages, max_tokens, asked)
        text = proxy.content(r)
        meta = {"session": str(session), "policy_version": r["version"], "sampling_used": {**proxy.sampling,
                "max_tokens": max_tokens}, "sampling_asked": asked, "extends": r["extends"]}  # fmt: skip
        head = {"id": "chatcmpl-" + secrets.token_hex(12), "created": int(time.time()), "model": proxy.name}
        usage = {"prompt_tokens": len(r["prompt_ids"]), "completion_tokens": len(r["ids"]),
                 "total_tokens": len(r["prompt_ids"]) + len(r["ids"])}  # fmt: skip
        if not body.get("stream"):
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "finish_reason": r["finish_reason"]}  # fmt: skip
            return self.answer(200, {**head, "object": "chat.completion", "choices": [choice], "usage": usage,
                                     "minrl": meta})  # fmt: skip
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()
        deltas = [{"role": "assistant", "content": ""}] + [{"content": d} for d in stream_deltas(proxy, r)]
        for i, delta in enumerate(deltas + [{}]):
            finish = r["finish_reason"] if i == len(deltas) else None
            chunk = {**head, "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta,
                     "finish_reason": finish}], **({"usage": usage, "minrl": meta} if finish else {})}  # fmt: skip
            self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        self.wfile.write(b"data: [DONE]\n\n")

    do_GET = do_POST = do_DELETE = do_PUT = do_PATCH = handle_any  # noqa: N815 (http.server's names: do_<METHOD>)


def start_proxy(proxy: ModelProxy, host: str = "127.0.0.1", port: int = 0) -> Server:
    """Serve `proxy` on host:port in its own threads (`server.url` is the base_url's root; stop with stop_proxy)."""
    server = Server((host, port), Handler)
    server.service, server.url = proxy, f"http://{host}:{server.server_address[1]}"
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def stop_proxy(server: Server) -> None:
    server.shutdown()
    server.server_close()
    server.service.stop.set()


# ----------------------------------------------------------------------------------------------
# Training an agent program through the proxy


@dataclass
class AgentConfig(Config):
    """`python model_proxy.py --agent PROGRAM`: the trainer's knobs, and the agent processes'."""

    agent: str = str(Path(__file__).resolve().parent / "examples" / "calc_agent.py")
    """The agent program: `python AGENT --base-url URL/v1 --env-url URL --max-turns N`, SEED:SESSION:SPLIT on stdin."""
    agents: int = 16
    """Agent processes (each plays its share of an iteration's episodes in order)."""
    agent_timeout: float = 600.0
    """Seconds an iteration's agents may take (then the run stops, naming them)."""
    gather_ms: float = 5.0
    """The proxy's batching window (ProxyArgs.gather_ms)."""
    task: str = "calc"

    def __post_init__(self):
        super().__post_init__()
        check_fields(self, {"[1, inf)": ("agents", "steps"), "(0.0, inf)": ("agent_timeout",), "[0.0, inf)":
                            ("gather_ms",)}, AgentConfig)  # fmt: skip
        if "float32" != self.dtype or "float32" != self.rollout_dtype:  # the batcher thread runs without autocast
            raise ValueError("config fields 'dtype' / 'rollout_dtype': the proxy samples in float32 only (for now)")


class AgentSampler:
    """train()'s sampler: each iteration the weights go to the proxy, the agent processes play the episodes (G sessions
    per env seed: a GRPO group; `done SESSION RETURN` on stdout each), what the proxy recorded becomes the batch."""

    def __init__(self, cfg: AgentConfig, proxy: ModelProxy, proxy_url: str, env_url: str):
        self.cfg, self.proxy, self.rng = cfg, proxy, np.random.default_rng(cfg.seed)  # rng: training env seeds
        cmd = [sys.executable, cfg.agent, "--base-url", proxy_url + "/v1", "--env-url", env_url, "--max-turns",
               str(cfg.max_turns)]  # fmt: skip
        self.logs = [tempfile.TemporaryFile("w+") for _ in range(cfg.agents)]  # each agent's stderr, for its failure
        self.procs = [subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
                                       bufsize=1) for log in self.logs]  # fmt: skip

    def play(self, seeds: list[int], tag: str, split: str = "train") -> list[dict]:
        """Play `seeds` (one session each) on the agent processes; the sessions the proxy recorded, in order."""
        names = [f"{tag}-{i}" for i in range(len(seeds))]
        share = [list(zip(seeds, names))[j :: len(self.procs)] for j in range(len(self.procs))]
        for p, jobs in zip(self.procs, share):
            p.stdin.write("".join(f"{s}:{n}:{split}\n" for s, n in jobs))
        timer = threading.Timer(self.cfg.agent_timeout, lambda: [p.kill() for p in self.procs])
        timer.start()  # a hung agent is killed: its readline below then ends, and the run stops naming it
        try:
            for j, (p, jobs) in enumerate(zip(self.procs, share)):
                for _ in jobs:
                    if not (line := p.stdout.readline()).startswith("done "):  # "": it exited (or the timer killed it)
                        code, _ = p.poll() if line else p.wait(timeout=30), self.logs[j].seek(0)
                        raise RuntimeError(
                            f"agent {j} ({self.cfg.agent}) stopped (exit {code}; agent_timeout "
                            f"{self.cfg.agent_timeout} s): {line!r}, {self.logs[j].read()[-2000:]}"
                        )
        finally:
            timer.cancel()
        return [self.proxy.session(n, pop=True) for n in names]

    def close(self) -> None:
        for p in self.procs:
            p.kill()
            p.wait()

    def __call__(self, step: int, policy):
        self.proxy.load_weights(policy, step)  # the samples of iteration `step` come from its weights (staleness 0)
        G, n = self.cfg.group_size, self.cfg.prompts_per_step
        seeds = [int(s) for s in self.rng.integers(2**31, size=n) for _ in range(G)]
        sessions = self.play(seeds, f"it{step}")
        dev = next(policy.parameters()).device
        rollout, owner, stats = sessions_rollout(sessions, self.proxy.tokenizer.pad_token_id, dev)
        blank = {"cut": False, "context_cut": False, "malformed": 0, "env_s": []}  # what an agent does not tell
        episodes = [{**blank, "return": sessions[k]["reward"], "success": sessions[k]["reward"] >= 1,
                     "turns": len(sessions[k]["records"])} for k in owner]  # fmt: skip
        return rollout, episodes, torch.tensor(owner, device=dev) // G, stats

    def greedy_success(self, n: int, tag: str) -> float:
        """Success of the agent on n held-out env seeds with the proxy's policy greedy."""
        sampling, self.proxy.sampling = self.proxy.sampling, {"temperature": 0.0}
        seeds = [int(s) for s in np.random.default_rng(12345).integers(2**31, size=n)]  # evaluation.held_out's draw
        try:
            return float(np.mean([s["reward"] >= 1 for s in self.play(seeds, tag, "eval")]))
        finally:
            self.proxy.sampling = sampling


def train_agent(cfg: AgentConfig, hooks=()) -> dict:
    """Train the policy on what `cfg.agent`'s processes do through a proxy; an environment server in this process.
    Returns train()'s result plus "agent_success": greedy success of the agent on eval_n held-out seeds, before and
    after."""
    env_server = start_server(ServiceArgs(port=0))
    box = {}

    def sampler(step, policy):
        if "s" not in box:  # the proxy serves a copy of the policy, loaded with its weights every iteration
            source = cfg.model or str(sft_warm_start(sft_config_for(cfg.task, cfg.sft_target)))
            args = ProxyArgs(max_tokens=cfg.max_new_tokens, max_context=cfg.max_context, gather_ms=cfg.gather_ms)
            sampling = {k: getattr(cfg, k) for k in ("temperature", "top_p", "top_k")}  # the trainer's, always
            tokenizer = load_policy(source, "cpu")[1]  # (train() has it, but gives a sampler the policy only)
            proxy = ModelProxy(copy.deepcopy(policy), tokenizer, args, sampling, seed=cfg.seed)
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
            box["s"].close()
        if "server" in box:
            stop_proxy(box["server"])
        stop_server(env_server)


def main(argv=None) -> None:
    """Serve (--serve), train an agent (--agent PROGRAM), or the demo: two turns of one session, then its sample."""
    argv = sys.argv[1:] if argv is None else argv
    if any(a.startswith("--agent") for a in argv):
        cfg = parse_config(AgentConfig, argv)
        out = train_agent(cfg)
        print(f"[minrl] greedy success of the agent on {cfg.eval_n} held-out episodes: {out['agent_success'][0]:.3f}"
              f" -> {out['agent_success'][1]:.3f}")  # fmt: skip
        return
    args = parse_config(ProxyArgs, argv)
    torch.manual_seed(0)
    if args.model:
        model, tokenizer = load_policy(args.model, "cpu")
    else:
        tokenizer = make_tokenizer()
        model = make_tiny_model(tokenizer)
    proxy = ModelProxy(model, tokenizer, args, {"temperature": 1.0, "top_p": 1.0, "top_k": 0})
    server = start_proxy(proxy, args.host, args.port)
    try:
        if args.serve:
            print(f"[minrl] model_proxy at {server.url}/v1 (model {proxy.name}); Ctrl-C stops it")
            proxy.stop.wait()
        messages = [{"role": "user", "content": "12+3="}]
        for turn in range(2 * (not args.serve)):
            out = request(
                server.url, "POST", "/v1/chat/completions", {"messages": messages, "user": "demo", "max_tokens": 8}, 60
            )
            answer = out["choices"][0]["message"]["content"]
            print(f"turn {turn}: {messages[-1]['content']!r} -> {answer!r} ({out['minrl']})")
            messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "=15?"}]
        if not args.serve:
            request(server.url, "POST", "/v1/sessions/demo/reward", {"reward": 1.0}, 60)
            rollout, _, stats = sessions_rollout([proxy.session("demo", pop=True)], tokenizer.pad_token_id, "cpu")
            r = rollout.response_ids[0].tolist(), rollout.response_mask[0].tolist()
            print(f"the session's sample: response ids {r[0]}\n  response_mask {r[1]}\n  {stats}")
    except KeyboardInterrupt:
        pass
    finally:
        stop_proxy(server)


if __name__ == "__main__":
    main()
