"""Every error of the foundation issue's "Errors" list: it is raised, and its message says what is wrong.

(The dead-rank error lives with the torchrun tests.)
"""

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import agent_train
import async_loop
import cli
import common
import critics
import data
import replay
import tasks
import trainer
from experiments import asyppo, credit
from rewards import NUMBER, RewardArgs, exact_number, math_exact_score
from rollout import generate
from tasks import tokenize_prompts

ROOT = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------------------------
# Config values


@pytest.mark.parametrize(
    "field,value,allowed",
    [
        ("lr", -1e-4, "[0, inf)"),
        ("seed", -1, "[0, inf)"),
        ("critic_lr", float("nan"), "[0.0, inf)"),
        ("steps", -1, "[0, inf)"),
        ("group_size", 0, "[1, inf)"),
        ("micro_batch", 0, "[1, inf)"),
        ("max_prompt_len", 0, "[1, inf)"),
        ("clip_low", 1.0, "(0, 1)"),
        ("clip_low", 0.0, "(0, 1)"),
        ("clip_high", 0.0, "(0, inf)"),
        ("value_clip", -0.5, "(0, inf)"),
        ("temperature", 0.0, "(0, inf)"),
        ("top_p", 0.0, "(0, 1]"),
        ("top_p", 1.5, "(0, 1]"),
        ("top_k", -1, "[0, inf)"),
        ("gamma", 1.01, "[0, 1]"),
        ("lam", -0.1, "[0, 1]"),
        ("dual_clip", 1.0, "(1, inf)"),
        ("adam_eps", 0.0, "(0, inf)"),
        ("grad_clip", float("inf"), "(0, inf)"),
        ("dist_timeout", 0.0, "(0.0, inf)"),
        ("sft_target", 0.0, "(0, 1]"),
        ("min_lr_ratio", 1.5, "[0, 1]"),
        ("n_critics", 0, "[1, inf)"),  # the concepts' Args classes (critics, attention_credit, offpolicy, envs)
        ("asyppo_k", 1.5, "[0.0, 1.0]"),
        ("credit_q", 0.0, "(0.0, 1.0]"),
        ("is_cap", 0.5, "[1.0, inf)"),
        ("max_turns", 0, "[1, inf)"),
        ("env_latency", -1.0, "[0.0, inf)"),
        ("dump_batch", 91, "[0, 90]"),
    ],
)
def test_config_range_errors_name_field_and_range(field, value, allowed):
    with pytest.raises(ValueError) as e:
        trainer.Config(**{field: value})
    msg = str(e.value)
    assert f"'{field}'" in msg and allowed in msg, msg


def test_experiment_configs_check_their_fields():
    for config, field, value in (
        (asyppo.Config, "jobs", 0),
        (credit.Config, "seeds", 0),
        (critics.Config, "prompts", 0),
    ):
        with pytest.raises(ValueError, match=f"'{field}' = {value} is out of range"):
            config(**{field: value})


@pytest.mark.parametrize(
    "field,value",
    [
        ("adv_estimator", "ppo"),
        ("loss_agg", "mean"),
        ("kl_ctrl", "adaptve"),
        ("kl_loss_type", "k4"),
        ("lr_schedule", "linear"),
    ],
)
def test_config_choice_errors_list_the_choices(field, value):
    with pytest.raises(ValueError) as e:
        trainer.Config(**{field: value})
    msg = str(e.value)
    assert f"'{field}'" in msg and repr(value) in msg and "must be one of" in msg, msg


def test_config_min_lr_ratio_needs_the_cosine_schedule_and_sft_target_is_derived():
    with pytest.raises(ValueError, match="'min_lr_ratio' = 0.1 needs lr_schedule 'cosine'"):
        trainer.Config(lr_schedule="constant", min_lr_ratio=0.1)
    assert (
        trainer.Config(task="sort").sft_target == 0.15 and trainer.Config(task="reverse").sft_target == 0.30
    )  # recorded
    assert trainer.Config(task="sort", sft_target=0.4).sft_target == 0.4


def test_config_env_url_needs_a_multi_turn_task_at_load():
    with pytest.raises(ValueError, match="'env_url' needs a multi-turn environment as --task, not 'sort'"):
        trainer.Config(task="sort", env_url="http://127.0.0.1:1")
    assert trainer.Config(task="calc", env_url="http://127.0.0.1:1").env_url  # checked at load, not contacted


def test_config_max_new_tokens_must_hold_the_tasks_answers():
    """Else every answer is cut before its end and scores ~0 (the embedded byte tokenizer: a token per byte)."""
    with pytest.raises(ValueError, match="'max_new_tokens' = 16: chain's answers need up to 44 tokens with EOS"):
        trainer.Config(task="chain")
    with pytest.raises(ValueError, match=r"countdown's answers need up to 4\d tokens .* --max-new-tokens 64\)"):
        trainer.Config(task="countdown", max_new_tokens=32)
    assert trainer.Config(task="countdown", max_new_tokens=64) and trainer.Config(task="sort")  # sort: 7
    assert trainer.Config(task="chain", model="M")  # a model of its own: its tokenizer may count otherwise


def test_config_group_estimators_need_groups():
    for est in ("grpo", "rloo"):
        with pytest.raises(ValueError, match=rf"'group_size' = 1: {est} needs >= 2"):
            trainer.Config(adv_estimator=est, group_size=1)
    trainer.Config(adv_estimator="gae", group_size=1)  # PPO with a critic is fine with one sample per prompt


def test_flags_that_would_do_nothing_are_errors():
    for kw, msg in [
        (dict(critic="asyppo", adv_estimator="grpo"), r"'critic' = 'asyppo' needs adv_estimator 'gae', not 'grpo'"),
        (dict(critic="asyppo", adv_estimator="rloo"), r"not 'rloo': rloo has no critic"),
        (dict(critic_warmup_steps=5, steps=5), r"'critic_warmup_steps' = 5 >= steps = 5: the actor would never"),
        (dict(kl_ctrl="adaptive"), r"'kl_ctrl' = 'adaptive' needs --kl-in-reward"),
    ]:
        with pytest.raises(ValueError, match=msg):
            trainer.Config(**kw)
    trainer.Config(critic="asyppo", critic_warmup_steps=4, steps=5, kl_ctrl="adaptive", kl_in_reward=True)  # all used


def test_config_errors_from_the_command_line():
    with pytest.raises(ValueError, match=r"'lr' = -1.0 is out of range"):
        cli.parse_config(trainer.Config, ["--lr", "-1"])
    with pytest.raises(SystemExit):  # argparse rejects a choice outside the Literal
        cli.parse_config(trainer.Config, ["--adv-estimator", "ppo"])
    cfg = cli.parse_config(trainer.Config, ["--clip-high", "0.28", "--dual_clip", "none", "--no-grpo-norm-std"])
    assert (cfg.clip_high, cfg.dual_clip, cfg.grpo_norm_std) == (0.28, None, False)


def test_check_helpers():
    cli.check_range("x", 0.5, 0.0, 1.0)
    with pytest.raises(ValueError, match=r"'x' = 1.5 is out of range: allowed \[0.0, 1.0\)"):
        cli.check_range("x", 1.5, 0.0, 1.0, hi_open=True)
    with pytest.raises(ValueError, match=r"'x' = None"):
        cli.check_range("x", None, 0)
    with pytest.raises(ValueError, match=r"'mode' = 'b': must be one of \['a'\]"):
        cli.check_choice("mode", "b", ["a"])


def test_help_lists_every_field_with_default_and_meaning():
    env = {**os.environ, "COLUMNS": "1000", "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "trainer.py", "--help"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    # one block per option: "  --flag METAVAR, --alias METAVAR   help text (default: X)"; the help text
    # follows the option strings after a run of >= 2 spaces or a newline
    blocks = {}  # the group headers ("Config (trainer.py):") and their descriptions are left out
    options_text = "\n".join(
        line for line in out.stdout.split("options:")[1].splitlines() if line.startswith(("  -", "    "))
    )
    for block in re.split(r"\n  (?=-)", options_text):
        options, _, help_text = block.strip().partition("  ")
        blocks[options.split()[0].rstrip(",")] = (options, " ".join(help_text.split()))
    for f in dataclasses.fields(trainer.Config):
        flag = "--" + f.name.replace("_", "-")
        assert flag in blocks, f"--help does not list {flag}"
        options, text = blocks[flag]
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        assert text.endswith(f"(default: {default})"), f"{flag}: no default in {text!r}"
        meaning = text[: -len(f"(default: {default})")].strip()
        assert len(meaning) > 10, f"{flag}: no meaning in {text!r} (options {options!r})"
    assert blocks["--steps"][1] == f"Number of RL iterations. (default: {trainer.Config.steps})"
    assert blocks["--adv-estimator"][1].endswith("(default: gae)")
    flags = re.findall(r"(?<![\w-])--[a-z][\w-]*", options_text)
    assert not [f for f in flags if "_" in f], "--help spells a flag with underscores"
    assert len(blocks) == len(dataclasses.fields(trainer.Config)) + 1, "one block per field, plus --help"
    for options, _ in blocks.values():  # each flag once: no alias in the option strings
        assert len([o for o in options.split() if o.startswith("--")]) <= 2, options  # --x / --no-x for a bool


def test_help_reads_top_down_for_a_newcomer(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    with pytest.raises(SystemExit):
        cli.parse_config(trainer.Config, ["--help"])
    out = capsys.readouterr().out
    head, _, options = out.partition("options:")
    assert out.splitlines()[0].endswith(" [-h] [--FLAG VALUE ...]   (flags below, grouped by concern)")
    examples = [line for line in head.splitlines() if line.startswith("    ")]  # the description: a few lines
    assert 3 <= len(examples) <= 4 and all("trainer.py" in e for e in examples) and "README.md" in head
    assert len(head.splitlines()) < 15
    groups = re.findall(r"^(\w+) \((\w+\.py)\):$", options, re.M)  # one group per Args class, everyday ones first
    assert [g for g, _ in groups[:4]] == ["TaskArgs", "Config", "DataArgs", "RewardArgs"] and len(groups) == 15
    assert options.index("--model MODEL") < options.index("--steps STEPS") < options.index("--lora-rank")
    assert "NO_EOS_PENALTY" not in out and "--no-eos-penalty NUMBER" in out  # a value, not a switch
    for choices in re.findall(r"\{([\w,-]+)\}", out):
        names = choices.split(",")
        assert "None" not in names and len(names) == len(set(names)), choices  # None once, spelled "none"
    assert "--off-policy {none,behav,tis,decoupled}" in out and "--rollout-is {token,sequence,none}" in out
    assert "TRL's" in out and "(TRL's;" not in out  # the jargon follows a plain sentence


def test_none_on_the_command_line():
    cfg = cli.parse_config(trainer.Config, ["--rollout-is", "none", "--no-eos-penalty", "-1", "--inject", "None"])
    assert (cfg.rollout_is, cfg.no_eos_penalty, cfg.inject) == (None, -1.0, None)
    import async_loop  # "none" is a choice of its own: no correction, where the unset default means tis

    assert cli.parse_config(async_loop.AsyncConfig, ["--off-policy", "none"]).off_policy == "none"
    assert cli.parse_config(async_loop.AsyncConfig, []).off_policy == "tis"


def test_flags_spelled_with_underscores_still_parse():
    cfg = cli.parse_config(trainer.Config, ["--max_new_tokens", "8", "--no-kl_loss", "--out_dir=runs/x", "--seed", "3"])
    assert (cfg.max_new_tokens, cfg.kl_loss, cfg.out_dir, cfg.seed) == (8, False, "runs/x", 3)
    cfg = cli.parse_config(trainer.Config, ["--off-policy", "none", "--model", "my_dir/with_under_scores"])
    assert cfg.off_policy == "none" and cfg.model == "my_dir/with_under_scores"  # values are left as they are


# ----------------------------------------------------------------------------------------------
# Rewards


class FakeTask:
    name = "fake-task"

    def compute_score(self, solution_str: str, ground_truth: str) -> float:
        if "boom" in solution_str:
            raise KeyError("parser exploded")
        if "nan" in solution_str:
            return float("nan")
        if "inf" in solution_str:
            return float("inf")
        return float(solution_str == ground_truth)


def test_reward_that_raises_names_task_sample_and_text():
    problems = [{"ground_truth": "1"}] * 3
    with pytest.raises(RuntimeError) as e:
        tasks.score_responses(FakeTask(), ["1", "2", "xx boom xx"], problems)
    msg = str(e.value)
    assert "'fake-task'" in msg and "sample 2" in msg and "'xx boom xx'" in msg and "parser exploded" in msg, msg
    assert isinstance(e.value.__cause__, KeyError)


@pytest.mark.parametrize("text,what", [("a nan", "nan"), ("-inf!", "inf")])
def test_reward_non_finite_names_task_sample_and_text(text, what):
    with pytest.raises(ValueError) as e:
        tasks.score_responses(FakeTask(), ["1", text], [{"ground_truth": "1"}] * 2)
    msg = str(e.value)
    assert "'fake-task'" in msg and "sample 1" in msg and repr(text) in msg and what in msg, msg


def test_rewards_that_work_give_floats():
    assert tasks.score_responses(FakeTask(), ["1", "2"], [{"ground_truth": "1"}] * 2) == [1.0, 0.0]


# ----------------------------------------------------------------------------------------------
# Prompts, tokenizers, model paths


def test_prompt_longer_than_max_prompt_len():
    tok = tasks.make_tokenizer()
    with pytest.raises(ValueError) as e:
        tokenize_prompts(tok, ["12>", "123456789>"], max_prompt_len=8)
    msg = str(e.value)
    assert "prompt 1" in msg and "10 tokens" in msg and "max_prompt_len=8" in msg and "123456789>" in msg, msg
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        tokenize_prompts(tok, [""], max_prompt_len=8)


def test_prompt_too_long_stops_training(sft_path, tmp_path):
    # the embedded default's prompt "<bos>123456>" has 8 tokens
    cfg = trainer.Config(
        model=str(sft_path), task="reverse", max_prompt_len=5, steps=1, eval_every=0, out_dir=str(tmp_path / "run")
    )
    with pytest.raises(ValueError, match=r"tokens > max_prompt_len=5"):
        trainer.train(cfg)


def save_tiny(tmp_path, tok) -> str:
    torch.manual_seed(0)
    tasks.make_tiny_model(tasks.make_tokenizer()).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    return str(tmp_path)


def test_tokenizer_without_pad_gets_eos_and_says_so(tmp_path, capsys):
    tok = tasks.make_tokenizer()
    tok.pad_token = None
    assert tok.pad_token_id is None
    path = save_tiny(tmp_path, tok)
    model, loaded = tasks.load_policy(path, "cpu")
    out = capsys.readouterr().out
    assert "has no pad token" in out and "'<eos>'" in out and path in out, out
    assert loaded.pad_token_id == loaded.eos_token_id == tok.eos_token_id
    assert not model.training  # dropout off


def test_tokenizer_without_eos_is_an_error(tmp_path):
    tok = tasks.make_tokenizer()
    tok.eos_token = None
    path = save_tiny(tmp_path, tok)
    with pytest.raises(ValueError, match=r"has no eos token"):
        tasks.load_policy(path, "cpu")


def test_generate_without_stop_token_is_an_error():
    tok = tasks.make_tokenizer()
    ids, attention_mask = tokenize_prompts(tok, ["1"], 4)
    with pytest.raises(ValueError, match="stop token"):
        generate(tasks.make_tiny_model(tok), ids, attention_mask, max_new_tokens=2, eos_token_ids=[], pad_token_id=0)


@pytest.mark.parametrize("name", ["/no/such/model/dir", "./missing-model", "~/missing-model", "tests/no_such_model"])
def test_model_path_that_does_not_exist(name):
    with pytest.raises(FileNotFoundError) as e:
        tasks.resolve_model_path(name)
    assert repr(name) in str(e.value) and "does not exist" in str(e.value)
    with pytest.raises(FileNotFoundError, match=re.escape(repr(name))):
        tasks.load_policy(name, "cpu")


def test_model_folder_that_is_not_a_model(tmp_path):
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises((FileNotFoundError, OSError, ValueError)) as e:
        tasks.load_policy(str(tmp_path), "cpu")
    assert str(tmp_path) in str(e.value), f"the error does not name the folder: {e.value}"


def test_models_that_cannot_be_trained_are_refused_at_load_with_the_reason(tmp_path):
    from transformers import BertConfig, BertForMaskedLM, T5Config, T5EncoderModel

    tok, small = tasks.make_tokenizer(), dict(num_attention_heads=2, intermediate_size=64)
    bert = BertForMaskedLM(BertConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=1, **small))
    t5 = T5EncoderModel(T5Config(vocab_size=len(tok), d_model=32, num_layers=1, num_heads=2, d_ff=64, d_kv=16))
    for name, model in (("bert", bert), ("t5", t5), ("no_tokenizer", tasks.make_tiny_model(tok))):
        model.save_pretrained(tmp_path / name)
        if name != "no_tokenizer":
            tok.save_pretrained(tmp_path / name)
    with pytest.raises(TypeError, match=r"'.*bert' \(BertLMHeadModel\) is not causal: position t's logits depend"):
        tasks.load_policy(str(tmp_path / "bert"), "cpu")  # loads through a causal-LM head, but attends both ways
    with pytest.raises(TypeError, match=r"'.*t5' is a t5 model, .*: pick one such as Qwen2"):
        tasks.load_policy(str(tmp_path / "t5"), "cpu")
    with pytest.raises(FileNotFoundError, match=r"'.*no_tokenizer' has no tokenizer .*tokenizer.save_pretrained"):
        tasks.load_policy(str(tmp_path / "no_tokenizer"), "cpu")  # transformers would build some tokenizer silently
    tok.save_pretrained(tmp_path / "no_tokenizer")
    weights = tmp_path / "no_tokenizer" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ValueError, match=r"could not read the weights of model '.*no_tokenizer' \(SafetensorError"):
        tasks.load_policy(str(tmp_path / "no_tokenizer"), "cpu")


def test_replay_of_a_file_that_is_not_a_dump(tmp_path):
    (tmp_path / "random.pt").write_bytes(os.urandom(4096))
    torch.save({"step": 3, "config": "{}"}, tmp_path / "state.pt")  # a checkpoint's state.pt, say
    with pytest.raises(ValueError, match=r"random.pt: not a readable --dump-batch file \(\w+\)") as e:
        replay.replay(str(tmp_path / "random.pt"))
    assert "weights_only" not in str(e.value)  # never the advice to unpickle it
    with pytest.raises(ValueError, match=r"state.pt: not a --dump-batch file \(it has no \['batch', 'policy'\]\)"):
        replay.replay(str(tmp_path / "state.pt"))


def test_device_cuda_without_cuda_names_the_field(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # on any machine, a GPU one too
    with pytest.raises(ValueError, match=r"'device' = 'cuda': CUDA is not available here: use --device cpu"):
        common.setup_dist(device="cuda")


def test_hub_style_name_is_passed_to_the_hub():
    assert tasks.resolve_model_path("Qwen/Qwen2.5-0.5B") == "Qwen/Qwen2.5-0.5B"
    assert tasks.resolve_model_path("gpt2") == "gpt2"  # hub ids without an org exist too


# ----------------------------------------------------------------------------------------------
# --data files, task and reward names


def write(tmp_path, text: str) -> str:
    p = tmp_path / "data.jsonl"
    p.write_text(text)
    return str(p)


def data_task(path, reward="math_exact", tokenizer=None, max_prompt_len=None):
    """The trainer's task for --data PATH --reward REWARD (in the trainer's process: no reward workers)."""
    return data.DataTask(data.DataArgs(data=path), RewardArgs(reward=[reward]), tokenizer, max_prompt_len)


def test_data_bad_json_names_the_line(tmp_path):
    good = json.dumps({"prompt": "1+1=", "ground_truth": "2"})
    path = write(tmp_path, f"{good}\n\n{{'prompt': 'single quotes'}}\n{good}\n")
    with pytest.raises(ValueError) as e:
        data_task(path)
    msg = str(e.value)
    assert f"{path}:3:" in msg and "not valid JSON" in msg and "single quotes" in msg, msg


@pytest.mark.parametrize(
    "row,what",
    [({"prompt": "1+1="}, "no ground_truth (nor reward_model.ground_truth): reward 'math_exact' reads one"),
     ({"ground_truth": "2"}, "'prompt' must be a string or a list of chat messages, got 'None'"),
     ({"prompt": 5, "ground_truth": "2"}, "'prompt' must be a string or a list of chat messages, got '5'"),
     (["1+1=", "2"], "expected a JSON object per line"),
     ({"prompt": [{"role": "user"}], "ground_truth": "2"}, "prompt message 0 is \"{'role': 'user'}\", not"),
     ({"prompt": [{"role": "system", "content": "x"}], "ground_truth": "2"}, "the prompt's messages have no 'user'")],
)  # fmt: skip
def test_data_missing_keys_names_the_line(tmp_path, row, what):
    good = json.dumps({"prompt": "1+1=", "ground_truth": "2"})
    path = write(tmp_path, f"{good}\n{json.dumps(row)}\n")
    with pytest.raises(ValueError) as e:
        data_task(path)
    msg = str(e.value)
    assert msg.startswith(f"{path}:2: ") and what in msg, msg


@pytest.mark.parametrize("text", ["", "\n\n  \n"])
def test_data_empty_file(tmp_path, text):
    path = write(tmp_path, text)
    with pytest.raises(ValueError, match=r"data file '.*data.jsonl' has no rows: a run needs at least one prompt"):
        data_task(path)


def test_data_file_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        data_task(str(tmp_path / "nope.jsonl"))


def test_data_file_that_works(tmp_path):
    rows = [{"prompt": f"{a}+{a}=", "ground_truth": 2 * a} for a in range(40)]
    path = write(tmp_path, "\n".join(json.dumps(r) for r in rows) + "\n")
    task = data_task(path, "math_exact")
    assert len(task.rows["train"]) + len(task.rows["eval"]) == 40
    row = next(r for r in task.rows["train"] + task.rows["eval"] if r["ground_truth"] == 14)  # a number stays one
    assert task.score_batch([row, row], ["the answer is 14", "13"], [[1], [1]])[:2] == ([1.0, 0.0], [True, False])


def test_data_rows_are_all_checked_at_load(tmp_path, capsys):
    """UTF-8 with file:line, one answer per prompt, duplicates and unknown characters counted, and with a tokenizer
    every prompt's length in tokens: all at load, where the probe crashed at the step that first sampled a row."""
    rows = [{"prompt": f"{a}+{a}=", "ground_truth": 2 * a} for a in range(30)]
    good = "".join(json.dumps(r) + "\n" for r in rows)
    path = tmp_path / "data.jsonl"
    path.write_bytes(good.encode() + b'{"prompt": "caf\xe9", "ground_truth": "1"}\n')  # latin-1 on line 31
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}:31: not UTF-8 \(byte 16 .*re-encode the file"):
        data_task(str(path))
    path.write_text(good + json.dumps({"prompt": "3+3=", "ground_truth": "7"}) + "\n")
    with pytest.raises(ValueError, match=r":31: prompt '3\+3=' has ground_truth '7' here but '6' at .*data.jsonl:4"):
        data_task(str(path))
    sep = "\u2028"  # a line separator inside a JSON string is not a line break of the file
    extra = [{"prompt": "3+3=", "ground_truth": 6}, {"prompt": f"9{sep}+9\u00e9=", "ground_truth": 18}]
    path.write_text(good + "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in extra))
    tok = tasks.make_tokenizer()  # byte-level: every character tokenizes, nothing to report
    task = data_task(str(path), tokenizer=tok, max_prompt_len=16)
    assert len(task.rows["train"]) + len(task.rows["eval"]) == 32
    out = capsys.readouterr().out
    assert "1 of its 32 rows repeat an earlier row" in out and "unknown token" not in out, out
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(tasks.SPECIALS + list("0123456789+="))}  # a vocabulary with no 'é'
    chars = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    chars.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    chars = PreTrainedTokenizerFast(tokenizer_object=chars, pad_token="<pad>", unk_token="<unk>")
    data_task(str(path), tokenizer=chars, max_prompt_len=16)
    out = capsys.readouterr().out
    assert "2 characters of the prompts map to the unknown token <unk>: '\\u2028' x1, 'é' x1" in out, out
    data.check_rows([data.normalize_row(rows[0], "x:1", "x")], ["exact"], tok)  # no length limit: nothing to compare
    path.write_text(good + json.dumps({"prompt": "1" * 20 + "=", "ground_truth": 0}) + "\n")  # line 31: 22 tokens
    with pytest.raises(
        ValueError, match=r"1 prompts are longer than max_prompt_len=16 tokens .*data.jsonl:31 \(22 tok"
    ):
        data_task(str(path), tokenizer=tok, max_prompt_len=16)


def test_a_data_prompt_too_long_stops_the_run_before_its_first_step(sft_path, tmp_path):
    rows = [{"prompt": f"{a}{a + 1}>", "ground_truth": f"{a + 1}{a}"} for a in range(40)] + [{"prompt": "12" * 40}]
    rows[-1]["ground_truth"] = "1"
    path = write(tmp_path, "".join(json.dumps(r) + "\n" for r in rows))
    cfg = trainer.Config(
        model=str(sft_path), data=path, reward="exact", steps=2, eval_every=0, out_dir=str(tmp_path / "r")
    )
    with pytest.raises(ValueError, match=r"data.jsonl:41 \(81 tokens\)"):
        trainer.train(cfg)
    assert not (tmp_path / "r" / "metrics.jsonl").exists()


def test_math_exact_compares_numbers_exactly():
    # through floats, 20-digit integers that differ in the last digit were equal, 0 equalled 1e-12, and a
    # 400-digit answer overflowed
    score = math_exact_score
    assert score("12345678901234567891", "12345678901234567890") == 0.0
    assert score("12345678901234567890", "12345678901234567890") == 1.0
    assert score("0", "1e-12") == 0.0 and score("so 0.50", "0.5") == 1.0 and score("-3", "-3.0") == 1.0
    assert score("7" * 400, "7" * 400) == 1.0 and score("7" * 399 + "8", "7" * 400) == 0.0
    assert score("1" + "0" * 309, "1e309") == 1.0 and score("no number here", "3") == 0.0


def test_math_exact_reads_thousands_exponents_signs_and_decimals_as_one_number():
    """rewards.NUMBER, one grammar for the responses and the load check: "1,000" was read as 1 and 000 (equal to 0),
    "1e-12" as 1 and -12, and a ground truth 1e3 passed the load check but no response could match it."""
    score = math_exact_score
    assert score("1,000", "0") == 0.0 and score("1e-12", "-12") == 0.0
    assert score("answer: 1,000", "1000") == 1.0 and score("1000", "1,000") == 1.0
    assert score("so 1e3", "1e3") == 1.0 and score("1000", "1e3") == 1.0 and score("2.5E3", "2500") == 1.0
    assert score("3-5", "5") == 1.0 and score("3-5", "-5") == 0.0 and score("x = -5", "-5") == 1.0
    assert score("half is .5", "0.5") == 1.0 and score("1,2,3", "3") == 1.0 and score("1,0000", "0") == 1.0
    assert NUMBER.findall("12,345,67 and +7") == ["12,345", "67", "+7"]
    for text in ("nan", "inf", "1/2", "1,00", "5.", "1 000"):
        with pytest.raises(ValueError, match="is not a number"):
            exact_number(text)


@pytest.mark.parametrize(
    "reward,truth", [("math_exact", "nan"), ("math_exact", "1,00"), ("math_exact", "1/2"), ("digits", " ")]
)
def test_a_ground_truth_the_reward_cannot_score_is_an_error_at_load(tmp_path, reward, truth):
    rows = [{"prompt": f"{a}+{a}=", "ground_truth": 2 * a} for a in range(5)]
    rows.insert(2, {"prompt": "x=", "ground_truth": truth})  # line 3
    path = write(tmp_path, "\n".join(json.dumps(r) for r in rows) + "\n")
    with pytest.raises(ValueError, match=rf"{re.escape(path)}:3: (ground_truth|empty ground_truth)"):
        data_task(path, reward)


def test_unknown_task():
    with pytest.raises(ValueError) as e:
        tasks.make_task("reverse-words")
    msg = str(e.value)
    assert "'task'" in msg and "'reverse-words'" in msg and "reverse" in msg and "--data" in msg, msg
    with pytest.raises(ValueError, match=r"'task' = 'reverse-words'"):
        trainer.Config(task="reverse-words")


def test_bad_reward_name(tmp_path):
    path = write(tmp_path, json.dumps({"prompt": "1+1=", "ground_truth": "2"}) + "\n")
    with pytest.raises(ValueError) as e:
        data_task(path, "fuzzy")
    msg = str(e.value)
    assert "'reward'" in msg and "'fuzzy'" in msg and "math_exact" in msg and "FILE.py[:FN]" in msg, msg
    with pytest.raises(ValueError, match=r"'reward' = 'fuzzy'"):
        trainer.Config(data=path, reward="fuzzy")


def test_the_vllm_engine_says_what_to_install_and_where_it_does_not_run(monkeypatch):
    import vllm_engine

    monkeypatch.setitem(sys.modules, "vllm", None)  # as in the project's own venv: vLLM has one of its own
    with pytest.raises(
        ImportError, match=r"--rollout-engine vllm needs vLLM: bash scripts/install_vllm.sh makes a venv"
    ):
        vllm_engine.Engine("/nowhere")
    with pytest.raises(ValueError, match="'rollout_engine' = 'vllm': rollout ranks sample with hf"):
        async_loop.AsyncConfig(rollout_engine="vllm")  # async_ratio 1: a rollout worker
    async_loop.AsyncConfig(rollout_engine="vllm", async_ratio=0)  # one process: trainer.train's own sampler
    policy = object()  # a sampler of its own samples by its own means: the policy is what train() gets back
    vllm_cfg = trainer.Config(rollout_engine="vllm")
    assert vllm_engine.sampling_engine(vllm_cfg, policy, "/nowhere", sampler=print) is policy
    trainer.Config(rollout_engine="vllm", rollout_dtype="bfloat16", fsdp=True)  # the engine's dtype; FSDP2 gathered
    with pytest.raises(ValueError, match="'rollout_dtype' = 'bfloat16' needs whole weights to copy"):
        trainer.Config(rollout_dtype="bfloat16", fsdp=True)  # our own copy of the weights: not from shards
    monkeypatch.setenv("WORLD_SIZE", "2")
    trainer.Config(rollout_engine="vllm", task="calc")  # multi-turn under torchrun: the ranks agree on each call
    with pytest.raises(ValueError, match="'rollout_engine' = 'vllm' needs world size 1 here: each rank's proxy"):
        agent_train.AgentConfig(rollout_engine="vllm")
