"""Latency of one chat request on a kept-alive connection, with and without TCP_NODELAY on the proxy's answers.

    python bench/keepalive_bench.py                 # 30 one-token requests each way (~5 s)

The official `openai` client keeps its HTTP connection open between requests (HTTP/1.1, openai_api.py). An answer
leaves the server in two writes (headers, then body); with Nagle's algorithm on, the body waits until the client
acknowledges the headers, and a client delays that ACK (up to ~40 ms on Linux). env_service.Handler therefore sets
`disable_nagle_algorithm`. This bench serves the embedded tiny model and times `requests` one-token chat requests from
two `openai` clients, one connection opened with the setting off (Nagle on), one with it on, their requests
interleaved, and prints the medians and their ratio.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import env_service  # noqa: E402
import model_proxy as mp  # noqa: E402
from cli import check_fields, parse_config  # noqa: E402
from tasks import make_tiny_model, make_tokenizer  # noqa: E402


@dataclass
class Config:
    """`python bench/keepalive_bench.py`: how many requests each way."""

    requests: int = 30
    """One-token requests per setting, on one client (one kept-alive connection)."""

    def __post_init__(self):
        check_fields(self, {"[1, inf)": ("requests",)})


def medians_ms(requests: int) -> tuple[float, float]:
    """Median milliseconds per request of two `openai` clients of one proxy, one connection each: the first opened
    with TCP_NODELAY off (Nagle's algorithm on), the second with it on; their requests alternate."""
    import openai  # pip install openai (requirements.txt has it)

    torch.manual_seed(0)
    tok = make_tokenizer()
    proxy = mp.ModelProxy(make_tiny_model(tok), tok, mp.ProxyArgs(max_tokens=1, gather_ms=0.0), {"temperature": 1.0})
    server = mp.start_proxy(proxy)
    clients, times = [openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0) for _ in "ab"], []
    ask = lambda c: c.chat.completions.create(model="m", messages=[{"role": "user", "content": "1+2="}], max_tokens=1)
    try:
        for nodelay, client in zip((False, True), clients):  # the handler reads the setting per new connection
            env_service.Handler.disable_nagle_algorithm = nodelay
            ask(client)  # opens the client's connection (not timed)
        for _ in range(requests):
            for client in clients:
                t0 = time.perf_counter()
                ask(client)
                times.append(time.perf_counter() - t0)
    finally:
        env_service.Handler.disable_nagle_algorithm = True  # the setting the project ships
        for c in clients:
            c.close()
        mp.stop_proxy(server)
    return 1e3 * statistics.median(times[0::2]), 1e3 * statistics.median(times[1::2])


def main(argv=None) -> None:
    cfg = parse_config(Config, argv)
    nagle, nodelay = medians_ms(cfg.requests)
    print(f"{cfg.requests} one-token requests per kept-alive connection, interleaved; median ms per request")
    print(f"{'nagle_ms':>9} {'nodelay_ms':>10} {'ratio':>6}\n{nagle:>9.2f} {nodelay:>10.2f} {nagle / nodelay:>6.2f}")


if __name__ == "__main__":
    main()
