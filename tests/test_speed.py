"""The speed work changes no number: the on-policy anchor taken from the update's first forward, the reference pass
on a cadence, the update's metrics copied to the host once. Each is checked against the path it replaces, bit for
bit, on short runs of the random-init tiny model (a model folder, as `--model DIR` loads it)."""

import dataclasses
import json

import numpy as np
import pytest
import torch

import replay
import trainer
from tasks import DigitTask, make_tiny_model, make_tokenizer

TIMES = ("time/", "perf/")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A random-init tiny model folder and a JSONL of sort prompts."""
    root = tmp_path_factory.mktemp("tiny")
    torch.manual_seed(0)
    tok = make_tokenizer()
    make_tiny_model(tok).save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    rows = DigitTask("sort").sample(64, "train", np.random.default_rng(0))
    (root / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def run(folder, tmp_path, name, monkeypatch=None, **kw):
    """Three iterations; the metric rows without wall times, the final weights and the trainer's logprob passes
    (counted with monkeypatch: "train" with grad, "reference" of the frozen model, "recompute" of the anchor)."""
    rows, out, passes = [], tmp_path / name, []
    cfg = trainer.Config(model=str(folder / "model"), data=str(folder / "data.jsonl"), reward="digits", steps=3,
                    prompts_per_step=4, group_size=4, ppo_epochs=1, minibatches=1, micro_batch=8, eval_every=0,
                    out_dir=str(out), **kw)  # fmt: skip
    if monkeypatch is not None:
        real = trainer.trainer_logprobs

        def counted(cfg, model, *a, **k):
            grad, frozen = torch.is_grad_enabled(), not next(model.parameters()).requires_grad
            passes.append("train" if grad else "reference" if frozen else "recompute")
            return real(cfg, model, *a, **k)

        monkeypatch.setattr(trainer, "trainer_logprobs", counted)
    trainer.train(cfg, hooks=[lambda step, m: rows.append({k: v for k, v in m.items() if not k.startswith(TIMES)})])
    return rows, (out / "policy" / "model.safetensors").read_bytes(), passes


@pytest.mark.parametrize("estimator", ["grpo", "gae"])
def test_anchor_from_the_first_forward_equals_the_recompute(folder, tmp_path, monkeypatch, estimator):
    """One epoch of one minibatch: the update's first forward gives the recompute's logprobs bit for bit, so skipping
    the recompute changes no metric and no weight (the critic's too, GAE); the run does skip it."""
    reused, w_reused, passes = run(folder, tmp_path, "reuse", monkeypatch, adv_estimator=estimator)
    monkeypatch.undo()
    recomputed, w_recomputed, _ = run(folder, tmp_path, "recompute", adv_estimator=estimator, reuse_old_logprobs=False)
    assert passes == ["reference", "train", "train"] * 3, passes  # 2 micro-batches, no recompute of the anchor
    first = ("stats/first_mb_ratio_dev", "stats/first_mb_clipfrac")  # 0 by construction: not logged
    assert [{k: v for k, v in r.items() if k not in first} for r in recomputed] == reused
    assert w_reused == w_recomputed and all(r["stats/first_mb_ratio_dev"] < 1e-6 for r in recomputed)
    assert "stats/rollout_vs_old_logp_diff" in reused[0] and "stats/kl" in reused[0]
    assert not trainer.reuses_anchor(trainer.Config()) and not trainer.reuses_anchor(
        trainer.Config(**ONE, credit="attention")
    )
    assert not trainer.reuses_anchor(trainer.Config(**ONE, off_policy="tis")) and trainer.reuses_anchor(
        trainer.Config(**ONE)
    )


ONE = {"ppo_epochs": 1, "minibatches": 1}


def test_replay_of_an_update_without_an_anchor(folder, tmp_path):
    """--dump-batch of an update whose anchor is its first forward (old_logprobs None in the dump) replays exactly."""
    run(folder, tmp_path, "dump", adv_estimator="grpo", dump_batch=2, kl_metric_every=2)
    saved = torch.load(tmp_path / "dump" / "batch-2.pt", weights_only=True)["batch"]
    assert saved["old_logprobs"] is None and saved["ref_logprobs"] is None  # what the update did not get before
    metrics, same = replay.replay(str(tmp_path / "dump" / "batch-2.pt"))
    assert same and metrics is not None and "loss/kl" not in metrics  # iteration 2: no reference pass


def test_reference_pass_on_its_cadence(folder, tmp_path, monkeypatch):
    """kl_metric_every: the reference's forward, stats/kl and loss/kl only on its iterations; every other number
    unchanged; a KL loss or KL in the reward needs the reference on every iteration whatever the cadence."""
    every, _, _ = run(folder, tmp_path, "every", adv_estimator="grpo")
    never, _, _ = run(folder, tmp_path, "never", adv_estimator="grpo", kl_metric_every=0)
    second, _, passes = run(folder, tmp_path, "second", monkeypatch, adv_estimator="grpo", kl_metric_every=2)
    kl_keys = ("stats/kl", "loss/kl")
    drop = lambda r: {k: v for k, v in r.items() if k not in kl_keys}  # noqa: E731
    assert [drop(r) for r in every] == never == [drop(r) for r in second]
    assert passes == ["reference", "train", "train"] + ["train", "train"] + ["reference", "train", "train"], passes
    assert [("stats/kl" in r, "loss/kl" in r) for r in second] == [(True, True), (False, False), (True, True)]
    assert [second[i]["stats/kl"] for i in (0, 2)] == [every[i]["stats/kl"] for i in (0, 2)]
    for kw in ({"kl_loss": True}, {"kl_in_reward": True}):
        assert all(trainer.needs_reference(trainer.Config(kl_metric_every=0, **kw), s) for s in range(3))
    with pytest.raises(ValueError, match="kl_loss needs the batch's ref_logprobs"):
        trainer.ppo_update(trainer.Config(kl_loss=True), None, None, None, batch_of(ref_logprobs=None), 1, None, None)


def batch_of(**none):
    """A Batch of ones [2, 3] with the fields named in `none` set to None (critic fields None)."""
    names = [f.name for f in dataclasses.fields(trainer.Batch)]
    critic = ("old_values", "critic_returns", "shares")
    return trainer.Batch(**{k: None if k in none or k in critic else torch.ones(2, 3) for k in names})


def test_host_floats_one_copy_same_values():
    """Each 0-d tensor becomes the Python float its .item() gives (fp32 and fp64 alike), other values stay."""
    rows = [{"a": torch.tensor(0.1), "b": 2.5}, {"c": torch.tensor(1 / 3, dtype=torch.float64), "d": "x"}]
    trainer.host_floats(rows)
    assert rows == [{"a": torch.tensor(0.1).item(), "b": 2.5}, {"c": 1 / 3, "d": "x"}]
    assert type(rows[0]["a"]) is float and type(rows[1]["c"]) is float
    trainer.host_floats(empty := [{}, {"e": 1}])
    assert empty == [{}, {"e": 1}]


def test_batch_without_anchor_needs_one_minibatch():
    with pytest.raises(ValueError, match="ppo_epochs = minibatches = 1"):
        trainer.ppo_update(trainer.Config(ppo_epochs=2), None, None, None, batch_of(old_logprobs=None), 1, None, None)
    with pytest.raises(ValueError, match="KL in the reward needs old and reference logprobs"):
        mask = torch.ones(2, 3)
        cfg = trainer.Config(kl_in_reward=True, adv_estimator="grpo")
        trainer.compute_advantages(cfg, torch.ones(2), mask, None, mask, 0.1, torch.zeros(2, dtype=torch.long), None)
    with pytest.raises(ValueError, match="pass credit's gamma"):
        trainer.shape_advantages(trainer.Config(credit="attention"), torch.ones(2, 3), torch.ones(2, 3), None, None)
