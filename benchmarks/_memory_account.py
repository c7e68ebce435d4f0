"""Who holds a step's bytes at its peak (the GPU suite's ``--profile``): where a memory ratio is over 1, which lines.

On CUDA from the caching allocator's history of one step (``torch.cuda.memory._record_memory_history``): every
allocation and completed free in order, replayed to the step's peak, the blocks live there summed by the innermost
frame of this library, timm or the benchmarks that asked for them. On the CPU from the profiler's allocation events,
by operator (``_step_memory.allocator_peak``), so that the same call runs in a dry run.

Both count what the step adds on top of what was live when it began (model, optimizer state, batch): the part a
scheme can change.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks._step_memory import allocator_peak, replay_to_peak

__all__ = ["memory_account", "peak_owners"]

_HISTORY = 2_000_000
"""Most allocator events kept (a ring buffer): far more than one step of a small model at batch 128 makes."""

_OWN = ("/mixlabels/", "/strategies/", "/backbones/", "/benchmarks/", "/timm/")
"""A frame in one of these folders names the site: the innermost such frame of an allocation's Python stack."""


def _site(frames: Sequence[Mapping[str, Any]]) -> str:
    """``file.py:line function`` of the innermost frame in this library, timm or the benchmarks (the allocator lists
    frames innermost first), else of the innermost frame, else ``<no python frame>``."""
    for frame in frames:
        if any(part in str(frame.get("filename", "")) for part in _OWN):
            break
    else:
        if not frames:
            return "<no python frame>"
        frame = frames[0]
    return f"{Path(str(frame.get('filename', '?'))).name}:{frame.get('line', 0)} {frame.get('name', '?')}"


def peak_owners(trace: Sequence[Mapping[str, Any]], top: int = 8) -> tuple[int, dict[str, int]]:
    """The bytes a traced step adds at its peak, and the ``top`` sites holding them there.

    Args:
        trace: one device's allocator events in order (``torch.cuda.memory._snapshot()["device_traces"][i]``):
            ``action`` (``alloc``; ``free_completed``, when the block may be reused; others are ignored), ``addr``,
            ``size`` and ``frames`` (``filename``, ``line``, ``name``; innermost first).
        top: how many sites to return, largest first.

    Returns:
        ``(peak, sites)``: the most bytes allocated and not yet freed at any point of the trace (blocks allocated
        before it and freed in it count negative, as they free what was live at its start) and, at that point, the
        live blocks allocated in the trace summed by ``_site``.

    Example:
        >>> f = [{"filename": "/x/mixlabels/a.py", "line": 3, "name": "g"}]
        >>> t = [{"action": "alloc", "addr": 1, "size": 10, "frames": f},
        ...      {"action": "alloc", "addr": 2, "size": 5, "frames": []},
        ...      {"action": "free_completed", "addr": 2, "size": 5}]
        >>> peak_owners(t)
        (15, {'a.py:3 g': 10, '<no python frame>': 5})
    """
    events = [(int(e["addr"]), int(e["size"]) if e["action"] == "alloc" else -int(e["size"]), e.get("frames", []))
              for e in trace if e["action"] in ("alloc", "free_completed")]
    return replay_to_peak(events, _site, 0, top)


def memory_account(step: Callable[[], object], device: torch.device, top: int = 8) -> dict[str, Any]:
    """One more ``step`` with its allocations recorded: ``{"step_mb": ..., "top": [{"site": ..., "mb": ...}]}``,
    what it adds at its peak and who holds that (CUDA: by line, ``peak_owners``; CPU: by operator)."""
    if device.type != "cuda":

        def window() -> None:
            step()

        alloc = allocator_peak(window, top=top)
        sites, peak = dict(alloc.top), alloc.step_bytes
    else:
        index = device.index if device.index is not None else torch.cuda.current_device()
        torch.cuda.synchronize(device)
        # Python frames only: symbolising C++ stacks costs seconds a step
        torch.cuda.memory._record_memory_history(context="alloc", stacks="python", max_entries=_HISTORY, device=device,
                                                 clear_history=True)  # the trace: this step's events alone
        try:
            step()
            torch.cuda.synchronize(device)
            trace = torch.cuda.memory._snapshot()["device_traces"][index]
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)
        if len(trace) >= _HISTORY:
            raise RuntimeError(f"the step made {_HISTORY} allocator events or more: the history lost its first ones")
        peak, sites = peak_owners(trace, top)
    return {"step_mb": peak / 2**20, "top": [{"site": s, "mb": n / 2**20} for s, n in sites.items()]}
