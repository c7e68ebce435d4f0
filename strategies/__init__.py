"""strategies: mixing augmentations (kornia modules) whose output carries a ``TokenLabelMap``.

Replacing timm's ``mixup_fn`` in a training loop::

    # before: mixup_fn = timm.data.Mixup(mixup_alpha=0.8, cutmix_alpha=1.0, label_smoothing=0.1, num_classes=1000)
    #         images, targets = mixup_fn(images, labels)
    mixer = Switch([MixUp(1000, alpha=0.8, label_smoothing=0.1), CutMix(1000, alpha=1.0, label_smoothing=0.1)])
    # or, with timm's own arguments and defaults: mixer = timm_mixup(mixup_alpha=0.8, cutmix_alpha=1.0)
    images, label_map = mixer(images, labels)        # labels: (b,) ids or (b, c) probabilities
    targets = label_map.image_targets()              # (b, c): timm's mixed target
    loss = mixlabels.soft_target_cross_entropy(model(images), targets)

With kornia: ``seq = AugmentationSequential(K.RandomHorizontalFlip(), mixer, data_keys=["input"])``;
``images = seq(images)``; ``label_map = sequential_label_map(seq, labels)``.
"""

from mixlabels.strategies._base import MixParams, Mixer, PairMixer, mix_images
from mixlabels.strategies._collate import CollateMixer, timm_collate_mixup
from mixlabels.strategies._config import (
    BlockwiseMixConfig,
    CutMixConfig,
    FMixConfig,
    GridMixConfig,
    MixerConfig,
    MixTokenConfig,
    MixUpConfig,
    RandomPatchMixConfig,
    ResizeMixConfig,
    SaliencyMixConfig,
    SwitchConfig,
    TokenMixConfig,
)
from mixlabels.strategies._cutmix import BoxParams, CutMix, cutmix_boxes
from mixlabels.strategies._elem_switch import ElemSwitch, ElemSwitchParams
from mixlabels.strategies._fmix import FMix
from mixlabels.strategies._gridmix import GridMix
from mixlabels.strategies._mixtoken import MixToken
from mixlabels.strategies._mixup import MixUp, MixUpParams
from mixlabels.strategies._patch import BlockwiseMix, CellParams, RandomPatchMix
from mixlabels.strategies._resizemix import ResizeMix, ResizeParams
from mixlabels.strategies._saliencymix import SaliencyMix, SaliencyParams
from mixlabels.strategies._sampling import Mode, Pairing
from mixlabels.strategies._sequential import sequential_label_map
from mixlabels.strategies._switch import Switch, SwitchParams
from mixlabels.strategies._timm_mixup import timm_mixup
from mixlabels.strategies._torchvision_mixup import torchvision_mixup_cutmix
from mixlabels.strategies._tokenmix import TokenMix

__all__ = [
    "CutMix",
    "MixUp",
    "RandomPatchMix",
    "BlockwiseMix",
    "MixToken",
    "FMix",
    "ResizeMix",
    "SaliencyMix",
    "GridMix",
    "TokenMix",
    "Switch",
    "ElemSwitch",
    "timm_mixup",
    "CollateMixer",
    "timm_collate_mixup",
    "torchvision_mixup_cutmix",
    "Mixer",
    "PairMixer",
    "MixParams",
    "BoxParams",
    "MixUpParams",
    "CellParams",
    "ResizeParams",
    "SaliencyParams",
    "SwitchParams",
    "ElemSwitchParams",
    "Mode",
    "Pairing",
    "mix_images",
    "cutmix_boxes",
    "sequential_label_map",
    "CutMixConfig",
    "MixUpConfig",
    "RandomPatchMixConfig",
    "BlockwiseMixConfig",
    "MixTokenConfig",
    "FMixConfig",
    "ResizeMixConfig",
    "SaliencyMixConfig",
    "GridMixConfig",
    "TokenMixConfig",
    "SwitchConfig",
    "MixerConfig",
]
