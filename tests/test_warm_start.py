"""The SFT warm start's cache under concurrency: a whole folder or none, whichever rank gets the lock first.

transformers' save_pretrained writes no model on a torch.distributed rank other than 0; a warm start built there
used to be cached without its model (tokenizer and sft.json only), and every later run failed to load it.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import warm_start

ROOT = Path(__file__).resolve().parents[1]
# a warm start that stops within seconds: no lr warm-up, a check every step, a target a few right answers reach
QUICK = warm_start.SFTConfig(task="add", target_acc=0.01, batch_size=32, check_every=1, warmup=0)

SCRIPT = """
import sys, time
from pathlib import Path
import torch.distributed as dist
import transformers
import warm_start
dist.init_process_group("gloo")
if dist.get_rank() == 0:
    time.sleep(3)  # rank 1 reaches the cache first: before the fix it built the warm start, and saved no model
cfg = warm_start.SFTConfig(task="add", target_acc=0.01, batch_size=32, check_every=1, warmup=0)
path = warm_start.sft_warm_start(cfg, cache_dir=Path(sys.argv[1]), verbose=False)
transformers.AutoModelForCausalLM.from_pretrained(path)  # the cached folder loads on every rank
print(f"rank {dist.get_rank()} loaded {path.name}", flush=True)
dist.barrier()
dist.destroy_process_group()
"""


def test_under_torchrun_rank0_builds_and_every_rank_loads_the_whole_folder(tmp_path):
    script = tmp_path / "build.py"
    script.write_text(SCRIPT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [*cmd, str(tmp_path / "cache")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count(" loaded sft-add-") == 2, proc.stdout
    (folder,) = [p for p in (tmp_path / "cache").iterdir() if p.is_dir()]
    assert {"config.json", "model.safetensors", "tokenizer.json", "sft.json"} <= {p.name for p in folder.iterdir()}


def test_a_rank_other_than_0_times_out_naming_what_it_waits_for(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 1)
    with pytest.raises(TimeoutError, match="rank 1: no SFT warm start at .*sft-add-.* rank 0 builds it"):
        warm_start.sft_warm_start(QUICK, cache_dir=tmp_path, verbose=False, wait_s=1.0)


def test_a_cached_folder_without_a_model_is_an_error_naming_it(tmp_path):
    out = tmp_path / f"sft-add-{warm_start.sft_cache_key(QUICK)}"
    out.mkdir()
    (out / "sft.json").write_text("{}")  # what a rank other than 0 cached before the fix: no config, no weights
    with pytest.raises(RuntimeError, match=f"{out.name} holds no model: delete that folder"):
        warm_start.sft_warm_start(QUICK, cache_dir=tmp_path, verbose=False)


def test_a_build_says_what_it_is_and_its_bar_promises_no_step_count(tmp_path, capsys):
    """The one-off build names itself and its cache; SFT stops at its target, so the bar counts steps, no total."""
    out = warm_start.sft_warm_start(QUICK, cache_dir=tmp_path)
    said = capsys.readouterr()
    assert (
        f"[minrl] building the warm start of 'add' once (SFT until greedy accuracy 0.01, at most {QUICK.max_steps}"
        in said.out
    )
    assert f"cached in {out}" in said.out
    bar = said.err.replace("\r", "\n")
    assert "SFT add: 1 steps" in bar and f"/{QUICK.max_steps}" not in bar, bar
    warm_start.sft_warm_start(QUICK, cache_dir=tmp_path)  # a cache hit: nothing to build, nothing said
    assert "building" not in capsys.readouterr().out
