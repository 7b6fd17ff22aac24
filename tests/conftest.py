"""Shared pytest fixtures (the repository root is on sys.path through pytest.ini's `pythonpath = .`)."""

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def sft_path() -> Path:
    """Folder (model + tokenizer) of the SFT warm start on `reverse`: the model the calibrated tests use
    (tests/calibrated.py), which pass `task="reverse"` with it.

    Built once and cached on disk under a key, behind a file lock (warm_start.sft_warm_start), so parallel
    test workers and repeated sessions share it.
    """
    import warm_start

    return warm_start.sft_warm_start(warm_start.SFTConfig(task="reverse"))


@pytest.fixture(scope="session")
def default_sft_path() -> Path:
    """The embedded default's warm start (the trainer's own key for its default task), built before the
    tests that start the trainer without --model in subprocesses, so they do not all build it at once."""
    import trainer
    import warm_start

    return warm_start.sft_warm_start(warm_start.sft_config_for(trainer.Config().task))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A random-init embedded model folder (digit tokenizer, no SFT): enough for runs that only need a model."""
    import torch

    import tasks

    torch.manual_seed(0)
    tok, path = tasks.make_tokenizer(), tmp_path_factory.mktemp("tiny")
    tasks.make_tiny_model(tok).save_pretrained(path)
    tok.save_pretrained(path)
    return path
