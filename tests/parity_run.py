"""One run of the textbook or the full trainer for tests/test_parity.py, with a digest of where it ended.

    python tests/parity_run.py textbook|trainer OUT_DIR [--frozen-batch SEED] [flags]      # or under torchrun

Runs `ppo_minimal.main` or `trainer.main` with the flags and `--out-dir OUT_DIR`, then writes OUT_DIR/digest-RANK.json:
a sha256 over every optimizer this run built, in the order it built them (the critic's first, then the policy's: both
files build them so), over each optimizer's parameters and then its AdamW state (step, exp_avg, exp_avg_sq). Equal
digests: the same weights and optimizer state, bit for bit. The optimizers are found by wrapping torch.optim.AdamW
before the run, so neither file needs a hook for this. The wrapper also hashes the gradients each step() is handed
(after clipping), so that a difference is found at the first optimizer step where it appears.

--frozen-batch SEED freezes what is sampled: every sampling call (rollout.generate, which the trainer's rollout_env
calls and the textbook calls by name) draws from its own generator seeded SEED instead of the run's stream, so both
files update on the same batch whatever their sampling streams are: the update alone is compared.
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
import rollout  # noqa: E402
import trainer  # noqa: E402

BUILT = []  # every AdamW the run constructs, in order
GRADS = []  # [optimizer index, sha256 of the gradients it stepped with] per step(), in order
FROZEN_CALLS = [0]  # sampling calls the frozen sampler answered


class RecordedAdamW(torch.optim.AdamW):
    """torch's AdamW, remembered in BUILT; each step() hashes the gradients it is handed into GRADS."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        BUILT.append(self)

    def step(self, closure=None):
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        GRADS.append([BUILT.index(self), sha256(grads)])
        return super().step(closure)


def frozen_sampler(seed: int):
    """rollout.generate drawing from a generator of its own (seeded `seed` at every call) when it samples."""
    real = rollout.generate

    def generate(*args, generator=None, **kwargs):
        if kwargs.get("temperature", 1.0) > 0:
            generator, FROZEN_CALLS[0] = torch.Generator().manual_seed(seed), FROZEN_CALLS[0] + 1
        return real(*args, generator=generator, **kwargs)

    return generate


def sha256(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def digest(optimizers) -> str:
    """sha256 over the optimizers' parameters and AdamW states, in order."""
    tensors = [p for o in optimizers for g in o.param_groups for p in g["params"]]
    tensors += [v for o in optimizers for st in o.state_dict()["state"].values() for v in st.values()]
    return sha256(tensors)


def main() -> None:
    which, out, flags = sys.argv[1], sys.argv[2], sys.argv[3:]
    torch.optim.AdamW = RecordedAdamW  # both files look it up when they build an optimizer
    if flags[:1] == ["--frozen-batch"]:
        rollout.generate = ppo_minimal.generate = frozen_sampler(int(flags[1]))  # the trainer's path, the textbook's
        flags = flags[2:]
    {"textbook": ppo_minimal, "trainer": trainer}[which].main([*flags, "--out-dir", out])
    rank = os.environ.get("RANK", "0")
    record = {"digest": digest(BUILT), "optimizers": len(BUILT), "grads": GRADS, "frozen_calls": FROZEN_CALLS[0]}
    (Path(out) / f"digest-{rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
