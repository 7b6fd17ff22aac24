"""Every file's `python FILE.py` runs (the files whose main() other tests do not run already), at tiny flags.

trainer, async_loop, attention_credit, diagnose and scheduler run their main() in their own test files; data.py
and rewards.py in test_user_data.py's guide journeys. The commands that read a run, start processes or time
themselves run in a subprocess, as a user would; the self-contained demos call main() in this process (a fresh
interpreter costs ~9 s of imports here, for nothing the test checks) and read what it printed.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import critics
import env_client
import env_service
import envs
import evaluation
import logits
import offpolicy
import rollout
import sandbox
import tasks
import warm_start

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def run(*args: str, timeout: float = 300) -> str:
    """The stdout of `python ARGS` from the repository root; a failure shows its output."""
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc.stdout


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    """A random-init tiny model folder (no SFT): enough for commands that only need a model to run."""
    path = tmp_path_factory.mktemp("tiny")
    tok = tasks.make_tokenizer()
    torch.manual_seed(0)
    tasks.make_tiny_model(tok).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def main_output(capsys, module, *argv) -> str:
    """What `python MODULE.py ARGV` prints, with main() called in this process."""
    capsys.readouterr()
    if argv:
        module.main(list(argv))
    else:
        module.main()
    return capsys.readouterr().out


def test_rollout_main_samples_and_reports_the_logprob_gap(capsys):
    out = main_output(capsys, rollout)
    assert "tok/s" in out and "max |rollout - recomputed logp|" in out


def test_logits_main_shows_the_chunked_head_equal_to_whole_logits(capsys):
    out = main_output(capsys, logits)
    gaps = [float(line.split("whole| ")[1].split(",")[0]) for line in out.splitlines() if "whole|" in line]
    assert len(gaps) == 2 and max(gaps) < 1e-5, out  # logprobs and entropies, fp32 rounding apart


def test_tasks_main_prints_samples_and_the_model(capsys):
    out = main_output(capsys, tasks, "--task", "add")
    assert out.count("add      prompt") == 3 and "0.53M parameters" in out
    out = main_output(capsys, tasks, "--task", "countdown")  # the solver's demonstration, not the scoring key
    assert out.count("countdown prompt") == 3 and out.count(" => ") == 3


def test_envs_main_plays_each_environment_to_its_end(capsys):
    out = main_output(capsys, envs)
    assert "--- calc" in out and "--- guess" in out and "--- shell" in out and "reward -0.1" in out
    assert out.count("'success': True") == len(envs.ENVS)


def test_env_service_main_plays_each_environment_through_a_server(capsys):
    out = main_output(capsys, env_service, "--port", "0")
    assert all(f"--- {name} at http://127.0.0.1:" in out for name in envs.ENVS), out
    assert out.count("'success': True") == len(envs.ENVS) and "'sessions': 0" in out


def test_env_client_main_plays_each_environment_through_remote_envs(capsys):
    out = main_output(capsys, env_client)
    assert all(f"--- {name} at http://127.0.0.1:" in out for name in envs.ENVS), out
    assert out.count("'success': True") == len(envs.ENVS) and "'sessions': 0" in out


def test_sandbox_main_contains_each_hostile_command(capsys):
    lines = main_output(capsys, sandbox).splitlines()
    assert len(lines) == 9 and "'hello\\n" in lines[0] and "No such file" in lines[1], lines
    assert "Read-only" in lines[2] and "timed_out True" in lines[4] and "capped True" in lines[5], lines
    assert all("No space left on device" in line for line in lines[7:]), lines  # the workspace's bytes, its inodes


def test_warm_start_main_loads_the_cached_warm_start(sft_path, capsys):
    out = main_output(capsys, warm_start, "--task", "reverse")  # the conftest fixture built it: this run loads it
    assert f"SFT warm start: {sft_path}" in out and '"val_acc"' in out.replace("'", '"')


def test_offpolicy_main_shows_each_correction(capsys):
    out = main_output(capsys, offpolicy)
    assert "tis        weights" in out and "decoupled  weights" in out


def test_evaluation_main_reports_greedy_mean_at_n_and_pass_at_k(sft_path, capsys):
    out = main_output(capsys, evaluation, "--model", str(sft_path), "--task", "reverse", "--eval-n", "24",
                      "--eval-samples", "4")  # fmt: skip
    values = dict(zip(out.split()[::2], map(float, out.split()[1::2])))
    assert set(values) == {"eval/acc", "eval/mean@4", "eval/acc_mean@4", "eval/pass@1", "eval/pass@2", "eval/pass@4"}
    assert values["eval/pass@1"] == values["eval/acc_mean@4"] <= values["eval/pass@4"] and values["eval/acc"] > 0


def test_evaluation_prints_samples_with_their_truth_and_return(sft_path, capsys):
    out = main_output(capsys, evaluation, "--model", str(sft_path), "--task", "reverse", "--eval-n", "8",
                      "--print-samples", "2").splitlines()  # fmt: skip
    assert out[0].startswith("eval/acc ") and [line.split(":")[0] for line in out[1::3]] == ["sample 1", "sample 2"]
    for prompt, answer, result in zip(out[1::3], out[2::3], out[3::3]):
        digits = prompt.split("'")[1].rstrip(">")  # reverse: the truth is the prompt's digits reversed
        assert answer.strip().startswith("answer '") and answer.endswith(f"truth '{digits[::-1]}'")
        solved = answer.split("'")[1] == digits[::-1]
        assert result.strip().startswith("return ") and result.endswith("not solved" if not solved else ", solved")


def test_common_main_under_torchrun_reduces_over_two_ranks():
    out = run("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "common.py", timeout=180)
    assert out.count("all-reduce of the ranks 1, 1 expected") == 2  # ranks 0 + 1, printed by each rank


def test_ci_installs_with_the_readme_install_command_and_runs_its_test_command():
    """One install command, the README's, for everything the tests need: CI (.ci/run) installs exactly the
    README's requirement files, every requirements*.txt of the repository among them but the vLLM venv's, and runs
    its test command; then the vLLM venv (scripts/install_vllm.sh, from requirements-vllm.txt, installed in the
    background beside the main suite) runs tests_vllm."""
    import re

    readme, ci = (ROOT / "README.md").read_text(), (ROOT / ".ci" / "run").read_text()
    install = next(line for line in readme.splitlines() if line.startswith("pip install"))
    ci_install = next(line for line in ci.splitlines() if "pip install" in line and not line.startswith("#"))
    files, vllm = set(re.findall(r"-r (\S+)", install)), "requirements-vllm.txt"
    every = {p.name for p in ROOT.glob("requirements*.txt")}
    assert files == set(re.findall(r"-r (\S+)", ci_install)) == every - {vllm}
    test_cmd = next(line for line in readme.splitlines() if "-m pytest" in line).split("#")[0].strip()
    lines = ci.splitlines()
    assert test_cmd in lines and f"-r {vllm}" in (ROOT / "scripts" / "install_vllm.sh").read_text()
    vllm_install = next(line for line in lines if "bash scripts/install_vllm.sh" in line and line[0] != "#")
    venv = vllm_install.split("scripts/install_vllm.sh")[1].split()[0]
    assert vllm_install.endswith("&") and lines.index(vllm_install) < lines.index(test_cmd)  # beside the main suite
    assert lines.index(test_cmd) < lines.index(f"OMP_NUM_THREADS=2 {venv}/bin/python -m pytest -q tests_vllm")


def test_curves_plot_the_eval_history_from_step_0(tmp_path, monkeypatch):
    import runlog

    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "rollout/reward_mean": 0.1}\n{"step": 2, "eval/acc": 0.5}\n')
    plotted, real = {}, runlog.plot_metrics
    monkeypatch.setattr(runlog, "plot_metrics", lambda *a: plotted.update(real(*a)))
    runlog.write_result(tmp_path, {"eval_history": [(0, 0.25), (2, 0.5)]})
    assert plotted["eval/acc"] == [(0, 0.25), (2, 0.5)]  # the rows alone start at step 2
    assert plotted["rollout/reward_mean"] == [(1, 0.1)] and (tmp_path / "curves.png").stat().st_size > 0


def test_repro_replay_checks_runlog_and_checkpoint_mains_read_a_run(tmp_path, tiny_model):
    run_dir = tmp_path / "run"
    flags = f"--model {tiny_model} --task reverse --steps 2 --prompts-per-step 2 --group-size 2 --eval-every 0"
    run("trainer.py", *flags.split(), "--dump-batch", "1", "--save-every", "1", "--out-dir", str(run_dir))
    about = run("checkpoint.py", str(run_dir))  # the checkpoint --resume would take, and the run it is of
    assert f"{run_dir / 'ckpt-2'}: complete, step 2 of 2" in about and "tokenizer_sha256" in about, about
    table = run("repro.py")
    names = ("reward_scale", "pad_eq_eos", "value_not_detached", "rollout.sequence_logprobs")
    assert all(name in table for name in names), table
    dump = run("repro.py", str(run_dir / "batch-1.pt"))
    assert "batch['advantages']: (4," in dump and "state after:" in dump
    again = run("replay.py", str(run_dir / "batch-1.pt"))  # exits 0 only if the update is the same, bit for bit
    assert "metrics identical; weights and optimizer state (sha256) identical" in again, again
    assert "checks pass" in run("checks.py", str(run_dir / "config.json"))
    rows = run("runlog.py", str(run_dir))
    assert [line.split()[0] for line in rows.strip().splitlines()[:3]] == ["step", "1", "2"]  # the table's rows
    assert (run_dir / "curves.png").stat().st_size > 0
    result = json.loads((run_dir / "result.json").read_text())
    assert result["eval_history"] == [] and "rollout/reward_mean" in result
    # the final policy by default, as a save_pretrained folder that AutoModelForCausalLM and the trainer load
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(run_dir / "policy").config.vocab_size == len(tasks.make_tokenizer())
    _, tok = tasks.load_policy(str(run_dir / "policy"), "cpu")
    assert tok("ab c", add_special_tokens=False).input_ids == tasks.make_tokenizer()("ab c").input_ids


def test_critics_main_fits_two_critics_on_their_shares_and_masks(capsys, sft_path):
    """`python critics.py`: two mini-critics fitted on disjoint shares disagree, and AsyPPO's masks drop ~k and ~h."""
    out = main_output(capsys, critics, "--model", str(sft_path), "--prompts", "4", "--fit-steps", "5")
    masked = float(next(line for line in out.splitlines() if line.startswith("stats/asyppo_pg_masked_frac")).split()[1])
    assert 0.1 < masked < 0.3 and "critic/actor_sized_mem_mb" in out and "P: PPO term dropped" in out, out


def test_transport_main_trades_a_message_each_way():
    """`python transport.py`: two gloo ranks, a header with a tensor one way, a header alone back."""
    out = run("transport.py", timeout=300)
    assert "rank 0 got {'kind': 'numbers', 'from': 1, 'shape': [4], 'dtype': 'float32'}" in out, out
    assert "rank 1 got {'kind': 'sum', 'value': 6.0} with None" in out, out


def test_asyppo_experiment_runs_as_trainer_subprocesses(tmp_path, sft_path):
    args = ["experiments/asyppo.py", "--steps", "1", "--out-dir", str(tmp_path)]
    out = run(*args, "--train-args", f"--model {sft_path} --eval-n 8 --prompts-per-step 2 --group-size 4", timeout=600)
    summary = json.loads((tmp_path / "quick" / "summary.json").read_text())
    assert [r["method"] for r in summary] == ["ppo_1_full", "asyppo_2_mini"] and "final_acc" in out
    assert all(r["eval"][0][0] == 0 and len(r["curves"]["rollout/reward_mean"]) == 1 for r in summary)


@pytest.mark.parametrize(
    "script, flags, column",
    [
        ("bench/rollout_bench.py", "--batch 4 --new-tokens 4", "ratio"),
        ("bench/update_bench.py", "--batch 8 --micro-batch 4 --response-len 8", "ratio"),
        ("bench/step_profile.py", "--warmup 1 --prompts 2 --group-size 2 --new-tokens 4", "step_s"),
    ],
)
def test_benches_print_a_ratio_measured_in_the_same_run(script, flags, column):
    out = run(script, "--preset", "tiny", "--repeats", "1", *flags.split())
    header, row = out.strip().splitlines()[-2:]
    value = float(row.split()[header.split().index(column)])
    assert row.split()[0] == "tiny" and 0 < value < float("inf"), out
    if script.endswith("step_profile.py"):  # the timers caught the decode forwards, the backward and the update
        shares = {c: float(v) for c, v in zip(header.split(), row.split()) if c.endswith("_%")}
        assert min(shares[k] for k in ("prefill_%", "decode_%", "train_forward_%", "backward_%")) > 0, out


def test_async_bench_main_measures_sync_and_async_and_the_prediction(tmp_path, sft_path):
    """The compute workload runs on `reverse` (sft_path's warm start): one sync and one alpha-1 run, 2 x 2 x 2 each."""
    flags = "--workload compute --ratios 1 --steps 2 --prompts-per-step 2 --group-size 2"
    out = run("bench/async_bench.py", *flags.split(), "--out-dir", str(tmp_path), timeout=600)
    headers = [line.split() for line in out.splitlines() if line.split()[:1] == ["config"]]
    rows = [line.split() for line in out.splitlines() if line.split()[:3] == ["async", "alpha", "1"]]
    assert len(headers) == 1 and len(rows) == 1, out
    cols = dict(zip(headers[0][1:], rows[0][3:]))  # the config name "async alpha 1" takes three words
    staleness = [int(n) for n in cols["staleness"].split("/")]  # samples trained at staleness 0, 1, ...
    assert len(staleness) <= 2 and sum(staleness) == 2 * 2 * 2 and cols["dropped"] == "0", out  # alpha 1 bound
    assert float(cols["speedup"]) > 0 and 0 < float(cols["meas_over_pred"]) < float("inf"), out


def test_identity_check_main_records_and_checks(tmp_path, capsys, default_sft_path):
    """record one config (its replay must match its dump); check exits 1 and names what changed; --only is checked."""
    name = "inject_value_not_detached"  # the embedded default (default_sft_path's warm start), with a dump
    assert f"{name}    3 rows  ok" in run("bench/identity_check.py", "record", "--only", name, "--ref", str(tmp_path))
    spec = importlib.util.spec_from_file_location("identity_check", ROOT / "bench" / "identity_check.py")
    identity_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(identity_check)
    ref = json.loads((tmp_path / f"{name}.json").read_text())
    row = json.loads(ref["rows"][1])
    row["rollout/reward_mean"] += 1e-9
    changed = {**ref, "rows": [ref["rows"][0], json.dumps(row, sort_keys=True), ref["rows"][2]], "digest": "0" * 64}
    check = ["check", "--only", name, "--ref", str(tmp_path)]
    for result, rc, printed in [
        (ref, 0, "ok"),
        (changed, 1, "row 2 differs in ['rollout/reward_mean']; update digest differs from the reference"),
        ({**ref, "rows": ref["rows"][:2]}, 1, "2 rows vs 3 in the reference"),
    ]:
        identity_check.run_one = lambda n, work, result=result: result  # main() runs no trainer: the result is given
        assert identity_check.main(check) == rc and printed in capsys.readouterr().out
    with pytest.raises(SystemExit):
        identity_check.main(["check", "--only", "nope"])
    assert "unknown configs ['nope']" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # a check without its reference stops before running anything
        identity_check.main(["check", "--only", "ppo", "--ref", str(tmp_path)])
    assert "no reference for ['ppo']" in capsys.readouterr().err


def test_mismatch_experiment_main_runs_an_arm_and_prints_its_row(default_sft_path):
    """experiments/mismatch.py on one arm, one seed, 2 iterations of the default recipe: its table row, with the
    gap measured (the bf16 sampler) and IcePop's zeroed share."""
    out = run("experiments/mismatch.py", "--arms", "bf16, IcePop", "--seeds", "1", "--steps", "2", timeout=600)
    row = next(line for line in out.splitlines() if line.startswith("| bf16, IcePop |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert float(cells[3].split()[0]) > 1e-4 and cells[6] != "-", out  # logp_diff of bf16, is_oob reported


def test_diagnose_bench_runs_a_case_and_its_clean_twin_and_scores_them(tmp_path):
    """bench/diagnose_bench.py on one case, one config, one seed, 6 iterations: the labelled run is named (pad ==
    eos: eos_mask dated to step 1, reported at 2), its clean twin raises nothing, and the table scores exactly that."""
    out = run("bench/diagnose_bench.py", "--cases", "pad_eq_eos", "--configs", "reverse-gae", "--seeds", "0",
              "--steps", "6", "--out-dir", str(tmp_path), "--json", str(tmp_path / "s.json"), timeout=600)  # fmt: skip
    assert "| eos_mask | 1 | 1.00 | 1.00 | 0 | 2, 2 |" in out, out
    scores = json.loads((tmp_path / "s.json").read_text())
    assert [(r["case"], r["found"]) for r in scores["runs"]] == [("pad_eq_eos", {"eos_mask": [1, 2]}), ("clean", {})]
    assert scores["confusion"]["clean"] == {"runs": 1, "(none)": 1}


def test_diagnose_bench_scoring_counts_symptoms_neither_way():
    spec = importlib.util.spec_from_file_location("diagnose_bench", ROOT / "bench" / "diagnose_bench.py")
    db = sys.modules["diagnose_bench"] = importlib.util.module_from_spec(spec)  # (its dataclass looks itself up)
    spec.loader.exec_module(db)
    results = [
        ("answer_format", "reverse-gae", 0, {"zero_variance_groups": (3, 5), "flat_reward": (0, 40)}),  # + symptom
        ("answer_format", "sort-grpo", 0, {}),  # missed
        ("adv_sign", "sort-grpo", 0, {"reward_decline": (10, 20), "kl_blowup": (7, 9), "eos_mask": (1, 2)}),
        ("clean", "sort-grpo", 0, {"zero_variance_groups": (4, 6)}),  # a false alarm on a clean run
    ]
    per, confusion = db.score(results)
    assert per["zero_variance_groups"]["recall"] == 0.5 and per["zero_variance_groups"]["precision"] == 0.5
    assert per["reward_decline"] == {"tp": 1, "fp": 0, "symptom": 0, "n": 1, "steps": [20], "recall": 1.0,
                                     "precision": 1.0}  # fmt: skip
    assert per["kl_blowup"]["fp"] == 0 and per["kl_blowup"]["symptom"] == 1  # adv_sign's declared symptom
    assert per["eos_mask"]["fp"] == 1
    assert per["flat_reward"]["fp"] == 0 and per["flat_reward"]["precision"] is None
    assert confusion["answer_format"] == {"runs": 2, "zero_variance_groups": 1, "flat_reward": 1, "(none)": 1}
    table = db.report(per, confusion, [0])
    assert "| zero_variance_groups | 2 | 0.50 | 0.50 | 0 | 5, 5 |" in table
    assert "| adv_sign (reward_decline) | 1 | " in table and "| 1 s |" in table  # kl_blowup: a declared symptom
    jobs = db.jobs(db.parse_config(db.Args, ["--cases", "ent_sign", "kl_sign", "--seeds", "3"]))
    clean = [settings for case, _, _, settings in jobs if case == "clean"]
    assert {"kl_in_reward": True, "kl_coef": 0.1}.items() <= clean[-1].items()  # kl_sign's twin: its stated config
    assert all("ent_coef" not in c and "inject" not in c for c in clean[:2])  # ent_sign's twins: no bonus at all
