"""Environments as a service: any envs.py environment behind HTTP, the API and the server (its client: env_client.py).

    python env_service.py --port 0                          # a server on a free port, episodes of each env through it
    python env_service.py --serve --port 8100               # serve until Ctrl-C (127.0.0.1; --host 0.0.0.0 for others)
    python trainer.py --task shell --env-url http://127.0.0.1:8100,http://127.0.0.1:8101   # train through two

Why (ROCK's pattern, minimal): environments, sandboxes above all, scale out on cheap CPU hosts while the GPUs stay
with the trainer; a crashed or hung environment host costs its episodes, never the run.

The API: JSON in, JSON out; every error is {"error": message} with its status.
    GET    /health               -> {"status": "ok", "sessions", "max_sessions", "envs", "steps"}
    POST   /sessions             {"env": name, "split": "train" | "eval", "options": {...}} -> {"session": id}
    POST   /sessions/ID/reset    {"seed": int | null}  -> {"observation", "info"}
    POST   /sessions/ID/step     {"action": str}       -> {"observation", "reward", "terminated", "truncated", "info"}
    DELETE /sessions/ID                                -> {"closed": id}
400: malformed JSON (NaN, nesting too deep too), a bad or missing field, an unknown env or option, limits over the
server's ceiling. 401: no or a wrong token. 404 / 405: an unknown path or session / a known path's wrong method. 408:
a body that stalled. 409: a step before reset or after the end. 410: closed by a timeout (which: in the message). 411
/ 413: no Content-Length / over max_body_bytes or max_action_chars. 501: an unknown method. 503: full.

Who may reach it, and what a client may change. The server binds 127.0.0.1 unless told otherwise (--host): only this
machine's processes reach it. A server others can reach should require a token: set MINRL_ENV_TOKEN to a shared secret
in the server's environment and its clients' (`request` sends it); every request must then carry `Authorization:
Bearer TOKEN` (401 otherwise). Plain HTTP carries it unencrypted: a private network, or a tunnel. A client chooses an
env, its split and its options: for the shell env, the sandbox's limits (sandbox.Limits: wall and CPU seconds, memory,
the workspace's bytes and files, ...) up to limit_ceiling times their defaults, never where its workspace lies (at the
default ceiling 16 and 256 sessions, the host may hold 256 x 64 MiB of workspaces). It holds at most max_sessions
sessions with the other clients, each closed after idle_timeout or session_timeout. Every command runs in
sandbox.py's sandbox.

Why the standard library's ThreadingHTTPServer, not an ASGI stack: no dependency; a thread per request fits steps that
wait (a sandboxed process, a sleep); async helps only async steps (64 sessions at once: bench/env_service_bench.py). A
connection per request (HTTP/1.0 style): none goes stale between two steps, so a step is never sent twice.

The client, RemoteEnv (the Env the trainer steps over HTTP, one server or several): env_client.py. `request` is one
request on its own connection (the client's, model_proxy's and the benches').

Implementation details (our choices)
1. Sessions are closed by DELETE (RemoteEnv does it when an episode ends), the idle timeout (no request for
   idle_timeout s) or the lifetime timeout (session_timeout s after creation), checked 4 times per idle timeout; a
   closed session's id answers 410 with the reason (the last 4096 are remembered). 2. A session's requests run one at
   a time, sessions concurrently. 3. Non-JSON info values (some GEM envs) go as str(); a service bug answers JSON 500.
4. A client that leaves before its answer (its timeout, its exit) takes its session with it: the session it opened
   (POST /sessions) or whose episode it reset or stepped is closed at once, not left to the idle timeout, so that
   clients that give up and retry cannot fill the server. A full server answers 503 with `Retry-After: 1`.
"""

from __future__ import annotations

import contextlib
import hmac
import http.client
import json
import os
import re
import secrets
import select
import socket
import sys
import threading
import time
import traceback
import urllib.parse
from collections import OrderedDict
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import sandbox
from cli import check_fields, json_refusal, parse_config, sigterm_as_ctrl_c
from envs import ENVS, make_env


@dataclass
class ServiceArgs:
    """`python env_service.py`: the server's address and limits."""

    host: str = "127.0.0.1"
    """Address to bind (127.0.0.1: this machine only; 0.0.0.0: every interface, then set MINRL_ENV_TOKEN)."""
    port: int = 8100
    """Port to bind (0 = any free port)."""
    serve: bool = False
    """Serve until Ctrl-C (otherwise: the demo, a server on a free port and an episode of each env through it)."""
    max_sessions: int = 256
    """Open sessions at most; a create beyond answers 503."""
    max_body_bytes: int = 65536
    """Largest request body (413 beyond)."""
    max_action_chars: int = 4096
    """Longest action (413 beyond)."""
    idle_timeout: float = 300.0
    """Seconds without a request after which a session is closed."""
    session_timeout: float = 3600.0
    """Seconds after creation at which a session is closed, busy or not."""
    limit_ceiling: float = 16.0
    """A session's sandbox limits (the shell's `limits` option) may be at most this multiple of sandbox.Limits'."""

    def __post_init__(self):
        ranges = {"[0, 65535]": ("port",), "[1, inf)": ("max_sessions", "max_body_bytes", "max_action_chars")}
        check_fields(self, {**ranges, "(0.0, inf)": ("idle_timeout", "session_timeout", "limit_ceiling")})


TOKEN_VAR = "MINRL_ENV_TOKEN"  # a shared secret: the server requires it, `request` sends it (module docstring)


class HTTPError(Exception):
    """A request the service refuses: its status and the message of the JSON error body."""

    def __init__(self, status: int, message: str, headers: dict | None = None):
        super().__init__(message)
        self.status, self.headers = status, headers or {}  # headers: 405's Allow


# ----------------------------------------------------------------------------------------------
# The server


@dataclass
class Session:
    """One open episode: the env, when it was created and last used, where the episode stands."""

    env: object
    created: float
    used: float
    lock: threading.Lock
    state: str = "created"  # created -> running -> done (reset again: running)
    closed: str = ""  # why it was closed (a request holding it then answers 410)


class EnvService:
    """The sessions and the four operations; the HTTP handler only parses and routes."""

    def __init__(self, args: ServiceArgs):
        self.args, self.sessions, self.lock, self.steps = args, {}, threading.Lock(), 0
        self.gone = OrderedDict()  # closed session id -> why (detail 1)

    @contextlib.contextmanager
    def held(self, sid: str):
        """The open session `sid`, under its lock; 404 / 410 saying why not (also when closed while waiting)."""
        with self.lock:
            s = self.sessions.get(sid)
            if s is None:  # closed, and remembered as gone (410), or never opened here (404)
                closed = HTTPError(410, f"session {sid} was closed: {self.gone.get(sid)}")
                raise closed if sid in self.gone else HTTPError(404, f"unknown session {sid}")
        with s.lock:
            if s.closed:
                raise HTTPError(410, f"session {sid} was closed: {s.closed}")
            yield s

    def create(self, body: dict) -> dict:
        """A new session holding a fresh environment."""
        name, split, options = required(body, "env", str), body.get("split", "train"), body.get("options", {})
        if split not in ("train", "eval") or not isinstance(options, dict) or "workspace_dir" in options:
            no_dir = "without 'workspace_dir' (a path on the server's host: the server's to choose)"
            raise HTTPError(400, f"'split' must be 'train' or 'eval' and 'options' an object, {no_dir}")
        if name not in ENVS and not name.startswith("gem:"):
            raise HTTPError(400, f"unknown environment {name!r}: one of {sorted(ENVS)} or gem:<env id>")
        with self.lock:
            if len(self.sessions) >= self.args.max_sessions:
                full = f"{self.args.max_sessions} sessions are open (max_sessions); close some or retry later"
                raise HTTPError(503, full, {"Retry-After": "1"})
        try:
            if name == "shell" and isinstance(options.get("limits"), dict):
                options = {**options, "limits": sandbox.Limits(**options["limits"])}
            env = make_env(name, split, **options)
            if name == "shell":  # what a client may ask of this host: its sandbox's limits and disk
                env.cfg.capped(self.args.limit_ceiling)
        except (TypeError, ValueError) as e:  # an unknown option, a bad value, limits over the ceiling
            raise HTTPError(400, f"environment {name!r} with options {options}: {e}") from e
        sid, now = secrets.token_hex(8), time.monotonic()
        with self.lock:
            self.sessions[sid] = Session(env, now, now, threading.Lock())
        return {"session": sid}

    def reset(self, sid: str, body: dict) -> dict:
        """Start (or restart) the session's episode."""
        seed = body.get("seed")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**63):
            raise HTTPError(400, f"'seed' must be an integer in [0, 2**63) or null, got {seed!r}")
        with self.held(sid) as s:
            obs, info = run_env(s, "reset", seed=seed)
            s.state = "running"
        return {"observation": obs, "info": info}

    def step(self, sid: str, body: dict) -> dict:
        """One action of the session's episode."""
        action = required(body, "action", str)
        if len(action) > self.args.max_action_chars:
            raise HTTPError(413, f"action of {len(action)} characters > max_action_chars {self.args.max_action_chars}")
        with self.held(sid) as s:
            if s.state != "running":
                why = "step before reset" if s.state == "created" else "the episode has ended; reset it"
                raise HTTPError(409, f"session {sid}: {why}")
            obs, reward, terminated, truncated, info = run_env(s, "step", action=action)
            s.state = "done" if terminated or truncated else "running"
        with self.lock:
            self.steps += 1
        return {"observation": obs, "reward": reward, "terminated": terminated, "truncated": truncated, "info": info}

    def close(self, sid: str, why: str = "closed by its client") -> dict:
        """Close a session: the env's close() (a sandbox's workspace goes) and its id remembered as gone."""
        with self.lock:
            s = self.sessions.pop(sid, None)
            if s is None:
                raise HTTPError(404, f"unknown session {sid}")
            self.gone[sid] = why
            while len(self.gone) > 4096:
                self.gone.popitem(last=False)
        with s.lock:  # after a running step of it; a request that fetched it before sees `closed` (410)
            s.closed = why
            if hasattr(s.env, "close"):
                s.env.close()
        return {"closed": sid}

    def reap(self, stop: threading.Event) -> None:
        """Detail 1: close sessions past their idle or lifetime timeout, until `stop`."""
        a = self.args
        while not stop.wait(min(a.idle_timeout, a.session_timeout) / 4):
            now = time.monotonic()
            with self.lock:
                idle = [k for k, s in self.sessions.items() if now - s.used > a.idle_timeout and not s.lock.locked()]
                old = [k for k, s in self.sessions.items() if now - s.created > a.session_timeout and k not in idle]
            why = {k: f"idle for more than idle_timeout = {a.idle_timeout} s" for k in idle}
            why.update({k: f"open for more than session_timeout = {a.session_timeout} s" for k in old})
            for k, reason in why.items():
                try:  # the reaper must outlive any one session: a failure is logged, the others still get reaped
                    self.close(k, reason)
                except HTTPError:  # closed meanwhile by its client
                    pass
                except Exception as e:
                    print(f"[minrl] env_service: closing session {k} ({reason}) failed: {e!r}", file=sys.stderr)

    def health(self) -> dict:
        """What the server holds."""
        with self.lock:
            held = {"sessions": len(self.sessions), "max_sessions": self.args.max_sessions}
            return {"status": "ok", **held, "envs": sorted(ENVS), "steps": self.steps}


def required(body: dict, name: str, kind: type):
    """body[name], which must be of type kind (400 otherwise)."""
    if not isinstance(body.get(name), kind):
        raise HTTPError(400, f"field {name!r} must be a {kind.__name__}, got {body.get(name)!r}")
    return body[name]


def not_json(constant: str):
    """json.loads's parse_constant: NaN, Infinity and -Infinity, which Python reads and strict JSON has not."""
    raise ValueError(f"{constant} is not a JSON number")


def run_env(s: Session, method: str, **kw):
    """The env's reset / step with its JSON-ready result; an env that raises is a 500 naming the exception."""
    try:
        out = getattr(s.env, method)(**kw)
    except Exception as e:
        raise HTTPError(500, f"{getattr(s.env, 'name', type(s.env).__name__)}.{method}({kw}) raised {e!r}") from e
    s.used = time.monotonic()
    jsonable = lambda info: json.loads(json.dumps(dict(info or {}), default=str))  # detail 3
    if method == "reset":
        return str(out[0]), jsonable(out[1])
    return str(out[0]), float(out[1]), bool(out[2]), bool(out[3]), jsonable(out[4])  # obs, reward, term., trunc., info


ROUTES = [  # (method, path pattern, handler(service, match, body)): the whole API
    ("GET", r"/health", lambda svc, m, b: svc.health()),
    ("POST", r"/sessions", lambda svc, m, b: svc.create(b)),
    ("POST", r"/sessions/([0-9a-f]+)/reset", lambda svc, m, b: svc.reset(m[1], b)),
    ("POST", r"/sessions/([0-9a-f]+)/step", lambda svc, m, b: svc.step(m[1], b)),
    ("DELETE", r"/sessions/([0-9a-f]+)", lambda svc, m, b: svc.close(m[1])),
]


class Handler(BaseHTTPRequestHandler):
    """Parse one request, route it, answer JSON (errors too). The service is `self.server.service`."""

    timeout = 30.0  # seconds a client may take to send its request (a stalled one cannot hold a thread forever)
    disable_nagle_algorithm = True  # an answer is 2 writes: on openai_api's kept-alive connections Nagle held the 2nd

    def handle_any(self) -> None:
        """Answer one request of any method (`self.command`)."""
        method, path = self.command, urllib.parse.urlsplit(self.path).path
        payload = {}
        try:
            try:
                self.check_token()
                routes = [(verb, m, fn) for verb, pattern, fn in ROUTES if (m := re.fullmatch(pattern, path))]
                for verb, m, fn in routes:
                    if verb == method:
                        payload = fn(self.server.service, m, self.read_body() if verb == "POST" else {})
                        return self.answer(200, payload)
                if not routes:
                    raise HTTPError(404, f"no route {path}")
                allow = ", ".join(verb for verb, *_ in routes)  # a known path, the wrong method
                raise HTTPError(405, f"{method} {path}: allowed {allow}", {"Allow": allow})
            except HTTPError as e:
                self.answer(e.status, {"error": str(e)}, e.headers)
            except (BrokenPipeError, ConnectionResetError, ClientLeft):
                raise
            except Exception as e:  # a bug of the service itself: a JSON 500 with its name (and the traceback here)
                traceback.print_exc()
                self.answer(500, {"error": f"env_service failed on {method} {self.path}: {e!r}"})
        except (BrokenPipeError, ConnectionResetError, ClientLeft):  # the client gave up (its timeout, its exit)
            self.client_left(method, path, payload)

    def client_left(self, method: str, path: str, payload: dict) -> None:
        """Detail 4: the client left before its answer. The session it opened or used is closed: nobody holds its
        id (a create's answer never arrived) or knows where its episode stands (a reset's or step's)."""
        m = re.fullmatch(r"/sessions/([0-9a-f]+)/(reset|step)", path)
        sid = payload.get("session") if method == "POST" and path == "/sessions" else m and m[1]
        why = f"its client left before the answer to {method} {path}"
        with contextlib.suppress(HTTPError):  # closed meanwhile (its client's DELETE, the reaper)
            if sid:
                self.server.service.close(sid, why)
        closed = f"; session {sid} closed" if sid else ""
        print(f"[minrl] env_service: the client of {method} {path} left before its answer{closed}", file=sys.stderr)

    def check_token(self) -> None:
        """401 unless the request carries the server's token (when it has one: MINRL_ENV_TOKEN at its start)."""
        token, given = self.server.token, self.headers.get("Authorization", "")
        if token and not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
            raise HTTPError(401, f"this server requires a token: the header Authorization: Bearer ${TOKEN_VAR}")

    def read_body(self) -> dict:
        """The JSON object of the request body, within max_body_bytes."""
        if not (n := self.headers.get("Content-Length", "")).isdigit():
            raise HTTPError(411, f"a POST needs a Content-Length header, a number of bytes (got {n!r})")
        if int(n) > self.server.service.args.max_body_bytes:
            raise HTTPError(413, f"body of {n} bytes > max_body_bytes {self.server.service.args.max_body_bytes}")
        try:
            raw = self.rfile.read(int(n))
        except TimeoutError:  # a client that stalls mid-body: a line here, not a traceback
            print(f"[minrl] env_service: the body of {self.command} {self.path} stalled", file=sys.stderr)
            raise HTTPError(408, f"the body did not arrive within {self.timeout} s") from None
        try:  # NaN and Infinity are not JSON: refused, so that no answer echoes one
            body = json.loads(raw or b"{}", parse_constant=not_json)
        except (ValueError, RecursionError) as e:  # also a number of over 4300 digits, brackets nested too deep
            raise HTTPError(400, f"malformed JSON body: {json_refusal(e)}") from None
        if not isinstance(body, dict):
            raise HTTPError(400, "the JSON body must be an object")
        return body

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """http.server's own refusals (501: an unknown method; 400: a malformed request line; 414, 431: too long) in
        JSON, as every other answer, not its HTML page; the connection is closed after."""
        self.close_connection = True
        what = message or self.responses.get(code, ("refused",))[0]
        asked = f"{self.command} {getattr(self, 'path', '')}" if self.command else "the request"
        self.answer(code, self.error_body(code, f"{asked}: {what}"), {"Connection": "close"})

    def error_body(self, status: int, message: str) -> dict:
        return {"error": message}

    def answer(self, status: int, payload: dict, headers: dict | None = None) -> None:
        """Send the JSON payload with its status (and headers); ClientLeft if the client has closed its end (a
        client that timed out: the write alone would often succeed into the socket's buffer)."""
        readable, _, _ = select.select([self.connection], [], [], 0)
        if readable and not self.connection.recv(1, socket.MSG_PEEK):  # end of stream: the client closed
            raise ClientLeft()
        data = json.dumps(payload).encode()
        self.send_response(status)
        for k, v in {"Content-Type": "application/json", "Content-Length": str(len(data)), **(headers or {})}.items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = do_DELETE = do_PUT = do_PATCH = handle_any  # noqa: N815 (http.server's names: do_<METHOD>)
    log_message = lambda self, fmt, *args: None  # noqa: E731 (a line per request would drown the trainer's output)


class ClientLeft(Exception):
    """The client closed its connection before the answer was written."""


class Server(ThreadingHTTPServer):
    request_queue_size, daemon_threads = 1024, True  # a backlog of 5 drops connections when 64 episodes step at once
    token = None  # start_server's MINRL_ENV_TOKEN (None: no check)

    def handle_error(self, request, client_address) -> None:
        """A request that failed past the handler's answers (its client reset the connection mid-request): one line
        in the log, not socketserver's traceback."""
        why = repr(sys.exc_info()[1])
        print(
            f"[minrl] server {getattr(self, 'url', '')}: a request from {client_address[0]} failed: {why}",
            file=sys.stderr,
        )


def start_server(args: ServiceArgs) -> Server:
    """A server on args.host:args.port answering in its own threads (`server.url`; stop it with stop_server)."""
    server = Server((args.host, args.port), Handler)
    server.service, server.stop, server.token = EnvService(args), threading.Event(), os.environ.get(TOKEN_VAR)
    server.url = f"http://{args.host}:{server.server_address[1]}"
    threading.Thread(target=server.serve_forever, daemon=True).start()
    threading.Thread(target=server.service.reap, args=(server.stop,), daemon=True).start()
    return server


def stop_server(server: Server) -> None:
    """Stop answering, close the socket and every session (a sandbox's workspace goes; a running step is awaited)."""
    server.stop.set()
    server.shutdown()
    server.server_close()
    for sid in list(server.service.sessions):
        server.service.close(sid, "the server stopped")


# ----------------------------------------------------------------------------------------------
# One request (the client's transport, env_client.py)


class ServerDown(Exception):
    """A server that did not answer (refused, timed out, dropped the connection, or a reply that is not JSON)."""


def request(url: str, method: str, path: str, body: dict | None, timeout: float) -> dict:
    """One HTTP request on its own connection: the JSON answer; ServerDown when the server does not answer within
    timeout (per socket operation) or not in JSON; HTTPError for a JSON error status."""
    host, port = urllib.parse.urlsplit(url).hostname, urllib.parse.urlsplit(url).port
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if data else {}
        if token := os.environ.get(TOKEN_VAR):  # a server that requires one (module docstring)
            headers["Authorization"] = f"Bearer {token}"
        conn.request(method, path, body=data, headers=headers)
        resp = conn.getresponse()
        status, raw = resp.status, resp.read()
    except (OSError, http.client.HTTPException) as e:  # refused, reset, timed out, a half answer
        raise ServerDown(f"{method} {path}: {type(e).__name__}: {e}") from e
    finally:
        conn.close()
    try:
        payload = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ServerDown(f"{method} {path}: HTTP {status} with a body that is not JSON: {raw[:200]!r}") from e
    if status >= 400:  # the message names the server and the request; callers re-raise what they cannot handle
        raise HTTPError(status, f"env server {url}: {method} {path}: HTTP {status}: {payload.get('error', payload)}")
    return payload


def main(argv=None) -> None:
    """Serve (--serve), or the demo: a server, each embedded env played through its API by its scripted solver."""
    args = parse_config(ServiceArgs, argv)
    sigterm_as_ctrl_c()  # kill, systemd, docker: the sessions and their workspaces are closed as on Ctrl-C
    server = start_server(args)
    try:
        if args.serve:
            if args.host not in ("127.0.0.1", "localhost", "::1") and not server.token:
                warn = f"[minrl] WARNING: {args.host} without {TOKEN_VAR}: anyone who reaches the port runs commands"
                print(warn, file=sys.stderr)
            print(f"[minrl] env_service at {server.url} (envs: {sorted(ENVS)}); Ctrl-C stops it")
            server.stop.wait()
        for name in [] if args.serve else ENVS:  # shell: needs user namespaces (sandbox.check_available says why)
            local, url, t0 = make_env(name), server.url, time.perf_counter()
            local.reset(seed=0)
            sid = request(url, "POST", "/sessions", {"env": name, "split": "train"}, 30.0)["session"]
            obs = request(url, "POST", f"/sessions/{sid}/reset", {"seed": 0}, 30.0)["observation"]
            print(f"--- {name} at {url} (session {sid})\nobs    {obs!r}")
            done = False
            while not done:
                action = local.expert()
                local.step(action)
                out = request(url, "POST", f"/sessions/{sid}/step", {"action": action}, 30.0)
                done = out["terminated"] or out["truncated"]
                print(f"action {action!r} -> reward {out['reward']}, obs {out['observation']!r}, info {out['info']}")
            request(url, "DELETE", f"/sessions/{sid}", None, 30.0)
            print(f"{(time.perf_counter() - t0) * 1e3:.0f} ms for the episode; server: {server.service.health()}")
    except KeyboardInterrupt:  # --serve's way to stop (Ctrl-C, SIGTERM)
        pass
    finally:
        stop_server(server)


if __name__ == "__main__":
    main()
