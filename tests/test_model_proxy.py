"""model_proxy.py over real HTTP on 127.0.0.1, spoken to by the official openai client: answers, streams, the
recorded ids and logprobs (the policy's own), batching, weight versions, sessions to samples token in token out,
a history rewrite as a new sample, the re-tokenisation drift it avoids, and every refusal."""

import contextlib
import http.client
import json
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

import model_proxy as mp
import openai_api
import tasks
from agent_pool import AgentPool
from common import make_autocast
from rollout import Rollout, generate, inference_copy, sequence_logprobs

ROOT = Path(__file__).resolve().parents[1]

openai = pytest.importorskip("openai", reason="pip install openai (requirements.txt installs it for the tests)")
SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": 0}


def make_proxy(tok=None, **args):
    tok = tok or tasks.make_tokenizer()
    torch.manual_seed(0)
    proxy = mp.ModelProxy(tasks.make_tiny_model(tok), tok, mp.ProxyArgs(**args), SAMPLING)
    return proxy, mp.start_proxy(proxy)


@pytest.fixture
def served():
    proxy, server = make_proxy(max_tokens=8)
    yield proxy, server, openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    mp.stop_proxy(server)


def post(url: str, body: bytes, headers=None):
    """(status, JSON body) of a raw POST."""
    req = urllib.request.Request(url, body, {"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as f:
            return f.status, json.loads(f.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_answers_and_streams_are_the_recorded_ids_with_the_policys_logprobs(served):
    proxy, server, client = served
    assert [m.id for m in client.models.list().data] == [proxy.name]
    out = client.chat.completions.create(model=proxy.name, messages=[{"role": "user", "content": "12+3="}],
                                         temperature=0.1, top_p=0.5, user="a")  # fmt: skip
    (rec,) = proxy.session("a")["records"]
    assert out.choices[0].message.content == proxy.content(rec)
    assert out.usage.completion_tokens == len(rec["ids"]) <= 8 and out.choices[0].finish_reason == rec["finish_reason"]
    meta = out.model_extra["minrl"]  # the client's sampling recorded, the proxy's used
    assert meta["sampling_asked"] == {"temperature": 0.1, "top_p": 0.5} and meta["sampling_used"] == {
        **SAMPLING,
        "max_tokens": 8,
    }
    assert rec["prompt_ids"] == proxy.encode(proxy.tokenizer.bos_token + "12+3=")  # rollout_env's first prompt
    ids = torch.tensor([rec["prompt_ids"] + rec["ids"]])
    ours, _ = sequence_logprobs(proxy.model, ids, torch.ones_like(ids), len(rec["ids"]), temperature=1.0)
    assert torch.allclose(ours[0], torch.tensor(rec["logprobs"]), atol=1e-5)  # the behaviour logprobs are right
    chunks = list(client.chat.completions.create(model=proxy.name, messages=[{"role": "user", "content": "4+4="}],
                                                 stream=True, user="b"))  # fmt: skip
    (rec,) = proxy.session("b")["records"]
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == proxy.content(rec)
    deltas = openai_api.stream_deltas(proxy, rec)  # a token per chunk, but never half of a UTF-8 character
    assert chunks[-1].choices[0].finish_reason == rec["finish_reason"] and len(chunks) == len(deltas) + 2
    assert "".join(deltas) == text and (len(chunks) == len(rec["ids"]) + 2 or not text.isascii()), (text, chunks)


def test_concurrent_requests_share_a_generate_call_and_weights_change_between_batches(served):
    proxy, server, client = served
    calls, generate = [], mp.generate

    def counting(model, ids, *a, **kw):
        calls.append(ids.shape[0])
        return generate(model, ids, *a, **kw)

    proxy.args.gather_ms = 200.0  # a wide window: the 8 requests below arrive within it
    mp.generate, errors = counting, []

    def ask(i):
        try:
            client.chat.completions.create(model="m", user=f"s{i}", messages=[{"role": "user", "content": f"{i}+1="}])
        except Exception as e:  # a failed request fails the test below, never vanishes with its thread
            errors.append(e)

    try:
        threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
        [t.start() for t in threads]
        [t.join() for t in threads]
    finally:
        mp.generate = generate
    assert not errors and sum(calls) == 8 and len(calls) < 8, (errors, calls)
    torch.manual_seed(1)
    proxy.load_weights(tasks.make_tiny_model(proxy.tokenizer), version=3)
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": "1+1="}], user="s0")
    assert [r["version"] for r in proxy.session("s0")["records"]] == [0, 3]


def test_a_requests_samples_depend_on_its_session_and_index_not_on_the_batch_it_shared():
    """Detail 1: a request alone and the same request among 8 concurrent others (a fresh proxy, the same seed)
    sample the same ids; another session, or the next request of the same session, samples its own."""
    ask = lambda client, user, text="12+3=": client.chat.completions.create(
        model="m", user=user, messages=[{"role": "user", "content": text}]
    )
    answers, x_rows, generate, x_first = [], [], mp.generate, mp.request_seed(0, "x", 0)

    def counting(model, ids, *a, **kw):  # the rows of the call that carries x's first request
        if x_first in [g.initial_seed() for g in kw["generator"]]:
            x_rows.append(ids.shape[0])
        return generate(model, ids, *a, **kw)

    for crowd in (0, 8):  # a batch closes at max_batch 9: the crowd and x's first request, whatever the timing
        proxy, server = make_proxy(max_tokens=8, gather_ms=2000.0, max_batch=9)
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        mp.generate = counting
        try:  # the crowd's prompts are longer: x's row is left-padded among them
            threads = [
                threading.Thread(target=ask, args=(client, f"other{i}", "123+45=" * (i + 1))) for i in range(crowd)
            ]
            [t.start() for t in threads]
            ask(client, "x"), ask(client, "x")
            [t.join() for t in threads]
        finally:
            mp.generate = generate
            mp.stop_proxy(server)
        answers.append([r["ids"] for r in proxy.session("x")["records"]])
        others = [proxy.session(f"other{i}")["records"][0]["ids"] for i in range(crowd)]
        assert all(ids != answers[-1][0] for ids in others), others  # another session: another stream
    assert x_rows == [1, 9], x_rows  # alone, then in one batch with the whole crowd
    assert answers[0] == answers[1] and answers[0][0] != answers[0][1], answers


def test_a_session_that_extends_its_history_is_one_sample_and_a_rewrite_starts_another(served):
    proxy, server, client = served
    chat = [{"role": "user", "content": "7*6="}]
    for _ in range(3):  # the agent resends the whole history plus a new observation, as agents do
        a = client.chat.completions.create(model="m", messages=chat, user="ep").choices[0].message.content
        chat += [{"role": "assistant", "content": a}, {"role": "user", "content": "=42?"}]
    client.chat.completions.create(model="m", messages=[chat[0], chat[-1]], user="ep")  # history rewritten
    status, _ = post(server.url + "/v1/sessions/ep/reward", b'{"reward": 0.5}')
    records = proxy.session("ep")["records"]
    assert status == 200 and [r["extends"] for r in records] == [False, True, True, False]
    rollout, owner, stats = mp.sessions_rollout([proxy.session("ep", pop=True)], proxy.tokenizer.pad_token_id, "cpu")
    assert stats == {"proxy/prefix_breaks": 1, "proxy/samples": 2} and owner == [0, 0]
    # sample 0: the three turns; the response is exactly the sampled ids (mask 1) and what the agent added between
    # them (mask 0): the observation, after the template's eos where an answer ended without one (max_tokens)
    eos, obs = proxy.tokenizer.eos_token_id, proxy.encode("=42?")
    gaps = [records[k + 1]["prompt_ids"][len(records[k]["prompt_ids"]) + len(records[k]["ids"]) :] for k in (0, 1)]
    assert all(g == [eos] * (records[k]["finish_reason"] == "length") + obs for k, g in enumerate(gaps)), gaps
    want = records[0]["ids"] + gaps[0] + records[1]["ids"] + gaps[1] + records[2]["ids"]
    mask = [1] * len(records[0]["ids"]) + [0] * len(gaps[0]) + [1] * len(records[1]["ids"]) + [0] * len(gaps[1])
    mask += [1] * len(records[2]["ids"])
    n = len(want)
    assert rollout.response_ids[0, :n].tolist() == want and rollout.response_mask[0, :n].tolist() == mask
    assert rollout.response_mask[0, n:].sum() == 0
    assert rollout.prompt_ids[0, -len(records[0]["prompt_ids"]) :].tolist() == records[0]["prompt_ids"]
    logp = records[0]["logprobs"] + [0.0] * len(gaps[0]) + records[1]["logprobs"] + [0.0] * len(gaps[1])
    logp += records[2]["logprobs"]
    assert torch.allclose(rollout.rollout_logprobs[0, :n], torch.tensor(logp))
    assert rollout.token_scores[0].tolist().index(0.5) == n - 1 and rollout.token_scores[0].sum() == 0.5
    m = len(records[3]["ids"])  # sample 1: the rewritten request alone, the same reward at its last sampled id
    assert rollout.response_ids[1, :m].tolist() == records[3]["ids"] and rollout.token_scores[1, m - 1] == 0.5
    same = mp.sessions_rollout([{"session": "ep", "records": records[:3], "reward": 0.5}], 0, "cpu")[0]
    assert isinstance(same, Rollout) and same.response_ids.shape[0] == 1


def bpe_tokenizer():
    """A BPE tokenizer where 'hello' is one token, though 'he' + 'llo' decodes to it too."""
    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "h": 3, "e": 4, "l": 5, "o": 6, " ": 7, "he": 8, "ll": 9, "llo": 10,
             "hello": 11, "hell": 12, "?": 13}  # fmt: skip
    t = Tokenizer(models.BPE(vocab=vocab, merges=[("h", "e"), ("l", "l"), ("he", "ll"), ("hell", "o"), ("ll", "o")]))
    t.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=t, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>")


def test_sampled_ids_are_kept_where_retokenising_the_decoded_chat_would_change_them():
    tok = bpe_tokenizer()
    proxy, server = make_proxy(tok, max_tokens=4)
    generate = mp.generate

    def sample_he_llo(model, ids, mask, **kw):  # the policy samples 'he' + 'llo' + eos: a segmentation BPE never makes
        r = torch.tensor([[8, 10, 1]] * ids.shape[0])
        return Rollout(ids, r, torch.cat([mask, torch.ones_like(r)], 1), torch.ones_like(r), -torch.ones(r.shape),
                       torch.zeros(ids.shape[0], dtype=torch.bool))  # fmt: skip

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    try:
        mp.generate = sample_he_llo
        a = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "h?"}], user="x")
        mp.generate = generate
        assert a.choices[0].message.content == "hello"
        chat = [{"role": "user", "content": "h?"}, {"role": "assistant", "content": "hello"}, {"role": "user",
                "content": "?"}]  # fmt: skip
        client.chat.completions.create(model="m", messages=chat, user="x")
    finally:
        mp.generate = generate
        mp.stop_proxy(server)
    first, second = proxy.session("x")["records"]
    assert second["extends"] and second["prompt_ids"] == first["prompt_ids"] + [8, 10, 1, 13]  # the sampled ids
    retokenised = tok(proxy.render(chat), add_special_tokens=False).input_ids
    assert retokenised == first["prompt_ids"] + [11, 1, 13] != second["prompt_ids"]  # what re-tokenising gives


def test_every_bad_request_gets_its_status_and_an_openai_error(served):
    proxy, server, client = served
    url = server.url
    cases = [
        ("/v1/chat/completions", b"{not json", 400, "malformed JSON"),
        ("/v1/chat/completions", b'{"messages": []}', 400, "'messages'"),
        ("/v1/chat/completions", b'{"messages": [{"role": "robot", "content": "x"}]}', 400, "messages[0] must be"),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}',
            400,
            "a list of text parts",
        ),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": '
            b'"", "tool_calls": [{"id": "c"}]}]}',
            400,
            "messages[1] has tool_calls: not supported",
        ),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "n": 2}', 400, "'n'"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}', 400, "positive"),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user"}, {"role": "user", "content": "x"}]}',
            400,
            "messages[0] must be",
        ),
        ("/v1/sessions/nobody/reward", b'{"reward": 1}', 404, "unknown session"),
        ("/v1/nowhere", b"{}", 404, "no route"),
    ]
    for path, body, status, words in cases:
        got, payload = post(url + path, body)
        assert (got, words in payload["error"]["message"]) == (status, True), (path, got, payload)
    long = json.dumps({"messages": [{"role": "user", "content": "1" * 2000}]}).encode()
    got, payload = post(url + "/v1/chat/completions", long)
    assert got == 400 and payload["error"]["code"] == "context_length_exceeded"
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": "1"}], user="r")
    for bad in (b'{"reward": "1"}', b'{"reward": NaN}', b'{"reward": true}', b"{}"):
        assert post(url + "/v1/sessions/r/reward", bad)[0] == 400, bad
    with pytest.raises(openai.BadRequestError, match="'n' must be 1"):
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "1"}], n=2)
    with pytest.raises(ValueError, match="no reward"):
        mp.sessions_rollout([proxy.session("r", pop=True)], 0, "cpu")


def test_the_demo_runs(capsys):
    mp.main(["--port", "0"])
    out = capsys.readouterr().out
    assert "turn 1:" in out and "'extends': True" in out and "'proxy/prefix_breaks': 0" in out


@pytest.mark.parametrize("batch_thread", ["--no-batch-thread", "--batch-thread"])
def test_the_bench_prints_the_proxys_overhead_measured_in_the_same_run(batch_thread):
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "bench/proxy_bench.py", "--presets", "tiny", "--rounds", "1", "--requests",
                          "4", "--max-tokens", "4", batch_thread], cwd=root, capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr
    header, row = out.stdout.strip().splitlines()[-2:]
    cells = dict(zip(["preset", "direct", "proxy", "overhead"], row.split()))
    assert cells["preset"] == "tiny" and float(cells["direct"]) > 0 and float(cells["proxy"]) > 0, out.stdout
    assert cells["overhead"].endswith("%"), out.stdout


def test_the_keepalive_bench_times_both_settings_in_one_run():
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "bench/keepalive_bench.py", "--requests", "2"], cwd=root,
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr
    header, row = out.stdout.strip().splitlines()[-2:]
    cells = dict(zip(header.split(), map(float, row.split())))
    assert set(cells) == {"nagle_ms", "nodelay_ms", "ratio"} and cells["nodelay_ms"] > 0, out.stdout
    assert cells["ratio"] == pytest.approx(cells["nagle_ms"] / cells["nodelay_ms"], rel=0.01), out.stdout


def test_a_large_max_tokens_is_capped_and_a_session_can_be_dropped(served):
    proxy, server, client = served
    out = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "1+1="}], max_tokens=1000,
                                         user="big")  # fmt: skip
    meta = out.model_extra["minrl"]
    assert meta["sampling_used"]["max_tokens"] == 8 and meta["sampling_asked"]["max_tokens"] == 1000
    assert out.usage.completion_tokens <= 8
    req = urllib.request.Request(server.url + "/v1/sessions/big", method="DELETE")
    with urllib.request.urlopen(req, timeout=30) as f:
        assert len(json.loads(f.read())["records"]) == 1
    assert "big" not in proxy.sessions


def test_stream_deltas_never_split_a_character_of_a_byte_level_tokenizer():
    """A byte-level BPE (GPT-2, Qwen) decodes half of a UTF-8 character to U+FFFD: the piece is held back, so the
    deltas join to the content."""
    from tokenizers import ByteLevelBPETokenizer

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(["ab cd"], vocab_size=257, min_frequency=1, special_tokens=["<eos>"])
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<eos>", pad_token="<eos>")
    ids = tok("a\u4e2db", add_special_tokens=False).input_ids + [tok.eos_token_id]  # a, 3 bytes of one character, b
    fake = type("P", (), {"eos_ids": [tok.eos_token_id], "tokenizer": tok, "content": mp.ModelProxy.content})()
    deltas = openai_api.stream_deltas(fake, {"ids": ids})
    assert "".join(deltas) == "a\u4e2db" and "\ufffd" not in "".join(deltas) and deltas == ["a", "\u4e2d", "b"]


def test_two_requests_in_flight_in_one_session_are_two_samples_in_their_own_contexts():
    """Both extend record 0; the one that finished second is its own sample with record 0 as its prompt's context."""
    rec = lambda prompt, ids, v=0: {"prompt_ids": prompt, "ids": ids, "logprobs": [-0.5] * len(ids), "version": v,
                                    "finish_reason": "stop", "extends": True}  # fmt: skip
    r0, r1, r2 = rec([1, 2], [3, 4]), rec([1, 2, 3, 4, 5], [6]), rec([1, 2, 3, 4, 7], [8], v=1)
    for order in ([r0, r1, r2], [r0, r2, r1]):
        a, b = mp.session_samples(order, 1.0)
        first, second = order[1], order[2]
        assert a["prompt_ids"] == [1, 2] and a["ids"] == [3, 4] + first["prompt_ids"][4:] + first["ids"]
        assert a["action"] == [1, 1, 0, 1] and a["score"] == [0.0, 0.0, 0.0, 1.0]
        assert b["prompt_ids"] == second["prompt_ids"] and b["ids"] == second["ids"] and b["action"] == [1]
    assert mp.session_samples([r0, r2], 1.0)[0]["version"] == 0  # a chain's oldest version


def test_a_hung_agent_is_killed_at_its_timeout_and_a_stopped_proxy_serves_nothing(tmp_path):
    hung = tmp_path / "hung_agent.py"
    hung.write_text("import sys, time\nsys.stdin.readline()\ntime.sleep(600)\n")
    pool = AgentPool(str(hung), 1, [], timeout=1.0)
    try:
        with pytest.raises(
            RuntimeError, match="agent 0 .*hung_agent.py.* failed \\(exit -9; killed after agent_timeout"
        ):
            pool.play([(7, "s0")], "train")
    finally:
        pool.close()
    proxy, server = make_proxy()
    mp.stop_proxy(server)
    with pytest.raises(RuntimeError, match="serve_while on a stopped proxy"):
        proxy.serve_while(lambda: None)


def test_a_bf16_proxy_samples_with_its_engines_logprobs_and_rounds_the_weights_it_loads():
    """--rollout-dtype bfloat16: the proxy serves inference_copy's bf16 engine under train()'s autocast; the recorded
    ids and logprobs are that engine's own (the same generate call, bit for bit), and the trainer's fp32 weights
    arrive rounded to bf16. A full forward is not the reference: bf16 kernels may round a one-token decoding step
    and a whole-sequence forward differently (2e-3 apart on an AVX2 CPU)."""
    tok = tasks.make_tokenizer()
    torch.manual_seed(0)
    policy = tasks.make_tiny_model(tok)
    engine, cast = inference_copy(policy, "bfloat16"), make_autocast("bfloat16", torch.device("cpu"))
    proxy = mp.ModelProxy(engine, tok, mp.ProxyArgs(max_tokens=8), SAMPLING, autocast=cast)
    rec = proxy.complete("a", [{"role": "user", "content": "12+3="}], 8, {})
    prompt = torch.tensor([rec["prompt_ids"]])
    stops = {"eos_token_ids": proxy.eos_ids, "pad_token_id": tok.pad_token_id, "max_new_tokens": 8, **SAMPLING}

    def sample(model, autocast):  # the proxy's call for this request: its seed, its prompt, its sampling
        gen = torch.Generator().manual_seed(mp.request_seed(proxy.seed, "a", 0))
        with torch.no_grad(), autocast():
            out = generate(model, prompt, torch.ones_like(prompt), generator=[gen], **stops)
        return out.response_ids[0, : len(rec["ids"])].tolist(), out.rollout_logprobs[0, : len(rec["ids"])]

    ids, logprobs = sample(engine, cast)
    assert ids == rec["ids"] and torch.equal(logprobs.float(), torch.tensor(rec["logprobs"])), (logprobs, rec)
    fp32 = sample(policy, contextlib.nullcontext)[1]
    assert not torch.allclose(fp32.float(), logprobs.float(), atol=1e-5)  # the bf16 engine is not the fp32 policy
    torch.manual_seed(1)
    new = tasks.make_tiny_model(tok)
    proxy.load_weights(new, version=1)
    name, weight = next(iter(new.named_parameters()))
    got = dict(engine.named_parameters())[name]
    assert got.dtype == torch.bfloat16 and torch.equal(got, weight.detach().to(torch.bfloat16))
    proxy.stop.set()


def test_text_parts_are_the_joined_string_and_a_connection_serves_several_requests(served):
    """A content given as a list of text parts is its joined string (the same prompt ids); HTTP/1.1 keep-alive: two
    requests on one connection, an error answer closes it."""
    proxy, server, client = served
    host, port = server.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    parts = [{"type": "text", "text": "12"}, {"type": "text", "text": "+3="}]
    sockets = []
    for session, content in (("str", "12+3="), ("parts", parts)):  # one connection, two requests
        body = json.dumps({"messages": [{"role": "user", "content": content}], "user": session})
        conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        sockets.append(conn.sock)  # http.client reconnects silently after a closed answer: a new socket would show
        answer = conn.getresponse()
        assert answer.status == 200 and answer.version == 11 and not answer.will_close
        answer.read()
    assert sockets[0] is sockets[1] is not None
    assert proxy.session("str")["records"][0]["prompt_ids"] == proxy.session("parts")["records"][0]["prompt_ids"]
    conn.request("POST", "/v1/chat/completions", b"{not json", {"Content-Type": "application/json"})
    answer = conn.getresponse()
    assert answer.status == 400 and answer.will_close and answer.getheader("Connection") == "close"
    conn.close()


def test_an_agent_that_prints_what_is_not_its_done_line_stops_the_run_naming_it(tmp_path):
    """AgentPool: a `done` line for a session it was not given (or a return that is no number) is a failure."""
    for line in ("done someone-else 1.0", "done s0 nan", "hello"):
        liar = tmp_path / "liar_agent.py"
        liar.write_text(f"import sys\nfor _ in sys.stdin:\n    print({line!r}, flush=True)\n")
        pool = AgentPool(str(liar), 1, [], timeout=60)
        try:
            with pytest.raises(RuntimeError, match=f"agent 0 .*liar_agent.py.*{line!r}.* no `done SESSION RETURN`"):
                pool.play([(7, "s0")], "train")
        finally:
            pool.close()
    good = tmp_path / "good_agent.py"
    good.write_text("import sys\nfor job in sys.stdin:\n    seed, s, _ = job.strip().split(':')\n"
                    "    print('done', s, int(seed) / 2, flush=True)\n")  # fmt: skip
    pool = AgentPool(str(good), 2, [], timeout=60)
    try:
        assert pool.play([(1, "a"), (2, "b"), (3, "c")], "eval") == {"a": 0.5, "b": 1.0, "c": 1.5}
    finally:
        pool.close()


def test_the_mains_of_agent_pool_and_openai_api_run():
    root = Path(__file__).resolve().parents[1]
    pool = subprocess.run([sys.executable, "agent_pool.py"], cwd=root, capture_output=True, text=True, timeout=120)
    assert pool.returncode == 0 and "'s3': 0.3" in pool.stdout, pool.stderr
    api = subprocess.run([sys.executable, "openai_api.py"], cwd=root, capture_output=True, text=True, timeout=120)
    assert api.returncode == 0 and "'12+3='" in api.stdout and "invalid_request_error" in api.stdout, api.stderr


def test_sessions_are_capped_idle_ones_dropped_and_a_refused_request_opens_none():
    """--serve holds at most max_sessions (one more: 503, OpenAI's server_error), drops those idle for idle_timeout
    when a new one comes, and a request refused for its length leaves no session behind."""
    proxy, server = make_proxy(max_tokens=2, max_context=64, max_sessions=2, idle_timeout=600.0)

    def chat(user: str, text: str = "1"):
        body = {"messages": [{"role": "user", "content": text}], "user": user}
        return post(server.url + "/v1/chat/completions", json.dumps(body).encode())

    try:
        assert chat("too-long", "1" * 500)[0] == 400 and proxy.sessions == {}
        assert chat("a")[0] == 200 and chat("b")[0] == 200 and chat("a")[0] == 200  # "a" again: no new session
        status, payload = chat("c")
        assert status == 503 and "2 sessions are held (max_sessions)" in payload["error"]["message"], payload
        for s in proxy.sessions.values():  # a and b, as if their last request were 601 s ago
            s["used"] -= 601.0
        assert chat("c")[0] == 200 and sorted(proxy.sessions) == ["c"]
    finally:
        mp.stop_proxy(server)
    assert not any(t.is_alive() for t in proxy.threads)  # stop_proxy returns once its batcher has left
    with pytest.raises(ValueError, match="'idle_timeout' = 60.0: 0 or >= request_timeout"):
        mp.ProxyArgs(idle_timeout=60.0, request_timeout=120.0)
