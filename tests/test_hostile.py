"""Hostile and broken clients, and files a user may hand over, against the servers and loaders: each probe gets its
status with a JSON error body (OpenAI's shape from the proxy), the server logs one line (no traceback) and stays
up; a loader names the file and line. The probes are cheap (in-process servers, raw sockets)."""

import json
import socket
import time

import pytest

import data
import env_client
import env_service
import model_proxy as mp
import tasks
from diagnose_logs import InputError, load_metrics
from env_service import ServiceArgs, request, start_server, stop_server


def raw(url: str, head: str, body: bytes = b"", wait: float = 30.0) -> tuple[int, dict]:
    """(status, JSON body) of a request written byte for byte (any method, any body)."""
    host, port = url.split("//")[1].split(":")
    with socket.create_connection((host, int(port)), timeout=wait) as s:
        s.sendall(head.encode() + f"\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
            if b"\r\n\r\n" in reply and len(reply.split(b"\r\n\r\n", 1)[1]) >= content_length(reply):
                break
    status = int(reply.split(b" ", 2)[1])
    return status, json.loads(reply.split(b"\r\n\r\n", 1)[1])


def content_length(reply: bytes) -> int:
    head = reply.split(b"\r\n\r\n", 1)[0].decode().lower()
    return int(head.split("content-length:")[1].split("\r\n")[0]) if "content-length:" in head else 1 << 30


@pytest.fixture
def env_server():
    server = start_server(ServiceArgs(port=0))
    yield server
    stop_server(server)


def test_env_service_answers_each_hostile_request_with_its_status_in_json(env_server, capsys):
    url = env_server.url
    sid = request(url, "POST", "/sessions", {"env": "guess"}, 30)["session"]
    probes = [
        ("POST /sessions HTTP/1.1", b"[" * 30000 + b"]" * 30000, 400, "malformed JSON body: nested too deep"),
        ("POST /sessions HTTP/1.1", b'{"env": "guess", "n": ' + b"9" * 5000 + b"}", 400, "(4300 digits)"),
        ("POST /sessions HTTP/1.1", b'{"env": NaN}', 400, "NaN is not a JSON number"),
        (f"POST /sessions/{sid}/reset HTTP/1.1", b'{"seed": -5}', 400, "'seed' must be an integer in [0, 2**63)"),
        (f"POST /sessions/{sid}/reset HTTP/1.1", b'{"seed": 18446744073709551616}', 400, "in [0, 2**63)"),
        ("BREW /sessions HTTP/1.1", b"", 501, "BREW /sessions: Unsupported method ('BREW')"),
        ("GET /health HTTP/1.1\r\nX: " + "y" * 70000, b"", 431, "Line too long"),
        (
            "POST /sessions HTTP/1.1\r\nContent-Length: x",
            b"",
            411,
            "Content-Length header, a number of bytes (got 'x')",
        ),
    ]
    for head, body, status, words in probes:
        got, payload = raw(url, head, body)
        assert got == status and words in payload["error"], (head, got, payload)
    assert request(url, "POST", f"/sessions/{sid}/reset", {"seed": 5}, 30)["observation"]  # still serving
    assert "Traceback" not in capsys.readouterr().err


def test_a_stalled_or_vanished_client_costs_one_line_in_the_log(env_server, capsys, monkeypatch):
    monkeypatch.setattr(env_service.Handler, "timeout", 1.0)  # seconds a client may take to send its request
    host, port = env_server.server_address
    with socket.create_connection((host, port), timeout=30) as s:  # 10 bytes promised, 2 sent, then nothing
        s.sendall(b"POST /sessions HTTP/1.1\r\nContent-Length: 10\r\n\r\n{}")
        reply = b"".join(iter(lambda: s.recv(65536), b""))  # until the server closes the connection
    assert b" 408 " in reply.split(b"\r\n")[0] and b"did not arrive within 1.0 s" in reply, reply
    s = socket.create_connection((host, port), timeout=30)  # half a request line, then a reset (RST)
    s.sendall(b"POST /sess")
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    s.close()
    err, t0 = "", time.monotonic()
    while "ConnectionResetError" not in err and time.monotonic() - t0 < 30:  # the server's thread logs it
        time.sleep(0.1)
        err += capsys.readouterr().err
    assert "[minrl] env_service: the body of POST /sessions stalled" in err and "Traceback" not in err, err
    assert "a request from 127.0.0.1 failed: ConnectionResetError" in err, err  # socketserver's traceback, before
    assert request(env_server.url, "GET", "/health", None, 30)["status"] == "ok"


def test_the_proxy_answers_unknown_methods_and_non_json_numbers_with_openai_errors(capsys):
    tok = tasks.make_tokenizer()
    proxy = mp.ModelProxy(tasks.make_tiny_model(tok), tok, mp.ProxyArgs(max_tokens=2), {"temperature": 1.0})
    server = mp.start_proxy(proxy)
    try:
        got, payload = raw(server.url, "BREW /v1/models HTTP/1.1")
        assert got == 501 and payload["error"]["type"] == "server_error", payload
        assert "BREW /v1/models: Unsupported method" in payload["error"]["message"]
        body = b'{"messages": [{"role": "user", "content": "1"}], "temperature": NaN}'
        got, payload = raw(server.url, "POST /v1/chat/completions HTTP/1.1", body)
        assert got == 400 and "NaN is not a JSON number" in payload["error"]["message"], payload
        assert proxy.sessions == {}  # nothing recorded, nothing echoed
    finally:
        mp.stop_proxy(server)
    assert "Traceback" not in capsys.readouterr().err


def test_a_badly_shaped_environment_answer_is_shown(monkeypatch):
    answers = iter([{"session": "ab12"}, {"obs": "x", "info": {}}])
    monkeypatch.setattr(env_client, "request", lambda *a, **k: next(answers))
    shown = r"/sessions/ab12/reset answered \{'obs': 'x', 'info': \{\}\}, without \['observation'\]"
    with pytest.raises(ValueError, match=shown + r" \(expected \{observation: str, info: dict\}\)"):
        env_client.RemoteEnv("http://127.0.0.1:9", "guess").reset(seed=0)


def test_loaders_name_the_file_of_no_rows_and_the_line_of_a_number_python_will_not_read(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(ValueError, match=r"data file '.*empty.jsonl' has no rows: a run needs at least one prompt"):
        data.load_rows(str(empty))
    pq = pytest.importorskip("pyarrow.parquet", reason="pip install pyarrow (requirements.txt installs it)")
    import pyarrow as pa

    pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), tmp_path / "none.parquet")
    with pytest.raises(ValueError, match=r"'.*none.parquet' has no rows"):
        data.load_rows(str(tmp_path / "none.parquet"))
    big = tmp_path / "big.jsonl"
    big.write_text('{"prompt": "1+1=", "ground_truth": "2"}\n{"prompt": "a", "ground_truth": ' + "9" * 5000 + "}\n")
    with pytest.raises(ValueError, match=r"big.jsonl:2: JSON that Python will not read \(Exceeds the limit \(4300"):
        data.load_rows(str(big))
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(
        '{"step": 1, "rollout/reward_mean": 0.5}\n{"step": 2, "rollout/reward_mean": ' + "9" * 5000 + "}\n"
    )
    with pytest.raises(InputError, match=r"metrics.jsonl, line 2: a number Python will not read"):
        load_metrics(metrics)


def test_a_server_with_a_token_refuses_requests_without_it(monkeypatch):
    monkeypatch.setenv(env_service.TOKEN_VAR, "s3cret")
    server = start_server(ServiceArgs(port=0))  # it takes the token at its start
    try:
        assert request(server.url, "GET", "/health", None, 30)["status"] == "ok"  # `request` sends it
        monkeypatch.setenv(env_service.TOKEN_VAR, "wrong")
        with pytest.raises(env_service.HTTPError, match="HTTP 401: this server requires a token"):
            request(server.url, "POST", "/sessions", {"env": "guess"}, 30)
        monkeypatch.delenv(env_service.TOKEN_VAR)
        assert raw(server.url, "GET /health HTTP/1.1")[0] == 401
        assert server.service.health()["sessions"] == 0
    finally:
        stop_server(server)
