"""Per-sample params drawn on the host, sent to the device in one asynchronous copy.

A mixer's params are a few tiny tensors (partners, lambdas, boxes, cells, the label map's
sources and weights). Drawn on the host they launch no kernels; sent one by one, each would be
a copy from pageable memory, which waits for the device's stream to drain (a host sync). Packed
into one pinned buffer they go in one ``non_blocking`` copy and come back as views of it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["to_device", "pack", "unpack"]

_ALIGN = 8  # bytes: every slice of the buffer starts where any dtype may be viewed


def to_device(tensors: Sequence[Tensor], device: torch.device | str) -> list[Tensor]:
    """``[t.to(device) for t in tensors]``, in one pinned, asynchronous copy from the CPU to a CUDA device.

    The results are views of one device buffer (contiguous, with the tensors' shapes and dtypes).
    Anything else (already there, another device pair, tracing by dynamo) moves tensor by tensor.

    Example:
        >>> a, b = to_device([torch.tensor([1, 2]), torch.tensor([0.5])], "cpu")
        >>> a.tolist(), b.tolist()
        ([1, 2], [0.5])
    """
    dev = torch.device(device)
    if dev.type != "cuda" or torch.compiler.is_compiling() or any(t.device.type != "cpu" for t in tensors):
        return [t.to(dev) for t in tensors]
    host = pack(tensors, pin_memory=True)  # the caching host allocator: reused, kept until copied
    return unpack(host.to(dev, non_blocking=True), tensors)


def _spans(tensors: Sequence[Tensor]) -> list[tuple[int, int]]:
    """``(start, bytes)`` of every tensor in the packed buffer, each start aligned."""
    spans, total = [], 0
    for t in tensors:
        size = t.numel() * t.element_size()
        spans.append((total, size))
        total += -(-size // _ALIGN) * _ALIGN
    return spans


def pack(tensors: Sequence[Tensor], pin_memory: bool = False) -> Tensor:
    """The bytes of every (CPU) tensor in one ``uint8`` buffer, each at an aligned start."""
    spans = _spans(tensors)
    end = spans[-1][0] + spans[-1][1] if spans else 0
    buffer = torch.empty(-(-end // _ALIGN) * _ALIGN, dtype=torch.uint8, pin_memory=pin_memory)
    for (start, size), t in zip(spans, tensors):
        buffer[start : start + size].copy_(t.contiguous().view(-1).view(torch.uint8))
    return buffer


def unpack(buffer: Tensor, like: Sequence[Tensor]) -> list[Tensor]:
    """Views of ``pack(like)``'s buffer (wherever it now is) with the shapes and dtypes of ``like``."""
    return [buffer[start : start + size].view(t.dtype).view(t.shape) for (start, size), t in zip(_spans(like), like)]
