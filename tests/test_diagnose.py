"""diagnose.py: each failure mode on synthetic metrics (id + start step), no false alarms on healthy runs,
veRL / TRL logs, bad inputs through the CLI, and the live diagnoser agreeing with the offline one."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import diagnose  # noqa: E402
import diagnose_checks  # noqa: E402
import diagnose_logs  # noqa: E402
from diagnose import TH, LiveDiagnoser  # noqa: E402

run_diagnose = diagnose.diagnose

N = 60


def healthy(n=N, seed=0, beta=0.05, kl_abs=0.05, resp_len=8.0):
    """A healthy PPO run with KL in the reward: [0, 1] reward rising 0.3 -> 0.8, small KL, slowly falling entropy."""
    rng = np.random.default_rng(seed)
    rows = []
    for t in range(n):
        p = 0.3 + 0.5 * t / (n - 1) + rng.normal(0, 0.02)
        k1 = 0.0 if t == 0 else kl_abs * (0.5 + 0.5 * t / n)  # policy == reference before the first update
        rows.append(
            {
                "step": t,
                "rollout/reward_mean": p,
                "rollout/acc": p,
                "rollout/reward_std": float(np.sqrt(p * (1 - p))),
                "rollout/response_len": resp_len + rng.normal(0, 0.3),
                "rollout/truncated_frac": abs(rng.normal(0, 0.01)),
                "rollout/zero_std_frac": 0.2 + abs(rng.normal(0, 0.05)),
                "stats/kl": 0.02 * t / n + abs(rng.normal(0, 0.002)),
                "stats/kl_coef": beta,
                "stats/token_reward_kl_abs": beta * k1,
                "stats/entropy": 1.0 - 0.4 * t / n + rng.normal(0, 0.02),
                "stats/clipfrac": 0.05 + abs(rng.normal(0, 0.03)),
                "stats/approx_kl": 0.002 + abs(rng.normal(0, 0.001)),
                "stats/first_mb_clipfrac": 0.0,
                "stats/first_mb_ratio_dev": 2e-6 * rng.random(),
                "stats/rollout_vs_old_logp_diff": 1e-7 * rng.random(),
                "stats/rollout_vs_old_logp_diff_first_turn": 1e-7 * rng.random(),  # (multi-turn runs log it)
                "stats/eos_mask_err_frac": 0.0,
                "critic/grad_norm_0": 0.3 * np.exp(rng.normal(0, 0.3)),
                "stats/adv_abs_mean": 0.8 + rng.normal(0, 0.02),
                "stats/adv_std": 1.0,
                "stats/return_mean": p,
                "stats/return_std": float(np.sqrt(p * (1 - p))),
                "stats/value_mean": p - 0.05,
                "loss/policy": rng.normal(0, 0.01),
                "loss/value": 0.1 * np.exp(-t / 20) + 0.02 + abs(rng.normal(0, 0.003)),
                "critic/explained_var": min(0.6, -0.4 + 0.05 * t) + rng.normal(0, 0.03),
                "stats/grad_norm": 0.5 * np.exp(rng.normal(0, 0.3)),
                "perf/tokens_per_s": 3000.0,
            }
        )
    return rows


def edit(rows, start, **changes):
    """From `start` on, set metric k (our name with '/' written as '__') to f(t) or a constant."""
    for r in rows[start:]:
        for k, v in changes.items():
            r[k.replace("__", "/")] = v(r["step"]) if callable(v) else v
    return rows


def ids_and_steps(findings):
    return [(f.id, f.step) for f in findings]


@pytest.mark.parametrize(
    "variant",
    [
        {},
        {"seed": 1},
        {"seed": 2, "beta": 0.1, "kl_abs": 0.1, "resp_len": 20.0},  # KL-heavy but healthy: ratio ~2
        {"seed": 6, "beta": 0.1, "kl_abs": 0.5, "resp_len": 7.0},  # like the real default run at KL 0.5: ratio ~1
        {"n": 200, "seed": 3},
    ],
)
def test_healthy_runs_raise_nothing(variant):
    rows = healthy(**variant)
    assert run_diagnose(rows) == []
    d = LiveDiagnoser()
    for r in rows:
        d.update(r["step"], r)
    assert d.skipped() == {}  # every check ran on our full metric set


# rollout/reward_mean of a real GRPO run at the earlier defaults (reverse task, T 1, lr 1e-4, warm-up 20, seed 0):
# flat for ~25 steps, then a slow rise; reward std across samples ~0.22
REAL_GRPO_REWARD = """0.58 0.59 0.62 0.62 0.54 0.61 0.61 0.57 0.62 0.61 0.61 0.59 0.61 0.63 0.60 0.64 0.63 0.60 0.61
0.63 0.62 0.63 0.59 0.58 0.59 0.60 0.61 0.63 0.61 0.63 0.67 0.63 0.68 0.64 0.64 0.63 0.63 0.61 0.69 0.64 0.62 0.64
0.69 0.66 0.66 0.61 0.66 0.67 0.63 0.66 0.67 0.67 0.63 0.64 0.67 0.69 0.65 0.68 0.71 0.68 0.71 0.67 0.71 0.70 0.68"""


@pytest.mark.parametrize("stuck", [False, True])
def test_slow_start_during_lr_warmup_is_not_flat_but_a_stuck_run_is(stuck):
    reward = [float(x) for x in REAL_GRPO_REWARD.split()]
    reward = reward[:25] * 3 if stuck else reward  # control: the flat warm-up segment, repeated
    rows = healthy(n=len(reward))
    for r, p in zip(rows, reward):
        r["rollout/reward_mean"] = r["rollout/acc"] = p
        r["rollout/reward_std"] = 0.22
    found = ids_and_steps(run_diagnose(rows))
    assert found[:1] == ([("flat_reward", 0)] if stuck else []) and {f for f, _ in found} <= {"flat_reward"}


@pytest.mark.parametrize("spread", ["stats/return_std", "rollout/reward_std"])
def test_healthy_growth_of_kl_and_value_loss_is_not_a_failure(spread):
    rows = healthy()
    for r in rows:  # KL grows linearly to 0.6 nat/token; value loss tracks the returns' growing variance
        r["stats/kl"] = 0.01 * r["step"]
        r.pop("stats/return_std")
        r[spread] = 0.02 + 0.45 * r["step"] / N
        r["loss/value"] = 0.4 * r[spread] ** 2
    assert run_diagnose(rows) == []


def test_saturated_flat_reward_is_not_flagged():
    # the run sits at its ceiling: flat reward, low entropy and all-equal groups are expected there
    rows = edit(healthy(), 0, rollout__reward_mean=0.97, rollout__acc=0.97, rollout__zero_std_frac=0.8)
    rows = edit(rows, 30, stats__entropy=0.005)
    assert run_diagnose(rows) == []


CASES = {
    # id: (start step, edits from that step on)
    "flat_reward": (0, dict(rollout__reward_mean=lambda t: 0.3 + 0.01 * np.sin(t), rollout__acc=0.3)),
    "zero_variance_groups": (30, dict(rollout__zero_std_frac=0.8)),
    "reward_scale": (  # score x 0.01 with KL in the reward (beta 0.05): KL per sequence >> score std
        1,
        dict(rollout__reward_std=0.0045, rollout__reward_mean=lambda t: 0.003 + 1e-4 * t),
    ),
    "kl_blowup": (40, dict(stats__kl=3.0)),
    "entropy_collapse": (35, dict(stats__entropy=0.004)),
    "logprob_mismatch": (1, dict(stats__first_mb_ratio_dev=0.4, stats__first_mb_clipfrac=0.05)),  # stale old logp
    "high_truncation": (20, dict(rollout__truncated_frac=0.6)),
    "eos_mask": (0, dict(stats__eos_mask_err_frac=0.9)),  # pad == eos: EOS dropped from almost every mask
    "value_divergence": (25, dict(critic__explained_var=-3.0, loss__value=5.0)),
    "nan_inf": (33, dict(loss__policy=float("nan"))),
    "grad_spike": (45, dict(stats__grad_norm=lambda t: 20.0 if t == 45 else 0.5)),
    "entropy_blowup": (20, dict(stats__entropy=2.8)),  # towards uniform noise: > 2 x 1.0 + 0.5
    "reward_decline": (  # the reward falls from step 10 on (an advantage sign): dated to its window's start
        10,
        dict(rollout__reward_mean=lambda t: 0.45 - 0.02 * (t - 10), rollout__acc=0.3),  # (below 0: a penalty)
    ),
    "policy_frozen": (10, dict(stats__kl=0.0)),  # gradients, but the policy stays the reference (lr 0)
    "sampler_precision_gap": (  # a bf16 sampler: a small steady gap on every turn, no correction
        0,
        dict(stats__rollout_vs_old_logp_diff=3e-3, stats__rollout_vs_old_logp_diff_first_turn=3e-3),
    ),
    "template_drift": (5, dict(stats__rollout_vs_old_logp_diff=0.3)),  # the first turn's stays ~1e-7
}


@pytest.mark.parametrize("fid", sorted(CASES))
def test_each_failure_mode_is_named_with_its_start_step(fid):
    start, changes = CASES[fid]
    rows = edit(healthy(), start, **changes)
    if fid == "nan_inf":  # a single bad step, then healthy again
        rows[34:] = healthy()[34:]
    if fid == "reward_scale":  # realistic |k1| ~ 0.2 nat/token; no critic, so only the KL term can tell
        rows = [{k: v for k, v in r.items() if k not in ("loss/value", "critic/explained_var")} for r in rows]
        for r in rows:
            r["stats/token_reward_kl_abs"] = 0.0 if r["step"] == 0 else 0.05 * 0.2
            r["stats/return_mean"] = r["rollout/reward_mean"]
            r["stats/return_std"] = r["rollout/reward_std"]
    start = TH["baseline_n"] - 1 if fid == "sampler_precision_gap" else start  # judged once its start level is known
    assert ids_and_steps(run_diagnose(rows)) == [(fid, start)]


def test_look_alikes_are_told_apart():
    gap = dict(stats__rollout_vs_old_logp_diff=3e-3, stats__rollout_vs_old_logp_diff_first_turn=3e-3)
    corrected = edit(healthy(), 0, **gap, rollout_corr__rollout_is_mean=1.0)  # TIS on: the gap is handled
    assert run_diagnose(corrected) == []
    stale_anchor = edit(healthy(), 0, **gap, stats__first_mb_ratio_dev=0.4)  # ratio != 1 before any step: a bug
    assert ids_and_steps(run_diagnose(stale_anchor)) == [("logprob_mismatch", 0)]
    growing = {k: (lambda t: 6e-3 * t) for k in gap}  # a sampler that misses its weight syncs: the gap grows
    assert [f.id for f in run_diagnose(edit(healthy(), 0, **growing))] == ["logprob_mismatch"]
    frozen_critic_warmup = edit(healthy(), 10, stats__kl=0.0, stats__grad_norm=0.0)  # no actor gradient: not frozen
    assert run_diagnose(frozen_critic_warmup) == []


def test_zero_variance_names_the_reward_level_and_a_flat_reward_it_explains_is_not_reported():
    rows = edit(healthy(), 0, rollout__zero_std_frac=1.0, rollout__reward_mean=0.0, rollout__acc=0.0)
    found = run_diagnose(rows)
    assert [f.id for f in found] == ["zero_variance_groups"]  # flat_reward too, but zero variance says why
    assert "mean reward 0" in found[0].evidence


def test_a_critic_that_cannot_move_is_value_divergence():
    rows = edit(healthy(), 12, critic__grad_norm_0=0.0)  # target = advantages + live values: zero gradient
    assert ids_and_steps(run_diagnose(rows)) == [("value_divergence", 12)]


def test_temperature_bug_shows_as_rollout_vs_old_mismatch():
    gap = {"stats__rollout_vs_old_logp_diff": 0.15, "stats__rollout_vs_old_logp_diff_first_turn": 0.15}  # every turn
    assert ids_and_steps(run_diagnose(edit(healthy(), 0, **gap))) == [("logprob_mismatch", 0)]
    single_turn = [{k: v for k, v in r.items() if not k.endswith("_first_turn")} for r in healthy()]
    rows = edit(single_turn, 0, stats__rollout_vs_old_logp_diff=0.15)
    assert ids_and_steps(run_diagnose(rows)) == [("logprob_mismatch", 0)]


def test_a_gap_after_the_first_turn_only_is_template_drift_not_logprob_mismatch():
    rows = edit(healthy(), 5, stats__rollout_vs_old_logp_diff=0.3)  # the first turn's stays ~1e-7
    assert ids_and_steps(run_diagnose(rows)) == [("template_drift", 5)]
    rows = edit(healthy(), 5, stats__rollout_vs_old_logp_diff=0.3, stats__rollout_vs_old_logp_diff_first_turn=0.1)
    assert ids_and_steps(run_diagnose(rows)) == [("logprob_mismatch", 5)]  # a third of it on turn 1: every turn


def test_dr_grpo_tiny_advantages_and_huge_returns_are_reward_scale():
    rows = edit(healthy(), 10, stats__adv_abs_mean=0.004)
    assert ids_and_steps(run_diagnose(rows)) == [("reward_scale", 10)]
    rows = edit(healthy(), 12, stats__return_mean=150.0, stats__return_std=80.0)
    assert ids_and_steps(run_diagnose(rows)) == [("reward_scale", 12)]


def test_tiny_score_under_critic_noise_is_reward_scale():
    rows = edit(healthy(), 0, rollout__reward_std=0.0045, stats__token_reward_kl_abs=0.0)  # no KL term at all
    assert ids_and_steps(run_diagnose(rows)) == [("reward_scale", 0)]  # sqrt(2 * value loss) ~ 0.5 >> 0.0045


def test_grpo_without_critic_or_kl_in_reward_is_healthy_and_reports_what_it_skipped():
    drop = ("loss/value", "critic/explained_var", "critic/grad_norm_0", "stats/token_reward_kl_abs")
    drop += ("stats/return_mean", "stats/return_std")
    rows = [{k: v for k, v in r.items() if k not in drop} for r in healthy(seed=4)]
    d = LiveDiagnoser()
    assert [f for r in rows for f in d.update(r["step"], r)] == []
    assert set(d.skipped()) == {"value_divergence"}  # reward_scale still runs on the advantages


def test_numpy_scalars_are_numbers():
    rows = edit(healthy(), 40, stats__kl=np.float32(3.0))
    assert ids_and_steps(run_diagnose(rows)) == [("kl_blowup", 40)]


def test_nan_in_an_unused_column_is_still_flagged():
    rows = healthy()
    rows[7]["time/train"] = float("inf")
    assert ids_and_steps(run_diagnose(rows)) == [("nan_inf", 7)]


def test_a_sudden_kl_jump_below_the_absolute_limit_is_a_kl_blowup():
    rows = edit(healthy(), 30, stats__kl=0.5)  # 0.01 -> 0.5 nat/token: 50x the previous median
    assert ids_and_steps(run_diagnose(rows)) == [("kl_blowup", 30)]


def test_persistence_a_single_bad_step_is_not_a_kl_blowup():
    rows = edit(healthy(), 40, stats__kl=lambda t: 3.0 if t == 40 else 0.02)
    assert run_diagnose(rows) == []


def test_live_reports_each_id_once_until_it_clears_and_agrees_with_diagnose():
    rows = edit(healthy(), 40, stats__kl=3.0)  # stays high: reported once
    rows = edit(rows, 20, stats__grad_norm=lambda t: 20.0 if t in (20, 45) else 0.5)  # two separate spikes
    d, live = LiveDiagnoser(), []
    for r in rows:
        new = d.update(r["step"], r)
        assert all(f.step <= r["step"] for f in new)
        live += new
    assert ids_and_steps(live) == [("grad_spike", 20), ("kl_blowup", 40), ("grad_spike", 45)]
    assert live == run_diagnose(rows)
    assert max(len(h) for h in d.hist.values()) <= diagnose.HISTORY  # bounded memory per metric: the longest window


def test_flat_reward_finding_arrives_when_the_window_fills_dated_to_its_start():
    rows = edit(healthy(), 0, rollout__reward_mean=0.3, rollout__acc=0.3)
    d = LiveDiagnoser()
    arrivals = [(r["step"], f.id, f.step) for r in rows for f in d.update(r["step"], r)]
    assert arrivals == [(TH["flat_reward.window"] - 1, "flat_reward", 0)]


def test_skipped_checks_are_reported_with_the_reason():
    keep = ("step", "rollout/reward_mean", "stats/kl")
    rows = [{k: v for k, v in r.items() if k in keep} for r in healthy()]
    d = LiveDiagnoser()
    for r in rows:
        d.update(r["step"], r)
    skipped = d.skipped()
    assert "logprob_mismatch" in skipped and "stats/first_mb_clipfrac" in skipped["logprob_mismatch"]
    assert set(skipped) == {c for c, _, _ in diagnose.CHECKS} - {
        "nan_inf",
        "flat_reward",
        "reward_decline",
        "kl_blowup",
    }
    few = LiveDiagnoser()
    for r in rows[:10]:
        few.update(r["step"], r)
    assert "too few steps" in few.skipped()["flat_reward"]


def test_threshold_table_documents_every_row_and_every_check():
    names = [t.name for t in diagnose_checks.THRESHOLDS]
    assert len(names) == len(set(names)) and all(t.why.strip() for t in diagnose_checks.THRESHOLDS)
    for cid, fn, _ in diagnose.CHECKS:  # the docstring is the advice: "<cause> Try: <fix>"
        cause, fix = " ".join(fn.__doc__.split()).split(" Try: ")
        assert cause and fix, cid
    for name in names:  # every '<id>.x' row belongs to a real check
        assert "." not in name or name.split(".")[0] in {c for c, _, _ in diagnose.CHECKS}, name


# ----------------------------------------------------------------------------------------------
# Other frameworks' names

VERL = {
    "rollout/reward_mean": "critic/score/mean",
    "rollout/response_len": "response_length/mean",
    "rollout/truncated_frac": "response_length/clip_ratio",
    "stats/kl": "actor/kl_loss",
    "stats/entropy": "actor/entropy",
    "stats/clipfrac": "actor/pg_clipfrac",
    "stats/approx_kl": "actor/ppo_kl",
    "stats/grad_norm": "actor/grad_norm",
    "loss/policy": "actor/pg_loss",
    "loss/value": "critic/vf_loss",
    "critic/explained_var": "critic/vf_explained_var",
    "stats/return_mean": "critic/returns/mean",
}
TRL = {
    "rollout/reward_mean": "reward",
    "rollout/reward_std": "reward_std",
    "rollout/zero_std_frac": "frac_reward_zero_std",
    "stats/kl": "kl",
    "stats/entropy": "entropy",
    "stats/clipfrac": "clip_ratio/region_mean",
    "rollout/truncated_frac": "completions/clipped_ratio",
    "rollout/response_len": "completions/mean_length",
    "stats/grad_norm": "grad_norm",
    "loss/policy": "loss",
}


def rename(rows, names):
    return [{names.get(k, k): v for k, v in r.items() if k in names or k == "step"} for r in rows]


EXTRA = {  # their name -> ours, beyond the two tables above
    "critic/rewards/mean": "rollout/reward_kl_mean",
    "critic/score/max": "rollout/score_max",
    "critic/advantages/mean": "stats/adv_mean",
    "critic/advantages/max": "stats/adv_max",
    "critic/advantages/min": "stats/adv_min",
    "actor/reward_kl_penalty": "stats/kl",
    "training/rollout_probs_diff_mean": "stats/rollout_vs_old_prob_diff",
    "training/rollout_probs_diff_max": "stats/rollout_vs_old_prob_diff_max",
    "sampling/sampling_logp_difference/mean": "stats/rollout_vs_old_logp_diff",
}


def test_name_map_covers_the_documented_verl_and_trl_names():
    pairs = [(theirs, ours) for names in (VERL, TRL) for ours, theirs in names.items()] + list(EXTRA.items())
    for theirs, ours in pairs:
        assert diagnose_logs.to_ours({theirs: 1.0}) == {ours: 1.0}, theirs
    mapped = diagnose_logs.to_ours({"stats/kl": 0.1, "kl": 9.0, "actor/kl_loss": 8.0})
    assert mapped == {"stats/kl": 0.1}  # our own name wins over theirs


def run_cli(*args):
    r = subprocess.run([sys.executable, str(ROOT / "diagnose.py"), *map(str, args)], capture_output=True, text=True)
    return r.returncode, r.stdout, r.stderr


def test_live_diagnoser_takes_trl_names_directly():
    rows = rename(edit(healthy(), 30, stats__entropy=0.004), TRL)
    assert ids_and_steps(run_diagnose(rows)) == [("entropy_collapse", 30)]


def test_help_lists_the_options():
    rc, out, err = run_cli("--help")
    assert rc == 0 and "--reward-max" in out and not err
    assert "Config(path:" not in out  # diagnose.Config has no docstring: no dataclass signature as its description


def test_verl_log_is_mapped_and_diagnosed(tmp_path):
    rows = rename(edit(healthy(), 40, stats__kl=3.0), VERL)
    for r in rows:
        r["training/rollout_probs_diff_mean"] = 0.003  # bf16-like, healthy
        r["timing_s/gen"] = 1.5  # an unused column
    rows[50]["training/rollout_probs_diff_mean"] = rows[51]["training/rollout_probs_diff_mean"] = 0.05
    lines = [json.dumps({"step": r.pop("step"), "data": r}) for r in rows]  # veRL's file logger layout
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    findings = run_diagnose(diagnose_logs.load_metrics(tmp_path))
    assert ids_and_steps(findings) == [("kl_blowup", 40), ("logprob_mismatch", 50)]
    rc, out, err = run_cli(tmp_path)
    assert rc == 1 and "kl_blowup @ step 40" in out and "logprob_mismatch @ step 50" in out and not err
    assert "timing_s/gen" in out  # listed as not used


def test_verl_log_without_prob_diff_skips_the_mismatch_check_and_says_why(tmp_path):
    rows = rename(healthy(), VERL)
    (tmp_path / "m.jsonl").write_text("\n".join(json.dumps({"step": r.pop("step"), "data": r}) for r in rows))
    rc, out, _ = run_cli(tmp_path / "m.jsonl")
    assert rc == 0 and "no failure mode flagged" in out
    line = next(x for x in out.splitlines() if x.startswith("check skipped: logprob_mismatch"))
    assert "stats/rollout_vs_old_prob_diff" in line and "clip fraction" in line


def test_trl_trainer_state_is_mapped_and_diagnosed(tmp_path):
    rows = rename(edit(healthy(), 12, rollout__zero_std_frac=0.9, rollout__reward_mean=0.1), TRL)
    history = []
    for r in rows:
        history.append({**r, "learning_rate": 1e-6, "epoch": r["step"] / 100})
        if r["step"] % 20 == 0:
            history.append({"eval_loss": 0.5, "step": r["step"]})  # eval entries: no known metric, skipped
    history.append({"train_runtime": 100.0, "train_loss": 0.01, "step": rows[-1]["step"]})
    (tmp_path / "trainer_state.json").write_text(json.dumps({"global_step": 59, "log_history": history}, indent=2))
    rc, out, err = run_cli(tmp_path / "trainer_state.json")
    assert rc == 1 and "zero_variance_groups @ step 12" in out and "flat_reward" in out, out + err


def test_csv_file(tmp_path):
    rows = edit(healthy(), 20, rollout__truncated_frac=0.6)
    cols = list(rows[0])
    text = ",".join(cols) + "\n" + "\n".join(",".join(str(r[c]) for c in cols) for r in rows) + "\n"
    (tmp_path / "m.csv").write_text(text)
    assert ids_and_steps(run_diagnose(diagnose_logs.load_metrics(tmp_path / "m.csv"))) == [("high_truncation", 20)]


def test_cli_healthy_run_dir_exits_0(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in healthy()) + "\n")
    rc, out, err = run_cli(tmp_path)
    assert rc == 0 and "no failure mode flagged" in out and "checks run: nan_inf" in out and not err


# ----------------------------------------------------------------------------------------------
# Bad inputs: exit code 2, a message naming the line and what was expected, never a traceback

GOOD = json.dumps({"step": 0, "rollout/reward_mean": 0.5})
BAD = {
    "empty.jsonl": ("", "line 1", "empty"),
    "blank.jsonl": ("\n  \n", "line 1", "empty"),
    "truncated.jsonl": (GOOD + "\n" + GOOD + '\n{"step": 2, "rollout/rew', "line 3", "truncated"),
    "unknown.jsonl": ('{"step": 0, "foo": 1}\n{"step": 1, "bar": 2}\n', "line 1", "known metric"),
    "nonnumeric.jsonl": (GOOD + '\n{"step": 1, "stats/kl": "high"}\n', "line 2", "not a number"),
    "listvalue.jsonl": (GOOD + '\n{"step": 1, "reward": [1, 2]}\n', "line 2", "not a number"),
    "notobject.jsonl": (GOOD + "\n[1, 2]\n", "line 2", "expected an object"),
    "badstep.jsonl": (GOOD + '\n{"step": "two", "stats/kl": 0.1}\n', "line 2", "'step'"),
    "short.csv": ("step,stats/kl\n0,0.1\n1,0.2\n2\n", "line 4", "header"),
    "nonnumeric.csv": ("step,stats/kl\n0,0.1\n1,abc\n", "line 3", "not a number"),
    "unknown.csv": ("step,foo\n0,1\n", "line 2", "known metric"),
    "headeronly.csv": ("step,stats/kl\n", "line 2", "no row"),
    "truncated.json": ('{"log_history": [{"step": 1, "reward": 0.5}, {"st', "line 1", "not valid JSON"),
    "nohistory.json": ('{"global_step": 3}', "line 1", "log_history"),
    "nonnumeric.json": ('{"log_history": [{"step": 1, "reward": "x"}]}', "log_history[0]", "not a number"),
    "infstep.jsonl": (GOOD + '\n{"step": Infinity, "stats/kl": 0.1}\n', "line 2", "'step' = inf is not a whole"),
    "nanstep.jsonl": (GOOD + '\n{"step": NaN, "stats/kl": 0.1}\n', "line 2", "'step' = nan is not a whole"),
    "fracstep.jsonl": (GOOD + '\n{"step": 0.5, "stats/kl": 0.1}\n', "line 2", "'step' = 0.5 is not a whole"),
    "backwards.jsonl": ('{"step": 5, "stats/kl": 0.1}\n' + GOOD + "\n", "line 2", "step 0 after step 5: two runs"),
    "deep.jsonl": (GOOD + "\n" + "[" * 100_000 + "]" * 100_000 + "\n", "line 2", "nested too deep"),
    "deep.json": ('{"log_history": ' + "[" * 100_000 + "]" * 100_000 + "}", "line 1", "nested too deep"),
    "infstep.csv": ("step,stats/kl\n0,0.1\ninf,0.2\n", "line 3", "'step' = 'inf' is not a whole"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_input_exits_2_naming_the_line(tmp_path, name, capsys):
    text, where, what = BAD[name]
    (tmp_path / name).write_text(text)
    assert diagnose.main([str(tmp_path / name)]) == 2  # the CLI entry point, in-process (fast)
    err = capsys.readouterr().err
    assert where in err and what in err, err


@pytest.mark.parametrize("name", ["truncated.jsonl", "short.csv", "nonnumeric.json", "infstep.jsonl", "deep.jsonl"])
def test_bad_input_through_a_subprocess_has_no_traceback(tmp_path, name):
    text, where, what = BAD[name]
    (tmp_path / name).write_text(text)
    rc, out, err = run_cli(tmp_path / name)
    assert rc == 2 and where in err and what in err and "Traceback" not in err + out, err


def test_missing_path_empty_dir_and_bad_flags_exit_2(tmp_path, capsys):
    for args in ([tmp_path / "nope.jsonl"], [tmp_path], [], ["--reward-max", "0", tmp_path]):
        assert diagnose.main([str(a) for a in args]) == 2, args
        assert "bad input" in capsys.readouterr().err, args


def test_a_large_log_is_streamed_in_bounded_memory(tmp_path, capsys):
    """24 MB of metrics (2000 steps x 400 columns) are diagnosed keeping a few columns per step: the peak of
    Python allocations stays far below the file's size (reading it whole kept the text and every row)."""
    import tracemalloc

    extra = {f"actor/unused_{k}": 0.25 for k in range(400)}
    with open(tmp_path / "big.jsonl", "w") as f:
        for r in healthy(n=2000):
            f.write(json.dumps({**r, **extra}) + "\n")
    size = (tmp_path / "big.jsonl").stat().st_size
    tracemalloc.start()
    rc = diagnose.main([str(tmp_path / "big.jsonl")])
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert rc in (0, 1) and "2000 steps (0..1999)" in capsys.readouterr().out  # read whole (a slow rise: 1)
    assert size > 20e6 and peak < size / 4, f"peak {peak / 1e6:.1f} MB for a {size / 1e6:.1f} MB file"


def test_nan_written_as_text_is_read_and_flagged(tmp_path):
    rows = healthy(n=10)
    text = "\n".join(json.dumps(r) for r in rows).replace('"loss/policy": ', '"loss/policy": "nan", "x": ', 1)
    (tmp_path / "m.jsonl").write_text(text)
    assert ids_and_steps(run_diagnose(diagnose_logs.load_metrics(tmp_path / "m.jsonl"))) == [("nan_inf", 0)]


def test_a_restored_diagnoser_goes_on_as_the_uninterrupted_one():
    # a resumed run keeps the live diagnosis' baselines, windows and streaks (its checkpoint holds state())
    rows = edit(edit(healthy(), 30, stats__entropy=0.05), 44, stats__grad_norm=lambda t: 20.0 if t == 44 else 0.5)
    whole = LiveDiagnoser()
    expected = [f for r in rows for f in whole.update(r["step"], r)]
    first, later = LiveDiagnoser(), LiveDiagnoser()
    before = [f for r in rows[:31] for f in first.update(r["step"], r)]  # stopped right after the collapse began
    later.load_state(json.loads(json.dumps(first.state())))  # through a file, as the checkpoint stores it
    after = [f for r in rows[31:] for f in later.update(r["step"], r)]
    assert ids_and_steps(expected) == [("entropy_collapse", 30), ("grad_spike", 44)]  # not vacuous
    assert before + after == expected
    fresh = LiveDiagnoser()  # without the state: no baseline, the collapse goes unseen
    assert "entropy_collapse" not in [f.id for r in rows[31:] for f in fresh.update(r["step"], r)]


def test_a_restored_diagnoser_keeps_flat_rewards_longer_window():
    # flat_reward's 60-step window is longer than the other checks' 40: a resume at step 50 must keep all of it
    rows = edit(healthy(), 0, rollout__reward_mean=0.3, rollout__acc=0.3)
    whole = LiveDiagnoser()
    expected = [f for r in rows for f in whole.update(r["step"], r)]
    first, later = LiveDiagnoser(), LiveDiagnoser()
    before = [f for r in rows[:50] for f in first.update(r["step"], r)]
    later.load_state(json.loads(json.dumps(first.state())))
    after = [f for r in rows[50:] for f in later.update(r["step"], r)]
    assert ids_and_steps(expected) == [("flat_reward", 0)] and before + after == expected
    assert later.state() == whole.state() and later.skipped() == whole.skipped()


def test_the_split_files_mains_list_the_checks_and_read_a_file(tmp_path, capsys):
    """diagnose_checks.py lists every check with its advice; diagnose_logs.py prints the rows it reads, names mapped."""
    diagnose_checks.main()
    out = capsys.readouterr().out
    assert all(f"{cid} (reads" in out for cid, _, _ in diagnose.CHECKS) and out.count("  try: ") == len(diagnose.CHECKS)
    rows = [{"step": s, "critic/score/mean": 0.5, "actor/kl_loss": 0.1 * s} for s in range(3)]
    (tmp_path / "m.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = diagnose_logs.main([str(tmp_path / "m.jsonl")])
    assert [r["stats/kl"] for r in got] == [
        0.0,
        0.1,
        0.2,
    ] and "critic/score/mean -> rollout/reward_mean" in capsys.readouterr().out
