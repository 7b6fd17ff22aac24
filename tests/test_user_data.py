"""Bring your own: veRL / TRL data, reward functions and a reward model; mean@N and pass@k; W&B with veRL's names.

Everything runs in this process (no fresh interpreter) on the embedded tokenizer and tiny models built here."""

import dataclasses
import itertools
import json
import math
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import cli
import data
import diagnose
import replay
import repro
import rewards
import tasks
import trainer
from envs import sample_episodes
from evaluation import pass_at_k, sampled_eval
from experiments import schedules
from rewards import RewardArgs, RewardModel, RewardSet

ROOT = Path(__file__).resolve().parents[1]


def digits(a: int) -> str:
    return f"{a:02d}{(a * 7) % 100:02d}{(a * 3) % 10}{a % 10}"


def verl_rows(n: int, start: int = 0) -> list[dict]:
    """Rows in veRL's schema (what its gsm8k preprocessing writes), on the `reverse` task."""
    return [{"data_source": "rev6", "prompt": [{"role": "system", "content": "be brief"},
                                               {"role": "user", "content": digits(a) + ">"}],
             "ability": "digits", "reward_model": {"style": "rule", "ground_truth": digits(a)[::-1]},
             "extra_info": {"index": a}} for a in range(start, start + n)]  # fmt: skip


def write_parquet(path: Path, rows: list[dict]) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def row(prompt="123>", truth="321", **columns) -> dict:
    """A normalized row as data.normalize_row makes it."""
    return data.normalize_row({"prompt": prompt, "ground_truth": truth, **columns}, "t.jsonl:1", "t")


def reward_file(tmp_path, body: str, name="r.py") -> str:
    p = tmp_path / name
    p.write_text("import math, time\n\n" + body)
    return str(p)


# ----------------------------------------------------------------------------------------------
# Data


def test_verl_parquet_and_plain_jsonl_read_as_one_schema(tmp_path, capsys):
    path = write_parquet(tmp_path / "train.parquet", verl_rows(30))
    tok = tasks.make_tokenizer()
    task = data.DataTask(data.DataArgs(data=path), RewardArgs(reward=["exact"], reward_workers=0), tok, 64)
    rows = task.rows["train"] + task.rows["eval"]
    assert len(rows) == 30 and len(task.rows["eval"]) > 0
    first = next(r for r in rows if r["extra_info"] == {"index": 0})
    assert first["ground_truth"] == digits(0)[::-1] and first["data_source"] == "rev6"
    assert first["where"] == f"{path}:row 1" and first["columns"]["ability"] == "digits"
    # no chat template (the embedded tokenizer): <bos> + the user messages' contents (not the system's); said once
    assert tasks.format_prompt(tok, first["prompt"]) == "<bos>" + digits(0) + ">"
    assert capsys.readouterr().out.count("the tokenizer has no chat template") == 1
    tok.chat_template = "{% for m in messages %}{{ m['role'][0] }}: {{ m['content'] }}\n{% endfor %}a: "
    assert tasks.format_prompt(tok, first["prompt"]) == f"s: be brief\nu: {digits(0)}>\na: "
    plain = tmp_path / "plain.jsonl"
    plain.write_text("".join(json.dumps({"prompt": digits(a) + ">", "ground_truth": digits(a)[::-1]}) + "\n"
                             for a in range(30)))  # fmt: skip
    again = data.DataTask(data.DataArgs(data=str(plain)), RewardArgs(reward=["exact"], reward_workers=0))
    same = lambda t: sorted((data.prompt_text(tasks.format_prompt(tasks.make_tokenizer(), r["prompt"])),
                             r["ground_truth"]) for r in t.rows["train"] + t.rows["eval"])  # fmt: skip
    assert same(again) == same(task)  # the two schemas give the same rows and prompts (the split hashes each one's)


def test_datasets_folder_and_held_out_file(tmp_path):
    import datasets

    train, test = verl_rows(20), verl_rows(8, start=50)
    datasets.Dataset.from_list(train).save_to_disk(tmp_path / "ds")
    datasets.DatasetDict({"train": datasets.Dataset.from_list(train), "test": datasets.Dataset.from_list(test)}
                         ).save_to_disk(tmp_path / "dd")  # fmt: skip
    rewards = RewardArgs(reward=["exact"], reward_workers=0)
    one = data.DataTask(data.DataArgs(data=str(tmp_path / "ds")), rewards)
    assert len(one.rows["train"]) + len(one.rows["eval"]) == 20  # a Dataset: the hash split
    both = data.DataTask(data.DataArgs(data=str(tmp_path / "dd"), eval_data=str(tmp_path / "dd")), rewards)
    assert len(both.rows["train"]) == 20 and len(both.rows["eval"]) == 8  # train split trains, test split held out
    assert {r["extra_info"]["index"] for r in both.rows["eval"]} == set(range(50, 58))
    assert both.rows["eval"][0]["where"] == f"{tmp_path / 'dd' / 'test'}:row 1"
    held = write_parquet(tmp_path / "test.parquet", test)
    mixed = data.DataTask(data.DataArgs(data=str(tmp_path / "ds"), eval_data=held), rewards)
    assert len(mixed.rows["train"]) == 20 and len(mixed.rows["eval"]) == 8
    datasets.DatasetDict({"train": datasets.Dataset.from_list(train)}).save_to_disk(tmp_path / "only")
    with pytest.raises(ValueError, match=r"splits \['train'\], none of \['test', 'validation'\]"):
        data.DataTask(data.DataArgs(data=str(tmp_path / "only"), eval_data=str(tmp_path / "only")), rewards)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="not a datasets.save_to_disk folder"):
        data.read_rows(str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="'eval_data' needs --data"):
        data.DataArgs(eval_data=held)
    with pytest.raises(ValueError, match=r"8 held-out prompts are training prompts too, e.g. .*test.parquet:row 1 = "):
        data.DataTask(
            data.DataArgs(data=write_parquet(tmp_path / "all.parquet", train + test), eval_data=held), rewards
        )


# ----------------------------------------------------------------------------------------------
# Reward functions


def test_verl_and_trl_reward_functions_weighted(tmp_path):
    """veRL's per-sample compute_score (float or dict) and TRL's batch signature (columns as keyword lists, chat
    completions as messages, None where a function does not apply), summed with their weights."""
    verl = "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
    verl += "    assert data_source == 't' and extra_info == {'k': 1}\n"
    verl = reward_file(
        tmp_path, verl + "    return {'score': float(solution_str == ground_truth), 'len': len(solution_str)}\n"
    )
    trl = reward_file(tmp_path, "def f(prompts, completions, completion_ids, level, ground_truth, **kw):\n"
                      "    return [None if lv == 0 else (0.5 if isinstance(c, list) else 0.25) * len(ids)\n"
                      "            for c, ids, lv in zip(completions, completion_ids, level)]\n", "t.py")  # fmt: skip
    rs = RewardSet(RewardArgs(reward=[verl, trl + ":f"], reward_weights=[1.0, 2.0], reward_workers=0))
    chat = [{"role": "user", "content": "123>"}]
    rows = [
        row(level=0, extra_info={"k": 1}),
        row(level=1, extra_info={"k": 1}),
        row(chat, level=2, extra_info={"k": 1}),
    ]
    scores, solved, infos = rs.score(rows, ["321", "32", "321"], [[1, 2], [1], [1, 2, 3]])
    assert scores == [1.0, 0.0 + 2 * 0.25 * 1, 1.0 + 2 * 0.5 * 3]  # None skipped; chat completions are messages
    assert solved == [True, False, True]  # the first term's own value >= 1, whatever the others add
    assert [i["reward/r"] for i in infos] == [1.0, 0.0, 1.0] and [i["reward/r/len"] for i in infos] == [3, 2, 3]
    assert ["reward/f" in i for i in infos] == [False, True, True] and infos[2]["reward/f"] == 1.5  # None: not logged
    assert all(i["time/reward"] > 0 for i in infos)
    alone = RewardSet(RewardArgs(reward=[trl + ":f"], reward_workers=0))
    with pytest.raises(ValueError, match=r"no reward term scores sample 0 \(t.jsonl:1\): every function returned None"):
        alone.score(rows[:1], ["x"], [[1]])


def test_a_trl_function_reads_ground_truth_from_a_verl_schema_file_too(tmp_path, capsys):
    """docs/from_trl.md's function reads kw["ground_truth"]: in a veRL-schema parquet the truth sits in
    reward_model, and still arrives as `ground_truth` (the veRL columns too, as stored). Repeats are counted per
    file: --eval-data's rows under their own name."""
    train = verl_rows(20) + verl_rows(2)  # 2 repeats in the training file
    path, held = (
        write_parquet(tmp_path / "train.parquet", train),
        write_parquet(tmp_path / "eval.parquet", verl_rows(5, 40) + verl_rows(1, 40)),
    )
    body = "def f(prompts, completions, completion_ids, **kw):\n"
    body += "    assert [r['ground_truth'] for r in kw['reward_model']] == kw['ground_truth']\n"
    body += "    return [float(c[0]['content'] == t) for c, t in zip(completions, kw['ground_truth'])]\n"
    fn = reward_file(tmp_path, body, "trl_gt.py") + ":f"
    tok = tasks.make_tokenizer()
    task = data.DataTask(data.DataArgs(data=path, eval_data=held), RewardArgs(reward=[fn], reward_workers=0), tok, 64)
    out = capsys.readouterr().out
    assert f"{path}: 2 of its 22 rows repeat" in out and f"{held}: 1 of its 6 rows repeat" in out, out
    rows = task.rows["train"][:3]
    right, wrong = rows[0]["ground_truth"], "nope"
    scores, _, _ = RewardSet(RewardArgs(reward=[fn], reward_workers=0)).score(rows[:2], [right, wrong], [[1], [1]])
    assert scores == [1.0, 0.0]


@pytest.mark.parametrize(
    "body,style,what",
    [("raise KeyError('parser exploded')", "verl", r"raised KeyError\('parser exploded'\) at \S+r\.py:6 .* sample 1"),
     ("return float('nan')", "verl", r"on sample 1 .* returned nan: a reward must be finite"),
     ("return 'high'", "verl", r"on sample 1 .* returned 'high', not a number"),
     ("return {'acc': 1.0}", "verl", r"on sample 1 .* returned a dict without 'score'"),
     ("return [1.0]", "trl", r"returned 1 values for 2 completions"),
     ("return [0.0, math.inf]", "trl", r"on sample 1 .* returned inf: a reward must be finite")],
)  # fmt: skip
def test_a_reward_that_fails_stops_naming_the_sample(tmp_path, body, style, what):
    head = "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
    if style == "trl":
        head = "def compute_score(prompts, completions, **kw):\n"
    else:
        body = f"if solution_str != 'boom':\n        return 0.0\n    {body}"
    path = reward_file(tmp_path, head + "    " + body + "\n")
    rs = RewardSet(RewardArgs(reward=[path], reward_workers=0))
    with pytest.raises((RuntimeError, ValueError, TypeError), match=what) as e:
        rs.score([row(), row("456>", "654")], ["ok", "boom"], [[1], [2]])
    if "sample 1" in what:
        assert "t.jsonl:1" in str(e.value) and "'456>'" in str(e.value) and "'boom'" in str(e.value), str(e.value)


def test_reward_pool_matches_inline_and_times_out_naming_the_sample(tmp_path):
    path = reward_file(tmp_path, "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                       "    if solution_str == 'slow':\n        time.sleep(60)\n"
                       "    return len(solution_str) / 10 + (solution_str == ground_truth)\n")  # fmt: skip
    rows, texts = [row(), row("456>", "654"), row("789>", "987")], ["321", "65", "x"]
    inline = RewardSet(RewardArgs(reward=[path], reward_workers=0)).score(rows, texts, [[1]] * 3)[:2]
    pool = RewardSet(RewardArgs(reward=[path], reward_workers=2, reward_timeout=1.0))
    try:
        assert pool.score(rows, texts, [[1]] * 3)[:2] == inline == ([1.3, 0.2, 0.1], [True, False, False])
        t0 = time.perf_counter()
        timed_out = (
            r"timed out after 1.0 s \(--reward-timeout\), in \S+r\.py:5 \(time.sleep\(60\)\) on sample 1 .*'slow'"
        )
        with pytest.raises(RuntimeError, match=timed_out):
            pool.score(rows, ["321", "slow", "x"], [[1]] * 3)
        assert time.perf_counter() - t0 < 10  # the worker's alarm, not the 60 s sleep
        assert pool.score(rows, texts, [[1]] * 3)[:2] == inline  # the worker killed meanwhile was replaced
    finally:
        pool.close()


def test_reward_names_and_flags_checked_at_load(tmp_path):
    with pytest.raises(ValueError, match=r"'reward' = 'fuzzy': must be one of .* or FILE.py\[:FN\]"):
        RewardArgs(reward=["fuzzy"])
    with pytest.raises(ValueError, match=r"'reward_weights' has 1 values for 2 reward terms \(exact, model:rm\)"):
        RewardArgs(reward=["exact"], reward_model="rm", reward_weights=[1.0])
    path = reward_file(tmp_path, "def g(x):\n    return 1.0\n")
    with pytest.raises(AttributeError, match=r"has no function 'compute_score' \(functions there: \['g'\]\)"):
        RewardSet(RewardArgs(reward=[path]))
    with pytest.raises(TypeError, match=r"neither a 'solution_str' parameter .* nor a 'completions' one"):
        RewardSet(RewardArgs(reward=[path + ":g"]))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        RewardSet(RewardArgs(reward=[str(tmp_path / "nope.py")]))
    # the CLI: a repeated flag and space-separated values both give a list; a list default is replaced, not extended
    cfg = cli.parse_config(trainer.Config, ["--reward", "a.py:f", "--reward", "b.py", "exact", "--reward-weights", "1",
                                          "0.5", "2"])  # fmt: skip
    assert cfg.reward == ["a.py:f", "b.py", "exact"] and cfg.reward_weights == [1.0, 0.5, 2.0]
    assert cli.parse_config(schedules.Config, ["--sweep-values", "1", "2"]).sweep_values == [1.0, 2.0]
    assert cli.parse_config(schedules.Config, []).sweep_values == [0.0, 0.4, 0.8, 1.2]
    assert trainer.Config(reward="exact").reward == ["exact"]  # one name, as older config.json files hold it


def test_reward_model_scores_prompt_and_response(tmp_path):
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    tok = tasks.make_tokenizer()
    torch.manual_seed(0)
    cfg = dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
               num_key_value_heads=1, num_labels=1, pad_token_id=tok.pad_token_id)  # fmt: skip
    Qwen2ForSequenceClassification(Qwen2Config(**cfg)).save_pretrained(tmp_path / "rm")
    tok.save_pretrained(tmp_path / "rm")
    rm = RewardModel(str(tmp_path / "rm"), "cpu", batch=2)
    assert not rm.model.training
    prompts, responses = ["123>", [{"role": "user", "content": "45>"}], "6>"], ["321", "54", "6666"]
    got = rm.score(prompts, responses)
    for p, r, g in zip(prompts, responses, got):  # one at a time, unpadded: the same score
        ids = tok(rm.text(p, r), return_tensors="pt")
        with torch.no_grad():
            assert g == pytest.approx(rm.model(**ids).logits[0, 0].item(), abs=1e-5)
    assert rm.text(prompts[1], "54") == "45>54"
    rs = RewardSet(RewardArgs(reward=["exact"], reward_model=str(tmp_path / "rm"), reward_weights=[1.0, 0.5]))
    assert rs.score([row(p) for p in prompts], responses, [[1]] * 3)[0] == pytest.approx(
        [1.0 + 0.5 * got[0], 0.5 * got[1], 0.5 * got[2]], abs=1e-6
    )
    Qwen2ForSequenceClassification(Qwen2Config(**{**cfg, "num_labels": 2})).save_pretrained(tmp_path / "cls")
    tok.save_pretrained(tmp_path / "cls")
    with pytest.raises(ValueError, match="has 2 labels: a reward model has one"):
        RewardModel(str(tmp_path / "cls"), "cpu")


# ----------------------------------------------------------------------------------------------
# Evaluation, end to end, W&B


def test_pass_at_k_is_the_unbiased_estimator():
    assert pass_at_k(4, 1, 1) == 0.25 and pass_at_k(4, 1, 2) == 0.5 and pass_at_k(4, 0, 4) == 0.0
    assert pass_at_k(4, 4, 1) == 1.0 and pass_at_k(5, 3, 3) == 1.0  # fewer than k wrong: every k-subset has a hit
    for n, c in itertools.product(range(1, 7), range(0, 7)):
        for k in range(1, n + 1):
            if c <= n:  # the mean over every k-subset of the n samples of "some sample right"
                subsets = list(itertools.combinations([1] * c + [0] * (n - c), k))
                assert pass_at_k(n, c, k) == pytest.approx(np.mean([max(s) for s in subsets]), abs=1e-12)


def test_sampled_eval_metrics_agree_and_leave_the_training_stream_alone(sft_path):
    policy, tok = tasks.load_policy(str(sft_path), "cpu")
    task, n = tasks.make_task("reverse"), 4
    episodes = sample_episodes(task, "reverse", "eval", 24, np.random.default_rng(12345), n)
    limits = dict(max_prompt_len=16, max_new_tokens=8, temperature=1.0, top_p=1.0, top_k=0)
    state = torch.get_rng_state()
    a = sampled_eval(policy, tok, episodes, [tok.eos_token_id], n, **limits)
    b = sampled_eval(policy, tok, episodes, [tok.eos_token_id], n, **limits)
    assert a == b and torch.equal(torch.get_rng_state(), state)  # its own generator, re-seeded: the same draws
    assert set(a) == {"eval/mean@4", "eval/acc_mean@4", "eval/pass@1", "eval/pass@2", "eval/pass@4"}
    assert a["eval/pass@1"] == pytest.approx(a["eval/acc_mean@4"]) and 0 < a["eval/pass@1"] < a["eval/pass@4"]
    assert a["eval/pass@1"] <= a["eval/pass@2"] <= a["eval/pass@4"] and a["eval/mean@4"] >= a["eval/acc_mean@4"]


def test_train_on_verl_data_with_reward_files_a_reward_model_and_wandb(sft_path, tmp_path, monkeypatch):
    """The journey of docs/from_verl.md: veRL parquet, a veRL compute_score, a TRL function and a reward model
    weighted, a held-out file, mean@N and pass@k; W&B offline gets our names and veRL's."""
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    tok = tasks.make_tokenizer()
    Qwen2ForSequenceClassification(Qwen2Config(vocab_size=len(tok), hidden_size=16, intermediate_size=32,
                                   num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, num_labels=1,
                                   pad_token_id=tok.pad_token_id)).save_pretrained(tmp_path / "rm")  # fmt: skip
    tok.save_pretrained(tmp_path / "rm")
    train = write_parquet(tmp_path / "train.parquet", verl_rows(40))
    held = write_parquet(tmp_path / "t.parquet", verl_rows(8, start=60))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = trainer.Config(model=str(sft_path), data=train, eval_data=held, adv_estimator="grpo", steps=2, eval_every=2,
                    eval_n=8, eval_samples=2, prompts_per_step=8, reward_workers=1, wandb_project="minrl-test",
                    reward=[f"{ROOT}/examples/rewards_verl.py", f"{ROOT}/examples/rewards_trl.py:length_penalty"],
                    reward_model=str(tmp_path / "rm"), reward_weights=[1.0, 1.0, 0.1], out_dir=str(tmp_path / "run"),
                    max_new_tokens=8, save_final=False)  # fmt: skip
    out = trainer.train(cfg)
    terms = out["reward/rewards_verl"] + out["reward/length_penalty"] + 0.1 * out["reward/model"]
    assert out["rollout/reward_mean"] == pytest.approx(terms, abs=1e-5)  # the weighted sum, term by term
    assert 0 < out["reward/rewards_verl"] <= 1 and out["reward/rewards_verl/has_number"] == 1.0
    assert out["time/reward"] > 0 and out["eval/pass@1"] <= out["eval/pass@2"] and "eval/mean@2" in out
    wandb_file = next((tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb"))
    rows = wandb_history(wandb_file)
    assert [r["_step"] for r in rows] == [1, 2]
    assert rows[-1]["actor/pg_clipfrac"] == rows[-1]["stats/clipfrac"] == out["stats/clipfrac"]
    assert rows[-1]["critic/score/mean"] == out["rollout/reward_mean"]
    assert rows[-1]["val-core/rev6/reward/mean@2"] == out["eval/mean@2"]  # the rows' data_source, as veRL names it
    # a resume is refused once a reward file changed (its hash is in the run's fingerprint)
    reward = tmp_path / "my_reward.py"
    reward.write_text((ROOT / "examples" / "rewards_verl.py").read_text())
    first = dataclasses.replace(cfg, reward=[str(reward)], reward_model=None, reward_weights=None, save_every=1,
                                steps=1, eval_every=0, wandb_project=None, out_dir=str(tmp_path / "ckpt"))  # fmt: skip
    trainer.train(first)
    reward.write_text(reward.read_text().replace("0.1", "0.2"))
    again = dataclasses.replace(first, steps=2, resume=str(tmp_path / "ckpt"), resume_allow=("steps",))
    with pytest.raises(ValueError, match=r"user_files_sha256: .*my_reward.py': '[0-9a-f]{64}'} in the checkpoint"):
        trainer.train(again)


def wandb_history(path: Path) -> list[dict]:
    """The logged rows of an offline W&B run file: a LevelDB-style log (32 KiB blocks, 7-byte record headers after a
    7-byte file header) of protobuf Records."""
    from wandb.proto import wandb_internal_pb2 as pb

    raw, pos, buf, rows = path.read_bytes(), 7, b"", []
    while pos + 7 <= len(raw):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        n, kind = int.from_bytes(raw[pos + 4 : pos + 6], "little"), raw[pos + 6]
        buf, pos = buf + raw[pos + 7 : pos + 7 + n], pos + 7 + n
        if kind in (1, 4):  # a full record, or the last piece of one
            rec = pb.Record()
            rec.ParseFromString(buf)
            buf = b""
            if rec.WhichOneof("record_type") == "history":
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item})
    assert rows, f"{path}: no history record"
    return [{k: v for k, v in r.items() if not math.isnan(v if isinstance(v, float) else 0.0)} for r in rows]


# ----------------------------------------------------------------------------------------------
# The guides' journeys, command by command


def doc_commands(md: Path) -> list[list[str]]:
    """Every `python FILE.py ...` line of the guide's bash blocks (continuations joined), as argv lists."""
    import re
    import shlex

    blocks = re.findall(r"```bash\n(.*?)```", md.read_text(), re.S)
    lines = [ln for b in blocks for ln in b.replace("\\\n", " ").splitlines() if ln.startswith("python ")]
    return [shlex.split(ln)[1:] for ln in lines]


def run_command(argv: list[str], model: Path, data_dir: Path, capsys) -> tuple[int, str]:
    """One guide command, in this process: $MODEL and $DATA filled in, the trainer's evaluation kept small."""
    mains = {"trainer.py": trainer.main, "diagnose.py": diagnose.main, "data.py": data.main,
             "rewards.py": rewards.main, "repro.py": repro.main, "replay.py": replay.main}  # fmt: skip
    args = [a.replace("$MODEL", str(model)).replace("$DATA", str(data_dir)) for a in argv[1:]]
    if argv[0] == "trainer.py":
        args += ["--eval-n", "16", "--max-new-tokens", "8", "--no-save-final"] + ["--steps", "2"] * (
            "--steps" not in args
        )
    capsys.readouterr()
    try:
        rc = mains[argv[0]](args) or 0
    except SystemExit as e:
        rc = e.code
    return rc, capsys.readouterr().out


def test_docs_journeys(sft_path, tmp_path, monkeypatch, capsys):
    """docs/from_verl.md, from_trl.md and my_run_is_flat.md: each command as written, on $DATA written here."""
    import re
    import shutil

    monkeypatch.chdir(tmp_path)  # the guides' runs/... folders land here
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    plain = "".join(json.dumps({"prompt": digits(a) + ">", "ground_truth": digits(a)[::-1]}) + "\n" for a in range(40))
    for name in ("verl", "trl", "flat"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "train.jsonl").write_text(plain)
    write_parquet(tmp_path / "verl" / "train.parquet", verl_rows(40))
    write_parquet(tmp_path / "verl" / "test.parquet", verl_rows(8, start=60))
    shutil.copy(ROOT / "examples" / "rewards_verl.py", tmp_path / "verl" / "my_reward.py")
    shutil.copy(ROOT / "examples" / "rewards_trl.py", tmp_path / "trl" / "my_rewards.py")
    for code in re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "my_run_is_flat.md").read_text(), re.S):
        (tmp_path / "flat" / re.match(r"# \$DATA/(\S+):?", code).group(1).rstrip(":")).write_text(code)
    result = lambda run: json.loads((tmp_path / "runs" / run / "result.json").read_text())

    (cmd,) = doc_commands(ROOT / "docs" / "from_verl.md")
    assert run_command(cmd, sft_path, tmp_path / "verl", capsys)[0] == 0
    out = result("from_verl")
    assert out["rollout/reward_mean"] == pytest.approx(out["reward/my_reward"]) and "eval/pass@4" in out
    assert next((tmp_path / "runs" / "from_verl" / "wandb").glob("offline-run-*/run-*.wandb")).stat().st_size > 0

    (cmd,) = doc_commands(ROOT / "docs" / "from_trl.md")
    assert run_command(cmd, sft_path, tmp_path / "trl", capsys)[0] == 0
    out = result("from_trl")
    both = out["reward/correct"] + 0.5 * out["reward/length_penalty"]
    assert out["rollout/reward_mean"] == pytest.approx(both) and out["reward/correct"] > 0

    flat, diag, show, dump, score, fixed = doc_commands(ROOT / "docs" / "my_run_is_flat.md")
    rc, log = run_command(flat, sft_path, tmp_path / "flat", capsys)
    rows = [json.loads(r) for r in (tmp_path / "runs" / "flat" / "metrics.jsonl").read_text().splitlines()]
    assert rc == 0 and len(rows) == 6 and "WARNING zero_variance_groups" in log, log
    assert all(r["rollout/reward_mean"] == 0 and r["rollout/zero_std_frac"] == 1 for r in rows)
    rc, log = run_command(diag, sft_path, tmp_path / "flat", capsys)
    assert rc == 1 and "zero_variance_groups @ step" in log, log
    rc, log = run_command(show, sft_path, tmp_path / "flat", capsys)
    assert rc == 0 and f"{tmp_path / 'flat' / 'train.jsonl'}:1: '<bos>000000>' -> ground truth '000000'" in log, log
    assert re.search(r"data:train.jsonl: (\d+) train rows, (\d+) held out", log), log
    rc, log = run_command(dump, sft_path, tmp_path / "flat", capsys)
    assert rc == 0 and "batch-1.pt" in log, log
    rc, log = run_command(score, sft_path, tmp_path / "flat", capsys)
    assert rc == 0 and "'42' -> 0.00" in log, log
    assert run_command(fixed, sft_path, tmp_path / "flat", capsys)[0] == 0
    rows = [json.loads(r) for r in (tmp_path / "runs" / "fixed" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["rollout/reward_mean"] > 0 and r["rollout/zero_std_frac"] < 1 for r in rows)
