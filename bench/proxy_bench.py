"""The model proxy's cost per request: 16 concurrent chat requests through model_proxy.py against one rollout.generate
call on the same 16 prompts, on the embedded model and the 2.5M preset (goal: <= 10 % overhead).

    python bench/proxy_bench.py                     # tiny and 2.5m, 16 requests of 32 tokens, 7 rounds (~1 minute)
    python bench/proxy_bench.py --presets 2.5m --max-tokens 64

A round, direct: rollout.generate on the 16 left-padded prompts (what the trainer's sampler does). A round, proxy: a
client process (agents are processes of their own: the clients' HTTP and JSON do not share the proxy's interpreter)
sends 16 concurrent POST /v1/chat/completions (real HTTP on 127.0.0.1, a connection per request), one prompt each,
and times from the first send to the last answer; the proxy gathers them into one generate call, records ids and
logprobs and answers each. Both sample exactly max_tokens tokens (no stop token can be sampled), so the tokens are
the same count. The proxy generates on the main thread while the client's round runs (ModelProxy.serve_while, as
agent_train.py does). The rounds interleave (direct, proxy, direct, ...); the medians are compared, overhead = proxy /
direct - 1: HTTP, JSON, the chat template, the gather window (gather_ms after the last request), the bookkeeping.
"""

from __future__ import annotations

import multiprocessing
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402
from rollout_bench import make_model  # noqa: E402

import model_proxy as mp  # noqa: E402
from cli import check_fields, parse_config  # noqa: E402
from env_service import request  # noqa: E402
from rollout import generate, left_pad  # noqa: E402
from tasks import make_tokenizer  # noqa: E402


@dataclass
class Config:
    """`python bench/proxy_bench.py`: what to measure."""

    presets: list[str] = field(default_factory=lambda: ["tiny", "2.5m"])
    """Models (bench/rollout_bench.py's presets, random init, the embedded tokenizer)."""
    requests: int = 16
    """Concurrent requests per round (the batch of the direct call)."""
    max_tokens: int = 32
    """Tokens per answer."""
    rounds: int = 7
    """Rounds of each; medians are compared."""
    gather_ms: float = 5.0
    """The proxy's batching window."""
    batch_thread: bool = False
    """Generate on the proxy's batcher thread (as before serve_while): on CPU a second OpenMP team, both slower."""

    def __post_init__(self):
        check_fields(self, {"[1, inf)": ("requests", "max_tokens", "rounds"), "[0.0, inf)": ("gather_ms",)})


def client_request(url: str, body: dict, errors: list) -> None:
    """One chat request; a failure goes to `errors`."""
    try:
        out = request(url, "POST", "/v1/chat/completions", body, 120)
        assert out["usage"]["completion_tokens"] == body["max_tokens"], out["usage"]
    except Exception as e:
        errors.append(repr(e))


def client_loop(conn, url: str) -> None:
    """The client process: for each list of request bodies it receives, send them all at once (a thread each) and
    answer (seconds from the first send to the last answer, the first error or None); None stops it."""
    while (bodies := conn.recv()) is not None:
        errors = []
        threads = [threading.Thread(target=client_request, args=(url, b, errors)) for b in bodies]
        t0 = time.perf_counter()
        [t.start() for t in threads]
        [t.join() for t in threads]
        conn.send((time.perf_counter() - t0, errors[0] if errors else None))


def bench_one(preset: str, cfg: Config) -> dict:
    """Median seconds of a direct round and of a proxy round on one model."""
    torch.manual_seed(0)
    tok = make_tokenizer()
    model = make_model(preset, tokenizer=tok).eval()
    model.generation_config.eos_token_id = None  # stop ids: the tokenizer's alone
    never = model.config.vocab_size  # a stop id no token has: every answer runs to max_tokens in both paths
    prompts = [f"{i}+{2 * i}=" for i in range(cfg.requests)]
    ids, mask = left_pad(
        [tok(tok.bos_token + p, add_special_tokens=False).input_ids for p in prompts], tok.pad_token_id
    )
    proxy = mp.ModelProxy(model, tok, mp.ProxyArgs(max_tokens=cfg.max_tokens, gather_ms=cfg.gather_ms, max_batch=64),
                          {"temperature": 1.0, "top_p": 1.0, "top_k": 0}, batch_thread=cfg.batch_thread)  # fmt: skip
    proxy.eos_ids = [never]
    server = mp.start_proxy(proxy)
    gen = torch.Generator().manual_seed(0)

    def direct() -> None:
        with torch.no_grad():
            generate(model, ids, mask, max_new_tokens=cfg.max_tokens, eos_token_ids=[never],
                     pad_token_id=tok.pad_token_id, generator=gen)  # fmt: skip

    client, there = multiprocessing.Pipe()
    worker = multiprocessing.get_context("spawn").Process(target=client_loop, args=(there, server.url), daemon=True)
    worker.start()

    def through_proxy() -> float:
        client.send([{"messages": [{"role": "user", "content": p}], "max_tokens": cfg.max_tokens, "user": f"{i}"}
                     for i, p in enumerate(prompts)])  # fmt: skip
        seconds, error = client.recv() if cfg.batch_thread else proxy.serve_while(client.recv)  # as agent_train.py
        proxy.sessions.clear()
        if error:  # a failed request must not look like a fast one
            raise RuntimeError(f"the client's request failed: {error}")
        return seconds

    times = {"direct": [], "proxy": []}
    try:
        direct(), through_proxy()  # warm-up
        for _ in range(cfg.rounds):
            t0 = time.perf_counter()
            direct()
            times["direct"].append(time.perf_counter() - t0)
            times["proxy"].append(through_proxy())
    finally:
        client.send(None)
        worker.join(30)
        mp.stop_proxy(server)
    d, p = statistics.median(times["direct"]), statistics.median(times["proxy"])
    return {"preset": preset, "direct_s": d, "proxy_s": p, "overhead": p / d - 1}


def main(argv=None) -> None:
    cfg = parse_config(Config, argv)
    print(f"{cfg.requests} requests of {cfg.max_tokens} tokens, median of {cfg.rounds} rounds, "
          f"torch threads {torch.get_num_threads()}")  # fmt: skip
    print(f"{'preset':>8} {'direct s':>10} {'proxy s':>10} {'overhead':>9}")
    for preset in cfg.presets:
        r = bench_one(preset, cfg)
        print(f"{r['preset']:>8} {r['direct_s']:>10.4f} {r['proxy_s']:>10.4f} {r['overhead']:>8.1%}")


if __name__ == "__main__":
    main()
