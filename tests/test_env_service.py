"""env_service.py over real HTTP on 127.0.0.1: every refusal with its status, remote episodes equal to local ones, 64
concurrent sessions, timeouts, and servers that die or hang failing only their episodes, in a trainer run too."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import env_service
import envs
import sandbox
import tasks
import trainer
from env_client import RemoteEnv, Servers
from env_service import ServerDown, ServiceArgs, request, start_server, stop_server

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def server():
    s = start_server(ServiceArgs(port=0, max_sessions=4, max_body_bytes=2000, max_action_chars=50))
    yield s
    stop_server(s)


def raw(url: str, method: str, path: str, body: bytes | None, headers=None):
    """(status, JSON body) of one request sent as given (no client-side checks)."""
    import http.client
    import urllib.parse

    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=10)
    conn.request(method, path, body=body, headers=headers or {})
    resp = conn.getresponse()
    out = resp.status, json.loads(resp.read())
    conn.close()
    return out


def test_every_bad_request_gets_its_status_and_a_json_error(server, monkeypatch):
    url = server.url
    sid = request(url, "POST", "/sessions", {"env": "calc"}, 10)["session"]
    cases = [
        ("POST", "/sessions", b"{not json", 400, "malformed JSON"),
        ("POST", "/sessions", b"[1, 2]", 400, "must be an object"),
        ("POST", "/sessions", b'{"split": "train"}', 400, "field 'env'"),
        ("POST", "/sessions", b'{"env": "chess"}', 400, "unknown environment"),
        ("POST", "/sessions", b'{"env": "calc", "options": {"no_such_knob": 1}}', 400, "no_such_knob"),
        ("POST", "/sessions", b'{"env": "calc", "split": "test"}', 400, "'split'"),
        ("POST", f"/sessions/{sid}/reset", b'{"seed": "zero"}', 400, "'seed'"),
        ("POST", f"/sessions/{sid}/step", b'{"action": "calc 1+1"}', 409, "before reset"),
        ("POST", "/sessions/0123abcd/step", b'{"action": "x"}', 404, "unknown session"),
        ("GET", "/nowhere", None, 404, "no route /nowhere"),
        ("GET", f"/sessions/{sid}/step", None, 405, "allowed POST"),
        ("PUT", "/sessions", b"{}", 405, "allowed POST"),
        ("POST", "/sessions", b'{"env": "shell", "options": {"limits": {"wall_s": 1000}}}', 400, "limit_ceiling"),
        ("POST", f"/sessions/{sid}/step", json.dumps({"action": "x" * 51}).encode(), 413, "max_action_chars"),
        ("POST", "/sessions", json.dumps({"env": "calc", "pad": "x" * 3000}).encode(), 413, "max_body_bytes"),
    ]
    for method, path, body, status, words in cases:
        got, payload = raw(url, method, path, body)
        assert (got, words in payload.get("error", "")) == (status, True), (method, path, got, payload)
    with socket.create_connection((server.server_address[0], server.server_address[1]), timeout=10) as s:
        s.sendall(b"POST /sessions HTTP/1.1\r\nHost: x\r\n\r\n")  # no Content-Length
        assert s.recv(4096).split(b"\r\n")[0].endswith(b"411 Length Required")
    request(url, "POST", f"/sessions/{sid}/reset", {"seed": 3}, 10)
    monkeypatch.setattr(envs.CalculatorEnv, "act", lambda self, verb, arg: 1 / 0)
    got, payload = raw(url, "POST", f"/sessions/{sid}/step", b'{"action": "calc 1+1"}')
    assert got == 500 and "ZeroDivisionError" in payload["error"] and "calc.step" in payload["error"]
    for _ in range(3):  # max_sessions = 4: this one and three more, then 503
        request(url, "POST", "/sessions", {"env": "guess"}, 10)
    got, payload = raw(url, "POST", "/sessions", b'{"env": "guess"}')
    assert got == 503 and "max_sessions" in payload["error"]
    assert request(url, "GET", "/health", None, 10)["sessions"] == 4
    request(url, "DELETE", f"/sessions/{sid}", None, 10)
    got, payload = raw(url, "POST", f"/sessions/{sid}/step", b'{"action": "calc 1+1"}')
    assert got == 410 and "closed by its client" in payload["error"]


def wait_for(condition, seconds=10.0) -> bool:
    t0 = time.monotonic()
    while not condition() and time.monotonic() - t0 < seconds:
        time.sleep(0.02)
    return condition()


def test_a_client_that_leaves_before_its_answer_takes_its_session_with_it(server, monkeypatch, capsys):
    """Detail 4: a client that gives up (its timeout) while its reset or its create is served leaves no session
    behind; otherwise every retry of a slow client would open one more, until the server is full."""
    slow = lambda fn: lambda *a, **k: (time.sleep(1.0), fn(*a, **k))[1]  # noqa: E731
    monkeypatch.setattr(envs.CalculatorEnv, "reset", slow(envs.CalculatorEnv.reset))
    sid = request(server.url, "POST", "/sessions", {"env": "calc"}, 10)["session"]
    with pytest.raises(ServerDown, match="timed out"):  # the client waits 0.2 s of the reset's 1 s
        request(server.url, "POST", f"/sessions/{sid}/reset", {"seed": 0}, 0.2)
    assert wait_for(lambda: sid in server.service.gone)
    assert server.service.gone[sid] == f"its client left before the answer to POST /sessions/{sid}/reset"
    monkeypatch.setattr(env_service, "make_env", slow(env_service.make_env))
    with pytest.raises(ServerDown, match="timed out"):  # a create: its id never reaches anyone
        request(server.url, "POST", "/sessions", {"env": "calc"}, 0.2)
    assert wait_for(lambda: len(server.service.gone) == 2) and server.service.health()["sessions"] == 0
    err = capsys.readouterr().err
    assert err.count("left before its answer; session") == 2 and "Traceback" not in err


def test_a_full_server_answers_503_retry_after_and_a_remote_env_waits_for_room(server):
    """max_sessions = 4: a fifth session waits (Retry-After) until one closes; a server full for the whole timeout
    is named with what to do."""
    held = [request(server.url, "POST", "/sessions", {"env": "calc"}, 10)["session"] for _ in range(4)]
    import http.client

    conn = http.client.HTTPConnection(server.server_address[0], server.server_address[1], timeout=10)
    conn.request("POST", "/sessions", body=b'{"env": "calc"}', headers={"Content-Length": "15"})
    resp = conn.getresponse()
    assert (resp.status, resp.getheader("Retry-After")) == (503, "1") and b"max_sessions" in resp.read()
    conn.close()
    with pytest.raises(ConnectionError, match="full for 2 s: raise the servers' --max-sessions"):
        RemoteEnv(server.url, "calc", timeout=2.0).reset(seed=0)
    threading.Timer(1.5, lambda: request(server.url, "DELETE", f"/sessions/{held[0]}", None, 10)).start()
    t0, env = time.monotonic(), RemoteEnv(server.url, "calc", timeout=30.0)
    obs, _ = env.reset(seed=0)
    assert obs == envs.make_env("calc").reset(seed=0)[0] and 1.0 < time.monotonic() - t0 < 20
    env.close()


def test_sessions_close_after_the_idle_and_the_lifetime_timeout():
    s = start_server(ServiceArgs(port=0, idle_timeout=1.0, session_timeout=3.0))
    try:
        idle = request(s.url, "POST", "/sessions", {"env": "calc"}, 10)["session"]
        busy = request(s.url, "POST", "/sessions", {"env": "guess"}, 10)["session"]
        t0 = time.monotonic()
        while busy in s.service.sessions and time.monotonic() - t0 < 10:  # never idle: only its lifetime ends it
            raw(s.url, "POST", f"/sessions/{busy}/reset", b'{"seed": 0}')
            time.sleep(0.05)
        assert 2.9 < time.monotonic() - t0 < 10
        assert raw(s.url, "POST", f"/sessions/{idle}/reset", b"{}") == (
            410,
            {"error": f"session {idle} was closed: idle for more than idle_timeout = 1.0 s"},
        )
        status, payload = raw(s.url, "POST", f"/sessions/{busy}/reset", b"{}")
        assert status == 410 and "open for more than session_timeout = 3.0 s" in payload["error"]
    finally:
        stop_server(s)


@pytest.mark.parametrize("name", ["calc", "guess", "shell"])
def test_a_remote_episode_is_the_local_episode(server, name):
    for seed in (0, 1, 2):
        local, remote = envs.make_env(name), RemoteEnv(server.url, name)
        assert remote.reset(seed=seed)[0] == local.reset(seed=seed)[0]
        for action in ["hello", local.expert() if name != "shell" else "ls", "answer 3"][: local.cfg.max_turns]:
            want, got = local.step(action), remote.step(action)
            assert got[:4] == want[:4] and got[4]["env_error"] is None, (want, got)
            if want[2] or want[3]:
                break
        assert (remote.sid is None) == (want[2] or want[3])  # a finished episode's session: closed by the client
        remote.close()
        local.close() if hasattr(local, "close") else None
    assert server.service.health()["sessions"] == 0


def test_64_concurrent_sessions_step_at_once():
    """64 episodes whose steps each sleep 0.3 s: served one at a time they would take 64 x 2 x 0.3 = 38 s."""
    s = start_server(ServiceArgs(port=0))
    try:
        barrier, results = threading.Barrier(64), [None] * 64

        def play(k):  # the scripted solver's episode, its actions taken from a local twin of the env
            env, local = RemoteEnv(s.url, "calc", latency_s=0.3), envs.make_env("calc")
            env.reset(seed=k)
            local.reset(seed=k)
            barrier.wait(timeout=60)
            for _ in range(2):
                action = local.expert()
                local.step(action)
                results[k] = env.step(action)

        t0 = time.monotonic()
        threads = [threading.Thread(target=play, args=(k,)) for k in range(64)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        wall = time.monotonic() - t0
        assert all(r is not None and r[1] == 1.0 and r[2] for r in results), results
        assert wall < 12, f"64 sessions x 2 steps of 0.3 s took {wall:.1f} s: not concurrent"
        assert s.service.health()["steps"] == 128
    finally:
        stop_server(s)


def test_a_hung_server_fails_within_the_timeout_never_hangs():
    listener = socket.socket()  # accepts connections and never answers: a hung host
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    hung = f"http://127.0.0.1:{listener.getsockname()[1]}"
    s = start_server(ServiceArgs(port=0))
    try:
        t0 = time.monotonic()
        with pytest.raises(ConnectionError, match="TimeoutError|timed out"):
            RemoteEnv(hung, "calc", timeout=0.5).reset(seed=0)
        slow = RemoteEnv(s.url, "calc", timeout=0.5, latency_s=3.0)  # a step that outlasts the client's timeout
        slow.reset(seed=0)
        obs, reward, terminated, truncated, info = slow.step("calc 1+1")
        assert (obs, reward, terminated, truncated) == ("", 0.0, False, True) and "timed out" in info["env_error"]
        assert time.monotonic() - t0 < 10
    finally:
        listener.close()
        stop_server(s)


def test_a_dead_server_fails_its_episodes_and_new_ones_go_to_the_others(capsys):
    a, b = start_server(ServiceArgs(port=0)), start_server(ServiceArgs(port=0))
    servers = Servers([a.url, b.url])
    eps = [RemoteEnv(servers, "guess", timeout=5) for _ in range(4)]
    for k, env in enumerate(eps):
        env.reset(seed=k)
    assert sorted(e.url for e in eps) == sorted([a.url, a.url, b.url, b.url])  # spread over both
    stop_server(a)
    out = [env.step("guess 16") for env in eps]
    failed = [o for o, e in zip(out, eps) if o[4]["env_error"]]
    assert len(failed) == 2 and all(o[3] and o[1] == 0.0 for o in failed)
    assert all(o[4]["env_error"] is None for o in out if o not in failed)
    assert f"env server {a.url} failed" in capsys.readouterr().err and servers.failures[a.url] >= 1
    fresh = RemoteEnv(servers, "guess", timeout=5)
    fresh.reset(seed=9)
    assert fresh.url == b.url
    stop_server(b)
    with pytest.raises(ConnectionError, match="no environment server"):
        RemoteEnv(servers, "guess", timeout=5).reset(seed=1)


def test_a_killed_server_process_fails_its_episode_within_the_timeout(tmp_path):
    proc, url = serve_in_a_process("env_service.py")
    try:
        env = RemoteEnv(url, "calc", timeout=3)
        env.reset(seed=0)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        t1 = time.monotonic()
        info = env.step("calc 1+1")[4]
        assert info["env_error"] and "Connection" in info["env_error"] and time.monotonic() - t1 < 5
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_the_trainer_goes_on_when_a_server_dies_mid_run(tiny_model_dir, tmp_path):
    """Two servers; the first dies during the second iteration's episodes: those fail (counted, no gradient), the
    run goes on with the other server, and the failures stop once the dead one is avoided."""
    a, b = start_server(ServiceArgs(port=0)), start_server(ServiceArgs(port=0))
    real_step, dead = a.service.step, threading.Event()

    def dying_step(sid, body):  # a crash mid-episode: the connection drops without an answer from then on
        if dead.is_set():
            threading.Thread(target=lambda: (a.shutdown(), a.server_close())).start()  # refused from now on
            raise SystemExit("the host went away")  # past the service's 500 handler: the connection just drops
        return real_step(sid, body)

    a.service.step = dying_step
    rows = []
    try:
        cfg = trainer.Config(model=str(tiny_model_dir), task="calc", adv_estimator="grpo", steps=4, prompts_per_step=4,
                        group_size=4, eval_every=0, out_dir=str(tmp_path), env_url=f"{a.url},{b.url}",
                        env_timeout=5.0, kl_metric_every=0)  # fmt: skip
        trainer.train(cfg, hooks=[lambda step, m: (rows.append(m), dead.set())])  # dies during the 2nd iteration
    finally:
        stop_server(b)
    errors = [r["rollout/env_error_frac"] for r in rows]
    assert len(rows) == 4 and errors[0] == 0.0 and max(errors) > 0 and errors[-1] == 0.0, errors
    assert b.service.steps > 0


def test_the_trainer_runs_shell_tasks_through_the_server(tmp_path):
    """GRPO on the sandboxed shell tasks with every training and held-out episode a RemoteEnv on one server: the
    steps the server served are the episodes' turns, no episode failed, the sampler's logprobs are the trainer's,
    and no sandbox process or workspace outlives the run. (The embedded tokenizer, random init.)"""
    torch.manual_seed(0)
    tok, model_dir = tasks.make_tokenizer(), tmp_path / "model"
    tasks.make_tiny_model(tok).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    workspaces = lambda: set(os.listdir("/tmp/minrl-shell")) if os.path.isdir("/tmp/minrl-shell") else set()
    s, rows, before = start_server(ServiceArgs(port=0)), [], workspaces()
    try:
        cfg = trainer.Config(model=str(model_dir), task="shell", env_url=s.url, max_new_tokens=40, adv_estimator="grpo",
                        steps=2, prompts_per_step=4, group_size=4, eval_every=2, eval_n=16, kl_metric_every=0,
                        out_dir=str(tmp_path / "run"))  # fmt: skip
        out = trainer.train(cfg, hooks=[lambda step, m: rows.append(m)])
        health = s.service.health()
    finally:
        stop_server(s)
    turns = sum(r["rollout/turns"] * 16 for r in rows)  # 16 training episodes per step
    assert [step for step, _ in out["eval_history"]] == [0, 2] and health["sessions"] == 0
    assert health["steps"] >= turns + 2 * 16  # + each held-out episode's turns (two evaluations of 16)
    assert all(r["rollout/env_error_frac"] == 0.0 for r in rows) and max(r["rollout/turns"] for r in rows) <= 2
    assert max(r["stats/rollout_vs_old_logp_diff"] for r in rows) < 1e-4
    ps = subprocess.run(["ps", "-eo", "uid="], capture_output=True, text=True, check=True).stdout.split()
    mine = range(sandbox.uid_for(0), sandbox.uid_for(1023) + 1)  # this process's sandbox uids
    assert not [u for u in ps if int(u) in mine] and workspaces() <= before


def serve_in_a_process(script: str, *args: str) -> tuple[subprocess.Popen, str]:
    """`python SCRIPT --serve --port P ARGS` in a session of its own, once it answers (GET /health or /v1/models)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    proc = subprocess.Popen([sys.executable, str(ROOT / script), "--serve", "--port", str(port), *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    url, t0 = f"http://127.0.0.1:{port}", time.monotonic()
    while True:
        try:
            request(url, "GET", "/health" if script == "env_service.py" else "/v1/models", None, 2)
            return proc, url
        except Exception:
            assert time.monotonic() - t0 < 90 and proc.poll() is None, proc.stdout.read1().decode()
            time.sleep(0.2)


@pytest.mark.parametrize("script", ["env_service.py", "model_proxy.py"])
def test_sigterm_stops_a_server_as_ctrl_c_does_and_its_shell_workspaces_go(script):
    """kill, systemd and docker stop a server with SIGTERM: it must clean up as on Ctrl-C (exit 0), and the shell
    workspaces of the sessions it held are removed."""
    workspaces = lambda: set(os.listdir("/tmp/minrl-shell")) if os.path.isdir("/tmp/minrl-shell") else set()
    before = workspaces()
    proc, url = serve_in_a_process(script)
    try:
        if script == "env_service.py":
            sids = [request(url, "POST", "/sessions", {"env": "shell"}, 30)["session"] for _ in range(2)]
            for sid in sids:
                request(url, "POST", f"/sessions/{sid}/reset", {"seed": 0}, 30)
            assert len(workspaces() - before) == 2  # each session's workspace, open
        else:
            request(url, "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "1"}]}, 30)
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=60)[0].decode()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0 and "Traceback" not in out, out
    assert workspaces() <= before
