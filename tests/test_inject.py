"""Bug-injection regression suite and deterministic replay (repro.INJECTIONS, --dump-batch, replay.py).

Each classic bug runs in its stated config (repro.INJECTIONS) from the SFT warm start on a small batch
(8 prompts x 8 samples). The live diagnosis (diagnose.LiveDiagnoser, fed by a train() hook exactly as the
trainer feeds its own) must name the declared failure-mode id within FIRES_BY[name] steps. The same configs
without the bug, run as long, must raise no finding at all, and so must the default config (at the same 8 x 8
batch) for 45 steps, long enough for the 40-step flat-reward window: a check that fires on every run fails here.
"""

import ast
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from calibrated import REVERSE_T1

import offpolicy
import ppo_math
import replay
import repro
import rollout
import tasks
import trainer
from diagnose import LiveDiagnoser
from evaluation import eos_mask_errors
from repro import INJECTIONS
from rollout import Rollout
from runlog import read_jsonl

SMALL = {**REVERSE_T1, "prompts_per_step": 8, "group_size": 8, "eval_every": 0}
# steps by which the declared id must be reported (measured: reward_scale 12, the rest 2-5)
FIRES_BY = {
    "reward_scale": 20,
    "eos_unmasked": 5,
    "logprob_shift": 5,
    "pad_eq_eos": 5,
    "stale_old_logprobs": 10,
    "no_temperature": 5,
    "value_not_detached": 5,
    "answer_format": 5,
    "adv_sign": 25,
    "kl_sign": 30,
    "ent_sign": 35,
    "wrong_stop_id": 5,
    "retokenized_history": 5,
    "stale_sampler": 15,
}
# injections that need another config than the calibrated reverse one (bench/diagnose_bench.py's): the trainer's
# own warm start of the task (cached), 8 prompts x 8 samples
OWN_CONFIG = {
    "ent_sign": {"task": "sort", "adv_estimator": "grpo"},  # lr 1e-4 constant: the collapse is too slow to show
    "retokenized_history": {"task": "calc", "adv_estimator": "grpo", "temperature": 0.6},  # multi-turn
}


class Found(Exception):
    pass


def run(sft_path, tmp_path, steps: int, stop_at: str | None = None, **overrides):
    """Train with a live diagnoser in a hook; stop early once `stop_at` is reported. Returns the findings."""
    diag, findings = LiveDiagnoser(), []

    def hook(step, metrics):
        findings.extend(diag.update(step, metrics))
        if stop_at in {f.id for f in findings}:
            raise Found

    stated = INJECTIONS[overrides["inject"]].config if overrides.get("inject") else {}
    pinned = {k: v for k, v in SMALL.items() if k not in stated}  # the injection's stated config wins (detail 12)
    if overrides.get("inject") in OWN_CONFIG:  # the trainer's defaults and warm start for that task
        pinned = {"prompts_per_step": 8, "group_size": 8, "eval_every": 0, **OWN_CONFIG[overrides["inject"]]}
    else:
        pinned["model"] = str(sft_path)
    cfg = trainer.Config(steps=steps, out_dir=str(tmp_path), save_final=False, **{**pinned, **overrides})
    try:
        trainer.train(cfg, hooks=[hook])
    except Found:
        pass
    return findings


def test_every_injection_has_a_bound_and_a_known_failure_id():
    from diagnose import CHECKS

    assert set(FIRES_BY) == set(INJECTIONS)
    assert {inj.diagnosed_as for inj in INJECTIONS.values()} <= {cid for cid, _, _ in CHECKS}
    for name, inj in INJECTIONS.items():  # each plant replaces what `points` names, and names the bug it plants
        planted = inj.plant(trainer)
        assert ", ".join(f"{m.__name__}.{f}" for m, f in planted) == inj.points, name
        assert all(callable(getattr(m, f)) for m, f in planted), name  # an existing function of that module
        plant = getattr(inj.plant, "func", inj.plant)  # (reward_scale, answer_format: partial(scaled_scores))
        assert name in plant.__doc__, f"{plant.__name__} does not name {name} in its docstring"


def test_the_trainer_calls_every_planted_function_through_its_module():
    """A `from rollout import rollout_env` in trainer.py would bind the function at import: the patch of
    repro.planted would never reach the loop and the injection would silently plant nothing. So no planted function
    is imported by name there (the trainer's own helpers are looked up in its module at each call)."""
    planted = {(m.__name__, f) for inj in INJECTIONS.values() for m, f in inj.plant(trainer)}
    tree = ast.parse((Path(__file__).resolve().parents[1] / "trainer.py").read_text())
    bound = {(n.module, a.name) for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    assert planted and not bound & planted, bound & planted
    assert {m for m, _ in planted} - {"trainer"} <= {
        a.name for n in tree.body if isinstance(n, ast.Import) for a in n.names
    }


def test_planted_replaces_the_functions_for_the_block_only_and_puts_them_back():
    before = rollout.sync_weights, rollout.rollout_env, trainer.episode_rewards
    with repro.planted("stale_sampler", trainer):
        assert rollout.sync_weights is not before[0] and rollout.rollout_env is before[1]
    with pytest.raises(RuntimeError, match="inside"), repro.planted("pad_eq_eos", trainer):
        assert rollout.rollout_env is not before[1] and trainer.episode_rewards is not before[2]
        raise RuntimeError("an error inside the block")
    assert (rollout.sync_weights, rollout.rollout_env, trainer.episode_rewards) == before
    with repro.planted(None, trainer):
        assert (rollout.sync_weights, rollout.rollout_env, trainer.episode_rewards) == before


@pytest.mark.parametrize("name", list(INJECTIONS))
def test_injected_bug_is_diagnosed(sft_path, tmp_path, name):
    expected = INJECTIONS[name].diagnosed_as
    findings = run(sft_path, tmp_path, FIRES_BY[name], stop_at=expected, inject=name)
    assert expected in [f.id for f in findings], f"{name}: {[str(f) for f in findings]}"


@pytest.mark.parametrize(
    "name", ["none", "reward_scale", "no_temperature", "kl_sign"]
)  # the injections with a config other than the default
def test_healthy_run_in_the_same_config_raises_nothing(sft_path, tmp_path, name):
    overrides = {} if name == "none" else INJECTIONS[name].config
    steps = 45 if name == "none" else FIRES_BY[name]  # the default for 45 steps: flat_reward's window runs too
    findings = run(sft_path, tmp_path, steps, **overrides)
    assert not findings, [str(f) for f in findings]


def test_retokenized_history_drops_the_inner_end_of_turn_tokens_and_keeps_the_rewards():
    eos, pad, t = 2, 0, torch.tensor
    # one episode: action [5, 6, EOS] (reward 0.5 on its EOS), observation [9], action [7, EOS] (reward 1), padding
    r = Rollout(prompt_ids=t([[1]]), response_ids=t([[5, 6, 2, 9, 7, 2, 0]]), attention_mask=t([[1] * 7 + [0]]),
                response_mask=t([[1, 1, 1, 0, 1, 1, 0]]), rollout_logprobs=t([[-0.1, -0.2, -0.3, 0, -0.4, -0.5, 0]]),
                truncated=t([False]), token_scores=t([[0, 0, 0.5, 0, 0, 1.0, 0]]))  # fmt: skip
    out = repro.retokenized(r, eos, pad)
    assert out.response_ids.tolist() == [[5, 6, 9, 7, 2, 0, 0]]  # the final EOS is the template's own
    assert out.response_mask.tolist() == [[1, 1, 0, 1, 1, 0, 0]]
    assert out.attention_mask.tolist() == [[1, 1, 1, 1, 1, 1, 0, 0]]
    assert out.token_scores.tolist() == [[0, 0.5, 0, 0, 1.0, 0, 0]]  # the lost EOS' reward on the token before it
    assert torch.equal(out.rollout_logprobs, r.rollout_logprobs)  # where they were: off by one from turn 2 on
    # an empty action (its EOS alone, reward 0.25) keeps its EOS: its reward cannot move onto the observation before it
    r = Rollout(prompt_ids=t([[1]]), response_ids=t([[5, 2, 9, 2, 8, 7, 2]]), attention_mask=t([[1] * 8]),
                response_mask=t([[1, 1, 0, 1, 0, 1, 1]]), rollout_logprobs=torch.zeros(1, 7), truncated=t([False]),
                token_scores=t([[0, 0, 0, 0.25, 0, 0, 1.0]]))  # fmt: skip
    out = repro.retokenized(r, eos, pad)
    assert out.response_ids.tolist() == [[5, 9, 2, 8, 7, 2, 0]] and out.response_mask.tolist() == [
        [1, 0, 1, 0, 1, 1, 0]
    ]
    assert out.token_scores.tolist() == [[0, 0, 0.25, 0, 0, 1.0, 0]]


def test_the_sampler_stop_and_sign_injections_plant_what_they_say():
    policy = torch.nn.Linear(2, 2)
    with repro.planted("stale_sampler", trainer):
        engine = rollout.inference_copy(policy, "float32")  # a frozen copy, not the policy itself
        with torch.no_grad():
            policy.weight.add_(1.0)
        rollout.sync_weights(engine, policy)
    assert engine is not policy and not torch.equal(engine.weight, policy.weight)  # never synced
    assert rollout.inference_copy(policy, "float32") is policy
    tokenizer = SimpleNamespace(eos_token_id=2, pad_token_id=0)
    with repro.planted("wrong_stop_id", trainer):
        assert tasks.stop_token_ids(None, tokenizer) == [0]
        with pytest.raises(ValueError, match="wrong_stop_id"):
            tasks.stop_token_ids(None, SimpleNamespace(eos_token_id=2, pad_token_id=2))
    assert tasks.stop_token_ids(None, tokenizer) == [2]
    one, x = torch.ones(2), torch.tensor([1.0, -2.0])
    with repro.planted("kl_sign", trainer):
        assert torch.equal(ppo_math.kl_reward(one, x, 0.1), one + 0.1 * x)  # the penalty added
    with repro.planted("ent_sign", trainer):
        assert torch.equal(ppo_math.entropy_bonus(one, x, 1.0), one + x)  # loss + c H
    assert torch.equal(ppo_math.entropy_bonus(one, x, 1.0), one - x)


def test_injection_config_applies_to_defaults_only_and_names_are_checked():
    cfg = trainer.Config(inject="no_temperature")
    assert cfg.temperature == 0.7
    assert trainer.Config(inject="no_temperature", temperature=0.9).temperature == 0.9  # a non-default value wins
    with pytest.raises(ValueError, match="needs adv_estimator 'gae'"):
        trainer.Config(inject="value_not_detached", adv_estimator="grpo")  # no critic: the bug could not act
    with pytest.raises(ValueError, match="inject"):
        trainer.Config(inject="off_by_two")
    with pytest.raises(ValueError, match="needs a multi-turn task"):
        trainer.Config(inject="retokenized_history", task="reverse")
    with pytest.raises(ValueError, match="dump_batch"):
        trainer.Config(steps=3, dump_batch=4)


@pytest.mark.parametrize("adv, extra", [("gae", {}), ("grpo", {"minibatches": 2, "ppo_epochs": 2})])
def test_replay_reproduces_the_dumped_update_bit_for_bit(sft_path, tmp_path, adv, extra, capsys):
    cfg = trainer.Config(
        model=str(sft_path), adv_estimator=adv, steps=3, dump_batch=2, out_dir=str(tmp_path), **{**SMALL, **extra}
    )
    trainer.train(cfg)
    path = tmp_path / "batch-2.pt"
    saved = torch.load(path, weights_only=True)  # the documented contract: a weights_only file
    assert json.loads(saved["config"])["adv_estimator"] == adv
    assert saved["threads"] == torch.get_num_threads()  # what replay.py runs with (cli.keep_threads)
    logged = read_jsonl(tmp_path / "metrics.jsonl")[1]
    assert logged["step"] == 2
    metrics, same = replay.replay(str(path))
    assert same, capsys.readouterr().out
    assert metrics == {k: logged[k] for k in metrics}  # the row the run logged for step 2


def test_a_crashing_update_is_dumped_with_its_error_and_replays_to_the_same_error(sft_path, tmp_path, monkeypatch):
    def nan_loss(*args, **kwargs):  # a NaN loss: the update raises on its non-finite gradient norm
        loss, m = policy_loss(*args, **kwargs)
        return loss * float("nan"), m

    policy_loss = offpolicy.policy_loss
    monkeypatch.setattr(offpolicy, "policy_loss", nan_loss)
    cfg = trainer.Config(model=str(sft_path), steps=2, dump_batch=1, out_dir=str(tmp_path), **SMALL)
    with pytest.raises(FloatingPointError, match="gradient norm is nan"):
        trainer.train(cfg)
    saved = torch.load(tmp_path / "batch-1.pt", weights_only=True)
    assert saved["error"].startswith("FloatingPointError") and saved["metrics"] is None
    assert replay.replay(str(tmp_path / "batch-1.pt")) == (None, True)  # the bug is still there: same error
    monkeypatch.setattr(offpolicy, "policy_loss", policy_loss)
    assert replay.replay(str(tmp_path / "batch-1.pt"))[1] is False  # fixed: the update now runs through


def test_eos_mask_errors_known_answers():
    eos = [2, 7]  # two stop ids
    ids = torch.tensor([[5, 5, 2, 0, 0], [5, 7, 0, 0, 0], [5, 5, 5, 5, 5], [2, 0, 0, 0, 0], [5, 2, 9, 5, 7]])
    good = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 0, 1, 1]])
    # row 2: cut by the length limit (5 tokens, no stop); row 4: two actions around an observation (9)
    assert eos_mask_errors(ids, good, eos, max_len=5) == 0.0
    no_eos = good.clone()
    no_eos[0, 2] = 0  # EOS masked out (pad == eos, mask rebuilt from ids)
    assert eos_mask_errors(ids, no_eos, eos, max_len=5) == pytest.approx(1 / 5)
    assert eos_mask_errors(ids, torch.ones_like(good), eos, max_len=5) == pytest.approx(4 / 5)  # padding trained
    assert eos_mask_errors(ids, good, eos, max_len=6) == pytest.approx(1 / 5)  # row 2 now ends early, no stop
    cut_action = torch.tensor([[5, 5, 9, 5, 7]]), torch.tensor([[1, 1, 0, 1, 1]])  # 1st action cut at max_len 2
    assert eos_mask_errors(*cut_action, eos, max_len=2) == 0.0
    assert eos_mask_errors(*cut_action, eos, max_len=3) == 1.0


def test_replay_detects_a_different_update(sft_path, tmp_path):
    cfg = trainer.Config(model=str(sft_path), steps=1, dump_batch=1, out_dir=str(tmp_path), **SMALL)
    trainer.train(cfg)
    path = tmp_path / "batch-1.pt"
    saved = torch.load(path, weights_only=True)
    saved["batch"]["advantages"] = -saved["batch"]["advantages"]  # another update than the one recorded
    torch.save(saved, path)
    assert replay.replay(str(path))[1] is False


def test_a_dump_in_the_earlier_dict_format_still_replays_bit_for_bit(sft_path, tmp_path, capsys):
    """Dumps written before trainer.Batch hold a dict: None for a neutral anchor or weight, kl_beta,
    policy_version and returns inside, no critic keys without a critic. They replay to the same update."""
    cfg = trainer.Config(
        model=str(sft_path), adv_estimator="grpo", steps=1, dump_batch=1, out_dir=str(tmp_path), **SMALL
    )
    cfg.reuse_old_logprobs = False  # the earlier format always held the recomputed anchor
    trainer.train(cfg)
    path = tmp_path / "batch-1.pt"
    saved = torch.load(path, weights_only=True)
    batch = saved["batch"]
    assert batch["old_values"] is None and torch.equal(batch["clip_anchor"], batch["old_logprobs"])
    legacy = {k: v for k, v in batch.items() if k not in ("old_values", "critic_returns", "shares")}
    legacy.update(clip_anchor=None, is_weights=None, token_weights=None, returns=batch["advantages"])
    torch.save({**saved, "batch": {**legacy, "kl_beta": 0.001, "policy_version": None}}, path)
    assert replay.replay(str(path))[1], capsys.readouterr().out
    torch.save({**saved, "batch": {**batch, "advantage": batch["advantages"]}}, path)  # a field no version has
    with pytest.raises(ValueError, match="'advantage'"):
        replay.replay(str(path))
    torch.save({**saved, "batch": {k: v for k, v in batch.items() if k != "advantages"}}, path)  # one missing
    with pytest.raises(ValueError, match=r"lacks \['advantages'\]"):
        replay.replay(str(path))


def test_the_dump_description_prints_the_config_changes_one_short_line_each(tmp_path, capsys):
    from dataclasses import asdict

    cfg = trainer.Config(steps=3, lr=1e-3, model="m" * 150, lora_targets=["q_proj", "v_proj"], dump_batch=2)
    record = {
        "config": json.dumps(asdict(cfg)),  # as dumped_update saves it: ~100 fields, a 2,000-character line
        "defaults": json.dumps(asdict(trainer.Config())),
        "batch": {"advantages": torch.zeros(4, 3)},
        "prompts": ["12+3="] * 4,
        "responses": ["15"] * 4,
        "scores": torch.ones(4),
        "error": None,
        "metrics": {"loss/policy": 0.1},
        "state_after": "sha256 ...",
    }
    torch.save(record, tmp_path / "batch-2.pt")
    repro.describe_dump(tmp_path / "batch-2.pt")
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == f"  config: 5 of {len(asdict(cfg))} fields differ from the defaults (all: the run's config.json)"
    fields = [line.split(" = ")[0].strip() for line in lines[2:] if " = " in line]
    assert sorted(fields) == ["dump_batch", "lora_targets", "lr", "model", "steps"] and "    steps = 3" in lines
    assert max(len(line) for line in lines[:-2]) <= 100  # the model's 150 characters wrapped over two lines
    assert "batch['advantages']: (4, 3)" in "\n".join(lines) and "state after: sha256 ..." in lines[-1]
