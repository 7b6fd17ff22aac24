"""The speed work changes no number: the on-policy anchor taken from the update's first forward, the reference pass
on a cadence, the update's metrics copied to the host once. Each is checked against the path it replaces, bit for
bit, on short runs of the random-init tiny model (a model folder, as `--model DIR` loads it)."""

import json

import numpy as np
import pytest
import torch

import ppo_minimal as pm
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


def run(folder, tmp_path, name, **kw):
    """Three iterations; the metric rows without wall times, and the final weights."""
    rows, out = [], tmp_path / name
    cfg = pm.Config(model=str(folder / "model"), data=str(folder / "data.jsonl"), reward="digits", steps=3,
                    prompts_per_step=4, group_size=4, ppo_epochs=1, minibatches=1, micro_batch=8, eval_every=0,
                    out_dir=str(out), **kw)  # fmt: skip
    pm.train(cfg, hooks=[lambda step, m: rows.append({k: v for k, v in m.items() if not k.startswith(TIMES)})])
    return rows, (out / "policy" / "model.safetensors").read_bytes()


@pytest.mark.parametrize("estimator", ["grpo", "gae"])
def test_anchor_from_the_first_forward_equals_the_recompute(folder, tmp_path, estimator):
    """One epoch of one minibatch: the update's first forward gives the recompute's logprobs bit for bit, so skipping
    the recompute changes no metric and no weight (the critic's too, GAE)."""
    assert pm.reuses_anchor(pm.Config(ppo_epochs=1, minibatches=1)) and not pm.reuses_anchor(pm.Config())
    reused, w_reused = run(folder, tmp_path, "reuse", adv_estimator=estimator)
    recomputed, w_recomputed = run(folder, tmp_path, "recompute", adv_estimator=estimator, reuse_old_logprobs=False)
    assert reused == recomputed and w_reused == w_recomputed
    assert all(r["stats/first_mb_ratio_dev"] == 0.0 for r in reused)  # the anchor is the first forward itself
    assert "stats/rollout_vs_old_logp_diff" in reused[0] and "stats/kl" in reused[0]


def test_reference_pass_on_its_cadence(folder, tmp_path):
    """kl_metric_every: stats/kl (and loss/kl) only on its iterations; every other number unchanged; a KL loss needs
    the reference on every iteration whatever the cadence."""
    every, _ = run(folder, tmp_path, "every", adv_estimator="grpo")
    never, _ = run(folder, tmp_path, "never", adv_estimator="grpo", kl_metric_every=0)
    second, _ = run(folder, tmp_path, "second", adv_estimator="grpo", kl_metric_every=2)
    kl_keys = ("stats/kl", "loss/kl")
    for a, b, c in zip(every, never, second):
        assert {k: v for k, v in a.items() if k not in kl_keys} == b
        assert {k: v for k, v in a.items() if k not in kl_keys} == {k: v for k, v in c.items() if k not in kl_keys}
    assert [("stats/kl" in r, "loss/kl" in r) for r in second] == [(True, True), (False, False), (True, True)]
    assert [second[i]["stats/kl"] for i in (0, 2)] == [every[i]["stats/kl"] for i in (0, 2)]
    assert all(pm.needs_reference(pm.Config(kl_loss=True, kl_metric_every=0), s) for s in range(3))


def test_host_floats_one_copy_same_values():
    rows = [{"a": torch.tensor(0.1), "b": 2.5}, {"c": torch.tensor(1 / 3, dtype=torch.float64), "d": "x"}]
    pm.host_floats(rows)
    assert rows == [{"a": torch.tensor(0.1).item(), "b": 2.5}, {"c": 1 / 3, "d": "x"}]
    assert all(type(r["a" if "a" in r else "c"]) is float for r in rows)


def test_batch_without_anchor_needs_one_minibatch():
    names = [f.name for f in pm.fields(pm.Batch)]
    batch = pm.Batch(
        **{k: None if k in ("old_logprobs", "clip_anchor", "old_values") else torch.ones(2, 3) for k in names}
    )
    cfg = pm.Config(ppo_epochs=2)
    with pytest.raises(ValueError, match="ppo_epochs = minibatches = 1"):
        pm.ppo_update(cfg, None, None, None, batch, 1, torch.Generator(), None)
