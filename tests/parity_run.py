"""One run of the textbook or the full trainer for tests/test_parity.py, with a digest of where it ended.

    python tests/parity_run.py textbook|trainer OUT_DIR [flags]      # or under torchrun

Runs `ppo_minimal.main` or `trainer.main` with the flags and `--out-dir OUT_DIR`, then writes OUT_DIR/digest-RANK.json:
a sha256 over every optimizer this run built, in the order it built them (the critic's first, then the policy's: both
files build them so), over each optimizer's parameters and then its AdamW state (step, exp_avg, exp_avg_sq). Equal
digests: the same weights and optimizer state, bit for bit. The optimizers are found by wrapping torch.optim.AdamW
before the run, so neither file needs a hook for this.
"""

import hashlib
import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import ppo_minimal  # noqa: E402
import trainer  # noqa: E402

BUILT = []  # every AdamW the run constructs, in order


class RecordedAdamW(torch.optim.AdamW):
    """torch's AdamW, remembered in BUILT."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        BUILT.append(self)


def digest(optimizers) -> str:
    """sha256 over the optimizers' parameters and AdamW states, in order."""
    h = hashlib.sha256()
    tensors = [p for o in optimizers for g in o.param_groups for p in g["params"]]
    tensors += [v for o in optimizers for st in o.state_dict()["state"].values() for v in st.values()]
    for t in tensors:
        h.update(t.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    which, out, flags = sys.argv[1], sys.argv[2], sys.argv[3:]
    torch.optim.AdamW = RecordedAdamW  # both files look it up when they build an optimizer
    {"textbook": ppo_minimal, "trainer": trainer}[which].main([*flags, "--out-dir", out])
    rank = os.environ.get("RANK", "0")
    record = {"digest": digest(BUILT), "optimizers": len(BUILT)}
    (Path(out) / f"digest-{rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
