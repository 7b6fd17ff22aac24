"""A run's folder and its checkpoints: never half-written, never mixed with another run's, never resumed into one.

    python trainer.py --steps 40 --save-every 10 --out-dir runs/a
    python trainer.py --steps 40 --resume runs/a/ckpt-20                # continues bit for bit on CPU
    python trainer.py --steps 60 --resume runs/a --resume-allow steps   # the newest complete ckpt-N of runs/a
    python checkpoint.py runs/a/ckpt-20                                     # is it complete? what run is it of?

A checkpoint folder `ckpt-N/` holds
- `policy/` (+ the tokenizer; a LoRA run's adapters alone, lora.py) and `critic_{m}/`: save_pretrained folders;
  with --fsdp instead `shards/`: every rank's part of every model and optimizer (torch.distributed.checkpoint);
- `state.pt`: the step, the counters, the config and (not with --fsdp) every optimizer's state, by rank 0;
- `rank{r}.pt`: each rank's random streams (the global torch RNG, the task Generator, the torch Generators),
  so that a resumed data-parallel run keeps distinct per-rank sampling;
- `checkpoint.json`, written last: the completion marker, with the run's fingerprint and every file's size.

A run's folder (run_dir): without --out-dir every run gets a fresh `runs/<entry>-<date>-<n>/` (printed); an --out-dir
that already holds a run (metrics, checkpoints, a policy) is refused, naming --resume (continue it) and --overwrite
(remove its files first): a second run never drops the first one's rows nor leaves its ckpt-N for a later --resume
to pick. A resume continues in the checkpoint's run folder. `RunArgs`: these flags (the trainer's Config inherits
them).

Atomic (the usual write-then-rename recipe): every rank writes into `ckpt-N.tmp/` and fsyncs its files; after a
barrier rank 0 writes the marker, fsyncs the folder and renames it to `ckpt-N` (an older `ckpt-N` is moved aside
first and deleted after). A crash at any point leaves the old complete checkpoint or none, never new weights
beside an old optimizer. A folder without its marker, or whose files differ in size from it, is refused by name.

Checked resume: the fingerprint is what must match for the resumed run to be the same run: every config field
that changes what is trained (RUN_FIELDS, where a run writes and how it reports, are free), the world size, the
model source with a hash of its config, a hash of the tokenizer and of the --data file. A mismatch is refused
naming each differing field. `--resume-allow FIELD ...` accepts changes of the named config fields (e.g. steps,
lr; `model model_source` or `data` for a folder or file that moved) and of `world_size` (the streams of ranks that
are gone are dropped; new ranks start from their seed); the contents (the model's config, the tokenizer, the data),
the task, reward, estimator, critic layout, sharding and LoRA layout can never change (IDENTITY).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import time
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path

import common
import lora
from cli import check_range, keep_threads

MARKER = "checkpoint.json"
# where a run writes, how it reports: free to change on resume
RUN_FIELDS = ("out_dir", "overwrite", "save_every", "resume", "resume_allow", "tensorboard", "save_final", "strict")
RUN_FIELDS += ("dist_timeout", "dump_batch", "lora_merge")
IDENTITY = ("task", "reward", "sft_target", "adv_estimator", "critic", "critic_model", "critic_depth", "n_critics")
IDENTITY += (
    "fsdp",
    "lora_rank",
    "lora_alpha",
    "lora_targets",
    "model_config_sha256",
    "tokenizer_sha256",
    "data_sha256",
)
IDENTITY += (
    "user_files_sha256",
)  # never change: the checkpoint's layout, its contents (a moved model: allow its path)


RUN_FILES = ("metrics.jsonl", "config.json", "result.json", "curves.png", "policy", "tb", "wandb", "timeline.json")


@dataclass
class RunArgs:
    """Where a run writes and what it keeps; the trainer's Config inherits these fields."""

    out_dir: str | None = None
    """The run's folder (metrics.jsonl, result.json, plots, checkpoints). Default: a fresh runs/<entry>-<date>-<n>;
    --resume: the checkpoint's run. A folder that holds a run is refused without --resume or --overwrite."""
    overwrite: bool = False
    """Remove the files of the run already in --out-dir (metrics, checkpoints, policy, plots) before this one."""
    save_every: int = 0
    """Checkpoint every this many iterations (0 = never)."""
    resume: str | None = None
    """Checkpoint folder to resume from, or a run folder: its newest complete ckpt-N."""
    resume_allow: tuple[str, ...] = ()
    """Config fields (and world_size) that may differ from the checkpoint's on --resume, e.g. steps lr."""
    tensorboard: bool = False
    """Also log to TensorBoard (needs the tensorboard package), with veRL's metric names as aliases."""
    wandb_project: str | None = None
    """Also log to Weights & Biases in this project, offline (`wandb sync` uploads it; WANDB_MODE overrides), with
    veRL's metric names as aliases (needs: pip install wandb)."""
    save_final: bool = True
    """Save the final policy and tokenizer in out_dir/policy (save_pretrained: AutoModelForCausalLM loads it)."""

    def __post_init__(self):
        check_range("save_every", self.save_every, 0)
        if self.resume:  # at load: a missing, incomplete or damaged checkpoint is refused before any model loads
            self.resume = find_checkpoint(self.resume)
            self.out_dir = self.out_dir or str(Path(self.resume).parent)  # the run goes on in its own folder
        elif self.resume_allow:
            raise ValueError(f"config field 'resume_allow' = {list(self.resume_allow)} needs --resume: it does nothing")
        names = {f.name for f in fields(self)} - set(IDENTITY) | {"world_size", "model_source"}
        if bad := [k for k in self.resume_allow if k not in names]:
            what = "name config fields (or world_size, model_source), none of"
            raise ValueError(f"config field 'resume_allow': {bad} cannot be allowed: {what} {list(IDENTITY)}")


def previous_run(folder: Path) -> list[str]:
    """The names in `folder` that a run writes (what a new run there would overwrite or mix with)."""
    ours = lambda p: p.name in RUN_FILES or p.match("ckpt-*") or p.match("batch-*.pt")  # noqa: E731
    return sorted(p.name for p in folder.iterdir() if ours(p)) if folder.is_dir() else []


def check_out_dir(out_dir: str | None, overwrite: bool, resuming: bool) -> list[str]:
    """The run files already in out_dir; FileExistsError if there are some and the run neither resumes nor
    overwrites (an entry point calls it before loading anything; run_dir again when it opens the folder)."""
    found = previous_run(Path(out_dir)) if out_dir else []
    if found and not resuming and not overwrite:
        fixes = f"--resume {out_dir} continues that run, --overwrite replaces it, no --out-dir starts a fresh folder"
        raise FileExistsError(f"--out-dir {out_dir} holds a run ({', '.join(found[:6])}): {fixes}")
    return found


def run_dir(out_dir: str | None, entry: str, overwrite: bool = False, resuming: bool = False) -> Path:
    """The run's folder, created: out_dir, or (None) a fresh runs/<entry>-<YYYYMMDD>-<n>. An out_dir that holds
    a run is refused unless the run resumes (it goes on there) or overwrite (that run's files are removed)."""
    if out_dir is None:
        stem = Path("runs") / f"{entry}-{time.strftime('%Y%m%d')}"
        taken = [p.name.rsplit("-", 1)[1] for p in stem.parent.glob(f"{stem.name}-*")]
        n = 1 + max([int(k) for k in taken if k.isdigit()], default=0)
        while True:  # mkdir is the claim: two runs starting at once take different numbers
            try:
                Path(f"{stem}-{n}").mkdir(parents=True)
                break
            except FileExistsError:
                n += 1
        print(f"[minrl] this run's folder: {stem}-{n} (--out-dir to choose one)", flush=True)
        return Path(f"{stem}-{n}")
    path, found = Path(out_dir), check_out_dir(out_dir, overwrite, resuming)
    if found and not resuming:
        for name in found:
            shutil.rmtree(path / name) if (path / name).is_dir() else (path / name).unlink()
        print(f"[minrl] --overwrite: removed {', '.join(found)} of the previous run in {path}", flush=True)
    path.mkdir(parents=True, exist_ok=True)
    return path


def sha256_json(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def run_fingerprint(cfg, world: int, source: str, ref, tokenizer) -> dict:
    """What a checkpoint must share with the run that resumes it: the config, the world size, the model source
    (`cfg.model` or the warm start's folder) and hashes of the reference model's config (without the keys that name
    a path, a dtype or the library version), of the tokenizer's vocabulary and special tokens, and of the user's data
    and reward files (--data, --eval-data, --reward FILE.py, --reward-model)."""
    unstable = ("_name_or_path", "dtype", "torch_dtype", "transformers_version")
    model_config = {k: v for k, v in ref.config.to_diff_dict().items() if k not in unstable}
    specials = {k: getattr(tokenizer, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")}
    user = [getattr(cfg, k, None) for k in ("data", "eval_data", "reward_model")]
    user += [spec.split(":")[0] for spec in getattr(cfg, "reward", None) or [] if ".py" in spec]
    return {
        "config": json.loads(json.dumps(asdict(cfg))),  # tuples as lists, as saved
        "world_size": world,
        "model_source": source,
        "model_config_sha256": sha256_json(model_config),
        "tokenizer_sha256": sha256_json([sorted(tokenizer.get_vocab().items()), specials]),
        "data_sha256": files_sha256(user[0]),
        **({"user_files_sha256": {p: files_sha256(p) for p in user[1:] if p}} if any(user[1:]) else {}),  # older: none
    }  # fmt: skip


def files_sha256(path: str | None) -> str | None:
    """A file's content hash, or a folder's (every file's, by relative path); None for None. Streamed: a reward
    model's weights are never read whole."""
    if path is None:
        return None
    p, whole = Path(path), hashlib.sha256()
    for f in [p] if p.is_file() else sorted(x for x in p.rglob("*") if x.is_file()):
        with open(f, "rb") as data:
            digest = hashlib.file_digest(data, "sha256")
        if p.is_file():
            return digest.hexdigest()
        whole.update(str(f.relative_to(p)).encode() + b"\0" + digest.digest())
    return whole.hexdigest()


# ----------------------------------------------------------------------------------------------
# Writing: every file into ckpt-N.tmp, fsync, marker, rename


def fsync_path(path: Path) -> None:
    """Flush a file's (or a folder's entries') data to the disk: a rename is only atomic for what is on it."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def barrier() -> None:
    """Wait for every rank (no-op for world size 1); named by common.collective if a rank is dead."""
    import torch.distributed as dist

    if common.world_size() > 1:
        common.collective(dist.barrier)


def save_checkpoint(path, rank: int, fingerprint: dict, state: dict, policy, tokenizer, opt, critics, rng, gens):
    """Write the checkpoint `path` (ckpt-N) atomically: see the module docstring. `state`: step and counters."""
    import torch

    path, cfg = Path(path), fingerprint["config"]
    tmp = path.with_name(path.name + ".tmp")
    if rank == 0 and tmp.exists():  # left by a crash during an earlier save
        shutil.rmtree(tmp)
    barrier()  # no rank writes into tmp before rank 0 has cleared it
    tmp.mkdir(parents=True, exist_ok=True)
    streams = {"torch_rng": torch.get_rng_state(), "task_rng": rng.bit_generator.state}
    streams["threads"] = torch.get_num_threads()  # a resume takes the same count (cli.keep_threads)
    torch.save({**streams, **{name: g.get_state() for name, g in gens.items()}}, tmp / f"rank{rank}.pt")
    fsync_path(tmp / f"rank{rank}.pt")
    if cfg.get("fsdp"):  # every rank writes its shards of every model and optimizer
        import torch.distributed.checkpoint as dcp

        stepped = [name for name, (_, o) in trained(policy, opt, critics).items() if o.state]
        dcp.save(sharded_state(policy, opt, critics, stepped), checkpoint_id=tmp / "shards")
        optimizers = {"sharded_optimizers": stepped}
    else:
        save_policy(policy, tokenizer, tmp / "policy", rank, cfg)
        for k, model in enumerate(critics.models if critics and rank == 0 else []):
            model.save_pretrained(tmp / f"critic_{k}")
        optimizers = {"opt": opt.state_dict(), **(critics.state() if critics else {})}
    if rank == 0:
        torch.save({**state, **optimizers, "config": json.dumps(cfg)}, tmp / "state.pt")
    barrier()  # every rank's streams are on disk
    if rank != 0:
        return
    files = {str(p.relative_to(tmp)): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()}
    for p in [*(tmp / f for f in files), *{(tmp / f).parent for f in files}]:
        fsync_path(p)
    marker = {"step": state["step"], "files": files, "fingerprint": fingerprint}
    (tmp / MARKER).write_text(json.dumps(marker, indent=1))
    fsync_path(tmp / MARKER), fsync_path(tmp)
    old = path.with_name(path.name + ".old")
    if old.exists():  # left by a crash during an earlier overwrite
        shutil.rmtree(old)
    if path.exists():  # overwriting ckpt-N (a rerun into the same folder): the complete old one stays until the end
        path.rename(old)  # (a crash right after leaves ckpt-N.old and ckpt-N.tmp, both complete: find_checkpoint)
    tmp.rename(path)
    fsync_path(path.parent)
    if old.exists():
        shutil.rmtree(old)


def save_policy(policy, tokenizer, path, rank: int, cfg: dict, merge: bool = False) -> None:
    """The policy as a save_pretrained folder (+ its tokenizer), written by rank 0; every rank calls it (FSDP2
    gathers the whole state from the shards, a collective). A LoRA run's: its adapters (lora.py), or merged."""
    state = None
    if cfg.get("fsdp"):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(policy, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0 and cfg.get("lora_rank"):
        lora.save(policy, tokenizer, path, policy.state_dict() if state is None else state, merge, cfg)
    elif rank == 0:
        policy.save_pretrained(path, state_dict=state)  # None: its own
        tokenizer.save_pretrained(path)


def sharded_state(policy, opt, critics, stepped: list[str]) -> dict:
    """The model states of policy and critics as DTensor shards, each rank its own part, and the optimizer states of
    those named in `stepped`: what torch.distributed.checkpoint saves, and loads in place (the template is filled).
    An optimizer not stepped yet (critic warm-up) is left out: torch would initialise it with a step at lr 0, whose
    count would change AdamW's bias correction from then on."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    out = {}
    for name, (model, optimizer) in trained(policy, opt, critics).items():
        both = get_state_dict(model, optimizer) if name in stepped else (get_model_state_dict(model),)
        out.update(zip((name, name + "_opt"), both))
    return out


def trained(policy, opt, critics) -> dict:
    """name -> (model, its optimizer), as a checkpoint names them: the policy's and each critic's."""
    critic_pairs = zip(critics.models, critics.opts) if critics else ()
    return {"policy": (policy, opt), **{f"critic_{k}": mo for k, mo in enumerate(critic_pairs)}}


# ----------------------------------------------------------------------------------------------
# Finding and checking: the marker, the files' sizes, the fingerprint


def incomplete(ckpt: Path) -> str | None:
    """Why the checkpoint folder `ckpt` must not be resumed (no marker, unreadable, a file missing or of another
    size than when it was written), or None when it is complete."""
    try:
        marker = json.loads((ckpt / MARKER).read_text())
        files = marker["files"]
    except FileNotFoundError:
        return f"it has no {MARKER} (written last: the save did not finish, or it predates atomic checkpoints)"
    except (ValueError, KeyError, TypeError) as e:
        return f"its {MARKER} is damaged ({type(e).__name__}: {e})"
    for name, size in files.items():
        f = ckpt / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != size:
            return f"{name} has {f.stat().st_size} bytes, not the {size} written (truncated or replaced)"
    return None


def find_checkpoint(path: str) -> str:
    """`--resume PATH`: a checkpoint folder (refused unless complete) or a run folder, whose newest complete ckpt-N
    is taken (newer incomplete ones are named; for one step, ckpt-N before a complete ckpt-N.tmp or ckpt-N.old, which a
    crash between save_checkpoint's two renames leaves). Returns the checkpoint folder."""
    p = Path(path)
    if not p.is_dir():
        raise FileNotFoundError(f"config field 'resume' = {path!r}: no such folder")
    pattern, rank = re.compile(r"ckpt-(\d+)(\.tmp|\.old)?"), {None: 2, ".tmp": 1, ".old": 0}
    found = [(int(m[1]), rank[m[2]], d) for d in p.iterdir() if (m := pattern.fullmatch(d.name)) and d.is_dir()]
    if not found or (p / MARKER).exists() or (p / "state.pt").exists():  # a checkpoint folder itself
        if why := incomplete(p):
            raise ValueError(f"config field 'resume' = {path!r}: refused, {why}. Resume another checkpoint, or "
                             f"pass its run folder to take the newest complete one")  # fmt: skip
        return str(p)
    skipped = []
    for _, _, ckpt in sorted(found, reverse=True):
        if why := incomplete(ckpt):
            skipped.append(f"{ckpt.name} ({why})")
            continue
        if skipped:
            print(f"[minrl] resume: skipped the incomplete {', '.join(skipped)}; taking {ckpt}", flush=True)
        return str(ckpt)
    raise ValueError(f"config field 'resume' = {path!r}: no complete checkpoint in it: {'; '.join(skipped)}")


def check_resume(ckpt: str, cfg, fingerprint: dict | None = None) -> int:
    """Refuse to resume `ckpt` into the run of `fingerprint` (of `cfg`) where they differ, naming each field
    (cfg.resume_allow: the config fields and "world_size" that may change, printed), or where the checkpoint is at
    cfg.steps already. A field newer than the checkpoint counts as its default there. Returns the step. Without a
    fingerprint: the config fields that can never change alone, quietly (first, before a warm start for another
    --task costs a minute)."""
    marker = json.loads((Path(ckpt) / MARKER).read_text())
    saved, now = marker["fingerprint"], fingerprint or {"config": json.loads(json.dumps(asdict(cfg)))}
    defaults = {f.name: f.default if f.default_factory is MISSING else f.default_factory() for f in fields(cfg)}
    defaults = json.loads(json.dumps(defaults, default=str))  # as a checkpoint holds them (tuples as lists)
    diffs = {k: (saved.get(k), now[k]) for k in now if k != "config" and saved.get(k) != now[k]}
    same_reward = lambda r: [r] if isinstance(r, str) else r or ["math_exact"]  # noqa: E731 (one name before 2026-12-02)
    for k in now["config"].keys() - set(RUN_FIELDS):
        old, new = saved["config"].get(k, defaults.get(k)), now["config"][k]
        if (same_reward(old) != same_reward(new)) if k == "reward" else old != new:
            diffs[k] = (old, new)
    refused = {k: v for k, v in diffs.items() if k in IDENTITY or k not in cfg.resume_allow}
    if fingerprint is None:  # the config alone: what can never change (the rest is named with the whole fingerprint)
        refused = {k: v for k, v in refused.items() if k in IDENTITY}
    show = lambda d: "; ".join(f"{k}: {a!r} in the checkpoint, {b!r} now" for k, (a, b) in sorted(d.items()))
    if refused:
        fix = " ".join(sorted(k for k in refused if k not in IDENTITY))
        hint = f" Pass the checkpoint's values, or add --resume-allow {fix} to change them on purpose." * bool(fix)
        if refused.keys() & set(IDENTITY):
            hint += " The model's config, tokenizer, data, task, reward, estimator, critics, sharding (--fsdp) and LoRA"
            hint += " layout cannot change."
        raise ValueError(f"--resume {ckpt}: the checkpoint is of another run: {show(refused)}.{hint}")
    if diffs and fingerprint:
        print(f"[minrl] resume: {show(diffs)} (--resume-allow): the run continues with the new values", flush=True)
    if marker["step"] >= cfg.steps and fingerprint:  # (after the whole fingerprint's check: it names more)
        raise ValueError(f"--resume {ckpt}: the run is finished (checkpoint at step {marker['step']}, --steps "
                         f"{cfg.steps}); to train further raise --steps and add --resume-allow steps")  # fmt: skip
    return marker["step"]


def load_pt(path: Path, need=(), what: str = "checkpoint file", **kw) -> dict:
    """torch.load(weights_only=True) of a file this project wrote (`need`: keys it must hold); one that is damaged or
    of another kind is an error naming it and the fix (never torch's own advice to unpickle untrusted code)."""
    import torch

    fix = "resume another checkpoint (--resume RUN_DIR takes the newest complete one)"
    fix = fix if what == "checkpoint file" else f"pass a {what} this project wrote"
    try:
        d = torch.load(path, weights_only=True, **kw)
    except FileNotFoundError:
        raise
    except Exception as e:  # UnpicklingError, RuntimeError (zip), EOFError: not what save wrote
        raise ValueError(f"{path}: not a readable {what} ({type(e).__name__}); damaged or another kind: {fix}") from e
    if missing := [k for k in need if not isinstance(d, dict) or k not in d]:
        raise ValueError(f"{path}: not a {what} (it has no {missing}): {fix}")
    return d


def resume_checkpoint(path, rank: int, policy, opt, critics, rng, gens: dict, fsdp: bool = False) -> dict:
    """Load a checkpoint of save_checkpoint (checked by check_resume) into the optimizer, the critics (fsdp: policy,
    critics and optimizers from this rank's part of the shards) and this rank's random streams (last: loading the
    critics draws from the global RNG). A rank the checkpoint has no
    streams for (a world size raised with --resume-allow world_size) keeps its fresh seed + rank streams, but
    takes the minibatch order (shuffle_gen, the same on every rank) from rank 0. Returns its state.pt."""
    import torch

    path = Path(path)
    state = load_pt(path / "state.pt", map_location="cpu")
    if fsdp:  # each rank reads its part of every shard (the world size may differ from the saving run's)
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

        shards = sharded_state(policy, opt, critics, state["sharded_optimizers"])
        dcp.load(shards, checkpoint_id=path / "shards")
        for name, (model, optimizer) in trained(policy, opt, critics).items():
            if name + "_opt" in shards:
                set_state_dict(model, optimizer, model_state_dict=shards[name], optim_state_dict=shards[name + "_opt"])
            else:  # an optimizer not stepped before the save: it stays empty
                set_model_state_dict(model, shards[name])
    else:
        opt.load_state_dict(state["opt"])
        if critics is not None:
            critics.load(path, state)
    mine = path / f"rank{rank}.pt"
    streams = load_pt(mine if mine.is_file() else path / "rank0.pt")
    keep_threads(streams.get("threads"), str(path))  # a bit-exact resume needs the run's thread count
    if mine.is_file():
        torch.set_rng_state(streams["torch_rng"])
        rng.bit_generator.state = streams["task_rng"]
    else:
        print(f"[minrl] resume: rank {rank} is new (the checkpoint has no {mine.name}): fresh streams", flush=True)
    for name, g in gens.items():
        if mine.is_file() or name == "shuffle_gen":
            g.set_state(streams[name])
    return state


def main(argv=None) -> None:
    """`python checkpoint.py CKPT_OR_RUN_DIR`: which checkpoint --resume would take, and what run it is of."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("path", help="a ckpt-N folder or a run folder")
    ckpt = Path(find_checkpoint(ap.parse_args(argv).path))
    marker = json.loads((ckpt / MARKER).read_text())
    fp, cfg = marker["fingerprint"], marker["fingerprint"]["config"]
    print(f"{ckpt}: complete, step {marker['step']} of {cfg['steps']}, {len(marker['files'])} files")
    for k in ("world_size", "model_source", "model_config_sha256", "tokenizer_sha256", "data_sha256"):
        print(f"  {k:20} {fp[k]}")
    for k in ("model", "data", *(k for k in IDENTITY if not k.endswith("_sha256"))):
        print(f"  {k:20} {cfg.get(k)}")


if __name__ == "__main__":
    main()
