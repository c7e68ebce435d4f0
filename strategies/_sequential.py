"""Label maps out of kornia's ``AugmentationSequential``.

kornia hands a mix augmentation only the images (``data_keys=["input"]``): its
``ClassSequentialOps`` raises ``NotImplementedError`` for class labels of any
``MixAugmentationBaseV2``. So the container mixes the images, records each
module's params (ours carry the typed params), and ``sequential_label_map`` builds
the map from the params recorded for that very call, so replays stay consistent.
"""

from __future__ import annotations

from typing import Any

from kornia.augmentation import AugmentationSequential, GeometricAugmentationBase2D
from kornia.augmentation.container.params import ParamItem
from torch import Tensor

from mixlabels import TokenLabelMap
from mixlabels.strategies._base import PARAMS_KEY, Mixer

__all__ = ["sequential_label_map"]


def _flatten(params: list[ParamItem], seq: Any) -> list[tuple[Any, ParamItem]]:
    """(module, params) pairs in execution order, nested containers expanded."""
    out: list[tuple[Any, ParamItem]] = []
    for item in params:
        module = seq.get_submodule(item.name)
        if isinstance(item.data, list):
            out.extend(_flatten(item.data, module))
        else:
            out.append((module, item))
    return out


def sequential_label_map(seq: AugmentationSequential, labels: Tensor, params: list[ParamItem] | None = None) -> TokenLabelMap:
    """The label map of the mixer inside ``seq`` for its last call (or for recorded ``params``).

    Args:
        seq: the container, already called on the images (``data_keys=["input"]``).
        labels: ``(b,)`` class ids or ``(b, c)`` probabilities of the un-mixed batch.
        params: kornia's recorded params (``seq._params``); default: the last call's.

    Returns:
        The mixer's map; when no mixer ran (e.g. ``random_apply`` skipped it) a map
        is impossible to build without the image size, so this raises.

    Raises:
        ValueError: no mixer ran, or a geometric augmentation ran after the mixer (it
            would move pixels the map does not follow: put mixers last).

    Example:
        >>> import torch, kornia.augmentation as K
        >>> from mixlabels.strategies import CutMix
        >>> seq = AugmentationSequential(K.RandomHorizontalFlip(), CutMix(num_classes=10), data_keys=["input"])
        >>> mixed = seq(torch.rand(2, 3, 8, 8))
        >>> sequential_label_map(seq, torch.tensor([1, 2])).image_targets().shape
        torch.Size([2, 10])
    """
    recorded = params if params is not None else seq._params
    if recorded is None:
        raise ValueError("the AugmentationSequential has not run yet: call it on the images first")
    found: tuple[Mixer[Any], ParamItem] | None = None
    for module, item in _flatten(list(recorded), seq):
        if isinstance(module, Mixer) and isinstance(item.data, dict) and PARAMS_KEY in item.data:
            found = (module, item)
        elif found is not None and isinstance(module, GeometricAugmentationBase2D):
            prob = item.data.get("batch_prob") if isinstance(item.data, dict) else None
            if prob is None or bool((prob > 0.5).any()):
                raise ValueError(
                    f"{type(module).__name__} ran after {type(found[0]).__name__} and moves pixels the label map "
                    "does not follow; put mix augmentations last (intensity augmentations after them are fine)"
                )
    if found is None:
        raise ValueError("no mixer from strategies ran in this AugmentationSequential call")
    mixer, item = found
    return mixer.label_map(labels, item.data)
