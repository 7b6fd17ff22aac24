"""LoRA (lora.py): only the adapters train, the reference is the base exactly, saved adapters load through peft and
the merged save is the same function; single process, 2 DDP ranks and 2 FSDP2 ranks give the same run; a resume is
bit-exact; the embedded default still learns."""

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import lora
import trainer
from rollout import sequence_logprobs
from runlog import read_jsonl
from tasks import load_policy

ROOT = Path(__file__).resolve().parents[1]
GRAD_CHECK = ROOT / "tests" / "ddp_grad_check.py"


def lora_models(sft_path, **kw):
    cfg = trainer.Config(model=str(sft_path), task="reverse", adv_estimator="grpo", lora_rank=4, lr=1e-2, **kw)
    policy, policy_train, opt, ref, tokenizer, *_ = trainer.build_models(cfg, cfg.model, torch.device("cpu"), 1)
    return cfg, policy, opt, ref, tokenizer


def a_batch(policy, vocab: int):
    import importlib.util

    spec = importlib.util.spec_from_file_location("ddp_grad_check", GRAD_CHECK)
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    return check, check.make_batch(policy, vocab)


def test_only_adapters_train_and_the_reference_is_the_base(sft_path):
    """Three Adam steps of ppo_update on a LoRA policy: every base weight bit for bit as loaded, every adapter B
    moved (from 0), AdamW holds the adapters alone; the reference (adapters off) computes the base model's
    logprobs exactly, while the policy's moved away from them."""
    cfg, policy, opt, ref, tokenizer = lora_models(sft_path, micro_batch=3, ppo_epochs=1, minibatches=1)
    base, _ = load_policy(str(sft_path), "cpu")
    check, batch = a_batch(base, len(tokenizer))
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    adapters = {n for n, p in policy.named_parameters() if p.requires_grad}
    assert adapters and all(".lora_" in n for n in adapters)
    assert sum(p.numel() for g in opt.param_groups for p in g["params"]) == sum(before[n].numel() for n in adapters)
    for _ in range(3):
        trainer.ppo_update(cfg, policy, opt, None, batch, 1, torch.Generator().manual_seed(0), contextlib.nullcontext)
    for n, p in policy.named_parameters():
        if n in adapters:
            assert ".lora_A" in n or (p - before[n]).abs().max() > 1e-4, f"adapter {n} did not move"
        else:
            assert torch.equal(p, before[n]), f"base weight {n} changed"
    ids, attn, R = batch.input_ids, batch.attention_mask, check.R
    with torch.no_grad(), lora.adapters_off(ref, True):
        ref_logp = sequence_logprobs(ref, ids, attn, R)[0]
    with torch.no_grad():
        assert torch.equal(ref_logp, sequence_logprobs(base, ids, attn, R)[0])  # the reference is the base, exactly
        moved = (sequence_logprobs(policy, ids, attn, R)[0] - ref_logp).abs().max()
    assert moved > 1e-3, f"the adapters did not change the policy ({moved:.2e})"


def test_the_run_header_counts_the_trainable_adapters(sft_path):  # lora.params_line, in the trainer's header
    cfg, policy, *_ = lora_models(sft_path)
    total = sum(p.numel() for p in policy.parameters())
    adapters = sum(p.numel() for n, p in policy.named_parameters() if ".lora_" in n)
    line = lora.params_line(policy, cfg.lora_rank)
    assert line == f"{total / 1e6:.2f}M params ({adapters / 1e6:.3g}M trainable, LoRA rank 4)", line
    assert 0 < adapters < total / 10
    assert lora.params_line(policy, 0) == f"{total / 1e6:.2f}M params"  # without LoRA: every weight trains


def test_saved_adapters_load_through_peft_and_merge_to_the_same_function(sft_path, tmp_path):
    """The adapter folder (peft's layout) loads with peft's own PeftModel.from_pretrained onto the base, and the
    merged save (W0 + alpha / r B A) with AutoModelForCausalLM: both give the LoRA policy's logprobs."""
    from peft import PeftModel

    from checkpoint import save_policy

    cfg, policy, opt, _, tokenizer = lora_models(sft_path, micro_batch=3, ppo_epochs=1, minibatches=1)
    for name, p in policy.named_parameters():  # adapters away from their start, as after training (B = 0 there)
        if ".lora_B" in name:
            torch.nn.init.normal_(p, std=0.05)
    _, batch = a_batch(policy, len(tokenizer))
    save_policy(policy, tokenizer, tmp_path / "adapters", 0, vars(cfg))
    save_policy(policy, tokenizer, tmp_path / "merged", 0, vars(cfg), merge=True)
    assert (tmp_path / "adapters" / lora.ADAPTER_FILE).is_file() and not (
        tmp_path / "adapters/model.safetensors"
    ).exists()
    peft_model = PeftModel.from_pretrained(load_policy(str(sft_path), "cpu")[0], str(tmp_path / "adapters")).eval()
    merged, _ = load_policy(str(tmp_path / "merged"), "cpu")
    with torch.no_grad():
        want = sequence_logprobs(policy, batch.input_ids, batch.attention_mask, 7)[0]
        assert (sequence_logprobs(merged, batch.input_ids, batch.attention_mask, 7)[0] - want).abs().max() < 1e-5
    pos = (batch.attention_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        theirs = peft_model(
            input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=pos
        ).logits  # peft's
    logp = torch.log_softmax(theirs[:, -8:-1].float(), -1).gather(-1, batch.input_ids[:, -7:, None]).squeeze(-1)
    assert (logp - want).abs().max() < 1e-5


def test_lora_resume_is_bit_exact(sft_path, tmp_path):
    """A LoRA checkpoint holds the adapters alone (and AdamW's state of them): resumed, step 2 is the same bits."""
    kw = dict(model=str(sft_path), task="reverse", lora_rank=4, lr=1e-2, steps=2, prompts_per_step=4, group_size=4,
              eval_every=0, save_every=1)  # fmt: skip
    trainer.train(trainer.Config(**kw, out_dir=str(tmp_path / "a")))
    assert (tmp_path / "a/ckpt-1/policy" / lora.ADAPTER_FILE).is_file()
    assert not (tmp_path / "a/ckpt-1/policy/model.safetensors").exists()
    trainer.train(trainer.Config(**kw, out_dir=str(tmp_path / "b"), resume=str(tmp_path / "a/ckpt-1")))
    same = lambda row: {k: v for k, v in row.items() if not k.startswith(("time/", "perf/"))}  # noqa: E731
    assert [same(r) for r in read_jsonl(tmp_path / "b/metrics.jsonl")] == [
        same(read_jsonl(tmp_path / "a/metrics.jsonl")[1])
    ]


def test_lora_under_ddp_and_fsdp_is_the_same_run(sft_path, tmp_path):
    """LoRA on 2 ranks through DDP and through FSDP2 (the adapters sharded with their frozen base): the same 2
    iterations within 1e-5, and the same saved adapters."""
    flags = ["trainer.py", "--model", str(sft_path), "--task", "reverse", "--steps", "2", "--prompts-per-step"]
    flags += ["4", "--group-size", "4", "--eval-every", "0", "--lora-rank", "4", "--lr", "1e-2", "--dist-timeout", "60"]
    runs = {}
    for name, extra in (("ddp", []), ("fsdp", ["--fsdp"])):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *flags, *extra]
        proc = subprocess.run([*cmd, "--out-dir", str(tmp_path / name)], cwd=ROOT, capture_output=True, text=True,
                              timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        runs[name] = read_jsonl(tmp_path / name / "metrics.jsonl")
    for a, b in zip(runs["ddp"], runs["fsdp"], strict=True):  # (the critic's footprint is measured on whole models)
        keys = [k for k in a if not k.startswith(("time/", "perf/", "critic/params", "critic/mem", "critic/actor"))]
        worst = max(keys, key=lambda k: abs(a[k] - b[k]))
        assert abs(a[worst] - b[worst]) < 1e-5, (a["step"], worst, a[worst], b[worst])
    from safetensors.torch import load_file

    ddp, fsdp = (load_file(tmp_path / name / "policy" / lora.ADAPTER_FILE) for name in ("ddp", "fsdp"))
    assert ddp.keys() == fsdp.keys() and max((ddp[k] - fsdp[k]).abs().max().item() for k in ddp) < 1e-5
    assert max(ddp[k].abs().max().item() for k in ddp if "lora_B" in k) > 1e-4  # trained: B moved from 0


def test_embedded_default_learns_with_lora(tmp_path, default_sft_path):
    """`python trainer.py --adv-estimator grpo --lora-rank 8 --lr 2e-3`: rank-8 adapters on every linear layer
    (RESULTS.md: 0.235 -> 0.730 greedy on 200 held-out prompts for seed 0, the full model's 0.785 within 6 points)
    raise held-out greedy accuracy by at least 30 points; as in test_learning, an lr = 0 run stays at the start
    exactly (greedy decoding of unchanged weights), so the start is the control."""
    cfg = trainer.Config(adv_estimator="grpo", lora_rank=8, lr=2e-3, eval_every=90, eval_n=200, out_dir=str(tmp_path),
                    kl_metric_every=0)  # fmt: skip
    (_, start), (step, end) = trainer.train(cfg)["eval_history"]
    assert step == cfg.steps and end - start >= 0.30, (start, end)


def test_lora_and_fsdp_flags_fail_loudly(monkeypatch):
    """Each refusal names its field: a rank below 0, an alpha of 0, no targets, targets the model lacks, the flags
    that need one process or whole models, the async trainer; without peft the message says what to install."""
    import async_loop
    from tasks import make_tiny_model, make_tokenizer

    refused = [
        ({"lora_rank": -1}, "lora_rank"),
        ({"lora_alpha": 0.0}, "lora_alpha"),
        ({"lora_rank": 4, "lora_targets": []}, "lora_targets"),
        ({"fsdp": True, "dump_batch": 2}, "fsdp"),
        ({"lora_rank": 4, "credit": "attention"}, "lora_rank"),
    ]
    for kw, field in refused:
        with pytest.raises(ValueError, match=field):
            trainer.Config(**kw)
    with pytest.raises(ValueError, match="async trainer is one rank"):
        async_loop.AsyncConfig(fsdp=True)
    model = make_tiny_model(make_tokenizer())
    with pytest.raises(ValueError, match="lora_targets.*no_such_proj"):
        lora.add_adapters(model, lora.LoraArgs(lora_rank=4, lora_targets=["no_such_proj"]))
    monkeypatch.setitem(sys.modules, "peft", None)  # as if not installed
    with pytest.raises(ImportError, match="pip install peft"):
        lora.add_adapters(model, lora.LoraArgs(lora_rank=4))
