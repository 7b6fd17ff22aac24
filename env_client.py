"""The client of env_service.py: RemoteEnv, the Env the trainer steps over HTTP, on one server or several.

    python env_client.py                                   # a server on a free port, each env played through RemoteEnv
    python env_service.py --serve --port 8100 & python env_service.py --serve --port 8101 &
    python trainer.py --task shell --env-url http://127.0.0.1:8100,http://127.0.0.1:8101   # train through both

RemoteEnv(url, env, split, timeout, **options) has Env's reset / step. `url` is one server or several, comma-
separated: each new episode's session goes to the live server with the fewest sessions this process has open there.
- reset: a server that refuses, times out or drops the connection is marked down (for `retry_s`, then tried again)
  and the next one is tried; 503 (full) tries the next one too; every one full: waits and retries for up to `timeout`
  seconds; none left: ConnectionError naming each failure.
- step: a server that does not answer within `timeout`, refuses or drops the connection fails the episode: step
  returns ("", 0.0, False, True, {"env_error": reason}), logs the reason and marks the server down; the trainer
  counts it (rollout/env_error_frac) and trains nothing on that episode (rollout.py); other episodes go on.
- An environment that raises (500) or a bad request (4xx) is a bug, as it would be locally: HTTPError with the
  server's message. A session expired on the server (410) fails only its episode, like a dead server.
"""

from __future__ import annotations

import re
import sys
import threading
import time

from cli import parse_config
from env_service import HTTPError, ServerDown, ServiceArgs, request, start_server, stop_server
from envs import ENVS, make_env


class Servers:
    """The servers of one --env-url and what this process knows of them: open sessions, failures, down until when."""

    def __init__(self, urls: str | list[str], retry_s: float = 30.0):
        self.urls = [u.strip().rstrip("/") for u in (urls.split(",") if isinstance(urls, str) else urls)]
        for u in self.urls:
            if not re.fullmatch(r"http://[^/:]+:\d+", u):
                raise ValueError(f"config field 'env_url': {u!r} is not http://HOST:PORT (https is not supported)")
        self.open, self.failures = dict.fromkeys(self.urls, 0), dict.fromkeys(self.urls, 0)
        self.down_until, self.retry_s, self.lock = dict.fromkeys(self.urls, 0.0), retry_s, threading.Lock()

    def order(self) -> list[str]:
        """Servers to try for a new session: live ones, fewest open sessions first; then those marked down."""
        with self.lock:
            now = time.monotonic()
            return sorted(self.urls, key=lambda u: (self.down_until[u] > now, self.open[u]))

    def mark_down(self, url: str, reason: str) -> None:
        """Count a failure of `url`, log it, and skip it for new sessions for retry_s seconds."""
        with self.lock:
            self.failures[url], self.down_until[url] = self.failures[url] + 1, time.monotonic() + self.retry_s
        avoid = f"new sessions avoid it for {self.retry_s:.0f} s"
        print(f"[minrl] env server {url} failed ({self.failures[url]} so far): {reason}; {avoid}", file=sys.stderr)

    def count(self, url: str, delta: int) -> None:  # a session opened (+1) or closed (-1) on url
        with self.lock:
            self.open[url] += delta


ANSWERS = {  # the fields of each answer RemoteEnv reads, and their types (env_service's docstring)
    "sessions": {"session": str},
    "reset": {"observation": str, "info": dict},
    "step": {"observation": str, "reward": (int, float), "terminated": bool, "truncated": bool, "info": dict},
}


def shaped(url: str, path: str, out: dict) -> dict:
    """The server's answer to `path`, checked against ANSWERS: a field missing or of another type (a server of
    another version, or not an env_service) is an error that shows the answer."""
    fields = ANSWERS[path.rsplit("/", 1)[-1]]
    if bad := [k for k, kind in fields.items() if not isinstance(out.get(k), kind)]:
        want = ", ".join(f"{k}: {getattr(t, '__name__', 'number')}" for k, t in fields.items())
        raise ValueError(f"env server {url}: {path} answered {str(out)[:300]}, without {bad} (expected {{{want}}})")
    return out


class RemoteEnv:
    """An Env whose episodes run on env_service servers (the module docstring says what a failure does)."""

    step_concurrently = True  # rollout.step_envs steps a turn's remote envs at once: they wait on the network

    def __init__(self, url: str | Servers, env: str, split: str = "train", timeout: float = 30.0, **options):
        self.servers = url if isinstance(url, Servers) else Servers(url)
        self.env, self.split, self.timeout, self.options = env, split, timeout, options
        self.name, self.url, self.sid = f"{env} (remote)", None, None

    def reset(self, seed: int | None = None) -> tuple[str, dict]:
        """Open a session on the least-loaded live server and start its episode there. Every server full (503):
        wait a second and try again, for up to `timeout` seconds in all."""
        self.close()
        deadline = time.monotonic() + self.timeout
        while True:
            failed, full = [], False
            for url in self.servers.order():
                try:
                    body = {"env": self.env, "split": self.split, "options": self.options}
                    opened = shaped(url, "POST /sessions", request(url, "POST", "/sessions", body, self.timeout))
                    self.url, self.sid = url, opened["session"]
                    self.servers.count(url, +1)
                    path = f"/sessions/{self.sid}/reset"
                    out = shaped(url, path, request(url, "POST", path, {"seed": seed}, self.timeout))
                    return out["observation"], out["info"]
                except ServerDown as e:  # (a session it opened: closed by the server when this client left)
                    self.servers.mark_down(url, str(e))
                    self.forget()
                    failed.append(f"{url}: {e}")
                except HTTPError as e:
                    if e.status != 503:  # a bug on either side, as it would be locally
                        raise
                    self.close()
                    failed.append(str(e))
                    full = True
            if not full or time.monotonic() > deadline:
                break
            time.sleep(1.0)  # the servers' Retry-After
        why = f" (full for {self.timeout:.0f} s: raise the servers' --max-sessions, or run fewer episodes at once)"
        raise ConnectionError("no environment server could start an episode: " + "; ".join(failed) + why * full)

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        """One action on the session's server; a failed server fails the episode (env_error), never hangs."""
        if self.sid is None:
            raise RuntimeError(f"{self.name}: step() before reset(), or after the episode ended")
        try:
            out = request(self.url, "POST", f"/sessions/{self.sid}/step", {"action": action}, self.timeout)
        except ServerDown as e:
            self.servers.mark_down(self.url, str(e))
            return self.failed(f"{self.url}: {e}")
        except HTTPError as e:
            if e.status != 410:  # 410: expired on the server, this episode only; anything else is a bug
                raise
            return self.failed(str(e))
        if shaped(self.url, f"/sessions/{self.sid}/step", out)["terminated"] or out["truncated"]:
            self.close()
        info = {**out["info"], "env_error": None}
        return out["observation"], out["reward"], out["terminated"], out["truncated"], info

    def failed(self, reason: str) -> tuple[str, float, bool, bool, dict]:
        """The step result of an episode its server failed: truncated, reward 0, the reason in info."""
        self.forget()
        return "", 0.0, False, True, {"env_error": reason, "success": False}

    def forget(self) -> None:
        """Drop the session without telling its server (it is unreachable; its idle timeout will close it)."""
        if self.sid is not None:
            self.servers.count(self.url, -1)
        self.url, self.sid = None, None

    def close(self) -> None:
        """Close the session on its server (an unreachable server: counted as a failure; its reaper closes it)."""
        url, sid = self.url, self.sid
        self.forget()
        try:
            if sid is not None:
                request(url, "DELETE", f"/sessions/{sid}", None, self.timeout)
        except ServerDown as e:
            self.servers.mark_down(url, str(e))
        except HTTPError as e:
            if e.status not in (404, 410):  # 404 / 410: the server closed it already (its reaper)
                raise


def env_maker(env_url: str | None, timeout: float):
    """`make(name, split, **overrides)` for the trainer's episodes: envs.make_env, or with env_url RemoteEnvs
    spread over those servers (one Servers object: what one failure teaches, every later episode knows), each
    answer awaited `timeout` seconds at most. That env_url needs a multi-turn --task is checks.py's."""
    if not env_url:
        return make_env
    servers = Servers(env_url)
    return lambda name, split="train", **overrides: RemoteEnv(servers, name, split, timeout, **overrides)


def ungroup_failed(group_ids, episodes: list[dict]):
    """[B] group ids with each episode its env server failed (info env_error: rollout_env) alone in a group of its
    own, so that its 0 return joins no GRPO / RLOO baseline (it has no gradient either: mask 0)."""
    if len(episodes) != len(group_ids):
        raise ValueError(f"ungroup_failed: {len(episodes)} episode infos for {len(group_ids)} group ids")
    ungrouped = group_ids.clone()  # [B]
    for i, episode in enumerate(episodes):
        if episode.get("env_error") is not None:
            ungrouped[i] = -1 - i  # a group id no other episode has
    return ungrouped


def main(argv=None) -> None:
    """The demo: a server on a free port (env_service.py), each embedded env played through a RemoteEnv by the
    local env's scripted solver."""
    server = start_server(parse_config(ServiceArgs, ["--port", "0", *(argv or [])]))
    try:
        for name in ENVS:  # shell: needs user namespaces (sandbox.check_available says why)
            local, remote, done, t0 = make_env(name), RemoteEnv(server.url, name), False, time.perf_counter()
            local.reset(seed=0)
            print(f"--- {name} at {server.url}\nobs    {remote.reset(seed=0)[0]!r}")
            while not done:
                action = local.expert()
                local.step(action)
                obs, reward, terminated, truncated, info = remote.step(action)
                done = terminated or truncated
                print(f"action {action!r} -> reward {reward}, obs {obs!r}, info {info}")
            print(f"{(time.perf_counter() - t0) * 1e3:.0f} ms for the episode; server: {server.service.health()}")
    finally:
        stop_server(server)


if __name__ == "__main__":
    main()
