"""Multi-process tests (docs/design.md 8, 6): DDP and FSDP2 give the single-process gradient, a 2-rank trainer run
works end to end (FSDP2's on two launchers, as two nodes, within 1e-5 of DDP's), and a dead or stuck rank makes the
survivor fail with an error naming it.

The dead-rank tests use torch.multiprocessing.spawn with join=False and a file:// rendezvous, not one
torchrun agent: an agent kills the surviving ranks itself as soon as one exits, which would hide whether
the survivors notice on their own.
"""

import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
COLLECTIVE_TIMEOUT = 5.0  # seconds, for the dead-rank tests


def torchrun(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc_per_node=2 ARGS` with this interpreter, in the repository root."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *args]
    return subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)


def load_grad_check():
    spec = importlib.util.spec_from_file_location("ddp_grad_check", ROOT / "tests" / "ddp_grad_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module", params=["ddp", "fsdp"])
def ddp_deltas(tmp_path_factory, request) -> dict:
    """Parameter changes per loss_agg mode from one 2-rank torchrun of tests/ddp_grad_check.py: through DDP's
    replicas, and through FSDP2's shards (--fsdp), each test below for both."""
    out = tmp_path_factory.mktemp(request.param) / "deltas.pt"
    proc = torchrun("tests/ddp_grad_check.py", str(out), *["--fsdp"] * (request.param == "fsdp"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return torch.load(out, weights_only=True)


@pytest.mark.parametrize(
    "loss_agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
)
def test_ddp_update_equals_single_process(ddp_deltas, loss_agg):
    """2 ranks x half the batch == 1 process x the whole batch: policy and both critics, SGD lr 1 (delta = -grad)."""
    check = load_grad_check()
    single = check.update_deltas(loss_agg, rank=0, world=1)
    ddp = ddp_deltas[loss_agg]
    assert ddp.keys() == single.keys()
    for who in ("policy.", "critic0.", "critic1."):
        moved = max(single[n].abs().max().item() for n in single if n.startswith(who))
        assert moved > 1e-3, f"{who} barely moved ({moved}): the check would be vacuous"
    worst = max(single, key=lambda n: (ddp[n] - single[n]).abs().max().item())
    diff = (ddp[worst] - single[worst]).abs().max().item()
    assert diff < 1e-5, f"{loss_agg}: DDP and single-process updates differ by {diff:.2e} at {worst}"


@pytest.mark.parametrize("lengths", ["ragged", "skewed"])
@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean"])
def test_ddp_token_budget_equals_single_process(ddp_deltas, loss_agg, lengths):
    """Micro-batches packed under a token budget on 2 ranks == 1 process with plain micro-batches of 3 sequences: the
    normaliser stays global. On the skewed batch rank 0 needs 4 micro-batches and rank 1 only 2: unless both run 4,
    the critics' per-micro-batch all-reduces would pair up wrongly or hang (the torchrun would fail)."""
    check = load_grad_check()
    single = check.update_deltas(loss_agg, rank=0, world=1, lengths=lengths)
    packed = ddp_deltas[f"{lengths}/{loss_agg}/tokens"]
    worst = max(single, key=lambda n: (packed[n] - single[n]).abs().max().item())
    diff = (packed[worst] - single[worst]).abs().max().item()
    assert diff < 1e-5, f"{lengths} {loss_agg}: packed DDP and single-process updates differ by {diff:.2e} at {worst}"
    if lengths == "skewed":  # the premise: the ranks' own packings differ in count
        from memory import micro_batches

        tok, policy, _ = check.make_models()
        batch = check.make_batch(policy, len(tok), lengths=lengths)
        halves = [batch.attention_mask[:4], batch.attention_mask[4:]]
        counts = [len(micro_batches(h, check.R, rows=check.MICRO, tokens=check.BUDGET)) for h in halves]
        assert counts[0] > counts[1], counts


def test_ddp_checkpointed_layers_equal_single_process(ddp_deltas):
    """Every decoder layer of policy and critics checkpointed (memory.checkpoint_layers) on 2 ranks == 1 process
    without: the recompute in backward happens inside DDP's reduction hooks, and must not double or drop a grad."""
    single = load_grad_check().update_deltas("token-mean", rank=0, world=1)
    ckpt = ddp_deltas["checkpointed/token-mean"]
    diff = max((ckpt[n] - single[n]).abs().max().item() for n in single)
    assert diff < 1e-5, f"checkpointed DDP and single-process updates differ by {diff:.2e}"


@pytest.mark.parametrize("key", ["sapo/token-mean", "rejected/seq-mean-token-mean", "sapo-rejected/token-mean/tokens"])
def test_loss_family_and_rejected_tokens_equal_single_process(ddp_deltas, key):
    """offpolicy.py's paths under 2 ranks == 1 process: sapo's policy term averaged per sequence over every rank's
    rows (its own global normaliser) beside token-mean entropy, KL and value terms; rejected tokens and a rejected
    row (Batch.loss_mask) out of the losses and of their global normalisers; both at once on the skewed batch
    packed under a token budget (the single process: plain micro-batches)."""
    check = load_grad_check()
    mode, agg = key.split("/")[:2]
    lengths = "skewed" if key.endswith("tokens") else "ragged"
    kw = {"loss_mode": "sapo" if "sapo" in mode else "vanilla", "reject": "rejected" in mode, "lengths": lengths}
    single = check.update_deltas(agg, rank=0, world=1, **kw)
    plain = check.update_deltas(agg, rank=0, world=1, lengths=lengths)
    assert max((single[n] - plain[n]).abs().max().item() for n in single) > 1e-4, f"{key}: the same as vanilla PPO"
    diff = max((ddp_deltas[key][n] - single[n]).abs().max().item() for n in single)
    assert diff < 1e-5, f"{key}: 2 ranks and 1 process differ by {diff:.2e}"


def test_no_grad_passes_under_a_token_budget_equal_single_process(ddp_deltas):
    """Old and reference logprobs and the critics' values on 2 ranks under a token budget whose micro-batches have
    other row counts on each rank == 1 process (under FSDP2 a rank with one forward more would hang in an
    all-gather, or pair its gathers with another model's)."""
    single = load_grad_check().no_grad_passes(0, 1)
    for k, v in ddp_deltas["no_grad"].items():
        assert v.shape == single[k].shape and (v - single[k]).abs().max() < 1e-5, k


def test_torchrun_trainer_smoke(sft_path, tmp_path):
    """`torchrun --nproc_per_node=2 trainer.py` runs 2 steps; only rank 0 writes the metrics rows. Its step-1
    checkpoint (atomic, with both ranks' streams) resumes on 2 ranks into the same step 2, and is refused on 1."""
    out = tmp_path / "run"
    flags = ["--model", str(sft_path), "--task", "reverse", "--steps", "2", "--prompts-per-step", "4"]
    flags += ["--group-size", "4", "--eval-every", "2", "--eval-n", "16", "--dist-timeout", "60"]
    proc = torchrun("trainer.py", *flags, "--out-dir", str(out), "--save-every", "1")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "world 2" in proc.stdout
    from runlog import read_jsonl

    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]  # two ranks writing would duplicate them
    assert {"rank0.pt", "rank1.pt", "checkpoint.json"} <= {p.name for p in (out / "ckpt-1").iterdir()}
    assert not list(out.glob("*.tmp")) and not list(out.glob("*.old"))
    proc = torchrun("trainer.py", *flags, "--out-dir", str(tmp_path / "resumed"), "--resume", str(out / "ckpt-1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    resumed = read_jsonl(tmp_path / "resumed" / "metrics.jsonl")
    same = lambda row: {k: v for k, v in row.items() if not k.startswith(("time/", "perf/"))}
    assert [same(r) for r in resumed] == [same(rows[1])]  # bit for bit, each rank on its own streams
    import trainer  # one process, this one: rank 1's streams would be lost

    with pytest.raises(ValueError, match="world_size: 2 in the checkpoint, 1 now"):
        trainer.main([*flags, "--out-dir", str(tmp_path / "one"), "--resume", str(out)])
    assert 0.0 <= rows[-1]["eval/acc"] <= 1.0 and "critic/explained_var" in rows[-1]


def _rank_worker(rank: int, world: int, init_file: str, fate: str, out_dir: str) -> None:
    """One rank of the dead-rank test: rank 1 dies (or hangs, or is stopped) before the second collective."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    import common

    common.setup_dist(timeout_s=COLLECTIVE_TIMEOUT, device="cpu", init_method=f"file://{init_file}")
    common.all_reduce_sum(torch.ones(1))  # everyone alive: this one succeeds
    if rank == 1:
        if fate == "dies":
            os._exit(3)  # no cleanup, no goodbye: like a crash or an OOM kill
        if fate == "stopped":
            os.kill(os.getpid(), signal.SIGSTOP)  # kill -STOP: alive, silent, deaf to SIGTERM until continued
        time.sleep(120)  # stuck: alive, but never reaches the next collective
    t0 = time.perf_counter()
    try:
        common.all_reduce_sum(torch.ones(1))
    except RuntimeError as e:
        Path(out_dir, f"rank{rank}.txt").write_text(f"{time.perf_counter() - t0:.3f}\n{e}")
        raise
    Path(out_dir, f"rank{rank}.txt").write_text("no error")


@pytest.mark.parametrize("fate", ["dies", "hangs", "stopped"])
def test_dead_rank_is_named(tmp_path, fate):
    """The survivor exits non-zero within the collective timeout, naming rank 1 as dead or stuck; a stopped
    rank (SIGSTOP) on this host is ended by it: torchrun would wait 30 s for it to take its SIGTERM."""
    ctx = mp.spawn(_rank_worker, args=(2, str(tmp_path / "init"), fate, str(tmp_path)), nprocs=2, join=False)
    survivor, victim = ctx.processes
    try:
        survivor.join(120)  # start-up (imports) on a busy 2-core machine included; a hang would stay alive
        assert survivor.exitcode is not None, "rank 0 still running: it hangs instead of failing"
        assert survivor.exitcode != 0
        victim.join(10 if fate != "hangs" else 0.1)  # dead already, or ended by the survivor
        assert victim.exitcode == {"dies": 3, "hangs": None, "stopped": -signal.SIGTERM}[fate], victim.exitcode
    finally:
        for p in ctx.processes:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)  # also a stopped one
                p.join(10)
    elapsed, message = (tmp_path / "rank0.txt").read_text().split("\n", 1)
    assert "rank(s) [1] never reached it" in message, message
    assert ("rank(s) [1] stopped (SIGSTOP) on this host: ended them" in message) == (fate == "stopped"), message
    assert "rank 0: collective #2 (all_reduce)" in message, message
    assert float(elapsed) < 2 * COLLECTIVE_TIMEOUT, f"the failed collective took {elapsed} s"


def metric_rows(rank: int, world: int) -> dict:
    """The trainer's batch metrics (stanza 4 and 6) of this rank's rows of one fixed ragged batch, reduced."""
    import common
    import ppo_math
    import trainer
    from evaluation import eos_mask_errors
    from offpolicy import OffPolicyArgs, corrections, gap_stats, off_policy_weights

    g = torch.Generator().manual_seed(0)
    B, R = 8, 9
    lengths = torch.tensor([9, 1, 2, 9, 7, 3, 8, 9])  # rank 0 holds 21 tokens, rank 1 holds 27
    mask = (torch.arange(R) < lengths[:, None]).float()  # [B, R]
    scores = torch.tensor([0.0, 1.0, 1.0, 1.0, 0.2, 0.9, 0.3, 0.4])  # rank halves: very different spreads
    old, ref, behav = (torch.randn(B, R, generator=g) * 0.3 - 1.0 for _ in range(3))
    values = torch.randn(B, R, generator=g) * mask
    group_ids = torch.arange(B) // 2
    ids = torch.randint(4, 20, (B, R), generator=g)
    rows = slice(rank * B // world, (rank + 1) * B // world)
    cfg = trainer.Config(kl_in_reward=True, kl_coef=0.1)
    m = trainer.score_stats(scores[rows], group_ids[rows])
    m.update(trainer.compute_advantages(cfg, scores[rows], mask[rows], old[rows], ref[rows], 0.1, group_ids[rows],
                                   values[rows])[-1])  # fmt: skip
    m.update(off_policy_weights(old[rows], behav[rows], mask[rows], "tis")[1])
    m.update(gap_stats(old[rows], behav[rows], mask[rows], verl=True))  # + veRL's rollout_corr/ gap metrics
    icepop = OffPolicyArgs(rollout_is="token", rollout_is_threshold="0.5_2.0", rollout_rs="token_k1,seq_mean_k3",
                           rollout_rs_threshold="2.0,0.05")  # fmt: skip
    m.update(corrections(icepop, old[rows], behav[rows], mask[rows])[2])  # veRL's rollout_corr/ metrics, global
    seq_is = corrections(OffPolicyArgs(rollout_is="sequence", rollout_rs="seq_max_k2", rollout_rs_threshold="0.3"),
                         old[rows], behav[rows], mask[rows])[2]  # fmt: skip
    m.update({f"seq/{k}": v for k, v in seq_is.items()})
    m["stats/kl"] = float(
        common.masked_mean(ppo_math.kl_estimate(old[rows], ref[rows]) * mask[rows], mask[rows], global_=True)
    )
    m["stats/eos_mask_err_frac"] = eos_mask_errors(ids[rows], mask[rows].long(), [3], R, global_=True)
    return common.reduce_metrics(m)


def _metrics_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    import common

    common.setup_dist(timeout_s=60, device="cpu", init_method=f"file://{init_file}")
    torch.save(metric_rows(rank, world), Path(out_dir, f"rank{rank}.pt"))
    torch.distributed.destroy_process_group()


def test_metrics_under_ddp_pool_every_sample_and_token(tmp_path):
    """2 ranks x half the batch log the metrics of 1 process x the whole batch: the reward std over all samples,
    token means over all tokens (the halves hold 21 and 27 tokens), not per-rank values averaged."""
    mp.spawn(_metrics_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2)
    parts = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    single = metric_rows(0, 1)
    assert parts[0] == parts[1] and parts[0].keys() == single.keys()
    for key in (
        "rollout/reward_std",
        "stats/kl",
        "stats/return_std",
        "stats/is_weight_mean",
        "stats/eos_mask_err_frac",
        "rollout_corr/rollout_is_min",
        "rollout_corr/rollout_is_eff_sample_size",
        "rollout_corr/rollout_rs_seq_masked_fraction",
        "seq/rollout_corr/rollout_is_max",
        "rollout_corr/chi2_seq",
    ):
        assert key in single
    assert 0 < single["rollout_corr/rollout_rs_masked_fraction"] < 1 and single["rollout_corr/rollout_is_oob_ratio"] > 0
    assert single["stats/eos_mask_err_frac"] > 0  # rows without the stop token 3 are errors: not vacuous
    bad = {k: (parts[0][k], v) for k, v in single.items() if abs(parts[0][k] - v) > 1e-6 * max(1.0, abs(v))}
    assert not bad, f"pooled over ranks != single process: {bad}"


def _strict_worker(rank: int, world: int, port: int, model: str, out_dir: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # train() rendezvous as under torchrun
    import trainer

    torch.set_num_threads(1)
    flags = dict(prompts_per_step=4, group_size=2, minibatches=1, eval_every=0, steps=6, dist_timeout=60)
    cfg = trainer.Config(model=model, task="reverse", inject="logprob_shift", strict=True, out_dir=out_dir, **flags)
    t0 = time.perf_counter()
    try:  # the shifted recompute trips logprob_mismatch on the second step; the rows are reduced over ranks
        trainer.train(cfg)
        Path(out_dir, f"rank{rank}.txt").write_text("went on")
    except RuntimeError as e:
        Path(out_dir, f"rank{rank}.txt").write_text(f"{time.perf_counter() - t0:.3f}\n{e}")


def test_strict_stops_every_rank_at_the_same_step(tmp_path, sft_path):
    """--strict under DDP: a finding stops every rank at once (each diagnoses the same reduced row), not rank 0
    alone while the others wait for the collective timeout (60 s here)."""
    import socket

    with socket.socket() as sock:  # a free port for the rendezvous
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(_strict_worker, args=(2, port, str(sft_path), str(tmp_path)), nprocs=2)
    messages = [(tmp_path / f"rank{r}.txt").read_text().split("\n", 1) for r in range(2)]
    for rank, (_, message) in enumerate(messages):
        assert message.startswith("--strict: stopping at step 2 on logprob_mismatch"), (rank, message)
    assert messages[0][1] == messages[1][1]


def _fsdp_rank_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    """One rank of the FSDP2 dead-rank test: both run one sharded forward (each all-gathers the others' shards),
    then rank 1 dies before the second."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    import common
    import trainer
    from tasks import make_tiny_model, make_tokenizer

    common.setup_dist(timeout_s=COLLECTIVE_TIMEOUT, device="cpu", init_method=f"file://{init_file}")
    torch.manual_seed(0)
    policy = common.shard_or_replicate(make_tiny_model(make_tokenizer()).eval(), world, fsdp=True)
    cfg, ids = trainer.Config(fsdp=True), torch.randint(4, 20, (2, 6))
    with torch.no_grad():
        trainer.trainer_logprobs(cfg, policy, ids, torch.ones_like(ids), 3)  # everyone alive: this one succeeds
        if rank == 1:
            os._exit(3)
        t0 = time.perf_counter()
        try:
            trainer.trainer_logprobs(cfg, policy, ids, torch.ones_like(ids), 3)
        except RuntimeError as e:
            Path(out_dir, f"rank{rank}.txt").write_text(f"{time.perf_counter() - t0:.3f}\n{e}")
            raise
    Path(out_dir, f"rank{rank}.txt").write_text("no error")


def test_dead_rank_is_named_under_fsdp(tmp_path):
    """Under FSDP2 every forward all-gathers the weights' shards: a rank that died makes the survivor's next forward
    fail within the collective timeout, naming it, as a dead rank does under DDP."""
    ctx = mp.spawn(_fsdp_rank_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=False)
    survivor, victim = ctx.processes
    try:
        survivor.join(120)
        assert survivor.exitcode is not None, "rank 0 still running: it hangs instead of failing"
        assert survivor.exitcode != 0 and victim.exitcode == 3, (survivor.exitcode, victim.exitcode)
    finally:
        for p in ctx.processes:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
                p.join(10)
    elapsed, message = (tmp_path / "rank0.txt").read_text().split("\n", 1)
    assert "rank(s) [1] never reached it" in message and "(sequence_logprobs)" in message, message
    assert float(elapsed) < 2 * COLLECTIVE_TIMEOUT, f"the failed forward took {elapsed} s"


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_fsdp_on_two_nodes_equals_ddp_and_resumes_bit_exact(sft_path, tmp_path):
    """FSDP2 on 2 ranks started as two nodes (two torchrun launchers, --nnodes 2 --nproc-per-node 1, a c10d
    rendezvous on 127.0.0.1): its first 3 iterations' metrics equal DDP's (one launcher, 2 ranks) within 1e-5; its
    sharded step-2 checkpoint resumes into the same step 3 bit for bit; its final policy is a whole model."""
    from runlog import read_jsonl
    from tasks import load_policy

    flags = ["trainer.py", "--model", str(sft_path), "--task", "reverse", "--steps", "3", "--prompts-per-step"]
    flags += ["4", "--group-size", "4", "--eval-every", "3", "--eval-n", "16", "--dist-timeout", "60"]
    proc = torchrun(*flags, "--out-dir", str(tmp_path / "ddp"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rdzv = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-id", "minrl-test"]
    rdzv += ["--rdzv-endpoint", f"127.0.0.1:{free_port()}"]
    cmd = [sys.executable, "-m", "torch.distributed.run", *rdzv, *flags, "--fsdp", "--save-every", "2"]
    logs = [tmp_path / f"node{i}.log" for i in range(2)]  # files, not pipes: a full pipe would block its launcher
    nodes = [subprocess.Popen([*cmd, "--out-dir", str(tmp_path / "fsdp")], cwd=ROOT, env=ENV, stdout=log.open("w"),
                              stderr=subprocess.STDOUT) for log in logs]  # fmt: skip
    try:
        for node in nodes:
            node.wait(timeout=300)
    finally:
        for node in nodes:
            node.kill()
    logs = [log.read_text() for log in logs]
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(log[-3000:] for log in logs)
    assert any("world 2" in log for log in logs), logs
    ddp, fsdp = read_jsonl(tmp_path / "ddp" / "metrics.jsonl"), read_jsonl(tmp_path / "fsdp" / "metrics.jsonl")
    assert [r["step"] for r in fsdp] == [1, 2, 3]
    for a, b in zip(ddp, fsdp):
        keys = [k for k in a if not k.startswith(("time/", "perf/", "critic/params", "critic/mem", "critic/actor"))]
        assert keys == [k for k in b if k in keys] and len(keys) > 30
        worst = max(keys, key=lambda k: abs(a[k] - b[k]))
        assert abs(a[worst] - b[worst]) < 1e-5, (a["step"], worst, a[worst], b[worst])
    assert (tmp_path / "fsdp" / "ckpt-2" / "shards").is_dir() and not (tmp_path / "fsdp" / "ckpt-2" / "policy").exists()
    proc = torchrun(*flags, "--fsdp", "--out-dir", str(tmp_path / "resumed"), "--resume", str(tmp_path / "fsdp"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    same = lambda row: {k: v for k, v in row.items() if not k.startswith(("time/", "perf/"))}  # noqa: E731
    assert [same(r) for r in read_jsonl(tmp_path / "resumed" / "metrics.jsonl")] == [same(fsdp[2])]
    gathered, replica = (load_policy(str(tmp_path / run / "policy"), "cpu")[0] for run in ("fsdp", "ddp"))
    diff = max((p - q).abs().max().item() for p, q in zip(gathered.parameters(), replica.parameters(), strict=True))
    assert diff < 1e-5, f"the final policy gathered from FSDP2's shards differs from DDP's by {diff:.2e}"
    start = load_policy(str(sft_path), "cpu")[0]
    assert max((p - q).abs().max().item() for p, q in zip(start.parameters(), replica.parameters(), strict=True)) > 1e-4


def test_fsdp_token_budget_critic_warmup_and_early_checkpoint_equal_ddp(sft_path, tmp_path):
    """FSDP2 under a token budget, with a critic warm-up that checkpoints before the policy's first step (its AdamW
    state empty: not saved, so never initialised by torch's step at lr 0, whose count would change the bias
    correction): the same 3 iterations as DDP within 1e-5, and the step-1 checkpoint resumes into the same steps 2
    and 3 bit for bit."""
    from runlog import read_jsonl

    flags = ["trainer.py", "--model", str(sft_path), "--task", "reverse", "--steps", "3", "--prompts-per-step", "4"]
    flags += ["--group-size", "4", "--eval-every", "0", "--dist-timeout", "60", "--micro-batch", "3"]
    flags += ["--micro-batch-tokens", "60", "--critic-warmup-steps", "2", "--save-every", "1"]
    resume = ["--fsdp", "--resume", str(tmp_path / "fsdp" / "ckpt-1")]
    for name, extra in (("ddp", []), ("fsdp", ["--fsdp"]), ("resumed", resume)):
        proc = torchrun(*flags, *extra, "--out-dir", str(tmp_path / name))
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ddp, fsdp, resumed = (read_jsonl(tmp_path / name / "metrics.jsonl") for name in ("ddp", "fsdp", "resumed"))
    skip = ("time/", "perf/", "critic/params", "critic/mem", "critic/actor")
    for a, b in zip(ddp, fsdp, strict=True):
        keys = [k for k in a if not k.startswith(skip)]
        worst = max(keys, key=lambda k: abs(a[k] - b[k]))
        assert abs(a[worst] - b[worst]) < 1e-5, (a["step"], worst, a[worst], b[worst])
    same = lambda row: {k: v for k, v in row.items() if not k.startswith(("time/", "perf/"))}  # noqa: E731
    assert [same(r) for r in resumed] == [same(r) for r in fsdp[1:]]


def _bf16_critic_worker(rank: int, init_file: str, out: str) -> None:
    """A world of one: the value model sharded with bf16 compute weights, its head in fp32 or not."""
    import common
    from critics import make_value_model
    from tasks import make_tiny_model, make_tokenizer

    common.setup_dist(device="cpu", init_method=f"file://{init_file}", group=True)
    ids, outcome = torch.randint(4, 20, (2, 6)), {}
    for fp32 in (True, False):
        torch.manual_seed(0)
        vm = make_value_model(make_tiny_model(make_tokenizer()).eval())
        common.shard_or_replicate(vm, 1, fsdp=True, bf16=True, fp32=[vm.head] if fp32 else [])
        try:
            values = vm(ids, torch.ones_like(ids), 3)
            values.sum().backward()
            outcome[fp32] = str(values.dtype)
        except RuntimeError as e:
            outcome[fp32] = f"error: {e}"
    Path(out).write_text(repr(outcome))


def test_fsdp_bf16_keeps_the_value_head_in_fp32(tmp_path):
    """FSDP2's bf16 compute weights would make the value head bf16 while its input is fp32 (critics.py detail 5):
    sharded on its own in fp32 the critic computes fp32 values; the control, the head inside the root's bf16, fails."""
    mp.spawn(_bf16_critic_worker, args=(str(tmp_path / "init"), str(tmp_path / "out.txt")), nprocs=1, join=True)
    outcome = eval((tmp_path / "out.txt").read_text())  # a dict this test's worker wrote
    assert outcome[True] == "torch.float32", outcome
    assert outcome[False].startswith("error") and "dtype" in outcome[False], outcome
