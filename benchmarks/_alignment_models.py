"""The alignment analysis' models: a timm ViT from a trained state dict or at random init, optionally sharpened."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["architecture_of", "build_model", "checkpoint_model", "heads_from_run_file", "load_state_dict"]


def load_state_dict(path: Path) -> dict[str, Tensor]:
    """A timm state dict, unwrapped from ``{"model": ...}``/``{"state_dict": ...}`` and ``module.`` prefixes."""
    blob: Any = torch.load(path, map_location="cpu", weights_only=True)
    for key in ("model", "state_dict", "model_state_dict"):
        if isinstance(blob, dict) and isinstance(blob.get(key), dict):
            blob = blob[key]
    if not isinstance(blob, dict):
        raise ValueError(f"{path} holds a {type(blob).__name__}, not a state dict")
    state: dict[str, Tensor] = {}
    for k, v in blob.items():
        for prefix in ("module.", "model."):
            k = k[len(prefix) :] if k.startswith(prefix) else k
        state[k] = v
    return state


def architecture_of(state: dict[str, Tensor]) -> dict[str, Any]:
    """What a ViT state dict tells about its architecture (not the number of heads)."""
    proj = state["patch_embed.proj.weight"]  # d 3 p p
    embed_dim, patch = int(proj.shape[0]), int(proj.shape[-1])
    depth = 1 + max(int(k.split(".")[1]) for k in state if k.startswith("blocks."))
    arch: dict[str, Any] = {"embed_dim": embed_dim, "patch_size": patch, "depth": depth}
    if "head.weight" in state:
        arch["num_classes"] = int(state["head.weight"].shape[0])
    prefix = int("cls_token" in state) + (int(state["reg_token"].shape[1]) if "reg_token" in state else 0)
    if "cls_token" not in state:
        arch.update(class_token=False, global_pool="avg")
    if "pos_embed" in state:
        for n in (int(state["pos_embed"].shape[1]) - prefix, int(state["pos_embed"].shape[1])):
            side = math.isqrt(n)
            if side * side == n:
                arch["img_size"] = side * patch
                break
    return arch


def heads_from_run_file(checkpoint: Path) -> int | None:
    """The head count of an ablation checkpoint ``<out>/checkpoints/<key>.pth``, from ``<out>/runs/<key>.json``."""
    run_file = checkpoint.parent.parent / "runs" / f"{checkpoint.stem}.json"
    try:
        heads = json.loads(run_file.read_text())["run"]["model"]["num_heads"]
    except (OSError, ValueError, KeyError, TypeError):  # no run file, or not the ablation's
        return None
    return heads if isinstance(heads, int) else None


def checkpoint_model(name: str, path: Path, overrides: dict[str, Any], sharpen: float) -> tuple[nn.Module, dict[str, Any]]:
    """The trained ViT in ``path``: its architecture from the state dict, its heads from the run file or
    ``overrides``/``embed_dim // 64``, every other ``overrides`` value on top."""
    state = load_state_dict(path)
    arch: dict[str, Any] = {"num_classes": 10, **architecture_of(state)}
    arch["num_heads"] = heads_from_run_file(path) or max(1, arch["embed_dim"] // 64)
    arch.update({k: v for k, v in overrides.items() if v is not None})
    arch.setdefault("img_size", 224)
    model = build_model(name, arch, sharpen)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise SystemExit(
            f"checkpoint {path} does not fit {name} {arch}: missing {missing[:4]}, unexpected {unexpected[:4]}; "
            "set --model/--num-heads/--img-size to the trained architecture"
        )
    return model, arch


def build_model(name: str, arch: dict[str, Any], sharpen: float) -> nn.Module:
    """A timm ViT (``pretrained=False``) in eval mode, attention logits optionally scaled by ``sharpen``."""
    import timm  # imports torchvision: keep it off the --help path

    model: nn.Module = timm.create_model(name, pretrained=False, **arch)
    if sharpen != 1.0:
        # Random-init ViTs attend almost uniformly; scaling q and k by sqrt(s) scales the
        # attention logits by s: a stand-in for the peaked attention of trained models.
        m: Any = model
        with torch.no_grad():
            for blk in m.blocks:
                qk = 2 * blk.attn.qkv.weight.shape[0] // 3
                blk.attn.qkv.weight[:qk] *= math.sqrt(sharpen)
                if blk.attn.qkv.bias is not None:
                    blk.attn.qkv.bias[:qk] *= math.sqrt(sharpen)
    return model.eval()

