"""The OpenAI chat-completions API over HTTP for model_proxy.py: its routes, request validation, error bodies, streams.

model_proxy.ModelProxy does the work (`complete`, `content`, `set_reward`, `session`); this file is its face on the
wire (`start_proxy`, `stop_proxy`), env_service.Handler's body parsing and JSON answers on OpenAI's schema (where it
has one). Every error is
{"error": {"message", "type", "code"}} with its status:
    GET  /v1/models                -> {"object": "list", "data": [{"id", "object": "model", "owned_by"}]}
    POST /v1/chat/completions      {"messages", "max_tokens" | "max_completion_tokens", "temperature", "top_p",
                                    "stream", "user", "n" (1)} -> a chat.completion, plus a `minrl` field (the
                                    session, policy version, sampling asked and used); with "stream": true, server-sent
                                    chat.completion.chunk events, then `data: [DONE]`
    POST /v1/sessions/ID/reward    {"reward": number} -> {"session", "reward"}    (the episode's return)
    GET | DELETE /v1/sessions/ID   -> {"session", "reward", "records": [{prompt_ids, ids, logprobs, version, ...}]}
The session is the header `X-Session-Id`, else the `user` field, else a new one per request. A message's content is a
string or a list of text parts; tool calls, other parts and n > 1 are refused (400). HTTP/1.1: a client's connection
stays open for its next request (the openai client's pool); an error or a stream closes it.
"""

from __future__ import annotations

import json
import secrets
import sys
import threading
import time
import traceback
import urllib.parse

import env_service
from env_service import HTTPError

CLOSE = {"Connection": "close"}  # after an error (its request's body may be unread on the connection)


def stream_deltas(proxy, record: dict) -> list[str]:
    """The answer's text a token at a time, holding back a piece that ends inside a character (a byte-level tokenizer's
    half of a UTF-8 sequence decodes to U+FFFD): the deltas join to the content exactly."""
    sent, deltas = "", []
    for i in range(len(record["ids"])):
        text = proxy.content(record, i + 1)
        if text.startswith(sent) and len(text) > len(sent) and not text.endswith("\ufffd"):
            deltas.append(text[len(sent) :])
            sent = text
    whole = proxy.content(record)
    return deltas + ([whole[len(sent) :]] if whole.startswith(sent) and whole != sent else [])


def chat_messages(messages) -> list[dict]:
    """The request's messages as {role, content: str}: content given as OpenAI's list of text parts is joined. Refused
    (400): anything else, images and other non-text parts, and tool calls (an agent here acts in its text)."""
    roles, out = ("system", "developer", "user", "assistant", "tool"), []
    text_part = lambda p: isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
    if not isinstance(messages, list) or not messages:
        raise HTTPError(400, "'messages' must be a non-empty list of {role, content} objects")
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(m, dict) and m.get("tool_calls"):
            why = "not supported (the proxy samples text; the agent parses its actions from the content)"
            raise HTTPError(400, f"messages[{i}] has tool_calls: {why}")
        if isinstance(content, list) and all(text_part(p) for p in content):
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str) or m.get("role") not in roles:
            wanted = f"{{role: one of {list(roles)}, content: a string or a list of text parts}}"
            raise HTTPError(400, f"messages[{i}] must be {wanted}, got {str(m)[:200]}")
        out.append({"role": m["role"], "content": content})
    return out


def openai_error(status: int, message: str) -> dict:
    """OpenAI's error body: its type by status, code context_length_exceeded for a prompt over max_context."""
    kind = {400: "invalid_request_error", 404: "not_found_error", 413: "invalid_request_error"}
    code = "context_length_exceeded" if "max_context" in message else None
    return {"error": {"message": message, "type": kind.get(status, "server_error"), "code": code}}


class Handler(env_service.Handler):
    """env_service's handler (its body parsing within max_body_bytes, its JSON answers) on the proxy's routes, with
    OpenAI's error bodies and server-sent events for a stream. `self.server.service` is the ModelProxy. HTTP/1.1: a
    client's connection stays open for its next request (an agent's pool); an error or a stream closes it."""

    protocol_version = "HTTP/1.1"

    def handle_any(self) -> None:
        path = urllib.parse.urlsplit(self.path).path
        try:
            self.respond(path)
        except (BrokenPipeError, ConnectionResetError, env_service.ClientLeft):  # the client left before its answer
            print(f"[minrl] model_proxy: the client of {self.command} {path} left before its answer", file=sys.stderr)

    def respond(self, path: str) -> None:
        """Route one request and answer it, errors as OpenAI's error bodies."""
        try:
            body, proxy = self.read_body() if self.command == "POST" else {}, self.server.service
            parts = [urllib.parse.unquote(p) for p in path.split("/")]  # ["", "v1", "sessions", ID, ("reward")]
            session = len(parts) in (4, 5) and parts[:3] == ["", "v1", "sessions"]
            if (self.command, path) == ("GET", "/v1/models"):
                model = {"id": proxy.name, "object": "model", "owned_by": "minrl"}
                return self.answer(200, {"object": "list", "data": [model]})
            if (self.command, path) == ("POST", "/v1/chat/completions"):
                return self.chat(proxy, body)
            if session and len(parts) == 5 and parts[4] == "reward" and self.command == "POST":
                return self.answer(200, proxy.set_reward(parts[3], body.get("reward")))
            if session and len(parts) == 4 and self.command in ("GET", "DELETE"):  # DELETE: the session is dropped
                return self.answer(200, proxy.session(parts[3], pop=self.command == "DELETE"))
            raise HTTPError(404, f"no route {self.command} {path}")
        except HTTPError as e:  # (closing: the request's body may be unread)
            self.answer(e.status, openai_error(e.status, str(e)), CLOSE)
        except (BrokenPipeError, ConnectionResetError, env_service.ClientLeft):
            raise
        except Exception as e:  # a bug of the proxy: a JSON 500 naming it (and the traceback here)
            traceback.print_exc()
            self.answer(500, openai_error(500, f"model_proxy failed on {self.command} {path}: {e!r}"), CLOSE)

    def chat(self, proxy, body: dict) -> None:
        """POST /v1/chat/completions: validate, complete, answer whole or as a stream."""
        messages = chat_messages(body.get("messages"))
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
        used = {**proxy.sampling, "max_tokens": max_tokens}
        sampling = {"sampling_used": used, "sampling_asked": asked}
        meta = {"session": str(session), "policy_version": r["version"], **sampling, "extends": r["extends"]}
        head = {"id": "chatcmpl-" + secrets.token_hex(12), "created": int(time.time()), "model": proxy.name}
        n_prompt, n_completion = len(r["prompt_ids"]), len(r["ids"])
        usage = {"prompt_tokens": n_prompt, "completion_tokens": n_completion, "total_tokens": n_prompt + n_completion}
        if not body.get("stream"):
            message = {"role": "assistant", "content": text}
            choice = {"index": 0, "message": message, "finish_reason": r["finish_reason"]}
            whole = {**head, "object": "chat.completion", "choices": [choice], "usage": usage, "minrl": meta}
            return self.answer(200, whole)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")  # the stream's end is the connection's (no Content-Length)
        self.end_headers()
        deltas = [{"role": "assistant", "content": ""}] + [{"content": d} for d in stream_deltas(proxy, r)]
        for i, delta in enumerate(deltas + [{}]):
            finish = r["finish_reason"] if i == len(deltas) else None
            choice = {"index": 0, "delta": delta, "finish_reason": finish}
            last = {"usage": usage, "minrl": meta} if finish else {}  # the final chunk carries the totals
            chunk = {**head, "object": "chat.completion.chunk", "choices": [choice], **last}
            self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        self.wfile.write(b"data: [DONE]\n\n")

    def error_body(self, status: int, message: str) -> dict:  # http.server's own refusals (send_error) too
        return openai_error(status, message)

    do_GET = do_POST = do_DELETE = do_PUT = do_PATCH = handle_any  # noqa: N815 (http.server's names: do_<METHOD>)


def start_proxy(proxy, host: str = "127.0.0.1", port: int = 0) -> env_service.Server:
    """Serve `proxy` on host:port in its own threads (`server.url` is the base_url's root; stop with stop_proxy)."""
    server = env_service.Server((host, port), Handler)
    server.service, server.url = proxy, f"http://{host}:{server.server_address[1]}"
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def stop_proxy(server: env_service.Server) -> None:
    """Stop answering and batching; returns once the batcher's thread has left (one left inside torch at the
    interpreter's exit can abort it)."""
    server.shutdown()
    server.server_close()
    server.service.stop.set()
    for t in server.service.threads:
        t.join(server.service.args.request_timeout)


def main() -> None:
    """`python openai_api.py`: what chat_messages makes of a request's messages, and the error a bad one gets."""
    print(
        chat_messages([{"role": "user", "content": [{"type": "text", "text": "12"}, {"type": "text", "text": "+3="}]}])
    )
    try:
        chat_messages([{"role": "user", "content": None}])
    except HTTPError as e:
        print(e.status, openai_error(e.status, str(e)))


if __name__ == "__main__":
    main()
