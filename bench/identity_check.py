"""Identity check for refactors: the same configs must give the same numbers, bit for bit.

    python bench/identity_check.py record   # before a refactor: write the reference (bench/identity/)
    python bench/identity_check.py check    # after each step: compare against it; exit 1 on any difference

A refactor (moving code between files, renaming, splitting functions) must change no number. This script runs
a fixed set of short trainer configs (seed 0, one thread each, two runs at a time) and compares every metrics row
with the reference, after dropping the fields that measure wall time (TIME_FIELDS) and writing each row with
sorted keys (so that the order in which a metrics dict is built does not count). It also checks the two
reproducibility promises of the trainer on the same runs:
  - replay: `--dump-batch` saves one update and its state digest (sha256 of weights and AdamW moments after it);
    `python replay.py` must reproduce it, and the digest must equal the reference's;
  - resume: a run resumed from its step-3 checkpoint must write the same rows as the uninterrupted run.
The reference is machine-specific (CPU kernels): record it on the machine that checks. The configs run through
the command line (`python trainer.py ...`), so flag names are part of what is checked.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
REF = ROOT / "bench" / "identity"
TIME_FIELDS = ("time/", "perf/tokens_per_s", "perf/credit_overhead", "async/wait_s")
SHORT = ["--steps", "6", "--eval-every", "3", "--eval-n", "100"]
INJECT = ["--steps", "3", "--eval-every", "0"]
# name: (script, flags). Each covers a concept whose code the restructure moves.
TRAINER = "trainer.py"  # the full trainer's script: the one name a move of the trainer edits here
TORCHRUN = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
# name: (command after `python`, flags). Each covers a concept whose code the restructure moves. ENV_URL in flags:
# the address of an env_service server started for that run.
PROXY = "--agent examples/calc_agent.py --agents 2 --eval-n 8 --prompts-per-step 4 --adv-estimator grpo"
INJECTED = ("reward_scale", "eos_unmasked", "logprob_shift", "pad_eq_eos", "stale_old_logprobs", "answer_format")
INJECTED += ("adv_sign", "kl_sign", "ent_sign", "wrong_stop_id", "stale_sampler")
RUNS = {
    "ppo": ([TRAINER], [*SHORT, "--dump-batch", "4", "--save-every", "3"]),
    "grpo": ([TRAINER], [*SHORT, "--adv-estimator", "grpo", "--dump-batch", "2"]),
    "asyppo": ([TRAINER], [*SHORT, "--critic", "asyppo", "--dump-batch", "5", "--save-every", "3"]),
    "credit": ([TRAINER], [*SHORT, *"--adv-estimator grpo --credit attention --max-new-tokens 24".split()]),
    "calc": ([TRAINER], [*SHORT, *"--task calc --adv-estimator grpo --prompts-per-step 16".split()]),
    "async0": (["async_loop.py"], [*SHORT, "--async-ratio", "0"]),
    "kl": ([TRAINER], [*SHORT, *"--kl-in-reward --kl-ctrl adaptive --kl-loss --ent-coef 0.01".split()]),
    "gspo_is": ([TRAINER], [*INJECT, *"--adv-estimator grpo --loss-mode gspo --rollout-is token".split()]),
    "rloo": ([TRAINER], [*INJECT, "--adv-estimator", "rloo"]),
    "reinforce_pp": ([TRAINER], [*INJECT, "--adv-estimator", "reinforce_plus_plus"]),
    "lora": ([TRAINER], [*INJECT, "--adv-estimator", "grpo", "--lora-rank", "4"]),
    "fsdp2": ([*TORCHRUN, TRAINER], [*INJECT, "--fsdp", "--prompts-per-step", "8"]),
    "env_url": ([TRAINER], [*INJECT, *"--task calc --adv-estimator grpo --env-url ENV_URL".split()]),
    "proxy": (["agent_train.py"], [*INJECT, *PROXY.split(), "--kl-metric-every", "0"]),
    **{f"inject_{name}": ([TRAINER], [*INJECT, "--inject", name]) for name in INJECTED},
    "inject_no_temperature": ([TRAINER], [*INJECT, "--inject", "no_temperature", "--adv-estimator", "grpo"]),
    "inject_value_not_detached": ([TRAINER], [*INJECT, "--inject", "value_not_detached", "--dump-batch", "2"]),
    "inject_retokenized_history": (
        [TRAINER],
        [*INJECT, *"--inject retokenized_history --task calc --adv-estimator grpo".split()],
    ),
}
# Per run, fields that vary from run to run of the same code: the proxy batches concurrent requests as they arrive,
# and the padding of a shared generate call moves the sampler's logprobs in the last bits (its samples do not move).
NOISY = {"proxy": ("stats/behav_vs_old_logp_diff", "stats/rollout_vs_old_logp_diff")}


def canonical(path: Path, noisy: tuple[str, ...] = ()) -> list[str]:
    """The rows of a metrics.jsonl without wall-time fields (and the run's noisy ones), as JSON with sorted keys."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    keep = lambda k: not k.startswith(TIME_FIELDS) and k not in noisy
    return [json.dumps({k: v for k, v in r.items() if keep(k)}, sort_keys=True) for r in rows]


def sh(args: list[str], log: Path) -> None:
    """Run one command with one thread; its output goes to `log`; a failure raises with the log's tail."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}
    with open(log, "a") as f:
        f.write("$ " + " ".join(args) + "\n")
        f.flush()
        proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode:
        tail = "\n".join(log.read_text().splitlines()[-15:])
        raise RuntimeError(f"{' '.join(args)} exited {proc.returncode}:\n{tail}")


@contextlib.contextmanager
def env_server(flags: list[str], log: Path):
    """The flags with ENV_URL replaced by the address of an env_service server, running while the block runs."""
    if "ENV_URL" not in flags:
        yield flags
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "env_service.py", "--serve", "--port", "0"]
    with subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as p:
        try:
            line = p.stdout.readline()  # "[minrl] env_service at URL (envs: ...)"
            if " at " not in line:
                raise RuntimeError(f"env_service.py --serve did not start: {line}{p.stdout.read()}")
            log.write_text(line)
            yield [line.split(" at ")[1].split()[0] if f == "ENV_URL" else f for f in flags]
        finally:
            p.terminate()


def run_one(name: str, work: Path) -> dict:
    """One config, plus its replay and resume checks. Returns rows, the dump's digest and the check outcomes."""
    command, flags = RUNS[name]
    out, log = work / name, work / f"{name}.log"
    with env_server(flags, log) as flags:
        sh([*command, *flags, "--out-dir", str(out)], log)
    result = {"rows": canonical(out / "metrics.jsonl", NOISY.get(name, ()))}
    dumps = sorted(out.glob("batch-*.pt"))
    if dumps:
        result["digest"] = torch.load(dumps[0], weights_only=True)["state_after"]
        try:
            sh(["replay.py", str(dumps[0])], log)
            result["replay"] = "identical"
        except RuntimeError as e:
            result["replay"] = f"differs: {e}"
    ckpt = out / "ckpt-3"
    if ckpt.exists():
        sh([*command, *flags, "--out-dir", str(work / f"{name}-resumed"), "--resume", str(ckpt)], log)
        resumed = canonical(work / f"{name}-resumed" / "metrics.jsonl", NOISY.get(name, ()))
        result["resume"] = "identical" if resumed == result["rows"][3:] else "differs"
    return result


def compare(result: dict, ref: dict) -> list[str]:
    """What differs between one config's result and its reference: the first differing row and its fields, the
    number of rows, the update digest. Empty when identical."""
    problems = []
    if result["rows"] != ref["rows"]:
        first = next((i for i, (a, b) in enumerate(zip(result["rows"], ref["rows"])) if a != b), None)
        if first is None:
            problems.append(f"{len(result['rows'])} rows vs {len(ref['rows'])} in the reference")
        else:
            now, was = json.loads(result["rows"][first]), json.loads(ref["rows"][first])
            keys = sorted(k for k in now.keys() | was.keys() if now.get(k) != was.get(k))
            problems.append(f"row {first + 1} differs in {keys[:8]}")
    if result.get("digest") != ref.get("digest"):
        problems.append("update digest differs from the reference")
    return problems


def main(argv=None) -> int:
    """`python bench/identity_check.py record|check`: write the reference, or compare against it (exit 1 if not)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=("record", "check"))
    ap.add_argument("--only", nargs="*", default=None, help="run only these configs (default: all)")
    ap.add_argument("--jobs", type=int, default=2, help="configs run at a time (each on one thread)")
    ap.add_argument("--ref", type=Path, default=REF, help=f"the reference folder (default: {REF.relative_to(ROOT)})")
    args = ap.parse_args(argv)
    unknown = sorted(set(args.only or ()) - set(RUNS))
    if unknown:
        ap.error(f"--only: unknown configs {unknown}; the configs are {list(RUNS)}")
    names = args.only or list(RUNS)
    missing = [n for n in names if args.mode == "check" and not (args.ref / f"{n}.json").exists()]
    if missing:  # before ten minutes of runs, not after
        ap.error(f"no reference for {missing} in {args.ref}: record it first (python bench/identity_check.py record)")
    with tempfile.TemporaryDirectory(prefix="identity-") as tmp:
        with ThreadPoolExecutor(args.jobs) as ex:
            results = dict(zip(names, ex.map(lambda n: run_one(n, Path(tmp)), names)))
    if args.mode == "record":
        args.ref.mkdir(parents=True, exist_ok=True)
        for name, r in results.items():
            (args.ref / f"{name}.json").write_text(json.dumps(r, indent=1) + "\n")
        print(f"recorded {len(results)} configs in {args.ref}")
    bad = []
    for name, r in results.items():
        problems = [f"{k} {r[k]}" for k in ("replay", "resume") if k in r and r[k] != "identical"]
        if args.mode == "check":
            problems += compare(r, json.loads((args.ref / f"{name}.json").read_text()))
        print(f"{name:28s} {len(r['rows'])} rows  " + ("; ".join(problems) if problems else "ok"))
        bad += problems
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
