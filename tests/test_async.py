"""async_loop.py: off-policy weights (known answers), the wire format, the staleness rules of the sampler (property
test on an in-process stand-in for the rollout ranks), and the real multi-process path: alpha 0 has staleness 0 and
the synchronous loss, alpha >= 1 stays within its bound, torchrun works, and every failure stops every process."""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import async_loop
from offpolicy import off_policy_weights, policy_loss
from replay import replay
from rollout import Rollout
from tasks import make_tiny_model, make_tokenizer

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
SMALL = ["--prompts-per-step", "2", "--group-size", "4", "--eval-every", "0", "--max-new-tokens", "12"]


def run_async(tmp: Path, *args: str, timeout: float = 240) -> tuple[subprocess.CompletedProcess, list, dict]:
    cmd = [sys.executable, "async_loop.py", "--out-dir", str(tmp), *SMALL, *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)
    rows = [json.loads(x) for x in (tmp / "metrics.jsonl").read_text().splitlines()] if proc.returncode == 0 else []
    timeline = json.loads((tmp / "timeline.json").read_text()) if (tmp / "timeline.json").exists() else {}
    return proc, rows, timeline


# ------------------------------------------------------------------------------------------------ pure pieces


def test_off_policy_weights_known_answers():
    """w = pi_old / pi_behav: tis truncates at C = 2, decoupled keeps w and zeroes w > 5; masked tokens get 1."""
    ratios = torch.tensor([[0.5, 1.0, 2.0, 3.0, 6.0, 7.0]])
    behav = torch.zeros(1, 6)
    old = ratios.log()
    mask = torch.tensor([[1, 1, 1, 1, 1, 0]])
    tis, m = off_policy_weights(old, behav, mask, "tis", cap=2.0)
    assert torch.allclose(tis, torch.tensor([[0.5, 1.0, 2.0, 2.0, 2.0, 1.0]]))
    assert m["stats/is_cut_frac"] == pytest.approx(2 / 5)
    dec, m = off_policy_weights(old, behav, mask, "decoupled", mask_cap=5.0)
    assert torch.allclose(dec, torch.tensor([[0.5, 1.0, 2.0, 3.0, 0.0, 1.0]]))
    assert m["stats/is_weight_mean"] == pytest.approx((0.5 + 1 + 2 + 3 + 6) / 5)
    assert off_policy_weights(old, behav, mask, "none")[0] is None
    assert off_policy_weights(old, behav, mask, "behav")[0] is None


@pytest.mark.parametrize("mode", ["tis", "decoupled"])
def test_off_policy_on_policy_is_plain_ppo_and_capped_tokens_get_no_gradient(mode):
    torch.manual_seed(0)
    old, adv, mask = torch.randn(3, 5), torch.randn(3, 5), torch.ones(3, 5)
    logp = (old + 0.1 * torch.randn(3, 5)).requires_grad_()
    w, _ = off_policy_weights(old, old.clone(), mask, mode)  # behaviour == proximal: weights exactly 1
    assert torch.equal(policy_loss(logp, old, adv, mask, is_weights=w)[0], policy_loss(logp, old, adv, mask)[0])
    behav = old.clone()
    behav[0, 0] = old[0, 0] - 3.0  # w = e^3 > 5: truncated to 2 (tis) or masked out (decoupled)
    w, _ = off_policy_weights(old, behav, mask, mode)
    loss, _ = policy_loss(logp, old, adv, mask, is_weights=w)
    (g,) = torch.autograd.grad(loss, logp)
    (g_plain,) = torch.autograd.grad(policy_loss(logp, old, adv, mask)[0], logp)
    expected = 2.0 * g_plain[0, 0] if mode == "tis" else torch.tensor(0.0)
    assert torch.allclose(g[0, 0], expected, atol=1e-7)
    assert torch.allclose(g[1:], g_plain[1:])  # the other tokens: weight 1 (on-policy)


def _rollout(P: int, R: int, n: int, version: int, pad: int = 0) -> Rollout:
    ids = torch.randint(3, 50, (n, P + R))
    attention_mask = torch.ones(n, P + R, dtype=torch.long)
    attention_mask[0, :1] = 0  # left padding in row 0
    ids[0, 0] = pad
    rm = torch.ones(n, R, dtype=torch.long)
    rm[-1, -1] = 0
    return Rollout(
        prompt_ids=ids[:, :P], response_ids=ids[:, P:], attention_mask=attention_mask, response_mask=rm,
        rollout_logprobs=-torch.rand(n, R), truncated=torch.tensor([True] + [False] * (n - 1)),
        token_scores=torch.rand(n, R), policy_version=torch.full((n,), version),
    )  # fmt: skip


def test_pack_unpack_round_trip_and_cat_pads_both_sides():
    a, b = _rollout(3, 4, 2, version=5), _rollout(5, 2, 3, version=5)
    back = async_loop.unpack(async_loop.pack(a), 3, 4, version=5)
    for f in ("prompt_ids", "response_ids", "attention_mask", "response_mask", "truncated", "policy_version"):
        assert torch.equal(getattr(back, f), getattr(a, f)), f
    assert torch.equal(back.rollout_logprobs, a.rollout_logprobs) and torch.equal(back.token_scores, a.token_scores)
    c = async_loop.cat_rollouts([a, b], pad_id=0, device="cpu")
    assert c.prompt_ids.shape == (5, 5) and c.response_ids.shape == (5, 4)
    assert torch.equal(c.prompt_ids[:2, 2:], a.prompt_ids) and torch.equal(c.response_ids[:2], a.response_ids)
    assert torch.equal(c.prompt_ids[2:], b.prompt_ids) and torch.equal(c.response_ids[2:, :2], b.response_ids)
    assert c.attention_mask[:2, :2].sum() == 0 and c.attention_mask[2:, 7:].sum() == 0  # the new padding
    assert torch.equal(c.attention_mask[:2, 2:], a.attention_mask)
    assert c.response_mask[2:, 2:].sum() == 0 and c.token_scores[2:, 2:].abs().sum() == 0


# ------------------------------------------------------------------------------------------------ sampler rules


class FakeRanks:
    """Stand-in for the rollout ranks, in process: each worker starts its queued requests in order at the weights
    version it holds, and finishes them after a random number of polls (long-tailed), so groups complete out of
    order. Only the transport is replaced: AsyncSampler's admission, expiry and batching run unchanged."""

    def __init__(self, workers: int, seed: int):
        self.rng, self.version = random.Random(seed), {w: -1 for w in range(1, workers + 1)}
        self.queue = {w: [] for w in self.version}
        self.running = {w: None for w in self.version}  # (rid, n, version, polls left)
        self.chans = {w: self.Chan(self, w) for w in self.version}

    class Chan:
        def __init__(self, ranks, w):
            self.ranks, self.w, self.peer = ranks, w, w

        def send(self, header, tensor=None):
            r = self.ranks
            if header["kind"] == "weights":
                r.queue[self.w].append(("weights", header["version"]))
            elif header["kind"] == "requests":
                r.queue[self.w] += [("req", tuple(i)) for i in header["items"]]

        def poll(self):
            r, w, out = self.ranks, self.w, []
            if r.running[w] is None:
                while r.queue[w] and r.queue[w][0][0] == "weights":  # weights only between two requests
                    r.version[w] = r.queue[w].pop(0)[1]
                if r.queue[w] and r.version[w] >= 0:
                    rid, _, n = r.queue[w].pop(0)[1]
                    r.running[w] = [rid, n, r.version[w], int(r.rng.lognormvariate(1.0, 1.0))]
            if r.running[w] is not None:
                r.running[w][3] -= 1
                if r.running[w][3] < 0:
                    rid, n, v, _ = r.running[w]
                    r.running[w] = None
                    part = _rollout(2, 3, n, v)
                    episodes = [{"success": False, "turns": 1}] * n
                    header = {"rid": rid, "version": v, "P": 2, "R": 3, "pad": 0, "t0": 0, "t1": 0}
                    out.append(({**header, "episodes": episodes}, async_loop.pack(part)))
            return out


class Policy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(2))


@pytest.mark.parametrize(
    "alpha,replicate,redundant,workers", [(0, False, 0, 2), (0, True, 2, 3), (1, False, 1, 2), (2, True, 0, 3)]
)
def test_sampler_staleness_bound_whole_groups_and_bounded_buffer(
    monkeypatch, tmp_path, alpha, replicate, redundant, workers
):
    """Property (docs/design.md 5.4): every trained sample has version used - version started <= alpha (0 for alpha 0),
    every batch is N whole groups of G, a group's samples are never split across batches, the buffer stays within
    (alpha + 1) N + redundant groups, and with alpha >= 1 some samples really are stale (the bound is exercised)."""
    monkeypatch.setattr(async_loop.AsyncSampler, "check_peers", lambda self: None)  # no store: see the tests below
    for seed in range(3):
        cfg = async_loop.AsyncConfig(
            async_ratio=alpha, replicate=replicate, redundant_groups=redundant, prompts_per_step=3, group_size=4,
            queue_depth=2, steps=12, worker_timeout=1e9,
        )  # fmt: skip
        fake = FakeRanks(workers, seed)
        sampler = async_loop.AsyncSampler(cfg, fake.chans, store=None, procs={}, device="cpu")
        seen_groups, stale, dropped = set(), [], 0
        for step in range(cfg.steps):
            samples, episodes, group_ids, m = sampler(step, Policy())
            with sampler.cond:  # oldest first: nothing complete left behind is older than what was taken
                left = [g["version"] for g in sampler.groups.values() if g["done_t"] is not None]
                assert not left or min(left) >= samples.policy_version.max()
            dropped += m["async/dropped"]
            assert samples.response_ids.shape[0] == 12 and len(episodes) == 12
            assert torch.equal(group_ids, torch.arange(12) // 4)
            staleness = step - samples.policy_version
            assert staleness.min() >= 0 and staleness.max() <= alpha, (step, staleness)
            assert m["async/buffer_groups"] <= (alpha + 1) * 3 + redundant
            stale += staleness.tolist()
            used = {e["gid"] for e in sampler.events if e["used"] == step}
            assert len(used) == 3 and not used & seen_groups
            seen_groups |= used
            for gid in used:
                assert sum(e["n"] for e in sampler.events if e["gid"] == gid and e["used"] == step) == 4
        assert (max(stale) >= 1) == (alpha >= 1), "alpha >= 1 never produced a stale sample: the test is vacuous"
        sampler.close(tmp_path)  # stops the dispatcher thread
        with sampler.cond:  # conservation: every sample that came back was trained, dropped or is still buffered
            back = sum(e["n"] for e in sampler.events)
            buffered = sum(g["n"] for g in sampler.groups.values())
            assert back == 12 * cfg.steps + dropped + buffered + sampler.step_stats["dropped"]


# ------------------------------------------------------------------------------------------------ real processes


def test_alpha0_one_process_is_the_synchronous_loop(tmp_path, default_sft_path):
    """--async-ratio 0 runs trainer's loop in this process (no off-policy weights): same seed, same metrics."""
    args = ["--steps", "2", *SMALL]
    import trainer

    trainer.main([*args, "--out-dir", str(tmp_path / "sync")])
    async_loop.main([*args, "--out-dir", str(tmp_path / "async"), "--async-ratio", "0"])
    rows = [
        [json.loads(x) for x in (tmp_path / d / "metrics.jsonl").read_text().splitlines()] for d in ("sync", "async")
    ]
    drop = lambda r: {k: v for k, v in r.items() if not k.startswith(("time/", "perf/"))}  # noqa: E731
    assert len(rows[0]) == 2 and [drop(r) for r in rows[0]] == [drop(r) for r in rows[1]]


def test_alpha0_processes_have_staleness_0_and_the_synchronous_loss(tmp_path, default_sft_path):
    """The multi-process path at alpha 0: every sample trained at the version it started with, the TIS weights
    are 1 up to float noise, and the loss on the dumped batch equals the loss without them (the sync loss)."""
    args = ["--async-ratio", "0", "--rollout-workers", "1", "--off-policy", "tis", "--steps", "3", "--dump-batch", "2"]
    proc, rows, timeline = run_async(tmp_path, *args)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    used = [e for e in timeline["events"] if e["used"] >= 0]
    assert used and all(e["used"] == e["version"] for e in used)
    assert all(r["async/staleness_max"] == 0 for r in rows)
    d = torch.load(tmp_path / "batch-2.pt", weights_only=True)
    assert torch.equal(d["policy_version"], torch.ones_like(d["policy_version"]))
    assert (d["batch"]["is_weights"] - 1).abs().max() < 1e-4
    d["batch"]["is_weights"] = torch.ones_like(d["batch"]["is_weights"])  # the synchronous update of the same batch
    torch.save(d, tmp_path / "sync.pt")
    sync_metrics, _ = replay(str(tmp_path / "sync.pt"))
    assert sync_metrics["loss/policy"] == pytest.approx(d["metrics"]["loss/policy"], abs=1e-6)
    assert sync_metrics["stats/grad_norm"] == pytest.approx(d["metrics"]["stats/grad_norm"], rel=1e-4)


def test_multi_turn_episodes_reach_the_trainer_with_their_action_spans(tmp_path):
    """calc through a rollout process: the trainer's first-turn gap (evaluation.first_action_mask) reads each
    episode's action spans, which the wire format must carry (a random-init tiny model: no warm start needed)."""
    tok, model_dir = make_tokenizer(), tmp_path / "tiny"
    torch.manual_seed(0)
    make_tiny_model(tok).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    args = ["--task", "calc", "--model", str(model_dir), "--adv-estimator", "grpo", "--async-ratio", "0"]
    proc, rows, _ = run_async(tmp_path / "run", *args, "--rollout-workers", "1", "--steps", "2")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert len(rows) == 2 and all(r["stats/rollout_vs_old_logp_diff_first_turn"] < 1e-4 for r in rows)


def test_alpha2_two_workers_replicated_redundant_stays_within_bound(tmp_path, default_sft_path):
    proc, rows, timeline = run_async(
        tmp_path,
        "--async-ratio",
        "2",
        "--rollout-workers",
        "2",
        "--steps",
        "5",
        "--replicate",
        "--redundant-groups",
        "1",
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    used = [e for e in timeline["events"] if e["used"] >= 0]
    assert all(0 <= e["used"] - e["version"] <= 2 for e in used)
    assert {e["worker"] for e in timeline["events"]} == {1, 2}, "a worker got no request"
    assert max(e["used"] - e["version"] for e in used) >= 1, "nothing was stale: alpha 2 not exercised"
    assert len(rows) == 5 and all(r["async/staleness_max"] <= 2 for r in rows)
    assert "async/dropped_len" in rows[-1] and "stats/is_weight_mean" in rows[-1]


def test_torchrun_rank0_trains_rank1_rolls_out(tmp_path, default_sft_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "async_loop.py"]
    cmd += ["--out-dir", str(tmp_path), *SMALL, "--steps", "2"]
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    timeline = json.loads((tmp_path / "timeline.json").read_text())
    assert {e["worker"] for e in timeline["events"]} == {1}
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2


def _live(pgid: int) -> list[str]:
    """Processes of the group still running (zombies excluded: they have exited)."""
    ps = subprocess.run(["ps", "-o", "pid=,stat=,cmd=", "-g", str(pgid)], capture_output=True, text=True).stdout
    return [line for line in ps.splitlines() if line.split()[1][0] != "Z"]


def test_dead_worker_stops_the_trainer_with_an_error_naming_it(tmp_path, default_sft_path):
    t = time.time()
    proc, _, _ = run_async(tmp_path, "--rollout-workers", "2", "--steps", "6", "--crash-worker-after", "2")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "rank 1" in out, out[-3000:]
    assert time.time() - t < 120


def test_dead_trainer_stops_the_workers(tmp_path, default_sft_path):
    cmd = [sys.executable, "async_loop.py", "--out-dir", str(tmp_path), *SMALL, "--steps", "6"]
    # 30 s: on a loaded machine the first samples (model load, first generation) may take longer than 10 s
    cmd += ["--rollout-workers", "2", "--crash-trainer-after", "2", "--worker-timeout", "30"]
    p = subprocess.Popen(
        cmd, cwd=ROOT, env=ENV, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    out, _ = p.communicate(timeout=240)
    assert p.returncode == 3, out.decode()[-3000:]
    deadline = time.time() + 45  # the workers notice within worker_timeout
    while _live(p.pid) and time.time() < deadline:
        time.sleep(0.5)
    assert not _live(p.pid), _live(p.pid)


def as_from_a_terminal(cmd: list[str]) -> subprocess.Popen:
    """`cmd` in its own process group with SIGINT at its default, as from a terminal (a background `&` job would
    ignore it): os.killpg(p.pid, SIGINT) is then what Ctrl-C does."""
    return subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=ENV,
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


@pytest.mark.parametrize("when", ["start-up", "training"])
def test_ctrl_c_stops_every_process(tmp_path, default_sft_path, when):
    cmd = [sys.executable, "async_loop.py", "--out-dir", str(tmp_path), *SMALL, "--steps", "200"]
    cmd += ["--rollout-workers", "2"]
    p = as_from_a_terminal(cmd)
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.time() + (3 if when == "start-up" else 180)  # start-up: processes spawning, models loading
    while not (metrics.exists() and metrics.stat().st_size) and time.time() < deadline and p.poll() is None:
        time.sleep(0.2)
    assert p.poll() is None, "the run ended before it could be interrupted"
    assert metrics.exists() == (when == "training")
    os.killpg(p.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: SIGINT to the whole foreground group
    out, _ = p.communicate(timeout=60)
    assert p.returncode != 0, out[-2000:]
    assert when == "start-up" or p.returncode == 130, out[-2000:]
    time.sleep(1)
    assert not _live(p.pid), _live(p.pid)


SIGINT_IN_SPAWN = """
import multiprocessing.context, os, signal, sys
import async_loop
real_start = multiprocessing.context.SpawnProcess.start
def start(self):  # a Ctrl-C that lands while the trainer spawns its rollout ranks
    os.kill(os.getpid(), signal.SIGINT)
    return real_start(self)
multiprocessing.context.SpawnProcess.start = start
async_loop.main(sys.argv[1:])
"""


def test_ctrl_c_while_the_trainer_spawns_its_workers_is_not_lost(tmp_path, default_sft_path):
    """The start-up race: SIGINT was ignored while the workers were spawned, so a Ctrl-C at that moment was lost and
    the run went on. Now it is blocked there and raised right after: exit 130, every process gone."""
    cmd = [sys.executable, "-c", SIGINT_IN_SPAWN, "--out-dir", str(tmp_path), *SMALL, "--steps", "200"]
    p = as_from_a_terminal([*cmd, "--rollout-workers", "2"])
    try:
        out, _ = p.communicate(timeout=90)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode == 130 and "interrupted" in out.decode(), out.decode()[-2000:]
    assert not (tmp_path / "metrics.jsonl").exists()  # stopped before any step
    time.sleep(1)
    assert not _live(p.pid), _live(p.pid)
