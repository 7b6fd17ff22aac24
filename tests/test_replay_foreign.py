"""replay.py on a batch exported by another framework (replay.py detail 2, FOREIGN_BATCH).

The batch is built here in veRL's DataProto layout from this project's own sampler and trainer (a random-init tiny
model saved as a Hugging Face folder), so every per-token number the replay recomputes must match the file's, and its
update must be exactly the one ppo_update runs on the same tensors. A planted difference must show in the comparison,
and a malformed file must be refused with the key and the layout named.
"""

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

import replay
import trainer
from rollout import generate, sequence_logprobs
from tasks import format_prompt, make_task, make_tiny_model, make_tokenizer, tokenize_prompts

G = 2  # samples per prompt


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    tok = make_tokenizer()
    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("tiny")
    make_tiny_model(tok).save_pretrained(d)
    tok.save_pretrained(d)
    return d


def config(model_dir, estimator: str, **kw) -> trainer.Config:
    return trainer.Config(model=str(model_dir), task="reverse", adv_estimator=estimator, prompts_per_step=4,
                     group_size=G,
                     steps=1, ppo_epochs=2, minibatches=2, eval_every=0, temperature=1.0, **kw)  # fmt: skip


def verl_batch(model_dir, estimator: str) -> dict:
    """One batch in veRL's names: sampled and scored here, advantages by our estimator (veRL's semantics)."""
    cfg, tok = config(model_dir, estimator), make_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    problems = make_task("reverse").sample(4, "train", np.random.default_rng(0))
    ids, mask = tokenize_prompts(tok, [format_prompt(tok, p["prompt"]) for p in problems for _ in range(G)], 16)
    g = torch.Generator().manual_seed(0)
    s = generate(model, ids, mask, max_new_tokens=8, eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id,
                 generator=g)  # fmt: skip
    R, rmask = s.response_ids.shape[1], s.response_mask.float()
    with torch.no_grad():
        old = sequence_logprobs(model, s.input_ids, s.attention_mask, R)[0]
    scores = trainer.last_valid(rmask).float() * torch.rand(len(ids), generator=g)[:, None]  # [B, R]
    uid, values = torch.arange(len(ids)) // G, torch.randn(len(ids), R, generator=g) * rmask
    _, adv, returns, _, _ = trainer.compute_advantages(cfg, scores, rmask, old, old, cfg.kl_coef, uid, values)
    return {"input_ids": s.input_ids, "attention_mask": s.attention_mask, "responses": s.response_ids,
            "response_mask": s.response_mask, "old_log_probs": old, "ref_log_prob": old.clone(),
            "rollout_log_probs": s.rollout_logprobs, "values": values, "advantages": adv, "returns": returns,
            "token_level_scores": scores, "token_level_rewards": scores.clone(), "uid": uid}  # fmt: skip


def save(batch: dict, path) -> str:
    if str(path).endswith(".npz"):
        np.savez(path, **{k: v.numpy() for k, v in batch.items()})
    else:
        torch.save(batch, path)
    return str(path)


@pytest.mark.parametrize("estimator, suffix", [("gae", ".pt"), ("grpo", ".npz"), ("rloo", ".pt")])
def test_a_verl_batch_replays_with_matching_per_token_numbers_and_the_same_update(model_dir, tmp_path, estimator,
                                                                                  suffix):  # fmt: skip
    batch = verl_batch(model_dir, estimator)
    path = save(batch, tmp_path / f"b{suffix}")
    assert replay.is_foreign_batch(path)
    cfg = config(model_dir, estimator)
    metrics, rows = replay.replay_foreign(path, cfg)
    diffs = {r["quantity"]: r["max_abs_diff"] for r in rows}
    assert set(diffs) == {"old_log_probs", "ref_log_prob", "rollout_log_probs (vs their old)", "advantages", "returns"}
    assert diffs["old_log_probs"] < 1e-5 and diffs["ref_log_prob"] < 1e-5  # the same weights, the same recompute
    assert diffs["rollout_log_probs (vs their old)"] < 1e-4  # our fp32 sampler vs its trainer
    assert diffs["advantages"] < 1e-6 and diffs["returns"] < 1e-6  # the same estimator on the same inputs
    # the update is ppo_update's on the same tensors, from the same weights
    policy, _, opt, _, *_ = trainer.build_models(cfg, cfg.model, torch.device("cpu"), 1)
    mask, old = batch["response_mask"].float(), batch["old_log_probs"]
    m = mask.long()
    direct = trainer.Batch(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], response_mask=m,
                      loss_mask=mask, old_logprobs=old, clip_anchor=old, ref_logprobs=batch["ref_log_prob"],
                      advantages=batch["advantages"] * mask, token_weights=torch.ones_like(mask), pg_mask=m, ent_mask=m,
                      is_weights=None, old_values=None, critic_returns=None, shares=None)  # fmt: skip
    gen = torch.Generator().manual_seed(cfg.seed)
    assert metrics == trainer.ppo_update(
        cfg, policy, opt, None, direct, 1, gen, trainer.make_autocast(cfg.dtype, "cpu")
    )
    assert metrics["stats/first_mb_ratio_dev"] < 1e-5  # the file's anchor is this model's logprobs


def test_a_planted_difference_shows_in_the_comparison(model_dir, tmp_path):
    batch = verl_batch(model_dir, "grpo")
    batch["old_log_probs"][0, 0] += 0.5  # their trainer scored one token differently
    batch["advantages"] = -batch["advantages"]  # and their estimator has the opposite sign
    rows = replay.replay_foreign(save(batch, tmp_path / "b.pt"), config(model_dir, "grpo"))[1]
    diffs = {r["quantity"]: r["max_abs_diff"] for r in rows}
    assert abs(diffs["old_log_probs"] - 0.5) < 1e-5
    assert diffs["advantages"] > 0.1


def test_the_cli_replays_a_foreign_batch(model_dir, tmp_path, capsys):
    path = save(verl_batch(model_dir, "grpo"), tmp_path / "b.npz")
    replay.main([path, "--model", str(model_dir), "--task", "reverse", "--adv-estimator", "grpo",
             "--group-size", str(G), "--prompts-per-step", "4", "--temperature", "1.0"])  # fmt: skip
    out = capsys.readouterr().out
    assert "per-token |ours - theirs|" in out and "old_log_probs" in out and "actor/pg_loss" in out


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda b: b.pop("old_log_probs"), r"no \['old_log_probs'\].*Layout"),
        (lambda b: b.update(values=b["values"][:, :-1]), "'values' has shape"),
        (lambda b: b.update(responses=b["responses"].flip(1)), "'responses' differs from input_ids"),
        (lambda b: b["advantages"].__setitem__((0, 0), float("nan")), "'advantages' is NaN"),
        (lambda b: [b.pop(k) for k in ("advantages", "token_level_scores", "token_level_rewards")], "nothing to train"),
    ],
)
def test_a_malformed_batch_is_refused_naming_the_key(model_dir, tmp_path, edit, match):
    batch = verl_batch(model_dir, "grpo")
    edit(batch)
    batch["response_mask"][0, 0] = 1  # the NaN above sits on a trained token
    with pytest.raises(ValueError, match=match):
        replay.load_foreign_batch(save(batch, tmp_path / "b.pt"))


def test_a_foreign_replay_needs_the_model_and_what_its_estimator_reads(model_dir, tmp_path):
    batch = verl_batch(model_dir, "gae")
    path = save(batch, tmp_path / "b.pt")
    with pytest.raises(ValueError, match="needs --model"):
        replay.replay_foreign(path, trainer.Config(task="reverse"))
    for k in ("advantages", "values"):
        batch.pop(k)
    with pytest.raises(ValueError, match="'gae' needs 'values'"):
        replay.replay_foreign(save(batch, tmp_path / "c.pt"), config(model_dir, "gae"))
    with pytest.raises(ValueError, match="needs the batch's 'rollout_log_probs'"):
        b = verl_batch(model_dir, "grpo")
        b.pop("rollout_log_probs")
        replay.replay_foreign(save(b, tmp_path / "d.pt"), config(model_dir, "grpo", rollout_is="token"))


def test_a_pt_with_numpy_arrays_is_refused_with_the_fix(tmp_path):
    torch.save({"old_log_probs": torch.zeros(2, 3), "uid": np.arange(2)}, tmp_path / "b.pt")  # not weights_only
    with pytest.raises(ValueError, match="torch.from_numpy"):
        replay.is_foreign_batch(tmp_path / "b.pt")


def test_grpo_advantages_from_the_files_scores_are_verls_by_hand(model_dir, tmp_path):
    """veRL's GRPO: (score - group mean) / (unbiased group std + 1e-6); for a pair of distinct scores ~ +-1/sqrt(2)
    on every token (a biased std would give ~ +-1)."""
    batch = verl_batch(model_dir, "grpo")
    mask = batch["response_mask"].float()
    s = batch["token_level_scores"].sum(-1)  # [B] one score per sample, pairs by uid
    d = s - s.view(-1, G).flip(1).reshape(-1)  # [B] minus its partner's score: mean +-d/2, unbiased std |d|/sqrt(2)
    batch["advantages"] = (d / 2 / (d.abs() / 2**0.5 + 1e-6))[:, None] * mask  # the hand answer
    rows = replay.replay_foreign(save(batch, tmp_path / "b.pt"), config(model_dir, "grpo"))[1]
    assert {r["quantity"]: r["max_abs_diff"] for r in rows}["advantages"] < 1e-5


def test_a_group_estimator_needs_uid_and_a_kl_term_needs_ref_log_prob(model_dir, tmp_path):
    batch = verl_batch(model_dir, "grpo")
    batch.pop("uid")
    with pytest.raises(ValueError, match="'grpo' needs the batch's 'uid'"):
        replay.replay_foreign(save(batch, tmp_path / "b.pt"), config(model_dir, "grpo"))
    batch = verl_batch(model_dir, "grpo")
    batch.pop("ref_log_prob")
    with pytest.raises(ValueError, match="need the batch's 'ref_log_prob'"):
        replay.replay_foreign(save(batch, tmp_path / "c.pt"), config(model_dir, "grpo", kl_loss=True))


def test_foreign_files_with_the_wrong_kinds_of_entries_name_the_key(model_dir, tmp_path):
    batch = verl_batch(model_dir, "grpo")
    arrays = {k: v.numpy() for k, v in batch.items()}
    np.savez(tmp_path / "s.npz", **{**arrays, "uid": np.array(["a", "b"] * (len(arrays["uid"]) // 2))})
    with pytest.raises(ValueError, match="'uid' is not a numeric array.*return_inverse"):
        replay.load_foreign_batch(tmp_path / "s.npz")  # veRL's raw string uids
    np.savez(tmp_path / "f.npz", **{**arrays, "input_ids": arrays["input_ids"][0]})
    with pytest.raises(ValueError, match="'input_ids' has shape .*2 dimensions"):
        replay.load_foreign_batch(tmp_path / "f.npz")
    np.savez(tmp_path / "x.npz", **arrays, extra=np.array(["ignored"]))  # other keys are not read
    assert set(replay.load_foreign_batch(tmp_path / "x.npz")) == set(batch)
    torch.save({k: v for k, v in batch.items() if k != "old_log_probs"}, tmp_path / "m.pt")
    assert replay.is_foreign_batch(tmp_path / "m.pt")  # so the replay names what is missing, not a dump's keys
    with pytest.raises(ValueError, match=r"no \['old_log_probs'\]"):
        replay.replay_foreign(str(tmp_path / "m.pt"), config(model_dir, "grpo"))
