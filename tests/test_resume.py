"""Checkpoint/resume exactness and seeded determinism of ppo_minimal.train on CPU (DESIGN.md 6).

A run of 6 steps, and a run stopped after 3 steps then resumed from its step-3 checkpoint for 3 more,
must log identical metrics for steps 4..6 (every key but the wall-clock ones, time/* and perf/*), for
PPO (critic + GAE) and GRPO. Two runs with the same seed must log identical metrics.

Bitwise equality needs the same torch thread count in both runs (OMP_NUM_THREADS, torch.set_num_threads):
CPU kernels split reductions by thread, so another count changes the last bits. These tests run every
training in this one process, so the count is the same by construction; no other flag is needed
(no torch.use_deterministic_algorithms: the CPU ops used here are deterministic).
"""

import json

import pytest
import torch

import ppo_minimal as pm
from runlog import read_jsonl

# the defaults (2 epochs x 2 shuffled minibatches; within the 20 warm-up iterations) on `sft_path`'s reverse task
TINY = dict(task="reverse", prompts_per_step=4, group_size=4, eval_every=3, eval_n=20)


def comparable(row: dict) -> dict:
    """A metrics row without the wall-clock metrics."""
    return {k: v for k, v in row.items() if not k.startswith(("time/", "perf/"))}


def assert_same_rows(expected: list[dict], got: list[dict], what: str) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in expected], what
    for a, b in zip(expected, got):
        a, b = comparable(a), comparable(b)
        diff = {k: (a.get(k), b.get(k)) for k in a.keys() | b.keys() if a.get(k) != b.get(k)}
        assert not diff, f"{what}, step {a['step']}: {diff}"


@pytest.fixture(scope="module")
def run(sft_path, tmp_path_factory):
    """run(name, adv, steps, **overrides) -> (metrics rows, train()'s return, out_dir); cached by name."""
    cache = {}

    def _run(name: str, adv: str, steps: int, **overrides):
        if name not in cache:
            out = tmp_path_factory.mktemp(name)
            cfg = pm.Config(model=str(sft_path), adv_estimator=adv, steps=steps, out_dir=str(out), **TINY, **overrides)
            result = pm.train(cfg)
            cache[name] = (read_jsonl(out / "metrics.jsonl"), result, out)
        return cache[name]

    return _run


@pytest.mark.parametrize("adv", ["gae", "grpo"])
def test_resume_reproduces_uninterrupted_run(run, adv):
    full, full_result, _ = run(f"full-{adv}", adv, 6)
    part, _, part_dir = run(f"part-{adv}", adv, 3, save_every=3)
    assert_same_rows(full[:3], part, f"{adv}: first 3 steps")
    resumed, resumed_result, _ = run(f"resumed-{adv}", adv, 6, resume=str(part_dir / "ckpt-3"))
    assert_same_rows(full[3:], resumed, f"{adv}: resumed from step 3")
    # step 3's eval comes from the checkpoint (through JSON: its (step, acc) pairs come back as lists)
    assert [list(e) for e in resumed_result["eval_history"]] == [list(e) for e in full_result["eval_history"]]
    assert [e[0] for e in full_result["eval_history"]] == [0, 3, 6]  # step 0: before any update


def test_resume_mid_cosine_schedule_is_exact(run, capsys):
    """A checkpoint taken mid-run (warm-up 1, cosine over 6 iterations) resumes onto the same lr curve: the
    last 3 rows equal the uninterrupted run's. Resuming with another --steps moves the curve, and says so."""
    kw = dict(warmup_steps=1, lr_schedule="cosine", min_lr_ratio=0.1)
    full, _, full_dir = run("cosine-full", "grpo", 6, save_every=3, **kw)
    resumed, _, _ = run("cosine-resumed", "grpo", 6, resume=str(full_dir / "ckpt-3"), **kw)
    assert_same_rows(full[3:], resumed, "cosine: resumed from step 3")
    assert "the lr schedule continues" not in capsys.readouterr().out
    longer, _, _ = run("cosine-longer", "grpo", 8, resume=str(full_dir / "ckpt-3"), **kw)
    assert "steps 6 -> 8: the lr schedule continues on the new values" in capsys.readouterr().out
    assert longer[0]["stats/lr"] != full[3]["stats/lr"] and longer[0]["loss/policy"] != full[3]["loss/policy"]


def test_checkpoint_is_safetensors_and_weights_only(run):
    _, _, part_dir = run("part-gae", "gae", 3, save_every=3)
    ckpt = part_dir / "ckpt-3"
    state = torch.load(ckpt / "state.pt", weights_only=True)  # raises if anything needs unpickling code
    assert state["step"] == 3
    assert json.loads(state["config"])["adv_estimator"] == "gae"
    for name in ("policy", "critic_0"):
        assert (ckpt / name / "model.safetensors").is_file()
    assert (ckpt / "critic_0" / "value_head.safetensors").is_file()
    torch.load(ckpt / "rank0.pt", weights_only=True)  # this rank's random streams
    diag = pm.LiveDiagnoser()  # the live diagnosis' state: a resumed run keeps its baselines
    diag.load_state(state["diag"])
    assert diag.count["stats/kl"] == 3
    # the final policy (out_dir/policy, saved by default) is the step-3 policy of the checkpoint, loadable as is
    from safetensors.torch import load_file

    final, saved = (load_file(str(d / "model.safetensors")) for d in (part_dir / "policy", ckpt / "policy"))
    assert final.keys() == saved.keys() and all(torch.equal(final[k], saved[k]) for k in final)
    allowed = ("state.pt", "rank0.pt")
    pickled = [p for p in ckpt.rglob("*") if p.suffix in (".bin", ".pt", ".pth", ".pkl") and p.name not in allowed]
    assert not pickled, pickled


def test_same_seed_is_bitwise_identical(run):
    first, _, _ = run("part-gae", "gae", 3, save_every=3)
    again, _, _ = run("again-gae", "gae", 3)
    assert_same_rows(first, again, "same seed twice")
    other, _, _ = run("seed1-gae", "gae", 3, seed=1)
    assert comparable(other[0]) != comparable(first[0]), "a different seed gave the same metrics: vacuous check"


def test_resume_into_the_same_folder_keeps_each_step_once(sft_path, tmp_path):
    """A run stopped after step 3 (having logged a step 4 and half of step 5 before it was killed), then
    resumed from ckpt-3 into the same folder: metrics.jsonl holds steps 1..5, each once."""
    cfg = dict(model=str(sft_path), adv_estimator="grpo", out_dir=str(tmp_path), **TINY)
    pm.train(pm.Config(steps=4, save_every=3, **cfg))
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "rollout/rew')  # killed mid-write
    pm.train(pm.Config(steps=5, resume=str(tmp_path / "ckpt-3"), **cfg))
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4, 5]
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\nnot json\n{"step": 2}\n')  # damage before the end
    with pytest.raises(ValueError, match="line 2: not a JSON metrics row"):
        pm.train(pm.Config(steps=5, resume=str(tmp_path / "ckpt-3"), **cfg))
