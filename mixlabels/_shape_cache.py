"""``shape_cache``: ``functools.lru_cache`` for the label path's constants of shapes and devices, kept out of
``torch.compile``'s trace.

Tap matrices, window matrices and box constants depend on shapes alone, so eager forwards build them once. Under
``torch.compile`` a cache cannot hold them (a graph makes its tensors anew each call), and dynamo, meeting an
``lru_cache``, traces the wrapped function anyway and warns, once per cached function, that "silent incorrectness is a
potential risk": several warnings on every user's first compiled step, about a cache that changes nothing there. A
``shape_cache`` function calls the plain function while dynamo traces (the cache never seen, no warning) and the
cached one otherwise.

Example:
    >>> calls = []
    >>> @shape_cache(maxsize=8)
    ... def square(n: int) -> int:
    ...     calls.append(n)
    ...     return n * n
    >>> square(3), square(3), calls
    (9, 9, [3])
    >>> square.cache_clear(); square(3), calls
    (9, [3, 3])
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Generic, ParamSpec, TypeVar

import torch

__all__ = ["ShapeCached", "shape_cache"]

P = ParamSpec("P")
R = TypeVar("R")


class ShapeCached(Generic[P, R]):
    """A function with an ``lru_cache`` that eager calls use and dynamo's trace skips."""

    def __init__(self, fn: Callable[P, R], maxsize: int) -> None:
        self._fn = fn
        self._cached = functools.lru_cache(maxsize=maxsize)(fn)
        functools.update_wrapper(self, fn)

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        if torch.compiler.is_compiling():  # a constant while tracing: the graph holds what the plain call builds
            return self._fn(*args, **kwargs)
        return self._cached(*args, **kwargs)  # type: ignore[arg-type]

    def cache_clear(self) -> None:
        self._cached.cache_clear()


def shape_cache(maxsize: int) -> Callable[[Callable[P, R]], ShapeCached[P, R]]:
    """``functools.lru_cache(maxsize)`` outside ``torch.compile``, the plain function inside its trace."""

    def wrap(fn: Callable[P, R]) -> ShapeCached[P, R]:
        return ShapeCached(fn, maxsize)

    return wrap
