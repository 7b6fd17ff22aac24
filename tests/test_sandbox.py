"""The shell environment's sandbox against hostile commands, each sent through the environment server: contained, the
server alive, the next episode unaffected; and the shell task family (splits, the scripted solver, the answer check)."""

import os
import shutil
import socket
import stat
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

import envs
import sandbox
import tasks
from env_client import RemoteEnv
from env_service import ServiceArgs, start_server, stop_server

LIMITS = {"wall_s": 3.0, "cpu_s": 2, "output_cap": 4096}  # sandbox.Limits fields sent as the env's options


@pytest.fixture(scope="module")
def server():
    s = start_server(ServiceArgs(port=0))
    yield s
    stop_server(s)


def uid_processes() -> int:
    """Processes on this machine owned by a sandbox uid of this process (its server's episodes)."""
    out = subprocess.run(["ps", "-eo", "uid="], capture_output=True, text=True, check=True).stdout.split()
    return sum(sandbox.uid_for(0) <= int(u) <= sandbox.uid_for(1023) for u in out)


def hostile(server, command: str, seed: int = 0, wall_s: float = LIMITS["wall_s"]):
    """Send `command` as the first action of a remote shell episode; returns (step result, the episode's env). wall_s:
    more for a test of another limit (a loaded machine must not turn it into a timeout)."""
    env = RemoteEnv(server.url, "shell", limits={**LIMITS, "wall_s": wall_s}, max_turns=2, obs_chars=2000)
    env.reset(seed=seed)
    return env.step(command), env


def check_unharmed(server, seed: int = 5):
    """The server answers, no sandbox process is left, and a fresh episode is solved by the scripted solver."""
    assert server.service.health()["status"] == "ok"
    for _ in range(50):  # the kernel reaps a killed pid namespace asynchronously: a few ms
        if uid_processes() == 0:
            break
        time.sleep(0.1)
    assert uid_processes() == 0
    local = envs.make_env("shell")
    local.reset(seed=seed)
    env = RemoteEnv(server.url, "shell")
    env.reset(seed=seed)
    obs, reward, terminated, *_ = env.step(local.expert())
    local.close()
    assert (reward, terminated) == (1.0, True), obs


def test_a_fork_bomb_is_bounded_and_killed(server):
    (obs, reward, _, _, info), env = hostile(server, "f(){ f|f & }; f 2>/dev/null; sleep 30")  # RLIMIT_NPROC: 32
    assert info["timed_out"] and info["exit_code"] == -9 and reward == 0.0
    env.close()
    check_unharmed(server)


def test_rm_rf_root_touches_nothing_outside_the_workspace(server, tmp_path):
    canary = tmp_path / "canary.txt"
    canary.write_text("still here")
    _, env = hostile(server, "rm -rf --no-preserve-root / 2>/dev/null")  # walks read-only /usr: may hit wall_s
    obs = env.step("rm -rf /work/* 2>/dev/null; ls -A /work | wc -l; ls /usr | wc -l")[0]  # (no 2nd walk of /usr)
    n_work, n_usr, code = obs.split("\n")[:3]
    assert (n_work, int(n_usr) > 3, code) == ("0", True, "[exit 0]"), obs  # its own workspace emptied, /usr intact
    assert canary.read_text() == "still here" and os.path.exists("/usr/bin/ls") and os.path.exists(__file__)
    env.close()
    check_unharmed(server)


def test_writing_outside_the_workspace_fails(server, tmp_path):
    target = tmp_path / "written.txt"
    cmd = f"echo x > {target}; echo x > /usr/x; echo x > /etc/x; echo x > /x; mkdir /proc/x; echo done"
    (obs, *_), env = hostile(server, cmd)
    assert "done" in obs and not target.exists() and not os.path.exists("/usr/x")
    assert obs.count("Read-only file system") + obs.count("No such file") + obs.count("Permission denied") >= 4, obs
    env.close()
    check_unharmed(server)


def test_reading_a_file_outside_the_workspace_fails(server, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("TOPSECRET-42")
    os.chmod(secret, 0o644)  # world-readable on the host: only the sandbox's view of the filesystem hides it
    (obs, *_), env = hostile(server, f"cat {secret}; cat /etc/passwd; cat /root/.bashrc; ls /home")
    assert "TOPSECRET" not in obs and "root:" not in obs and obs.count("No such file") >= 3, obs
    env.close()
    check_unharmed(server)


def test_an_infinite_loop_and_a_sleep_are_killed_at_the_cpu_and_wall_clock_limits(server):
    env = RemoteEnv(server.url, "shell", limits={"cpu_s": 1, "wall_s": 60.0}, max_turns=2)
    env.reset(seed=0)
    t0 = time.monotonic()
    obs, reward, _, truncated, info = env.step("while :; do :; done")  # RLIMIT_CPU: SIGKILL after 1 s of CPU
    assert (info["exit_code"], info["timed_out"], truncated) == (137, False, False), obs  # the episode goes on
    assert time.monotonic() - t0 < 60
    env.close()
    (obs, reward, _, truncated, info), env = hostile(server, "sleep 60")  # no CPU spent: the wall clock (3 s) ends it
    assert info["timed_out"] and info["exit_code"] == -9 and not truncated
    env.reset(seed=0)
    assert env.step("echo ok")[0] == "ok\n[exit 0]\n"  # the same server, a new episode, right after the kill
    env.close()
    check_unharmed(server)


def test_a_gigabyte_of_output_is_capped(server):
    (obs, _, _, _, info), env = hostile(server, "head -c 1000000000 /dev/zero | tr '\\0' a")
    assert info["capped"] and info["exit_code"] == -9 and len(obs) <= 2000 + len("[exit -9]\n")  # obs_chars
    env.close()
    check_unharmed(server)


def test_memory_and_file_size_are_bounded(server):
    (obs, _, _, _, info), env = hostile(server, "x=$(head -c 700000000 /dev/zero | tr '\\0' a); echo ${#x}", wall_s=60)
    assert "700000000" not in obs and not info["timed_out"], obs  # RLIMIT_AS 512 MiB: the shell cannot hold it
    (obs, *_) = env.step("head -c 2000000 /dev/zero > big; ls -l big | wc -c")
    assert "File size limit exceeded" in obs or "[exit 153]" in obs, obs
    env.close()
    check_unharmed(server)


def test_no_socket_reaches_a_listener_on_127_0_0_1(server):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    port = listener.getsockname()[1]
    (obs, *_), env = hostile(server, f"bash -c 'echo hi > /dev/tcp/127.0.0.1/{port}' && echo connected")
    listener.settimeout(0.5)  # a connection that had reached it would be waiting in the backlog now
    with pytest.raises(TimeoutError):
        listener.accept()
    listener.close()
    assert "connected" not in obs and "Network is unreachable" in obs, obs
    env.close()
    check_unharmed(server)


def test_the_sandbox_runs_as_an_unprivileged_uid_without_capabilities(tmp_path):
    uid, base = sandbox.take_uid(), tempfile.mkdtemp()  # under /tmp: every folder above it searchable
    try:
        os.chmod(base, 0o711)
        ws = os.path.join(base, "work")
        sandbox.prepare_workspace(ws, uid)
        r = sandbox.run("grep Cap /proc/self/status; ls /", ws, sandbox.Limits(), uid)
        assert r.exit_code == 0 and r.output.count("0000000000000000") == 5, r.output  # every capability set empty
        assert sorted(r.output.split("\n")[5:-1]) == ["bin", "dev", "etc", "lib", "lib64", "proc", "sbin", "tmp",
                                                      "usr", "work"]  # fmt: skip
        with pytest.raises(FileNotFoundError, match="prepare_workspace"):
            sandbox.run("true", str(tmp_path / "elsewhere"), sandbox.Limits())
    finally:
        sandbox.remove_workspace(ws)
        os.rmdir(base)
        sandbox.release_uid(uid)
    with pytest.raises(PermissionError, match="not searchable"):
        sandbox.prepare_workspace(str(tmp_path / "deeper" / "work"), uid)


# ----------------------------------------------------------------------------------------------
# The task family


def test_shell_episodes_are_seeded_split_and_solved_by_the_scripted_solver():
    kinds, firsts = set(), {"train": set(), "eval": set()}
    for split in ("train", "eval"):
        for seed in range(40):
            env = envs.make_env("shell", split)
            obs, _ = env.reset(seed=seed)
            again = envs.make_env("shell", split)
            assert again.reset(seed=seed)[0] == obs and again.files == env.files  # deterministic
            again.close()
            firsts[split].add(env.split_key(obs))
            kinds.add(next(k for k in ("lines of", "files in", "print line", "largest") if k in obs))
            obs, reward, terminated, truncated, info = env.step(env.expert())
            assert (reward, terminated, truncated, info["success"]) == (1.0, True, False, True), obs
            assert env.workspace is None  # removed at the episode's end
    assert not firsts["train"] & firsts["eval"] and len(kinds) == 4, kinds


def test_the_scripted_solvers_habits_are_wrong_and_slip_at_the_configured_rate():
    """Each kind's habit (ShellEnv.expert with slip: the shell warm start's demonstrator) is run and not rewarded, but
    `head -n N` for line N = 1; the first command slips at cfg.slip, a second one never."""
    slipped, kinds = 0, set()
    for seed in range(60):
        env = envs.make_env("shell", slip=0.5)
        obs, _ = env.reset(seed=seed)
        right, habit = env.demonstrations()
        first = env.expert()
        assert first in (right, habit) and habit != right
        slipped += first == habit
        if first == right:
            env.reset(seed=seed)  # the same workspace, to run the habit
        _, reward, terminated, truncated, info = env.step(habit)
        kinds.add(habit.split()[0] + (" head" if "head" in habit else ""))
        assert (reward == 1.0) == ("print line 1 " in obs) and info["exit_code"] == 0, (obs, habit)
        if not terminated:
            assert env.expert() == right  # after a slip the solver types the right command
            assert env.step(env.expert())[1] == 1.0
        env.close()
    assert 18 <= slipped <= 42 and len(kinds) == 4, (slipped, kinds)  # Binomial(60, 0.5): P(outside) = 1.1e-3
    with pytest.raises(ValueError, match="slip"):
        envs.make_env("shell", slip=1.5)


def test_a_sandbox_that_cannot_be_built_raises_and_runs_nothing():
    """A failing setup step (here: the workspace's bind mount, its folder gone) is a SandboxError naming what
    failed, never an output the answer check could score."""
    uid, base = sandbox.take_uid(), tempfile.mkdtemp()  # under /tmp: every folder above it searchable
    ws = os.path.join(base, "work")
    try:
        os.chmod(base, 0o711)
        sandbox.prepare_workspace(ws, uid)
        os.rmdir(ws)
        with pytest.raises(sandbox.SandboxError, match="setup failed.*mount"):
            sandbox.run("echo 3", ws, sandbox.Limits(), uid)
    finally:
        shutil.rmtree(base)
        sandbox.release_uid(uid)


def test_a_wrong_or_failing_command_is_not_rewarded_and_the_episode_goes_on():
    env = envs.make_env("shell")
    env.reset(seed=3)
    answer = env.state[0]
    obs, reward, terminated, truncated, _ = env.step(f"echo {answer}; false")  # right text, failing exit
    assert (reward, terminated, truncated) == (0.0, False, False) and obs.endswith("[exit 1]\n")
    obs, reward, terminated, truncated, _ = env.step("")
    assert (reward, terminated, truncated) == (env.cfg.penalty, False, True)  # max_turns 2


def test_any_bytes_a_byte_level_model_types_are_a_command_or_a_malformed_action():
    env, tok = envs.make_env("shell"), tasks.make_tokenizer()
    env.reset(seed=1)
    try:
        obs, reward, _, truncated, info = env.step(tok.decode([4 + ord("l"), 4 + ord("s"), 4 + 0, 4 + 0xC3]))
        assert (obs, reward, info["malformed"]) == ("error: the command holds a NUL byte\n", env.cfg.penalty, True)
        esc_bad_utf8_x = tok.decode([4 + 0x1B, 4 + 0xFF, 4 + ord("x")])  # a control byte, a byte no UTF-8 text holds
        obs, reward, _, truncated, info = env.step(esc_bad_utf8_x)  # run by the shell: not found
        assert obs.endswith("[exit 127]\n") and reward == 0.0 and info["exit_code"] == 127 and truncated, obs
    finally:
        env.close()


def test_the_byte_level_tokenizer_types_any_shell_command_and_the_experts_fit_the_action_budget():
    tok = tasks.make_tokenizer()
    assert tok.get_vocab() == {t: i for i, t in enumerate(tasks.SPECIALS + tasks.byte_symbols())}
    cmd = "grep -c fox notes.txt | sort -n > \"$HOME\"/{a,b} && echo 'A_B~#;[x]&' \\ \u00e9"
    ids = tok(cmd, add_special_tokens=False).input_ids
    assert tok.decode(ids) == cmd and len(ids) == len(cmd.encode()) and tok.unk_token_id not in ids
    rng = np.random.default_rng(0)
    env = envs.make_env("shell")
    for seed in rng.integers(2**31, size=20):
        env.reset(seed=int(seed))
        ids = tok(env.expert(), add_special_tokens=False).input_ids
        assert len(ids) + 1 <= envs.ShellEnv.action_tokens and tok.unk_token_id not in ids
        env.close()


def test_a_deep_or_locked_tree_in_the_workspace_is_copied_back_and_removed(server):
    (obs, _, _, truncated, info), env = hostile(server, "mkdir -p $(printf 'd/%.0s' $(seq 1100)) && chmod 000 d",
                                                wall_s=60)  # fmt: skip
    # 1100 nested folders: copied back to the host's workspace after the command, then removed with the episode
    # (chmod -R, rm -rf: no recursion limit); the next command sees them (files carry over between commands)
    assert (obs, truncated) == ("[exit 0]\n", False), obs
    assert env.step("chmod 700 d && find d | wc -l")[0] == "1100\n[exit 0]\n"
    assert env.sid is None and server.service.health()["sessions"] == 0  # the episode's session closed with it
    check_unharmed(server)


def test_the_workspace_bounds_bytes_and_inodes_while_a_command_runs(server):
    """3,000 files of 1 MB and 60,000 empty ones stop at the workspace's tmpfs (4 MiB, 4096 inodes) with "No space
    left on device", inside the command; the host's copy never holds more; the episode goes on."""
    env = RemoteEnv(server.url, "shell", limits={"wall_s": 60.0}, max_turns=3, obs_chars=2000)
    env.reset(seed=0)
    host = server.service.sessions[env.sid].env.workspace
    big = "for i in $(seq 3000); do head -c 1000000 /dev/zero > f$i || break; done; ls f* | wc -l"
    obs, *_ = env.step(big)
    assert "No space left on device" in obs and obs.split("\n")[-3] in ("4", "5"), obs  # the 5th: cut short
    assert sum(p.stat().st_size for p in Path(host).rglob("*")) <= 4 << 20  # the host's copy, after the command
    many = "rm -f f*; i=0; while [ $i -lt 60000 ]; do true > e$i || break; i=$((i+1)); done; echo $i"
    obs, _, _, truncated, _ = env.step(f"sh -c '{many}' 2>&1 | tail -2")
    assert "No space left on device" in obs and not truncated, obs  # then how many it made
    assert 4000 < int(obs.split("\n")[-3]) < 4096 and len(os.listdir(host)) < 4096, obs
    env.close()
    check_unharmed(server)


def test_a_killed_command_leaves_the_workspace_as_it_found_it(server):
    (obs, _, _, _, info), env = hostile(server, "echo new > new.txt; rm -rf ./*; sleep 60")  # killed at wall_s (3 s)
    assert info["timed_out"], obs
    obs = env.step("ls -A | wc -l; ls -A /.host | wc -l; echo x > /.host/x")[0]
    lines = obs.split("\n")
    assert lines[0] != "0" and "new.txt" not in obs and lines[1] == "0", obs  # the files as before; no host path
    assert "Read-only file system" in obs, obs
    env.close()
    check_unharmed(server)


def test_the_copy_back_keeps_links_as_links_and_the_host_folder_private(server):
    """What the command leaves is copied to the host as it is (a symlink stays a link, never followed; a FIFO stays
    a FIFO), the host's folder is not opened to others by a chmod of the copy, and the host's workspace is out of
    the command's reach through pid 1's /proc entries."""
    env = RemoteEnv(server.url, "shell", max_turns=3, obs_chars=2000)
    env.reset(seed=0)
    host = Path(server.service.sessions[env.sid].env.workspace)
    cmd = "ln -s /etc/passwd link; ln -s .. up; mkfifo fifo; chmod 777 .; ls /proc/1/root/.host /proc/1/cwd; echo ok"
    obs = env.step(cmd + " 2>&1")[0]
    assert obs.count("Permission denied") == 2 and obs.endswith("ok\n[exit 0]\n"), obs
    assert os.readlink(host / "link") == "/etc/passwd" and os.readlink(host / "up") == ".."
    assert stat.S_ISFIFO((host / "fifo").lstat().st_mode) and not host.stat().st_mode & 0o022
    obs = env.step("cat link up/x 2>&1 | wc -l; ls -F")[0]
    assert obs.startswith("2\n") and "fifo|\nlink@\n" in obs, obs  # two errors: nothing of the host's was read
    env.close()
    check_unharmed(server)
