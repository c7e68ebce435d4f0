"""``OpCounter``: the ATen operators dispatched inside it, counted by name (what a GPU would launch)."""

from __future__ import annotations

from collections import Counter
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["OpCounter"]


class OpCounter(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch types its __init_subclass__ loosely
    """Counts every ATen operator dispatched inside it, by name (``aten.mm.default`` -> ``mm``), and apart
    the ones that compute (``kernels``): not views (``view``, ``permute``, ``slice``, ``detach`` ... only
    describe memory that exists), which on a GPU launch nothing."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.ops: Counter[str] = Counter()
        self.kernels = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops[func.overloadpacket.__name__] += 1
        self.kernels += not getattr(func, "is_view", False)
        return func(*args, **(kwargs or {}))
