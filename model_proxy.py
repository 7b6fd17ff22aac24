"""An OpenAI-compatible endpoint on the policy that records the tokens it sampled: what an unmodified agent trains on.

    python model_proxy.py                        # demo: a proxy on a free port, a two-turn chat through it
    python model_proxy.py --serve --port 8200    # serve the embedded policy (or --model) until Ctrl-C

An agent calls an ordinary chat endpoint (`OpenAI(base_url="http://HOST:PORT/v1", api_key="none")`); the proxy answers
with the current policy and records per request the prompt ids (the chat template applied here, once), the sampled ids,
their logprobs and the policy version, under the caller's session (header `X-Session-Id`, else the `user` field). A
session becomes samples token in token out (`session_samples`), sessions a Rollout (`sessions_rollout`), rewarded by
what the agent posts (POST /v1/sessions/ID/reward); agent_train.py trains on them (the agent processes: agent_pool.py).
The HTTP API, chat completions (streamed too), models and sessions, is openai_api.py's (start_proxy serves a
ModelProxy). `--serve` holds at most max_sessions, dropping the idle ones. Sampling (docs/design.md section 3): the
behaviour policy must be the trained one, so the client's temperature and top_p are recorded and replaced by the
trainer's; the answer's `minrl` field says what was asked and what was used.

Implementation details (our choices)
1. Batching: requests wait in a queue; one thread takes the first, then the next while each comes within gather_ms of
   the last (at most max_batch), and calls rollout.generate (or its engine) once; each request gets its row, cut at its
   own max_tokens (a prefix of a sample is a sample of the shorter one). A stream sends the answer a token per chunk.
   Each request draws from a stream of its own, seeded by (seed, session, its index in the session): what it samples
   does not depend on which requests share its batch (a matter of timing), so a run through the proxy repeats, but where
   padding's rounding tips a draw or a greedy argmax between two near-equal tokens. With a vLLM engine (vllm_engine.py)
   the stream gives the request's vLLM seed, drawn per request there too. agent_train.py generates on the trainer's
   thread while the agents play (serve_while): on CPU a second thread running torch ops owns a second OpenMP team, and
   with two teams generate ran 2-3x slower on 2 cores (RESULTS.md).
2. Weights: the proxy samples from its own model, or its engine; `load_weights` copies new ones in (the engine: a
   sync) between two batches (the batch lock): no answer mixes versions.
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

import contextlib
import hashlib
import math
import queue
import threading
import time
import traceback
from dataclasses import dataclass, field

import torch

import vllm_engine
from cli import check_fields, parse_config, sigterm_as_ctrl_c
from env_service import HTTPError, request
from openai_api import start_proxy, stop_proxy
from rollout import Rollout, generate, left_pad, pack_tracks
from tasks import load_policy, make_tiny_model, make_tokenizer, stop_token_ids

TRAINING = "Training an agent program on what it samples through the proxy: python3 agent_train.py --agent PROGRAM"
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% if m['role'] == 'assistant' %}{{ eos_token }}"
    "{% endif %}{% endfor %}"
)


@dataclass
class ProxyArgs:
    """`python model_proxy.py`: the proxy's address, batching and limits."""

    host: str = "127.0.0.1"
    """Address to bind (127.0.0.1: this machine only; there is no authentication: bind wider on a trusted net only)."""
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
    max_sessions: int = 1024
    """Sessions held at most: a request that would open one more gets a 503 (after the idle ones are dropped)."""
    idle_timeout: float = 600.0
    """Seconds without a request before a session may be dropped (0 = never: agent_train's; else >= request_timeout)."""

    def __post_init__(self):
        ints = ("max_batch", "max_tokens", "max_context", "max_body_bytes", "max_sessions")
        ranges = {"[0, 65535]": ("port",), "[1, inf)": ints, "[0.0, inf)": ("gather_ms", "idle_timeout")}
        check_fields(self, {**ranges, "(0.0, inf)": ("request_timeout",)})
        if 0 < self.idle_timeout < self.request_timeout:  # a session waiting for its answer would look idle
            raise ValueError(f"config field 'idle_timeout' = {self.idle_timeout}: 0 or >= request_timeout")


def request_seed(seed: int, session: str, k: int) -> int:
    """Detail 1: the seed of the k-th request of `session` (63 bits of sha256, the same in every process)."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{session}/{k}".encode()).digest()[:8], "big") >> 1


@dataclass
class Pending:
    """One request in the batch queue: its prompt ids, its token budget, and where its answer goes."""

    prompt_ids: list[int]
    max_tokens: int
    seed: int  # of its own sampling stream (detail 1)
    done: threading.Event = field(default_factory=threading.Event)
    ids: list[int] | None = None
    logprobs: list[float] | None = None
    version: int = -1
    error: Exception | None = None


class ModelProxy:
    """The policy behind the API: the batch queue, the sessions' records, weight updates (details 1-3)."""

    def __init__(
        self,
        model,
        tokenizer,
        args: ProxyArgs,
        sampling: dict,
        name: str = "minrl-policy",
        seed: int = 0,
        autocast=contextlib.nullcontext,
        batch_thread: bool = True,
        engine: vllm_engine.Engine | None = None,
    ):
        self.model, self.tokenizer, self.args, self.name = model.eval(), tokenizer, args, name
        self.engine = engine  # None: rollout.generate on `model`; else the engine samples (model: its device, stops)
        # common.make_autocast's: autocast is per thread, so the batcher enters its own (an engine: its own dtype)
        self.autocast = autocast if engine is None else contextlib.nullcontext
        self.sampling = dict(sampling)  # temperature, top_p, top_k: the trainer's
        self.eos_ids, self.version = stop_token_ids(model, tokenizer), 0
        self.template = getattr(tokenizer, "chat_template", None) or TEMPLATE
        self.seed = seed  # with the session and the request's index in it, the seed of a request's samples
        self.queue, self.batch_lock, self.lock = queue.Queue(), threading.Lock(), threading.Lock()
        self.sessions = {}  # id -> {"records": [...], "reward": None | float, "requests": n, "used": monotonic s}
        self.stop, self.threads = threading.Event(), []  # stop_proxy sets the one, joins the others
        if batch_thread:  # otherwise the owner generates on its own thread: serve_while (detail 1)
            self.threads.append(threading.Thread(target=self.batcher, daemon=True))
            self.threads[0].start()

    def render(self, messages: list[dict]) -> str:  # the chat as the model sees it, ready for the answer
        template = {"chat_template": self.template, "tokenize": False, "add_generation_prompt": True}
        return self.tokenizer.apply_chat_template(messages, **template)

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
        with self.lock:  # (a refused request opens no session)
            s = self.sessions.get(session) or {"records": [], "reward": None, "requests": 0}
            ids, extends = self.prompt_ids(s["records"], text)
            if len(ids) > self.args.max_context:
                raise HTTPError(400, f"the prompt has {len(ids)} tokens > max_context {self.args.max_context}")
            if session not in self.sessions:
                self.open_session(session, s)
            k, s["requests"], s["used"] = s["requests"], s["requests"] + 1, time.monotonic()  # k: its index in s
        p = Pending(ids, max_tokens, request_seed(self.seed, session, k))
        self.queue.put(p)
        if not p.done.wait(self.args.request_timeout) or p.error is not None:
            raise p.error or HTTPError(503, f"no answer within request_timeout = {self.args.request_timeout} s")
        finish = "stop" if p.ids and p.ids[-1] in self.eos_ids else "length"
        answer = {"ids": p.ids, "logprobs": p.logprobs, "version": p.version, "extends": extends}
        record = {"prompt_ids": ids, "prompt_text": text, **answer, "finish_reason": finish, "asked": asked}
        with self.lock:
            s["records"].append(record)
            s["used"] = time.monotonic()
        return record

    def open_session(self, session: str, s: dict) -> None:
        """Hold a new session (under the lock), first dropping those idle for idle_timeout s; 503 when full."""
        now, idle = time.monotonic(), self.args.idle_timeout
        for k in [k for k, v in self.sessions.items() if idle and now - v["used"] > idle]:
            del self.sessions[k]  # (--serve: nobody takes its sessions; the memory they hold stays bounded)
        if len(self.sessions) >= self.args.max_sessions:
            raise HTTPError(503, f"{len(self.sessions)} sessions are held (max_sessions); retry later")
        self.sessions[session] = s

    def content(self, record: dict, n: int | None = None) -> str:
        """The answer's text: its first n sampled ids decoded, special ones included but a final stop token, so
        that an agent resending it resends what the model produced (detail 3)."""
        ids = record["ids"][:n]
        return self.tokenizer.decode(ids[:-1] if ids and ids[-1] in self.eos_ids else ids, skip_special_tokens=False)

    def batcher(self, until: threading.Event | None = None) -> None:
        """Detail 1: gather, generate once, answer each request; until `until` is set, or the proxy stops."""
        while not self.stop.is_set() and not (until and until.is_set()):
            try:
                batch = [self.queue.get(timeout=0.1)]
            except queue.Empty:
                continue
            while len(batch) < self.args.max_batch and batch[-1] is not None:  # until none comes within gather_ms
                try:
                    batch.append(self.queue.get(timeout=self.args.gather_ms / 1000))
                except queue.Empty:
                    break
            if (batch := [p for p in batch if p is not None]) == []:  # None: serve_while's work is done
                continue
            try:
                self.generate(batch)
            except Exception as e:  # every waiting request learns why (a 500 naming it), the batcher goes on
                traceback.print_exc()
                for p in batch:
                    p.error = HTTPError(500, f"generate failed on a batch of {len(batch)}: {e!r}")
            for p in batch:
                p.done.set()

    def serve_while(self, work, *args):
        """work(*args) in a thread while this one runs the batcher (detail 1); its result, or its exception."""
        if self.stop.is_set():
            raise RuntimeError("serve_while on a stopped proxy (stop_proxy): no batcher would answer its requests")
        box, finished = {}, threading.Event()

        def run():
            try:
                box["out"] = work(*args)
            except BaseException as e:  # re-raised below, in the caller's thread
                box["error"] = e
            finally:
                finished.set()
                self.queue.put(None)  # wakes the batcher now, not at its next 0.1 s poll

        threading.Thread(target=run, daemon=True).start()
        self.batcher(until=finished)
        if not finished.is_set():
            raise RuntimeError("the proxy stopped (stop_proxy) while its owner's work was running")
        if "error" in box:
            raise box["error"]
        return box["out"]

    @torch.no_grad()
    def generate(self, batch: list[Pending]) -> None:
        """One rollout.generate call (or the engine's) for the batch, under the batch lock (no weight update in
        between: detail 2)."""
        dev = next(self.model.parameters()).device
        ids, mask = left_pad([p.prompt_ids for p in batch], self.tokenizer.pad_token_id)
        streams = [torch.Generator(device=dev).manual_seed(p.seed) for p in batch]  # a row's draws are its own
        longest = max(p.max_tokens for p in batch)
        stops = {"eos_token_ids": self.eos_ids, "pad_token_id": self.tokenizer.pad_token_id}
        with self.batch_lock, self.autocast():
            sampling = {**self.sampling, "generator": streams}  # read under the lock: greedy_success swaps it
            sample = generate if self.engine is None else self.engine.generate  # the same signature and Rollout
            out = sample(self.model, ids.to(dev), mask.to(dev), max_new_tokens=longest, **stops, **sampling)
            version = self.version
        for j, p in enumerate(batch):
            n = min(int(out.response_mask[j].sum()), p.max_tokens)
            p.ids, p.logprobs = out.response_ids[j, :n].tolist(), out.rollout_logprobs[j, :n].tolist()
            p.version = version

    def load_weights(self, policy, version: int) -> float:
        """Detail 2: the trainer's new weights, between two batches (rounded to the proxy's, e.g. --rollout-dtype);
        returns the seconds the copy or the sync took (time/sync)."""
        with self.batch_lock:
            t0 = time.perf_counter()
            if self.engine is not None:
                vllm_engine.sync_weights(self.engine, policy)
            else:
                self.model.load_state_dict(policy.state_dict())
            self.version = version
            return time.perf_counter() - t0

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
            s = dict(prompt_ids=r["prompt_ids"], ids=[], action=[], logp=[], version=r["version"], failed=False)
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


def main(argv=None) -> None:
    """Serve (--serve), or the demo: two turns of one session, then its sample."""
    args = parse_config(ProxyArgs, argv, epilog=TRAINING)
    sigterm_as_ctrl_c()  # kill, systemd, docker: stopped as on Ctrl-C
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
