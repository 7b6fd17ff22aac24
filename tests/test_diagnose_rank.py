"""diagnose.rank (causes before their symptoms, diagnose.py's detail 4) on hand-built findings, the CLI's ranked
output on synthetic metrics, the sample advice of the checks, and the benchmark's cause table and top-k scoring.
No training: each test takes well under a second (the benchmark module imports torch once)."""

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import diagnose  # noqa: E402
import diagnose_checks  # noqa: E402
from diagnose import RANK_LAG, Finding, rank, why_first  # noqa: E402

IDS = [cid for cid, _, _ in diagnose.CHECKS]


def F(cid, step):
    return Finding(cid, step, "evidence", "cause", "fix")


def ranked(*findings):
    return [(f.id, f.step) for f in rank(list(findings))]


def test_a_cause_dated_after_its_symptom_within_the_lag_ranks_first():
    # entropy_collapse explains zero_variance_groups (near-greedy samples are alike), not the other way round
    assert ranked(F("zero_variance_groups", 5), F("entropy_collapse", 5 + RANK_LAG)) == [
        ("entropy_collapse", 5 + RANK_LAG),
        ("zero_variance_groups", 5),
    ]


def test_beyond_the_lag_the_earlier_onset_wins():
    assert ranked(F("zero_variance_groups", 5), F("entropy_collapse", 6 + RANK_LAG)) == [
        ("zero_variance_groups", 5),
        ("entropy_collapse", 6 + RANK_LAG),
    ]


def test_findings_that_explain_each_other_go_by_onset():
    # a falling reward and a KL that runs away explain each other: the one that began first is the cause
    assert ranked(F("kl_blowup", 18), F("reward_decline", 3))[0] == ("reward_decline", 3)  # advantage sign flipped
    assert ranked(F("kl_blowup", 10), F("reward_decline", 12))[0] == ("kl_blowup", 10)


def test_unrelated_findings_go_by_onset_and_ties_by_check_order():
    assert ranked(F("policy_frozen", 9), F("sampler_precision_gap", 4)) == [
        ("sampler_precision_gap", 4),
        ("policy_frozen", 9),
    ]
    same = ranked(F("sampler_precision_gap", 4), F("policy_frozen", 4))
    assert [cid for cid, _ in same] == [c for c in IDS if c in ("sampler_precision_gap", "policy_frozen")]


def test_the_issue_examples_name_the_cause_first():
    # an advantage sign flip, in the order the live diagnosis reported it: kl_blowup, high_truncation,
    # reward_decline (dated back to where the fall began), entropy_blowup, zero_variance_groups
    sign_flip = [F("kl_blowup", 18), F("high_truncation", 15), F("reward_decline", 3), F("zero_variance_groups", 30)]
    out = rank(sign_flip)
    assert [f.id for f in out] == ["reward_decline", "high_truncation", "kl_blowup", "zero_variance_groups"]
    assert why_first(out[0], out) == "explains high_truncation, kl_blowup, zero_variance_groups; earliest, step 3"
    # an entropy bonus of 1.0 (seed 6, sort-grpo): the KL crosses its threshold first, the reward falls from the start
    bonus = [F("kl_blowup", 7), F("entropy_blowup", 13), F("high_truncation", 15), F("reward_decline", 3)]
    assert ranked(*bonus)[0] == ("entropy_blowup", 13)
    # the KL penalty added with the wrong sign: the reward falls first, but reward_scale explains that fall
    kl_sign = [F("high_truncation", 12), F("reward_decline", 10), F("reward_scale", 15), F("kl_blowup", 22)]
    assert rank(kl_sign)[0].id == "reward_scale"
    # a bug planted in the masks: everything after it is its consequence
    masks = [F("logprob_mismatch", 1), F("reward_decline", 2), F("eos_mask", 1), F("kl_blowup", 20)]
    assert ranked(*masks)[0] == ("eos_mask", 1)


def test_a_cycle_starts_with_its_earliest_finding():
    # nan_inf explains kl_blowup, which (earlier) explains grad_spike, which (within the lag) explains nan_inf
    assert ranked(F("grad_spike", 20), F("kl_blowup", 10), F("nan_inf", 5)) == [
        ("nan_inf", 5),
        ("kl_blowup", 10),
        ("grad_spike", 20),
    ]


def test_each_id_once_dated_to_its_first_report_and_the_why():
    out = rank([F("high_truncation", 3), F("grad_spike", 7), F("high_truncation", 30)])
    assert [(f.id, f.step) for f in out] == [("high_truncation", 3), ("grad_spike", 7)]
    assert why_first(out[0], out) == "earliest, step 3"
    assert rank([]) == []


def test_explains_names_real_checks_and_keeps_what_explains_a_flat_reward():
    assert list(diagnose_checks.EXPLAINS) == IDS
    assert all(set(effects) <= set(IDS) - {cid} for cid, effects in diagnose_checks.EXPLAINS.items())
    assert diagnose_checks.EXPLAINS["flat_reward"] == ()  # the last symptom: it explains nothing
    assert {"kl_blowup", "policy_frozen", "zero_variance_groups"} <= set(diagnose_checks.EXPLAINS_FLAT)
    assert not {"nan_inf", "grad_spike", "sampler_precision_gap"} & set(diagnose_checks.EXPLAINS_FLAT)


@pytest.mark.parametrize("fall", [0.03, 0.01])
def test_reward_decline_is_dated_to_where_the_fall_began(fall):
    """A reward that rises to step 30, then falls: seen only once below its start (after a slow fall, 50 steps
    later), dated to step 30."""
    rng = np.random.default_rng(0)
    rows = [
        {
            "step": t,
            "rollout/reward_mean": (0.2 + 0.4 * t / 30 if t <= 30 else 0.6 - fall * (t - 30)) + rng.normal(0, 0.01),
        }
        for t in range(100)
    ]
    declines = [f for f in diagnose.diagnose(rows) if f.id == "reward_decline"]
    assert [f.step for f in declines] == [30]


def rows_truncation_then_entropy(n=40):
    """A run whose responses stop ending with EOS at step 10; its entropy blows up at step 25 (the cause)."""
    return [
        {"step": t, "rollout/truncated_frac": 0.5 if t >= 10 else 0.02, "stats/entropy": 3.0 if t >= 25 else 1.0}
        for t in range(n)
    ]


def test_cli_prints_the_findings_ranked_and_what_to_check_first(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows_truncation_then_entropy()) + "\n")
    assert [f.id for f in diagnose.diagnose(rows_truncation_then_entropy())] == ["high_truncation", "entropy_blowup"]
    assert diagnose.main([str(tmp_path)]) == 1
    lines = capsys.readouterr().out.splitlines()
    found = [line for line in lines if line.startswith("FOUND")]
    assert [line.split(" @ ")[0] for line in found] == ["FOUND 1. entropy_blowup", "FOUND 2. high_truncation"]
    assert "check first: entropy_blowup (explains high_truncation)" in lines
    assert lines[-1] == "2 failure mode(s) flagged"


def test_sample_advice_names_the_commands_and_truncation_blames_the_setup_first():
    for cid, check, _ in diagnose.CHECKS:
        fix = " ".join(check.__doc__.split()).split(" Try: ")[1]
        if "samples" in fix:
            assert "--dump-batch N" in fix and "python repro.py OUT_DIR/batch-N.pt" in fix, cid
    cause = " ".join(diagnose_checks._high_truncation.__doc__.split()).split(" Try: ")[0]
    assert cause.index("max_new_tokens") < cause.index("not instruction-tuned") < cause.index("wrong EOS id")


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("diagnose_bench", ROOT / "bench" / "diagnose_bench.py")
    db = sys.modules["diagnose_bench"] = importlib.util.module_from_spec(spec)  # (its dataclass looks itself up)
    spec.loader.exec_module(db)
    return db


def test_bench_causes_name_real_cases_and_checks(bench):
    assert set(bench.CAUSES) == set(bench.CASES)
    for case, ids in bench.CAUSES.items():
        assert bench.CASES[case].label in ids and set(ids) <= set(IDS), case
    assert bench.CAUSES["kl_sign"] == ("kl_blowup", "reward_scale")


def test_bench_symptoms_are_explained_by_their_cases_cause(bench):
    """The two tables agree: each symptom the bench declared for a case is explained by one of the case's causes,
    but for the one-way choice EXPLAINS documents (a policy that unlearns seldom blows its entropy up)."""
    unexplained = {
        (case, s)
        for case, symptoms in bench.SYMPTOMS.items()
        for s in symptoms
        if s not in bench.CAUSES[case] and not any(s in diagnose_checks.EXPLAINS[c] for c in bench.CAUSES[case])
    }
    assert unexplained == {("adv_sign", "entropy_blowup")}


def test_bench_top_k_scores_both_orders_on_labelled_runs_only(bench):
    results = [  # (case, config, seed, {id: (dated step, reported step)}), in the order the ids were reported
        ("adv_sign", "sort-grpo", 6, {"kl_blowup": (18, 19), "high_truncation": (15, 17), "reward_decline": (3, 22)}),
        ("adv_sign", "reverse-gae", 6, {"reward_decline": (2, 22)}),
        ("kl_sign", "sort-grpo", 6, {"high_truncation": (12, 14), "kl_blowup": (22, 23)}),  # ranked 2nd either way
        ("lr_zero", "sort-grpo", 6, {"reward_decline": (4, 24)}),  # the cause was missed: no order finds it
        ("clean", "sort-grpo", 6, {"zero_variance_groups": (4, 6)}),  # not scored here
    ]
    scores = bench.top_k(results)
    assert list(scores) == ["adv_sign", "kl_sign", "lr_zero", "all"]
    assert scores["adv_sign"] == {"runs": 2, "ranked": {1: 2, 2: 2}, "reported": {1: 1, 2: 1}}
    assert scores["kl_sign"] == {"runs": 1, "ranked": {1: 0, 2: 1}, "reported": {1: 0, 2: 1}}
    assert scores["all"] == {"runs": 4, "ranked": {1: 2, 2: 3}, "reported": {1: 1, 2: 2}}
    table = bench.top_k_report(scores)
    assert "| adv_sign | reward_decline | 2 | 2/2 | 1/2 | 2/2 | 1/2 |" in table
    assert "| kl_sign | kl_blowup or reward_scale | 1 | 0/1 | 0/1 | 1/1 | 1/1 |" in table
    assert "| all | (all labelled runs) | 4 | 2/4 | 1/4 | 3/4 | 2/4 |" in table
    assert bench.orders(results[0][3]) == {
        "ranked": ["reward_decline", "high_truncation", "kl_blowup"],
        "reported": ["kl_blowup", "high_truncation", "reward_decline"],
    }


def test_bench_replaces_an_unfinished_run_in_its_folder(bench, tmp_path, monkeypatch):
    calls = []

    def fake_run(cmd, **kw):
        calls.append(cmd)
        return type("Done", (), {"returncode": 0, "stderr": ""})()

    monkeypatch.setattr(bench.subprocess, "run", fake_run)
    bench.train_run(tmp_path / "new", 6, 3, {"task": "reverse"})  # a fresh folder: nothing to replace
    (tmp_path / "crashed").mkdir()
    (tmp_path / "crashed" / "metrics.jsonl").write_text("{}\n")  # a run that never finished
    bench.train_run(tmp_path / "crashed", 6, 3, {"task": "reverse"})
    assert "--overwrite" not in calls[0] and calls[1][-1] == "--overwrite"
    saved = json.loads((tmp_path / "crashed" / "bench_flags.json").read_text())
    assert "--overwrite" not in saved  # the flags a finished run is matched on
    (tmp_path / "crashed" / "result.json").write_text("{}")
    bench.train_run(tmp_path / "crashed", 6, 3, {"task": "reverse"})  # finished with these flags: reused
    assert len(calls) == 2
