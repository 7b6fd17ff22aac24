"""Every command of the README's usage block names a file that exists and only flags its entry point knows.

Running them all would take an hour; what goes stale silently is a renamed flag or a moved file. Each command's
entry point is loaded in this process and asked for `--help`; every `--flag` the README passes must be in that help.
The commands that are run whole live in their own tests (the main job: test_parity / test_learning; the agent
command: test_agent_train).
"""

import importlib
import re
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FLAGS_OF = {"replay.py": "trainer.py"}  # replay.py BATCH [flags]: another framework's batch takes the trainer's flags


def usage_commands() -> list[list[str]]:
    """The README's usage block, one argv per command (continuation lines joined, `&` / `&&` split)."""
    readme = (ROOT / "README.md").read_text()
    block = readme.split("## Usage, by goal", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    text = re.sub(r"\\\n\s*", " ", block)
    commands = []
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip() if not line.lstrip().startswith("#") else ""
        for part in re.split(r"\s&&?\s", line):
            words = shlex.split(part)
            if words[:1] == ["torchrun"]:  # torchrun's own flags, then the script
                words = ["python3", *words[next(i for i, w in enumerate(words) if w.endswith(".py")) :]]
            if words:
                commands.append(words)
    return commands


COMMANDS = usage_commands()


def test_the_usage_block_is_read():
    files = {c[1] for c in COMMANDS}
    assert len(COMMANDS) >= 25 and {"ppo_minimal.py", "trainer.py", "agent_train.py", "replay.py"} <= files


@pytest.mark.parametrize("argv", COMMANDS, ids=[" ".join(c[1:3]) for c in COMMANDS])
def test_a_readme_command_names_a_file_and_flags_that_exist(argv, capsys, monkeypatch):
    assert argv[0] == "python3", argv
    path = ROOT / argv[1]
    assert path.is_file(), f"{argv[1]} does not exist"
    entry = FLAGS_OF.get(argv[1], argv[1])
    module = importlib.import_module(entry.removesuffix(".py").replace("/", "."))  # experiments/x.py: a package
    monkeypatch.setattr(sys, "argv", [str(path), "--help"])
    with pytest.raises(SystemExit) as done:
        module.main(["--help"])
    assert done.value.code in (0, None)
    shown = capsys.readouterr().out
    flags = [w.split("=")[0] for w in argv[2:] if w.startswith("--")]
    unknown = [f for f in flags if f not in shown and f.replace("--no-", "--") not in shown]
    assert not unknown, f"{' '.join(argv)}: {unknown} not in {entry} --help"
