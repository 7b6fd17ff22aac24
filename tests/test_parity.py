"""The textbook (ppo_minimal.py) equals the full trainer (trainer.py) on the default recipe, bit for bit.

Two files run the same PPO: the textbook, which writes its loop out in its own text, and the trainer, which runs it
through every feature's seams. They are kept equal by these tests, not by sharing the loop: on the default recipe
(3 iterations, seed 0) both end with the same weights and AdamW state (tests/parity_run.py's digest), single process
and under `torchrun --nproc_per_node 2` (gloo), and every metric both write agrees to 1e-9. The pieces the textbook
does its own way are checked where they differ: its sampling (rollout.generate + the task's score) against the
trainer's (rollout_env over the task's envs), its greedy evaluation against evaluation.evaluate. AST tests keep the
textbook a textbook: its own loop, only tensor math, sampling, tasks, the warm start and plumbing imported.
"""

import ast
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import ppo_math
import ppo_minimal
from envs import TaskEnv
from evaluation import evaluate, held_out
from rollout import generate, last_valid, rollout_env
from tasks import format_prompt, load_policy, make_task, stop_token_ids, tokenize_prompts

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
RECIPE = ["--steps", "3", "--eval-every", "0"]  # the default recipe, 3 iterations, no evaluation (a row is a step)
CASES = {"ppo": [], "grpo": ["--adv-estimator", "grpo"], "ppo_warmup_1": ["--warmup-steps", "1"]}  # 1: the cosine runs
WRITTEN = ["rollout/reward_mean", "rollout/response_len", "loss/policy", "stats/kl", "stats/clipfrac", "stats/entropy"]
WRITTEN += ["stats/grad_norm", "stats/lr", "time/rollout", "time/train"]  # + loss/value with a critic
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
PLUMBING = {"common", "cli", "runlog"}


def run_both(tmp_path, flags: list[str], model: Path, launcher: list[str], recipe=RECIPE) -> dict:
    """The textbook and the trainer with the same flags, side by side: {which: (metrics rows, digests per rank)}."""
    procs = {}
    for which in ("textbook", "trainer"):
        cmd = [*launcher, str(ROOT / "tests" / "parity_run.py"), which, str(tmp_path / which)]
        cmd += [*recipe, *flags, "--model", str(model)]
        procs[which] = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out = {}
    for which, proc in procs.items():
        log = proc.communicate(timeout=900)[0].decode()
        assert proc.returncode == 0, f"{which}:\n{log[-3000:]}"
        rows = [json.loads(line) for line in (tmp_path / which / "metrics.jsonl").read_text().splitlines()]
        digests = [json.loads(p.read_text()) for p in sorted((tmp_path / which).glob("digest-*.json"))]
        out[which] = rows, digests
    return out


def assert_equal_runs(runs: dict, ranks: int, critic: bool) -> None:
    """Same digest on every rank of both files; every metric both write within 1e-9 (wall times aside)."""
    (ours, our_digests), (theirs, their_digests) = runs["textbook"], runs["trainer"]
    assert len(our_digests) == len(their_digests) == ranks
    assert {d["optimizers"] for d in our_digests + their_digests} == {2 if critic else 1}
    for ours_r, theirs_r in zip(our_digests, their_digests):  # every optimizer step's gradients, in order
        assert ours_r["grads"] == theirs_r["grads"], first_difference(ours_r["grads"], theirs_r["grads"])
    assert {d["digest"] for d in our_digests + their_digests} == {our_digests[0]["digest"]}
    assert [r["step"] for r in ours] == [r["step"] for r in theirs] == [1, 2, 3]
    written = WRITTEN + ["loss/value"] * critic
    for a, b in zip(ours, theirs):
        assert not [k for k in written if k not in a or k not in b], (sorted(a), sorted(b))
        shared = [k for k in a.keys() & b.keys() if not k.startswith("time/")]
        differ = {k: (a[k], b[k]) for k in shared if abs(a[k] - b[k]) > 1e-9 * abs(b[k])}  # relative; 0 == 0
        assert not differ, differ
    assert ours[-1]["stats/clipfrac"] > 0 and ours[-1]["stats/kl"] != 0  # the runs trained: the policy moved


def first_difference(ours: list, theirs: list) -> str:
    """Where two lists of [optimizer, gradient digest] per step first differ (the step a bug enters the update)."""
    n = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
    return f"optimizer step {n} of {len(ours)} / {len(theirs)} differs: {ours[n : n + 1]} vs {theirs[n : n + 1]}"


@pytest.mark.parametrize("case", CASES)
def test_the_textbook_ends_bit_for_bit_where_the_trainer_ends(tmp_path, default_sft_path, case):
    runs = run_both(tmp_path, CASES[case], default_sft_path, [sys.executable])
    assert_equal_runs(runs, ranks=1, critic=case != "grpo")


@pytest.mark.parametrize("case", ["ppo", "grpo"])
def test_the_textbook_equals_the_trainer_under_torchrun(tmp_path, default_sft_path, case):
    """Two ranks (gloo): DDP, the global token denominator, global whitening, rank-local groups, metrics averaged."""
    runs = run_both(tmp_path, CASES[case], default_sft_path, TORCHRUN)
    assert_equal_runs(runs, ranks=2, critic=case != "grpo")


def test_one_update_on_a_frozen_batch_has_the_same_loss_and_gradients(tmp_path, default_sft_path):
    """The update alone: both files' sampling answered from one generator of its own (parity_run --frozen-batch),
    one iteration of PPO with a critic. Every optimizer step (4 minibatches, policy and critic) is handed the same
    gradients, the losses agree, and the weights and AdamW states end equal."""
    recipe = ["--frozen-batch", "7", "--steps", "1", "--eval-every", "0"]
    runs = run_both(tmp_path, [], default_sft_path, [sys.executable], recipe=recipe)
    (ours, [our_digest]), (theirs, [their_digest]) = runs["textbook"], runs["trainer"]
    assert our_digest["frozen_calls"] == their_digest["frozen_calls"] == 1  # one sampling call each, frozen
    assert our_digest["grads"] == their_digest["grads"], first_difference(our_digest["grads"], their_digest["grads"])
    assert len(our_digest["grads"]) >= 2 and {i for i, _ in our_digest["grads"]} == {0, 1}  # critic and policy steps
    assert our_digest["digest"] == their_digest["digest"]
    for key in ("loss/policy", "loss/value", "stats/grad_norm", "stats/clipfrac"):
        assert abs(ours[0][key] - theirs[0][key]) <= 1e-9 * abs(theirs[0][key]), key


def test_the_textbooks_sampling_and_scoring_equal_the_trainers_rollout_env(default_sft_path):
    """rollout.generate + the task's score (the textbook) and rollout_env over the task's envs (the trainer's
    single-turn path) give the same tokens, masks, sampler logprobs and rewards, from the same generator seed."""
    policy, tok = load_policy(str(default_sft_path), "cpu")
    task, eos = make_task("sort"), stop_token_ids(policy, tok)
    problems = [p for p in task.sample(8, "train", np.random.default_rng(0)) for _ in range(4)]
    kw = {"max_new_tokens": 16, "temperature": 0.6, "eos_token_ids": eos, "pad_token_id": tok.pad_token_id}
    ids, mask = tokenize_prompts(tok, [format_prompt(tok, p["prompt"]) for p in problems], 64)
    ours = generate(policy, ids, mask, **kw, generator=torch.Generator().manual_seed(3))
    texts = [tok.decode(r[m.bool()], skip_special_tokens=True) for r, m in zip(ours.response_ids, ours.response_mask)]
    scores = torch.tensor([float(task.compute_score(t, p["ground_truth"])) for t, p in zip(texts, problems)])
    envs = [TaskEnv(task, p) for p in problems]
    limits = {"max_prompt_len": 64, "max_new_tokens": 16, "max_turns": 1, "max_context": 80, "temperature": 0.6}
    gen = torch.Generator().manual_seed(3)
    theirs, _ = rollout_env(policy, tok, envs, [None] * len(envs), eos, **limits, generator=gen)
    for name in ("prompt_ids", "response_ids", "attention_mask", "response_mask", "rollout_logprobs", "truncated"):
        assert torch.equal(getattr(ours, name), getattr(theirs, name)), name
    assert torch.equal(last_valid(ours.response_mask.float()).float() * scores[:, None], theirs.token_scores)
    assert 0 < scores.mean() < 1  # some answers right, some not: the comparison sees both


def test_the_textbooks_greedy_evaluation_equals_evaluation_evaluate(default_sft_path):
    policy, tok = load_policy(str(default_sft_path), "cpu")
    task, eos = make_task("sort"), stop_token_ids(policy, tok)
    problems = task.sample(300, "eval", np.random.default_rng(12345))  # the held-out draw of both files
    ours = ppo_minimal.evaluate(policy, tok, task, problems, eos, 16, 0, 1)
    limits = {"max_prompt_len": 64, "max_new_tokens": 16, "max_turns": 1, "max_context": 80}
    theirs = evaluate(policy, tok, held_out(task, "sort", 300)[0], eos, **limits)
    assert ours == theirs and 0 < ours < 1


def imported_names(tree) -> dict[str, str]:
    """{local name: module} of every import of the textbook."""
    names = {}
    for node in tree.body:
        if isinstance(node, ast.Import):
            names.update({(a.asname or a.name): a.name for a in node.names})
        elif isinstance(node, ast.ImportFrom):
            names.update({(a.asname or a.name): node.module for a in node.names})
    return names


def test_the_textbook_is_a_textbook():
    """Its own loop in its own text: <= 300 lines of <= 100 characters, train() <= 120, no `# fmt: skip`, a Config
    of <= 20 fields; it imports only ppo_math, rollout, tasks, warm_start and plumbing of the project, redefines
    nothing ppo_math defines, and calls no project function that takes a model and an optimizer (the update is
    written out here: the forward, the loss, backward, clip and step)."""
    src = (ROOT / "ppo_minimal.py").read_text()
    tree, lines = ast.parse(src), src.splitlines()
    assert len(lines) <= 300 and max(map(len, lines)) <= 100 and "fmt: skip" not in src
    defs = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    assert defs["train"].end_lineno - defs["train"].lineno + 1 <= 120
    fields = list(ppo_minimal.Config.__dataclass_fields__)
    required = "model task adv_estimator steps prompts_per_step group_size lr seed out_dir eval_every eval_n"
    assert len(fields) <= 20 and set(required.split()) <= set(fields), fields
    project = {p.stem for p in ROOT.glob("*.py")}
    used = {m.split(".")[0] for m in imported_names(tree).values()} & project
    assert used <= {"ppo_math", "rollout", "tasks", "warm_start"} | PLUMBING, used
    assert not (set(defs) - {"main"}) & {n for n, _ in inspect.getmembers(ppo_math, inspect.isfunction)}
    from_project = [n for n, m in imported_names(tree).items() if m.split(".")[0] in project]
    called = [getattr(ppo_minimal, n) for n in from_project if inspect.isfunction(getattr(ppo_minimal, n))]
    called += [f for _, f in inspect.getmembers(ppo_math, inspect.isfunction)]  # called as ppo_math.NAME
    for fn in called:
        params = list(inspect.signature(fn).parameters)
        assert not any(p in ("opt", "optimizer", "optim") or p.endswith("_opt") for p in params), (fn, params)
