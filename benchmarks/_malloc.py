"""The page faults a CPU step pays to glibc's malloc, counted, and a heap that keeps its pages (``speed.py --malloc keep``).

On Linux, torch's CPU tensors come from glibc's malloc. By default it returns memory to the kernel as it goes: large
blocks are mapped and unmapped one by one, and a heap whose free top grows past a threshold is trimmed. Memory
handed back is faulted in again, one 4 KiB page at a time, by the next tensor that writes it. When that happens
depends on the whole sequence of allocations and frees (and on thresholds glibc moves as it runs), not on the work,
so two processes that run the same steps can pay different page faults: session 60 counted 9.4 thousand faults a
backward of EfficientNet-B0 at batch 8 for CutMix + NoAlign and 25.9 thousand for TL-Align in one process, 37 and 32
thousand in the next. At a few microseconds a fault that moves a 0.5 s step by several percent either way.

``keep_heap`` tells malloc to serve every size from its heap (no mapped blocks) and never trim it: after the first
steps every allocation reuses pages already faulted in, and a step's time is its work.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

__all__ = ["keep_heap", "minor_faults"]

_M_TRIM_THRESHOLD = -1  # glibc's malloc.h: free heap top kept before trimming
_M_MMAP_MAX = -4  # glibc's malloc.h: most blocks served by mmap at once (0: none)
_NEVER = 2**31 - 1  # mallopt takes an int: 2 GiB of free heap top before a trim, which a benchmark step never frees


def keep_heap() -> None:
    """Make glibc's malloc keep every page this process has faulted in: no mapped blocks, no trims (process-wide,
    for the rest of its life; meant for a benchmark process). Raises ``RuntimeError`` where there is no glibc."""
    name = ctypes.util.find_library("c") if sys.platform.startswith("linux") else None
    mallopt = getattr(ctypes.CDLL(name), "mallopt", None) if name else None
    if mallopt is None:
        raise RuntimeError("--malloc keep needs glibc's mallopt (Linux); run with --malloc default here")
    for param, value in ((_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, _NEVER)):
        if mallopt(ctypes.c_int(param), ctypes.c_int(value)) != 1:
            raise RuntimeError(f"glibc's mallopt refused parameter {param} = {value}; run with --malloc default")


def minor_faults() -> int | None:
    """Page faults served without I/O so far by this process (all threads), or ``None`` where ``getrusage`` is absent."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)
