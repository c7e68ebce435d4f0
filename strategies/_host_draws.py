"""Random draws as Python numbers, seeded from a ``torch.Generator``, and their one trip to the device.

A mixer's per-batch randomness is a few numbers a group (a partner, a lambda, a box). Drawn as
tiny CPU tensors they cost dozens of host-side operators a call and a copy per tensor; drawn as
Python numbers they cost none, and the params reach the images' device in one buffer.

Randomness still comes from the mixer's ``torch.Generator`` (or torch's default one): each call
takes one 63-bit seed from it and seeds a ``random.Random`` with it, so a generator's state gives
the same params, the generator advances once per call, and per-worker generators stay apart.

Shapes: ``b`` batch, ``g`` groups (independent draws).
"""

from __future__ import annotations

import random
import struct
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from mixlabels.strategies._sampling import Mode, Pairing, check_pairing, check_prob

__all__ = ["HostPairs", "host_rng", "draw_pairs", "draw_beta", "to_fp32", "Column", "column", "columns_on", "sources_column"]

_PHILOX_STEP = 4  # a philox generator's offset advances in multiples of 4 (one 128-bit draw)


def host_rng(generator: torch.Generator | None) -> random.Random:
    """A Python RNG seeded by one draw from ``generator`` (``None``: torch's default CPU generator).

    A CPU generator gives one 63-bit integer (one small host draw, no device). An accelerator's
    generator (philox) is never read on the device, which would wait for its stream: its seed and
    offset are host-side state, so the seed is taken from them and the offset advanced by one draw.
    """
    if generator is None or generator.device.type == "cpu":
        seed = int(torch.empty((), dtype=torch.int64).random_(generator=generator))
        return random.Random(seed)
    offset = generator.get_offset()
    generator.set_offset(offset + _PHILOX_STEP)
    return random.Random(generator.initial_seed() * 2**64 + offset)


@dataclass(frozen=True)
class HostPairs:
    """``Pairs`` as Python lists: partner, draw group and whether each sample is mixed."""

    partner: list[int]
    group: list[int]
    num_groups: int
    applied: list[bool]


def draw_pairs(batch: int, mode: Mode, pairing: Pairing, prob: float, rng: random.Random) -> HostPairs:
    """``sample_pairs``' law with Python numbers: the same pairings, groups and gate.

    Example:
        >>> p = draw_pairs(5, "pair", "flip", 1.0, random.Random(0))
        >>> p.partner, p.group, p.applied
        ([4, 3, 2, 1, 0], [0, 1, 2, 1, 0], [True, True, False, True, True])
    """
    check_pairing(pairing, mode)
    check_prob(prob)
    idx = range(batch)
    pair_slot = [min(i, batch - 1 - i) for i in idx]  # flip pairs i and b-1-i: one draw per pair
    if pairing == "flip":
        partner = [batch - 1 - i for i in idx]
    elif pairing == "roll":
        partner = [(i - 1) % batch for i in idx]  # torchvision's batch.roll(1, 0): sample i takes i - 1
    else:
        perm = list(idx)
        rng.shuffle(perm)
        partner = list(idx)
        if mode == "pair":  # positions 2k and 2k+1 of the permutation form a pair; an odd one out keeps itself
            for k, s in enumerate(perm):
                partner[s] = perm[k ^ 1] if k ^ 1 < batch else s
                pair_slot[s] = k // 2
        else:  # one cycle through a random order: every partner uniform over the others
            for k, s in enumerate(perm):
                partner[s] = perm[(k + 1) % batch]
    if mode == "batch":
        group, num_groups = [0] * batch, 1
    elif mode == "elem":
        group, num_groups = list(idx), batch
    else:
        group, num_groups = pair_slot, (batch + 1) // 2
    gate = [prob >= 1.0 or rng.random() < prob for _ in range(num_groups)]
    applied = [gate[group[i]] and partner[i] != i for i in idx]
    return HostPairs(partner=partner, group=group, num_groups=num_groups, applied=applied)


def draw_beta(alpha: float, rng: random.Random) -> float:
    """One Beta(alpha, alpha) draw in double precision, in ``[0, 1]`` (Python's ``betavariate``)."""
    return rng.betavariate(alpha, alpha)


def to_fp32(x: float) -> float:
    """``x`` rounded to the nearest float32, as ``torch.tensor(x, dtype=torch.float32)`` stores it."""
    return float(struct.unpack("f", struct.pack("f", x))[0])


class Column(NamedTuple):
    """One tensor's values as bytes, for ``columns_on``: its dtype and shape travel with them. (A named tuple: a
    call makes several, and a frozen dataclass's construction costs a few times as much host time.)"""

    data: bytes
    dtype: torch.dtype
    shape: tuple[int, ...]


_TYPECODES = {torch.int64: "q", torch.float32: "f", torch.bool: "B"}  # ``array`` codes of the dtypes sent
_ALIGN = 8  # bytes: every column starts where its dtype may be viewed


def column(values: Iterable[float] | bytes, dtype: torch.dtype, *shape: int) -> Column:
    """``values`` (Python numbers, or their bytes already) as a ``Column`` of ``dtype``, shape ``shape`` (default: flat).

    Example:
        >>> column([1, 2, 3, 4], torch.int64, 2, 2).shape
        (2, 2)
    """
    data = values if isinstance(values, bytes) else array(_TYPECODES[dtype], values).tobytes()
    count = len(data) // dtype.itemsize
    return Column(data, dtype, shape if shape else (count,))


def sources_column(pairs: HostPairs) -> Column:
    """The label map's sources ``[i, partner[i]]`` of every sample, ``(b, 2)`` long."""
    return column([s for i, j in enumerate(pairs.partner) for s in (i, j)], torch.int64, len(pairs.partner), 2)


def columns_on(columns: Sequence[Column], device: torch.device) -> list[Tensor]:
    """Typed columns as tensors on ``device``: one host buffer, at most one (async) copy, no kernel.

    Every column keeps its dtype (long partners and boxes, bool gates and cells, fp32 weights), so
    the device only takes views of the buffer (``view(dtype)``), never converts. On CUDA the buffer
    is pinned and copied without waiting for the stream.

    Example:
        >>> partner, lam = columns_on([column([1, 0], torch.int64), column([0.5, 0.5], torch.float32)], torch.device("cpu"))
        >>> partner.tolist(), lam.dtype
        ([1, 0], torch.float32)
    """
    starts, end = [], 0
    for col in columns:
        starts.append(end)
        end += -(-len(col.data) // _ALIGN) * _ALIGN
    flat = bytearray(end)
    for start, col in zip(starts, columns):
        flat[start : start + len(col.data)] = col.data
    cuda = device.type == "cuda" and not torch.compiler.is_compiling()
    if device.type == "cpu" and not torch.compiler.is_compiling():
        # each column read straight from the bytes, typed (``frombuffer``: no operator, no copy; the tensors keep
        # the bytearray alive): one call a column where slicing one buffer and viewing its dtype cost two
        out = [torch.frombuffer(flat, dtype=col.dtype, count=len(col.data) // col.dtype.itemsize, offset=start)
               if col.data else torch.empty(0, dtype=col.dtype) for start, col in zip(starts, columns)]  # fmt: skip
    else:
        host = torch.frombuffer(flat, dtype=torch.uint8) if end else torch.empty(0, dtype=torch.uint8)
        buffer = host.pin_memory().to(device, non_blocking=True) if cuda else host.to(device)
        # every column's span in one call (a slice each from Python costs an indexing call a column), then its dtype:
        # its data, then its padding to the next aligned start
        spans = [n for col in columns for n in (len(col.data), -len(col.data) % _ALIGN)]
        out = [part.view(col.dtype) for part, col in zip(buffer.split_with_sizes(spans)[0::2], columns)]
    return [t if len(col.shape) == 1 else t.view(col.shape) for t, col in zip(out, columns)]
