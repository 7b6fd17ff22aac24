"""Checkpoint/resume exactness and seeded determinism of trainer.train on CPU (docs/design.md 7).

A run of 6 steps, and a run stopped after 3 steps then resumed from its step-3 checkpoint for 3 more,
must log identical metrics for steps 4..6 (every key but the wall-clock ones, time/* and perf/*), for
PPO (critic + GAE) and GRPO. Two runs with the same seed must log identical metrics.

Bitwise equality needs the same torch thread count in both runs (OMP_NUM_THREADS, torch.set_num_threads):
CPU kernels split reductions by thread, so another count changes the last bits. These tests run every
training in this one process, so the count is the same by construction; no other flag is needed
(no torch.use_deterministic_algorithms: the CPU ops used here are deterministic).
"""

import json
import shutil
from pathlib import Path

import pytest
import torch

import checkpoint
import tasks
import trainer
from runlog import read_jsonl

ROOT = Path(__file__).resolve().parents[1]

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
            cfg = trainer.Config(
                model=str(sft_path), adv_estimator=adv, steps=steps, out_dir=str(out), **TINY, **overrides
            )
            result = trainer.train(cfg)
            cache[name] = (read_jsonl(out / "metrics.jsonl"), result, out)
        return cache[name]

    return _run


@pytest.mark.parametrize("adv", ["gae", "grpo"])
def test_resume_reproduces_uninterrupted_run(run, adv):
    full, full_result, _ = run(f"full-{adv}", adv, 6)
    part, _, part_dir = run(f"part-{adv}", adv, 3, save_every=3)
    assert_same_rows(full[:3], part, f"{adv}: first 3 steps")
    resumed, resumed_result, _ = run(f"resumed-{adv}", adv, 6, resume=str(part_dir / "ckpt-3"), resume_allow=("steps",))
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
    assert "(--resume-allow)" not in capsys.readouterr().out  # nothing changed, nothing printed
    with pytest.raises(ValueError, match=r"steps: 6 in the checkpoint, 8 now.*--resume-allow steps"):
        run("cosine-refused", "grpo", 8, resume=str(full_dir / "ckpt-3"), **kw)  # a changed field is refused ...
    longer, _, _ = run("cosine-longer", "grpo", 8, resume=str(full_dir / "ckpt-3"), resume_allow=("steps",), **kw)
    assert "steps: 6 in the checkpoint, 8 now (--resume-allow)" in capsys.readouterr().out  # ... unless allowed
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
    streams = torch.load(ckpt / "rank0.pt", weights_only=True)  # this rank's random streams
    assert streams["threads"] == torch.get_num_threads()  # and its thread count, which a resume takes
    diag = trainer.LiveDiagnoser()  # the live diagnosis' state: a resumed run keeps its baselines
    diag.load_state(state["diag"])
    assert diag.count["stats/kl"] == 3
    # the final policy (out_dir/policy, saved by default) is the step-3 policy of the checkpoint, loadable as is
    from safetensors.torch import load_file

    final, saved = (load_file(str(d / "model.safetensors")) for d in (part_dir / "policy", ckpt / "policy"))
    assert final.keys() == saved.keys() and all(torch.equal(final[k], saved[k]) for k in final)
    allowed = ("state.pt", "rank0.pt")
    assert checkpoint.incomplete(ckpt) is None and json.loads((ckpt / "checkpoint.json").read_text())["step"] == 3
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
    trainer.train(trainer.Config(steps=4, save_every=3, **cfg))
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "rollout/rew')  # killed mid-write
    trainer.train(trainer.Config(steps=5, resume=str(tmp_path / "ckpt-3"), resume_allow=("steps",), **cfg))
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4, 5]
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\nnot json\n{"step": 2}\n')  # damage before the end
    with pytest.raises(ValueError, match="line 2: not a JSON metrics row"):
        trainer.train(trainer.Config(steps=5, resume=str(tmp_path / "ckpt-3"), resume_allow=("steps",), **cfg))


# ----------------------------------------------------------------------------------------------
# Checked resume: the fingerprint (model, tokenizer, data, config, world size), a finished run


def copy_ckpt(run, tmp_path) -> Path:
    """A copy of the 3-step PPO run's ckpt-3 (to damage or edit), in a run folder of its own."""
    _, _, part_dir = run("part-gae", "gae", 3, save_every=3)
    shutil.copytree(part_dir / "ckpt-3", tmp_path / "run" / "ckpt-3")
    return tmp_path / "run" / "ckpt-3"


def resume_cfg(sft_path, ckpt, out, **overrides) -> trainer.Config:
    kw = dict(model=str(sft_path), adv_estimator="gae", steps=4, resume_allow=("steps",), out_dir=str(out), **TINY)
    return trainer.Config(**{**kw, "resume": str(ckpt), **overrides})  # the 3-step run's checkpoint, one more step


def test_resume_with_another_task_is_refused_at_load_before_a_warm_start_is_built(run, sft_path, tmp_path, monkeypatch):
    ckpt = copy_ckpt(run, tmp_path)
    monkeypatch.setattr(trainer, "sft_warm_start", lambda *a, **k: pytest.fail("a warm start was built first"))
    with pytest.raises(ValueError, match=r"task: 'reverse' in the checkpoint, 'calc' now\. .*cannot change"):
        resume_cfg(sft_path, ckpt, tmp_path / "out", task="calc", model=None)  # the embedded model: calc's warm start


def test_resume_refuses_another_run_naming_each_field(run, sft_path, tmp_path):
    ckpt = copy_ckpt(run, tmp_path)
    for overrides, fields_named in [
        (dict(lr=1e-4, clip_high=0.28), ["clip_high: 0.2 in the checkpoint, 0.28 now", "lr: 0.0002", "clip_high lr"]),
        (dict(model=str(tmp_path / "other")), ["model:", "model_source:"]),  # A's weights against B's reference
        (dict(adv_estimator="grpo"), ["adv_estimator: 'gae' in the checkpoint, 'grpo' now", "cannot change"]),
        (dict(critic_depth=0.5), ["critic_depth: 1.0 in the checkpoint, 0.5 now", "cannot change"]),
    ]:
        if "model" in overrides:  # another model with another config: the tiny default, one layer fewer
            tok = tasks.load_policy(str(sft_path), "cpu")[1]
            tasks.make_tiny_model(tok, num_hidden_layers=1).save_pretrained(overrides["model"])
            tok.save_pretrained(overrides["model"])
        with pytest.raises(ValueError, match="the checkpoint is of another run") as e:
            trainer.train(resume_cfg(sft_path, ckpt, tmp_path / "out", **overrides))
        assert all(f in str(e.value) for f in fields_named), str(e.value)
        assert not (tmp_path / "out" / "metrics.jsonl").exists()  # refused before any step
    moved = tmp_path / "moved"  # the same model in another folder: its path may be allowed, its contents must match
    shutil.copytree(sft_path, moved)
    with pytest.raises(ValueError, match=r"model: '.*' in the checkpoint, '.*moved' now.*--resume-allow model model_s"):
        trainer.train(resume_cfg(sft_path, ckpt, tmp_path / "out", model=str(moved)))
    with pytest.raises(ValueError, match=r"model_config_sha256.*cannot change"):  # allowed paths, another config
        trainer.train(resume_cfg(sft_path, ckpt, tmp_path / "out", model=str(tmp_path / "other"),
                            resume_allow=("steps", "model", "model_source")))  # fmt: skip
    for bad, msg in [(("task",), r"\['task'\] cannot be allowed"), (("stepz",), r"\['stepz'\] cannot be allowed")]:
        with pytest.raises(ValueError, match=msg):
            resume_cfg(sft_path, ckpt, tmp_path / "out", resume_allow=bad)
    with pytest.raises(ValueError, match=r"'resume_allow' = \['lr'\] needs --resume: it does nothing"):
        trainer.Config(resume_allow=("lr",))
    marker = json.loads((ckpt / "checkpoint.json").read_text())
    marker["fingerprint"]["world_size"] = 2  # a 2-rank checkpoint on 1 rank: rank 1's streams would be lost
    marker["fingerprint"]["tokenizer_sha256"] = "0" * 64
    (ckpt / "checkpoint.json").write_text(json.dumps(marker))
    with pytest.raises(ValueError, match=r"tokenizer_sha256: '0000.*world_size: 2 in the checkpoint, 1 now"):
        trainer.train(resume_cfg(sft_path, ckpt, tmp_path / "out"))
    marker["fingerprint"]["tokenizer_sha256"] = checkpoint.run_fingerprint(
        trainer.Config(model=str(sft_path)), 1, str(sft_path), *tasks.load_policy(str(sft_path), "cpu")
    )["tokenizer_sha256"]
    (ckpt / "checkpoint.json").write_text(json.dumps(marker))
    with pytest.raises(ValueError, match=r"world_size: 2 in the checkpoint, 1 now.*--resume-allow world_size to"):
        trainer.train(resume_cfg(sft_path, ckpt, tmp_path / "out"))
    marker["fingerprint"]["config"]["reward"] = "exact"  # one name, as config.json held it before 2026-12-02
    (ckpt / "checkpoint.json").write_text(json.dumps(marker))
    with pytest.raises(ValueError, match=r"reward: 'exact' in the checkpoint, None now.*cannot change"):
        trainer.train(resume_cfg(sft_path, ckpt, tmp_path / "out", resume_allow=("world_size", "steps")))
    marker["fingerprint"]["config"]["reward"] = "math_exact"  # the old default: the run of today's default (None)
    (ckpt / "checkpoint.json").write_text(json.dumps(marker))
    trainer.train(resume_cfg(sft_path, ckpt, tmp_path / "out", resume_allow=("world_size", "steps")))
    assert [r["step"] for r in read_jsonl(tmp_path / "out" / "metrics.jsonl")] == [4]  # allowed: it trains on
    allow = ("world_size", "steps", "model", "model_source")  # and the moved model, once its paths are allowed
    trainer.train(resume_cfg(sft_path, ckpt, tmp_path / "moved-out", model=str(moved), resume_allow=allow))
    assert [r["step"] for r in read_jsonl(tmp_path / "moved-out" / "metrics.jsonl")] == [4]


def test_resume_refuses_changed_data(sft_path, tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"{i}{i + 1}>", "ground_truth": f"{i + 1}{i}"}) + "\n" for i in range(9))
    )
    cfg = dict(model=str(sft_path), adv_estimator="grpo", data=str(data), reward="exact", **TINY)
    trainer.train(trainer.Config(**cfg, steps=1, save_every=1, out_dir=str(tmp_path / "a")))
    data.write_text(data.read_text().replace('"10"', '"11"'))  # same path, another ground truth
    with pytest.raises(ValueError, match=r"data_sha256: '[0-9a-f]{64}' in the checkpoint, '[0-9a-f]{64}' now"):
        trainer.train(
            trainer.Config(**cfg, steps=2, resume=str(tmp_path / "a"), resume_allow=("steps",), out_dir=str(tmp_path))
        )


def test_resume_of_a_finished_run_says_so_and_exits_nonzero(run, sft_path, tmp_path):
    _, _, part_dir = run("part-gae", "gae", 3, save_every=3)
    argv = ["--model", str(sft_path), "--steps", "3", "--resume", str(part_dir), "--out-dir", str(tmp_path)]
    argv += [f"--{k.replace('_', '-')}={v}" for k, v in TINY.items()]
    with pytest.raises(ValueError, match=r"the run is finished \(checkpoint at step 3, --steps 3\)"):
        trainer.main(argv)  # the command line's entry point: uncaught, a non-zero exit status


# ----------------------------------------------------------------------------------------------
# Atomic checkpoints: a crash mid-save leaves the old complete one; incomplete ones are refused by name


def test_a_crash_while_overwriting_a_checkpoint_leaves_the_old_one(run, sft_path, tmp_path, monkeypatch):
    ckpt = copy_ckpt(run, tmp_path)
    before = {p.name: p.read_bytes() for p in (ckpt / "policy").iterdir()}
    real_save = torch.save

    def crash_at_state(obj, f, *a, **kw):  # the policy is written, then the process dies before state.pt
        if Path(f).name == "state.pt":
            raise KeyboardInterrupt("killed between the policy and state.pt")
        return real_save(obj, f, *a, **kw)

    # a run that writes ckpt-3 where one is (as a resume from an earlier checkpoint of the folder would): the
    # folder's own rule (a second run into it is refused: tests/test_run_dir.py) is set aside for this
    monkeypatch.setattr(checkpoint, "check_out_dir", lambda *a: [])
    monkeypatch.setattr(torch, "save", crash_at_state)
    cfg = dict(model=str(sft_path), adv_estimator="gae", steps=3, save_every=3, out_dir=str(ckpt.parent), **TINY)
    with pytest.raises(KeyboardInterrupt):
        trainer.train(
            trainer.Config(**cfg, lr=1e-3)
        )  # a rerun into the same folder overwrites ckpt-3, with other weights
    monkeypatch.setattr(torch, "save", real_save)
    assert {p.name: p.read_bytes() for p in (ckpt / "policy").iterdir()} == before  # the old one, whole
    assert checkpoint.incomplete(ckpt) is None
    assert "has no checkpoint.json" in checkpoint.incomplete(ckpt.with_name("ckpt-3.tmp"))
    assert checkpoint.find_checkpoint(str(ckpt.parent)) == str(ckpt)  # the run folder: the newest complete one
    trainer.train(trainer.Config(**cfg, lr=1e-3))  # the same rerun, uncrashed: ckpt-3 now holds the new weights
    assert {p.name: p.read_bytes() for p in (ckpt / "policy").iterdir()} != before  # (so the check above could fail)
    assert not ckpt.with_name("ckpt-3.tmp").exists() and not ckpt.with_name("ckpt-3.old").exists()
    ckpt.rename(ckpt.with_name("ckpt-3.tmp"))  # a crash between the two renames: only ckpt-3.tmp, complete
    assert checkpoint.find_checkpoint(str(ckpt.parent)) == str(ckpt.with_name("ckpt-3.tmp"))


def test_incomplete_or_damaged_checkpoints_are_refused_by_name(run, sft_path, tmp_path, capsys):
    ckpt = copy_ckpt(run, tmp_path)
    newer = ckpt.with_name("ckpt-6")
    shutil.copytree(ckpt, newer)
    (newer / "checkpoint.json").unlink()  # a save that never finished
    assert checkpoint.find_checkpoint(str(ckpt.parent)) == str(ckpt)
    assert "skipped the incomplete ckpt-6 (it has no checkpoint.json" in capsys.readouterr().out
    with pytest.raises(ValueError, match=r"ckpt-6'?: refused, it has no checkpoint.json"):
        trainer.Config(resume=str(newer))  # at load, before any model is built
    weights = newer / "policy" / "model.safetensors"
    shutil.copy(ckpt / "checkpoint.json", newer)
    weights.write_bytes(weights.read_bytes()[:1000])  # truncated
    with pytest.raises(ValueError, match=r"policy/model.safetensors has 1000 bytes, not the \d+ written"):
        trainer.Config(resume=str(newer))
    with pytest.raises(FileNotFoundError, match="no such folder"):
        trainer.Config(resume=str(tmp_path / "nothing"))
    state = ckpt / "state.pt"  # random bytes, the same size: the marker passes, the load names the file
    state.write_bytes(torch.randint(0, 256, (state.stat().st_size,), dtype=torch.uint8).numpy().tobytes())
    with pytest.raises(ValueError, match=r"state.pt: not a readable checkpoint file \(\w+\); damaged") as e:
        trainer.train(resume_cfg(sft_path, ckpt, tmp_path / "out"))
    assert "weights_only" not in str(e.value)  # never the advice to unpickle what it cannot trust
