"""``OpCounter``: the ATen operators dispatched inside it, counted by name (what a GPU would launch)."""

from __future__ import annotations

from collections import Counter
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["NO_LAUNCH", "OpCounter"]


NO_LAUNCH = frozenset({"_unsafe_view", "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"})
"""Operators that are not views by their schema and still launch nothing on a GPU: ``_unsafe_view`` is a view that
autograd does not track (what ``reshape`` of a fresh product returns), the ``empty`` family allocates (from the
caching allocator) without writing. Counted as dispatched, not as computing."""


class OpCounter(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch types its __init_subclass__ loosely
    """Counts every ATen operator dispatched inside it, by name (``aten.mm.default`` -> ``mm``), and apart
    the ones that compute (``kernels``): not views (``view``, ``permute``, ``slice``, ``detach`` ... only
    describe memory that exists) nor ``NO_LAUNCH``'s, which on a GPU launch nothing."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.ops: Counter[str] = Counter()
        self.kernels = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        self.ops[name] += 1
        self.kernels += not (getattr(func, "is_view", False) or name in NO_LAUNCH)
        return func(*args, **(kwargs or {}))
