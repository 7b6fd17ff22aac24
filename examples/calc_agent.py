"""A tool-using agent that knows nothing of minrl: the official OpenAI client, an HTTP environment, a loop.

    python examples/calc_agent.py --base-url http://127.0.0.1:8200/v1 --env-url http://127.0.0.1:8100 \
        --episodes 7:ep-a,7:ep-b       # seed:session pairs; without --episodes, SEED:SESSION:SPLIT lines on stdin

Each episode: open a `calc` session on the environment server (env_service.py's HTTP API), send its observation to
the model as a user message, send the model's answer back as the action (`calc 3*4` is answered `=12`, `answer 12`
ends it), and repeat with the whole history, as any chat agent does. At the end it reports the episode's return to
the endpoint it chats with (POST {base_url}/sessions/SESSION/reward), the one call a training proxy needs from it.
Without --episodes it is a worker: it plays each `SEED:SESSION:SPLIT` line it reads on stdin in a thread of its own
(episodes wait on the network, so they overlap, as a production agent's do) and prints `done SESSION RETURN` when it
ends (agent_train.py keeps --agents of them running). It needs `pip install openai`; nothing else beyond the
standard library.
"""

import argparse
import json
import os
import sys
import threading
import time
import traceback
import urllib.error
import urllib.request

from openai import OpenAI
from openai.types import CompletionUsage
from openai.types.chat import ChatCompletion, ChatCompletionMessage
from openai.types.chat.chat_completion import Choice


def call(url: str, method: str, body: dict | None = None, patience: float = 120.0) -> dict:
    """One JSON request (the environment server's API and the reward report). A full server (503) is asked again
    after its Retry-After, for up to `patience` seconds; then the error stands."""
    data = None if body is None else json.dumps(body).encode()
    deadline = time.monotonic() + patience
    while True:
        req = urllib.request.Request(url, data, {"Content-Type": "application/json"}, method=method)
        try:
            with urllib.request.urlopen(req, timeout=120) as f:
                return json.loads(f.read())
        except urllib.error.HTTPError as e:
            if e.code != 503 or time.monotonic() > deadline:
                raise
            time.sleep(float(e.headers.get("Retry-After", 1)))


def play(client: OpenAI, env_url: str, seed: int, session: str, split: str, max_turns: int, model: str) -> float:
    """One episode; returns its return (the sum of the environment's rewards)."""
    sid = call(f"{env_url}/sessions", "POST", {"env": "calc", "split": split})["session"]
    try:
        obs = call(f"{env_url}/sessions/{sid}/reset", "POST", {"seed": seed})["observation"]
        messages, total = [{"role": "user", "content": obs}], 0.0
        for _ in range(max_turns):
            answer = client.chat.completions.create(model=model, messages=messages, user=session, max_tokens=16)
            action = answer.choices[0].message.content
            out = call(f"{env_url}/sessions/{sid}/step", "POST", {"action": action})
            total += out["reward"]
            if out["terminated"] or out["truncated"]:
                break
            messages += [{"role": "assistant", "content": action}, {"role": "user", "content": out["observation"]}]
        return total
    finally:
        call(f"{env_url}/sessions/{sid}", "DELETE")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", required=True, help="the chat endpoint, e.g. http://127.0.0.1:8200/v1")
    ap.add_argument("--env-url", required=True, help="the environment server, e.g. http://127.0.0.1:8100")
    ap.add_argument("--episodes", help="comma-separated SEED:SESSION pairs, played in order (default: stdin lines)")
    ap.add_argument("--split", default="train", choices=["train", "eval"], help="of --episodes")
    ap.add_argument("--max-turns", type=int, default=3)
    ap.add_argument("--model", default="policy")
    args = ap.parse_args(argv)
    client = OpenAI(base_url=args.base_url, api_key="none")  # one client (its connection pool) for every thread
    printing = threading.Lock()

    def job(line: str) -> None:
        seed, session, split = line.strip().split(":")
        ret = play(client, args.env_url, int(seed), session, split, args.max_turns, args.model)
        call(f"{args.base_url}/sessions/{session}/reward", "POST", {"reward": ret})
        with printing:
            print(f"done {session} {ret}", flush=True)

    if args.episodes:  # in order, here
        for pair in args.episodes.split(","):
            job(f"{pair}:{args.split}")
        return
    # the client's response types build their pydantic schemas on first use, and two threads' first responses at
    # once can fail there (PydanticUserError "BaseModel cannot be instantiated directly"): build them here, once
    for model in (ChatCompletion, Choice, ChatCompletionMessage, CompletionUsage):
        model.model_rebuild(force=True)
    threads = []  # a worker: each job in a thread (an exception ends the program, the trainer names it)
    for line in sys.stdin:
        threads = [t for t in threads if t.is_alive()]  # (a long-lived worker keeps only its running ones)
        threads.append(threading.Thread(target=guarded, args=(job, line), daemon=True))
        threads[-1].start()
    for t in threads:  # stdin closed: the episodes in flight still end
        t.join()


def guarded(job, line: str) -> None:
    """Run job(line); on an exception print its traceback and end the whole process (exit 1), not just the thread."""
    try:
        job(line)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)


if __name__ == "__main__":
    main()
