"""mixlabels: mixing augmentations whose labels follow the tokens through vision transformers.

The typed core shared by the mixers (``strategies``) and the backbone adapters
(``backbones``): the label map of a mixed batch, the soft-target losses and the
configuration base.
"""

from mixlabels._align import AlignedOutput, AlignedTargets, Fork, LabelTracker, Readout, Scheme, TokenLayout
from mixlabels._config import Config
from mixlabels._label_map import TokenLabelMap, check_labels, class_distributions
from mixlabels._mask import BoxMask, CellMask, Mask
from mixlabels._loss import (
    SoftTargetCrossEntropy,
    TokenSoftTargetCrossEntropy,
    soft_target_cross_entropy,
    token_soft_target_cross_entropy,
)
from mixlabels._rules import Rules
from mixlabels._trackers import CompactTracker, DenseTracker

# The schemes and their configs are re-exported whole (their modules' ``__all__``), so a
# new scheme lands in exactly two files: its class in _schemes.py, its config in _scheme_config.py.
from mixlabels import _scheme_config, _schemes
from mixlabels._scheme_config import *  # noqa: F403
from mixlabels._schemes import *  # noqa: F403

__all__ = [
    "Config",
    "TokenLabelMap",
    "Mask",
    "CellMask",
    "BoxMask",
    "check_labels",
    "class_distributions",
    "SoftTargetCrossEntropy",
    "TokenSoftTargetCrossEntropy",
    "soft_target_cross_entropy",
    "token_soft_target_cross_entropy",
    # alignment: the event protocol, the schemes and their configs
    "TokenLayout",
    "LabelTracker",
    "Fork",
    "Scheme",
    "Readout",
    "AlignedTargets",
    "AlignedOutput",
    "Rules",
    "CompactTracker",
    "DenseTracker",
    *_schemes.__all__,
    *_scheme_config.__all__,
]
