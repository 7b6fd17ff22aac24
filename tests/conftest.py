"""Shared pytest fixtures (the repository root is on sys.path through pytest.ini's `pythonpath = .`)."""

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def sft_path() -> Path:
    """Folder (model + tokenizer) of the embedded default's SFT warm start on `reverse`.

    Built once and cached on disk under a key, behind a file lock (tasks.sft_warm_start), so parallel
    test workers and repeated sessions share it.
    """
    import tasks

    return tasks.sft_warm_start(tasks.SFTConfig(task="reverse"))
