"""Where a run's weights start: a checkpoint file (``--init``) or timm's hub weights (``--pretrained``).

``--init`` accepts what people have: a raw state dict, ``{"state_dict": ...}``,
``{"model": ...}`` or ``{"state_dict_ema": ...}`` as timm's ``train.py`` writes them
(its ``args`` namespace included), ``.safetensors`` files, and DDP's ``module.``
prefix. It is loaded strictly: a checkpoint of another architecture is refused with
the keys that do not fit, never half-loaded. ``--pretrained`` downloads through
timm; without network it fails at once with what to do instead, never hangs.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["read_state_dict", "load_init", "file_digest", "pretrained_model", "hub_reachable", "PretrainedUnavailable"]

# the wrappers a checkpoint may put its weights under, in timm's order (the EMA weights only when alone)
_WRAPPERS = ("state_dict", "model", "state_dict_ema", "model_ema")
_HUB = ("huggingface.co", 443)


class PretrainedUnavailable(RuntimeError):
    """timm's hub weights could not be had (offline and not cached, or not fitting the asked architecture)."""


def file_digest(path: str | Path) -> str:
    """sha256 of a file's bytes: the run key follows the checkpoint's content, not only its name."""
    p = _existing(path)
    h = hashlib.sha256()
    with p.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _existing(path: str | Path) -> Path:
    p = Path(path).expanduser()
    if not p.is_file():
        raise FileNotFoundError(
            f"--init {path}: no such file; pass a state dict or a timm checkpoint (.pth, .pt, .bin or .safetensors)"
        )
    return p


def read_state_dict(path: str | Path) -> dict[str, Tensor]:
    """The weights in ``path``, unwrapped from a checkpoint and from DDP's ``module.`` prefix.

    Raises:
        FileNotFoundError: no such file.
        ValueError: not a torch or safetensors file, or no state dict in it (the message names its keys).
    """
    p = _existing(path)
    blob: Any
    try:
        if p.suffix == ".safetensors":
            from safetensors.torch import load_file

            blob = load_file(str(p), device="cpu")
        else:
            # timm's train.py stores its argparse namespace next to the weights: allow that one class, nothing else
            with torch.serialization.safe_globals([argparse.Namespace]):
                blob = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises UnpicklingError, RuntimeError, EOFError... for a file it cannot read
        raise ValueError(f"--init {path} could not be read as a torch checkpoint or state dict: {err}") from err
    if isinstance(blob, dict):
        for key in _WRAPPERS:
            if isinstance(blob.get(key), dict):
                blob = blob[key]
                break
    if not isinstance(blob, dict) or not blob or not all(isinstance(v, Tensor) for v in blob.values()):
        keys = list(blob)[:8] if isinstance(blob, dict) else type(blob).__name__
        raise ValueError(
            f"--init {path} holds no state dict (top level: {keys}); expected a mapping of parameter names to "
            f"tensors, or one under {', '.join(repr(k) for k in _WRAPPERS)}"
        )
    state: dict[str, Tensor] = dict(blob)
    if all(k.startswith("module.") for k in state):  # saved from a DistributedDataParallel wrapper
        state = {k.removeprefix("module."): v for k, v in state.items()}
    return state


def load_init(model: nn.Module, path: str | Path, name: str = "the model") -> None:
    """Load ``path`` into ``model`` strictly; a mismatch names the missing, unexpected and mis-shaped keys."""
    state = read_state_dict(path)
    own = model.state_dict()
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    shapes = [f"{k} {tuple(state[k].shape)} vs {tuple(v.shape)}" for k, v in own.items()
              if k in state and state[k].shape != v.shape]
    if missing or unexpected or shapes:
        def few(keys: list[str]) -> str:
            return f"{len(keys)} ({', '.join(keys[:6])}{', ...' if len(keys) > 6 else ''})"

        raise ValueError(
            f"--init {path} does not fit {name}: missing {few(missing)}, unexpected {few(unexpected)}, "
            f"shape mismatches (checkpoint vs model) {few(shapes)}; build the checkpoint's architecture "
            "(--model, --embed-dim, --depth, --heads, --patch-size, --img-size, and the class count of its data)"
        )
    model.load_state_dict(state, strict=True)


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the Hugging Face hub answers a TCP connection within ``timeout`` seconds."""
    try:
        with socket.create_connection(_HUB, timeout=timeout):
            return True
    except OSError:
        return False


@contextmanager
def _offline_hub(offline: bool, timeout: float) -> Iterator[None]:
    """Hub downloads offline (cache only) when asked, and no socket waiting longer than ``timeout``."""
    import huggingface_hub.constants as hub

    was_offline, was_timeout = hub.HF_HUB_OFFLINE, socket.getdefaulttimeout()
    hub.HF_HUB_OFFLINE = was_offline or offline  # read at import from HF_HUB_OFFLINE; set here for this call
    socket.setdefaulttimeout(timeout)  # URL-hosted weights go through urllib, which would wait forever
    try:
        yield
    finally:
        hub.HF_HUB_OFFLINE = was_offline
        socket.setdefaulttimeout(was_timeout)


def pretrained_model(name: str, build: Callable[[], nn.Module], *, reachable: Callable[[], bool] | None = None,
                     timeout: float = 30.0) -> nn.Module:
    """``build()`` (a ``timm.create_model(..., pretrained=True)``) that fails fast and clearly without network.

    With ``HF_HUB_OFFLINE=1`` set, or the hub unreachable, the download runs offline: weights in
    the local cache load, anything else raises at once.
    """
    forced = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    offline = forced or not (reachable or hub_reachable)()
    try:
        with _offline_hub(offline, timeout):
            return build()
    except Exception as err:
        if offline:
            raise PretrainedUnavailable(
                f"--pretrained: {name}'s weights are not in the local cache and the hub cannot be reached "
                f"(no network, or HF_HUB_OFFLINE set): {type(err).__name__}: {err}. Run once with network to "
                "cache them, or pass a local checkpoint with --init PATH instead"
            ) from err
        raise PretrainedUnavailable(
            f"--pretrained: timm could not load {name}'s pretrained weights: {type(err).__name__}: {err}. "
            "The weights fix the architecture: use --model NAME without size overrides (--embed-dim, --depth, "
            "--heads, --patch-size), or pass a checkpoint with --init PATH"
        ) from err
