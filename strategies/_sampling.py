"""Random draws with an explicit ``torch.Generator``: pairings, shared draws, Beta lambdas.

Every mixer samples through these helpers so that the same seed gives the same
params on the same device, whatever the mixer. Draws are *grouped*: a mode says
which samples share one random draw (timm's ``mode``):

- ``"batch"``: one draw for the whole batch (kornia's ``same_on_batch``),
- ``"pair"``:  one draw per pair; a pair mixes symmetrically (each takes the other's region),
- ``"elem"``:  one draw per sample.

Shapes: ``b`` batch, ``g`` groups (independent draws).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Literal, TypeVar

import torch
from kornia.augmentation.random_generator.base import RandomGeneratorBase
from torch import Tensor

if TYPE_CHECKING:
    import random

    from mixlabels.strategies._base import MixParams
    from mixlabels.strategies._host_draws import HostPairs

__all__ = ["Mode", "Pairing", "Pairs", "MixSampler", "sample_pairs", "check_pairing", "sample_beta", "sample_uniform", "check_prob"]

Mode = Literal["batch", "pair", "elem"]
Pairing = Literal["flip", "derangement", "roll"]
MODES: tuple[str, ...] = ("batch", "pair", "elem")
PAIRINGS: tuple[str, ...] = ("flip", "derangement", "roll")

P = TypeVar("P", bound="MixParams")


@dataclass(frozen=True, eq=False, kw_only=True)
class Pairs:
    """Who mixes with whom, and which random draw each sample uses.

    Attributes:
        partner: ``(b,)`` long, batch index of the sample mixed in (source 1).
        group: ``(b,)`` long, index of the draw (lambda, box, cells) each sample uses.
        num_groups: ``g``, number of independent draws to make.
        applied: ``(b,)`` bool, the sample is mixed (won its ``prob`` draw and has a partner other than itself).
    """

    partner: Tensor
    group: Tensor
    num_groups: int
    applied: Tensor


def check_pairing(pairing: str, mode: str) -> None:
    """Raise unless ``pairing`` is known and fits ``mode`` (``roll`` is a cycle: no ``pair`` mode)."""
    if pairing not in PAIRINGS:
        raise ValueError(f"pairing must be one of {PAIRINGS}, got {pairing!r}")
    if pairing == "roll" and mode == "pair":
        raise ValueError(
            "pairing='roll' (sample i mixes with i - 1, torchvision's MixUp/CutMix) forms a cycle, not pairs, so "
            "mode='pair' (one draw per symmetric pair) cannot use it: use mode 'batch' or 'elem' with 'roll', "
            "or pairing 'flip'/'derangement' with 'pair'"
        )


def check_prob(prob: float, name: str = "prob", meaning: str = "the probability of mixing a batch, pair or sample") -> None:
    """Raise unless ``prob`` is a probability; the message names the argument ``name`` and what it means."""
    if not 0.0 <= prob <= 1.0:
        raise ValueError(f"{name} must lie in [0, 1] ({meaning}), got {prob}")


def sample_uniform(shape: tuple[int, ...], generator: torch.Generator | None, device: torch.device) -> Tensor:
    """Uniform ``[0, 1)`` draws in float64 (integer positions are floored from them without fp32 rounding)."""
    return torch.rand(shape, generator=generator, device=device, dtype=torch.float64)


def sample_beta(alpha: float, n: int, generator: torch.Generator | None, device: torch.device) -> Tensor:
    """``n`` draws of Beta(alpha, alpha) as fp32, ``(n,)``.

    ``torch.distributions.Beta`` cannot take a generator; it samples the first
    coordinate of a Dirichlet, which is what this does, with the generator. Float64
    keeps small alphas from underflowing both gamma draws to zero.
    """
    conc = torch.full((n, 2), float(alpha), dtype=torch.float64, device=device)
    return torch._sample_dirichlet(conc, generator=generator)[:, 0].clamp(0.0, 1.0).float()


def _positions(perm: Tensor) -> Tensor:
    """Inverse permutation: where each sample sits in ``perm``."""
    pos = torch.empty_like(perm)
    pos[perm] = torch.arange(perm.numel(), device=perm.device)
    return pos


def sample_pairs(
    batch: int,
    mode: Mode,
    pairing: Pairing,
    prob: float,
    generator: torch.Generator | None,
    device: torch.device,
) -> Pairs:
    """Draw partners, draw groups and the per-group ``prob`` gate for a batch.

    ``flip`` pairs sample ``i`` with ``b - 1 - i`` (timm). ``derangement`` draws a
    uniformly random cyclic permutation in ``batch``/``elem`` mode (every sample's
    partner is uniform over the others, none is its own) and a uniformly random
    perfect matching in ``pair`` mode. ``roll`` mixes sample ``i`` with ``i - 1``
    (``batch.roll(1, 0)``: torchvision's MixUp and CutMix); a cycle, not pairs, so
    ``pair`` mode refuses it. A sample left with itself (the middle of an
    odd batch under ``flip``, the odd one out of a matching, a batch of one) is
    unmixed: mixing an image with itself changes nothing, so it keeps weight 1.

    Args:
        batch: ``b``.
        mode: ``"batch"``, ``"pair"`` or ``"elem"``.
        pairing: ``"flip"``, ``"derangement"`` or ``"roll"``.
        prob: probability of mixing, drawn once per group.
        generator: source of randomness; ``None`` uses torch's default generator.
        device: where to draw (the generator's device when one is given).

    Returns:
        The pairing, groups and gate.

    Example:
        >>> p = sample_pairs(5, "pair", "flip", 1.0, torch.Generator().manual_seed(0), torch.device("cpu"))
        >>> p.partner.tolist(), p.group.tolist(), p.applied.tolist()
        ([4, 3, 2, 1, 0], [0, 1, 2, 1, 0], [True, True, False, True, True])
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES} (one lambda per batch, per pair, per element), got {mode!r}")
    check_pairing(pairing, mode)
    check_prob(prob)
    idx = torch.arange(batch, device=device)
    pair_slot = torch.minimum(idx, idx.flip(0))  # flip pairs i and b-1-i: one draw per pair
    if pairing == "flip":
        partner = idx.flip(0)
    elif pairing == "roll":
        partner = (idx - 1) % max(batch, 1)  # torchvision's batch.roll(1, 0): sample i takes i - 1
    elif mode == "pair":
        perm = torch.randperm(batch, generator=generator, device=device)
        pos = _positions(perm)
        mate = pos ^ 1  # positions 2k and 2k+1 of the permutation form a pair
        partner = perm[torch.where(mate < batch, mate, pos)]
        pair_slot = pos // 2
    else:
        perm = torch.randperm(batch, generator=generator, device=device)
        partner = perm[(_positions(perm) + 1) % max(batch, 1)]  # one cycle through a random order
    if mode == "batch":
        group, num_groups = torch.zeros_like(idx), 1
    elif mode == "elem":
        group, num_groups = idx, batch
    else:
        group, num_groups = pair_slot, (batch + 1) // 2
    gate = sample_uniform((num_groups,), generator, device) < prob
    applied = gate[group] & (partner != idx)
    return Pairs(partner=partner, group=group, num_groups=num_groups, applied=applied)


class MixSampler(RandomGeneratorBase, Generic[P]):
    """Kornia random generator that returns frozen, typed params for one mixing kind.

    Subclasses implement ``draw``; ``forward`` pairs the batch, then draws the
    kind's randomness once per group. Kornia generators return ``Dict[str, Tensor]``
    from ``torch.distributions`` with the global RNG; these take an explicit
    ``torch.Generator`` and return a frozen dataclass instead.

    Args:
        mode: which samples share a draw: ``"batch"``, ``"pair"`` or ``"elem"``.
        pairing: ``"flip"`` (timm), ``"derangement"`` or ``"roll"`` (torchvision).
        prob: probability of mixing, per batch, pair or sample according to ``mode``.
    """

    params_type: ClassVar[type[Any]]  # the MixParams subclass ``draw`` returns (checked on replay)
    # The draws are a few numbers a group (partners, lambdas, boxes, cell grids): kinds that set
    # ``host_draws`` draw them as Python numbers (``draw_host``, seeded by one draw from the
    # generator: ``_host_draws``), so sampling runs no tensor operator on the host, reads no device
    # value, and builds the params where the images are in one buffer (one copy to an accelerator).
    # A kind that also draws per pixel (FMix's spectra) draws its Python numbers so and the pixels'
    # tensor from the generator (``draw_host_and_pixels``); ``draw`` draws everything as tensors.
    host_draws: ClassVar[bool] = False

    def __init__(self, mode: Mode = "batch", pairing: Pairing = "flip", prob: float = 1.0) -> None:
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES} (one lambda per batch, per pair, per element), got {mode!r}")
        check_pairing(pairing, mode)
        check_prob(prob)
        self.mode: Mode = mode
        self.pairing: Pairing = pairing
        self.prob = float(prob)

    def make_samplers(self, device: torch.device, dtype: torch.dtype) -> None:
        # Draws take the generator at call time, so there is no distribution object
        # to rebuild; kornia still records the device, used when no generator is given.
        return None

    def __repr__(self) -> str:
        return f"mode={self.mode}, pairing={self.pairing}, prob={self.prob}"

    def check_image_size(self, image_size: tuple[int, int]) -> None:
        """Raise a clear error if this kind cannot mix images of ``image_size``."""
        if image_size[0] < 1 or image_size[1] < 1:
            raise ValueError(f"images must have a positive height and width, got {image_size}")

    def forward(  # type: ignore[override]  # typed params, not kornia's Dict[str, Tensor]
        self,
        batch_shape: tuple[int, ...],
        same_on_batch: bool = False,
        *,
        generator: torch.Generator | None = None,
        device: torch.device | None = None,
    ) -> P:
        """Sample params for a batch of shape ``(b, c, H, W)``; ``same_on_batch`` is ``mode="batch"``."""
        b, hh, ww = int(batch_shape[0]), int(batch_shape[-2]), int(batch_shape[-1])
        self.check_image_size((hh, ww))
        if generator is not None:
            dev = generator.device
        elif device is not None:
            dev = torch.device(device)
        else:
            dev = torch.device(self.device) if self.device is not None else torch.device("cpu")
        if self.host_draws:
            from mixlabels.strategies._host_draws import draw_pairs, host_rng  # it imports this module

            if device is not None:  # the params go where they are used; the draws never touch a device
                dev = torch.device(device)
            rng = host_rng(generator)
            host_pairs = draw_pairs(b, self.mode, self.pairing, self.prob, rng)
            return self.draw_host_and_pixels(host_pairs, (hh, ww), rng, generator, dev)
        pairs = sample_pairs(b, self.mode, self.pairing, self.prob, generator, dev)
        return self.draw(pairs, (hh, ww), generator, dev)

    def draw_host(self, pairs: HostPairs, image_size: tuple[int, int], rng: random.Random, device: torch.device) -> P:
        """``draw`` with Python numbers from ``rng``; the params' tensors are built on ``device``."""
        raise NotImplementedError

    def draw_host_and_pixels(
        self, pairs: HostPairs, image_size: tuple[int, int], rng: random.Random, generator: torch.Generator | None,
        device: torch.device,
    ) -> P:
        """``draw_host``; a kind whose Python draws come with a per-pixel tensor draw (FMix's noise) overrides this
        and draws that tensor from ``generator`` (``None``: torch's default generator of ``device``)."""
        return self.draw_host(pairs, image_size, rng, device)

    def draw(self, pairs: Pairs, image_size: tuple[int, int], generator: torch.Generator | None, device: torch.device) -> P:
        """Draw this kind's randomness for ``pairs.num_groups`` groups and build the params."""
        raise NotImplementedError
