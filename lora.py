"""LoRA: train low-rank adapters of the policy's linear layers, the base frozen; the reference is the base itself.

    python trainer.py --lora-rank 8 --lr 2e-3                          # the embedded default, adapters only
    python lora.py --lora-rank 8 --lora-targets q_proj v_proj             # which layers get adapters, how many weights
    torchrun --nproc_per_node=8 trainer.py --model M --fsdp --lora-rank 64 --lora-targets q_proj v_proj

LoRA (Hu et al. 2021, eq. 3): a target layer computes h = W0 x + (alpha / r) B A x, A [r, in] random, B [out, r]
zero at the start (so the first policy is the base exactly), W0 frozen. peft's LoRA layers are put into the
policy in place (`add_adapters`: inject_adapter_in_model), so the model stays the same object and class and every
path here (chunked head, checkpointing, DDP, FSDP2, the estimate's probes) treats it as before. What changes:
- only A and B require grad: AdamW holds their moments alone, DDP reduces their gradients alone;
- the reference is the policy with its adapters off (`adapters_off`), no second copy of the model: KL to the
  reference is KL to the base;
- a checkpoint's `policy/` and the final one hold the adapters in peft's layout (`PeftModel.from_pretrained(base,
  folder)` loads them; under --fsdp a checkpoint holds the whole model's shards instead); with --lora-merge the
  final one holds the merged weights, a plain model (`adapter_state`);
- the critics (PPO with GAE) stay whole models: a value head on a frozen base would learn little.
Needs peft (`pip install peft==0.21.0`), imported only here.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path

from cli import check_fields, parse_config
from tasks import make_tiny_model, make_tokenizer


@dataclass
class LoraArgs:
    """LoRA knobs (the trainer's Config inherits them); lora_rank 0 trains every weight."""

    lora_rank: int = 0
    """LoRA adapters of this rank on the policy (needs peft; 0 = train every weight); the reference = adapters off."""
    lora_alpha: float = 16.0
    """LoRA scale numerator: the update is (lora_alpha / lora_rank) B A."""
    lora_targets: list[str] = field(default_factory=lambda: ["all-linear"])
    """Modules that get adapters, by name (peft's target_modules: q_proj v_proj ..., all-linear: all but the head)."""
    lora_merge: bool = False
    """The final policy/ folder holds the merged weights (a plain model) instead of the adapters alone."""

    def __post_init__(self):
        check_fields(self, {"[0, inf)": ("lora_rank",), "(0.0, inf)": ("lora_alpha",)}, LoraArgs)
        if self.lora_rank and not self.lora_targets:
            raise ValueError("config field 'lora_targets' is empty: name the modules that get adapters, or all-linear")
        if self.lora_merge and not self.lora_rank:
            raise ValueError(
                "config field 'lora_merge' needs --lora-rank R: without adapters there is nothing to merge"
            )


def add_adapters(model, args: LoraArgs, saved: str | None = None):
    """LoRA adapters put into `model`'s target linear layers in place (peft's inject_adapter_in_model: the model
    stays the same object and class, so every path here treats it as before); only they require grad. saved: an
    adapter folder (adapter_model.safetensors) to load, a checkpoint's. Returns the model."""
    try:
        import peft
    except ImportError as e:
        raise ImportError("--lora-rank needs peft: pip install peft==0.21.0") from e
    targets = args.lora_targets[0] if args.lora_targets == ["all-linear"] else list(args.lora_targets)
    config = peft.LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha, target_modules=targets, lora_dropout=0.0)
    try:
        peft.inject_adapter_in_model(config, model)
    except ValueError as e:  # peft names the targets it could not find
        raise ValueError(f"config field 'lora_targets' = {args.lora_targets}: {e}") from e
    if saved is not None:
        from safetensors.torch import load_file

        state = {k.removeprefix(PEFT_PREFIX): v for k, v in load_file(Path(saved) / ADAPTER_FILE).items()}
        loaded = peft.set_peft_model_state_dict(model, state)
        lacking = [k for k in loaded.missing_keys if ".lora_" in k]
        if (extra := loaded.unexpected_keys) or lacking:
            raise ValueError(f"{saved}: another LoRA layout than --lora-targets / --lora-rank give: adapters "
                             f"{extra[:3]} fit no layer, {lacking[:3]} are not in the file")  # fmt: skip
    return model


def adapter_params(model, args: LoraArgs) -> int:
    """How many adapter weights add_adapters gives `model` (the memory estimate's, on a meta model): r (in + out) per
    target linear layer (torch's Linear, or GPT-2's Conv1D), every one but the output head for all-linear."""
    import peft
    import torch
    from peft.tuners.tuners_utils import check_target_module_exists
    from transformers.pytorch_utils import Conv1D

    head, every = model.get_output_embeddings(), args.lora_targets == ["all-linear"]
    config = peft.LoraConfig(r=args.lora_rank, target_modules=None if every else list(args.lora_targets))
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear | Conv1D) and m is not head]
    targets = [m for n, m in linears if every or check_target_module_exists(config, n)]  # peft's own name matching
    return sum(args.lora_rank * sum(m.weight.shape) for m in targets)


ADAPTER_FILE = "adapter_model.safetensors"  # peft's names: PeftModel.from_pretrained(base, folder) loads the folder
PEFT_PREFIX = "base_model.model."  # where a PeftModel keeps the model its adapters are in: its saved keys start so


def params_line(model, rank: int) -> str:
    """The model's size for a run's header: "0.52M params", with adapters "(0.0225M trainable, LoRA rank 4)" too."""
    line = f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params"
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad) / 1e6  # only the adapters, with LoRA
    return line + (f" ({trainable:.3g}M trainable, LoRA rank {rank})" if rank else "")


def tuner_layers(model) -> list:
    """The layers that carry adapters (peft's BaseTunerLayer), empty for a model without."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [m for m in model.modules() if isinstance(m, BaseTunerLayer)]


@contextlib.contextmanager
def adapters_off(model, lora: bool):
    """Inside, the LoRA policy computes as its base model (the reference of a LoRA run); lora False: nothing."""
    layers = tuner_layers(model) if lora else []
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield model
    finally:
        for layer in layers:
            layer.enable_adapters(True)


def adapter_state(model, state: dict, merge: bool, args: LoraArgs) -> dict:
    """What a LoRA run saves of `model`'s whole state dict `state` (the model's own, or gathered from FSDP2 shards):
    the adapters under peft's names, or with merge the base model's names and weights W0 + (alpha / r) B A."""
    import peft

    if not merge:
        return peft.get_peft_model_state_dict(model, state_dict=state)
    out, scale = {}, args.lora_alpha / args.lora_rank
    transposed = {n for n, m in model.named_modules() if getattr(m, "fan_in_fan_out", False)}  # Conv1D: W0 [in, out]
    for k, v in state.items():
        if ".lora_" in k:
            continue
        if k.endswith(".base_layer.weight"):  # a linear layer with an adapter
            stem = k.removesuffix(".base_layer.weight")
            delta = scale * state[f"{stem}.lora_B.default.weight"] @ state[f"{stem}.lora_A.default.weight"]  # [out, in]
            v = v + (delta.T if stem in transposed else delta)
        out[k.replace(".base_layer.", ".")] = v
    return out


def save(model, tokenizer, path, state: dict, merge: bool, cfg: dict) -> None:
    """A LoRA run's policy/ folder from `model`'s whole state dict `state` (cfg: the run's config as a dict): the
    adapters in peft's layout (adapter_model.safetensors, adapter_config.json), or with merge a plain model."""
    args = LoraArgs(**{k: cfg[k] for k in ("lora_rank", "lora_alpha", "lora_targets")})
    state = adapter_state(model, state, merge, args)
    if merge:
        model.save_pretrained(path, state_dict=state)
    else:
        from safetensors.torch import save_file

        Path(path).mkdir(parents=True, exist_ok=True)
        save_file({PEFT_PREFIX + k: v.contiguous() for k, v in state.items()}, Path(path) / ADAPTER_FILE)
        model.peft_config["default"].base_model_name_or_path = cfg.get("model")  # None: the embedded warm start
        model.peft_config["default"].save_pretrained(str(path))
    tokenizer.save_pretrained(path)


def main(argv=None) -> None:
    """`python lora.py [--lora-rank R --lora-targets ...]`: the embedded model's layers that get adapters, and the
    trained share of its weights."""
    args = parse_config(LoraArgs, argv)
    args.lora_rank = args.lora_rank or 8
    model = make_tiny_model(make_tokenizer())
    whole = sum(p.numel() for p in model.parameters())
    add_adapters(model, args)
    layers = [n for n, m in model.named_modules() if m in tuner_layers(model)]
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(f"rank {args.lora_rank}, alpha {args.lora_alpha}: adapters on {len(layers)} layers: {', '.join(layers)}")
    print(
        f"{trained} adapter weights train, {trained / whole:.1%} of the base's {whole} (lora.adapter_params: "
        f"{adapter_params(make_tiny_model(make_tokenizer()), args)})"
    )


if __name__ == "__main__":
    main()
