"""Every notebook in notebooks/ executes top to bottom (nbclient, kernel python3, cwd = repository root).

A failing cell raises nbclient's CellExecutionError, which shows the cell and its traceback. The notebooks are
committed executed, so that a reader on a code host sees their outputs and plots; after editing one, write its
outputs back with `python tests/test_notebooks.py [NOTEBOOK ...]` (all of them by default).
"""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def execute(path: Path, timeout: int = 300):
    """Run one notebook top to bottom in a fresh kernel; return it with its outputs and assert no cell failed."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    resources = {"metadata": {"path": str(ROOT)}}  # record_timing off: a re-run changes no cell metadata
    NotebookClient(nb, timeout=timeout, kernel_name="python3", resources=resources, record_timing=False).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors, errors
    return nb


def test_there_are_notebooks():
    assert NOTEBOOKS, "notebooks/ holds no .ipynb: the parametrized tests below would run nothing"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_is_committed_executed(path):
    """A reader on a code host sees outputs and a figure: every code cell ran, in order, and a plot is kept."""
    import nbformat

    cells = [c for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]
    counts = [c.execution_count for c in cells]
    assert counts == list(range(1, len(cells) + 1)), (
        f"{path.name}: cells not executed top to bottom (execution counts {counts}); "
        f"write its outputs back with `python tests/test_notebooks.py {path.relative_to(ROOT)}` before committing"
    )
    plots = [o for c in cells for o in c.outputs if "image/png" in o.get("data", {})]
    assert plots, f"{path.name}: no plot in the committed outputs"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_executes(path):
    execute(path)


if __name__ == "__main__":
    import nbformat

    for arg in sys.argv[1:] or NOTEBOOKS:
        nbformat.write(execute(Path(arg).resolve(), timeout=900), Path(arg))
        print(f"{arg}: executed, outputs written")
