"""agent_train.py: an unmodified agent program (examples/calc_agent.py, the official openai client) trained on what
it samples through the model proxy: it learns against an lr = 0 control, the README's command runs, a failing agent
stops the run naming it. The engine-backed proxy (--rollout-engine vllm) is tested in tests_vllm/."""

import subprocess
import sys
import time
from pathlib import Path

import pytest

import agent_train
import model_proxy as mp
import tasks

ROOT = Path(__file__).resolve().parents[1]

pytest.importorskip("openai", reason="pip install openai (requirements.txt installs it for the tests)")


def agent_run(tmp_path, name: str, **kw) -> tuple[dict, list[dict]]:
    """`python agent_train.py --agent examples/calc_agent.py`: train_agent's result and its per-iteration rows."""
    rows = []
    cfg = agent_train.AgentConfig(
        agents=4, adv_estimator="grpo", kl_metric_every=0, seed=0, out_dir=str(tmp_path / name), **kw
    )
    return agent_train.train_agent(cfg, hooks=[lambda step, m: rows.append(m)]), rows


def test_help_lists_the_agent_flags_first_and_the_proxys_help_points_here(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    with pytest.raises(SystemExit):  # its own flags first, then the trainer's
        agent_train.main(["--help"])
    out = capsys.readouterr().out
    assert out.index("--agents AGENTS") < out.index("--steps STEPS") < out.index("--lora-rank"), out
    assert "--agent-timeout" in out and "--rollout-engine" in out
    with pytest.raises(SystemExit):
        mp.main(["--help"])
    assert "python3 agent_train.py --agent PROGRAM" in capsys.readouterr().out


def test_an_unmodified_agent_learns_through_the_proxy_against_an_lr0_control(tmp_path):
    """The agent processes' episodes (G sessions per env seed) are the batch, with the sampler's logprobs the
    trainer's and no history break; the agent's greedy success through the proxy on 100 held-out seeds rises by >= 10
    points in 20 iterations (seed 0: 0.49 -> 0.64; seeds 1-2: 0.59, 0.55, so not every seed; at 60 iterations all
    three >= 0.68: RESULTS.md; a run repeats, so this test sees seed 0's) and equals the trainer's own greedy
    evaluation of the same weights on the same episodes (rollout_env), before and after: the proxy's token layout is
    the trainer's (TEMPLATE). The control (lr = 0) leaves the weights, so its success, where they were."""
    common = dict(group_size=8, temperature=0.6, lr_schedule="constant", ppo_epochs=1, minibatches=1, eval_n=100)
    schedule = dict(steps=20, prompts_per_step=16, lr=1e-4, warmup_steps=5, eval_every=20)
    out, rows = agent_run(tmp_path, "train", **schedule, **common)
    control, _ = agent_run(tmp_path, "control", steps=1, prompts_per_step=2, lr=0.0, eval_every=1, **common)
    (_, start), (_, end) = out["eval_history"]
    ours, theirs = out["agent_success"], control["agent_success"]
    assert ours[1] - theirs[1] >= 0.10, (ours, theirs)
    # the same weights give the same success, but for a near-tie in an argmax under another batch's padding (the
    # requests that share a generate call vary with timing): at most 2 of 100 episodes
    near = lambda a, b: abs(a - b) <= 0.02  # noqa: E731
    assert near(theirs[0], theirs[1]) and near(theirs[0], ours[0]), (ours, theirs)
    assert near(ours[0], start) and near(ours[1], end), (ours, out["eval_history"])
    assert [r["proxy/samples"] for r in rows] == [128] * 20 and all(r["proxy/prefix_breaks"] == 0 for r in rows)
    assert max(r["stats/rollout_vs_old_logp_diff"] for r in rows) < 1e-4
    assert all(r["rollout/turns"] >= 1 for r in rows)


def test_the_readmes_agent_command_runs_one_iteration_beside_a_busy_process(tmp_path):
    """The README's `agent_train.py --agent ...` command, as written there, for one iteration, while a second process
    keeps a core busy: its 16 agents open the 500 greedy evaluation episodes at once (the environment server has room
    for them) and 128 training episodes; nothing is refused, no client leaves before its answer."""
    readme = (ROOT / "README.md").read_text().splitlines()
    command = next(line for line in readme if line.startswith("python3 agent_train.py")).split("#")[0].split()
    assert command[:2] == ["python3", "agent_train.py"] and "--agents" in command, command
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        t0, flags = time.monotonic(), ["--steps", "1", "--out-dir", str(tmp_path / "run")]
        argv = [sys.executable, *command[1:], *flags]
        proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600)
        wall = time.monotonic() - t0
    finally:
        busy.kill()
        busy.wait()
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "greedy success of the agent on 500 held-out episodes" in proc.stdout, proc.stdout[-2000:]
    assert "503" not in proc.stderr and "left before" not in proc.stderr, proc.stderr[-3000:]
    print(f"the README's agent command, one iteration beside a busy process: {wall:.0f} s")


def test_an_agent_that_fails_stops_the_run_naming_it(tmp_path):
    broken = tmp_path / "broken_agent.py"
    broken.write_text("import sys\nprint('no model here', file=sys.stderr)\nsys.exit(3)\n")
    tok = tasks.make_tokenizer()
    proxy = mp.ModelProxy(tasks.make_tiny_model(tok), tok, mp.ProxyArgs(), {"temperature": 1.0})
    server = mp.start_proxy(proxy)
    try:
        s = agent_train.AgentSampler(
            agent_train.AgentConfig(agent=str(broken), agents=2), proxy, server.url, "http://127.0.0.1:9"
        )
        with pytest.raises(RuntimeError, match="agent 0 .*broken_agent.py.* failed \\(exit 3.*no model here"):
            s.play([1, 2], "t")
        s.pool.close()
    finally:
        mp.stop_proxy(server)
