"""The rows of the paper's Table 7 (mixers x TL-Align) and Table 8 (TL-Align operations), as configs.

Table 7 (DeiT-S, ImageNet): no mixing; CutMix; MixUp+CutMix switching (timm's
``switch_prob=0.5``, MixUp alpha 0.8, CutMix alpha 1.0); random patch mixing;
block-wise mixing; each mixer without and with TL-Align. The paper's random and
block-wise mixers use 16x16 cells on 224 px images (a 14x14 grid, one cell per
token). Here a cell is one patch of the model (4x4 px on 32 px CIFAR: an 8x8
grid), and BEiT's smallest block of 16 of 196 cells is scaled by area to the grid
(5 of 64 cells at 8x8).

Table 8 (all with CutMix): none; TL-Align at layer 12 only (the last layer); at
layers 2, 4, 6, 8 of 12; normalisation disabled; full TL-Align. For a model of
depth ``d`` the paper's 1-based layer ``l`` of 12 becomes the 0-based layer
``round(l * d / 12) - 1``: layers 0, 1, 2, 3 for the default depth 6 (the first
two thirds of the network, as in the paper); 1, 3, 5, 7 for depth 12. One row
beyond the paper, ``official-drop-path``: full TL-Align with the official code's
stochastic-depth rule (a sample whose attention branch was dropped still mixes
its labels), against the default where its labels stay; the two differ only
where stochastic depth drops branches (the model's ``drop_path`` rate, 0.1 by
default as in DeiT).

Table 7's extension beyond the paper (only when asked for by ``--rows``): FMix,
ResizeMix, SaliencyMix, GridMix (MaskMix) and TokenMix's mixing, each without and
with TL-Align. On the model's grid: FMix and ResizeMix and SaliencyMix with
their papers' settings on pixels (alpha 1, decay 3; scale 0.1-0.8); GridMix cells
of 1, 2 and 4 patches; TokenMix's smallest block of 14 of 196 tokens scaled by
area like BEiT's (5 of 64 at 8x8).

Table "tokenlabel" (Token Labeling's Table 2, from its baseline to MixToken and
token labeling): CutMix with image labels; MixToken (Eq. 6-7: mixed patch
tokens, class target the mask's mean) with image labels; MixToken with the
dense loss of Eq. 3-4 (beta 0.5) whose per-token targets are the mask's sources
(the image labels, token by token); MixToken with the dense loss against a
machine annotator's score maps, aligned to each crop and flip and mixed by the
mask (the paper's full method). The paper's annotator is a pretrained NFNet-F6;
nothing may be downloaded here, so the job trains its own teacher first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mixlabels import NoAlignConfig, TLAlignConfig, TokenLabelingConfig
from mixlabels._scheme_config import SchemeConfig
from mixlabels.strategies import BlockwiseMixConfig, CutMixConfig, MixTokenConfig, MixUpConfig, RandomPatchMixConfig, SwitchConfig
from mixlabels.strategies import FMixConfig, GridMixConfig, ResizeMixConfig, SaliencyMixConfig, TokenMixConfig
from mixlabels.strategies import MixerConfig

__all__ = ["Cell", "MixerFlags", "Table", "table_cells", "paper_layers", "ROW_IDS", "EXTENSION_ROWS", "row_ids"]

Table = int | str  # 7, 8 or "tokenlabel"

ROW_IDS: dict[Table, tuple[str, ...]] = {
    7: ("none", "cutmix", "mixup+cutmix", "random", "blockwise"),
    8: ("none", "layer-last", "layers-2468", "no-norm", "tl-align", "official-drop-path"),
    "tokenlabel": ("cutmix", "mixtoken", "mixtoken+mask-labels", "mixtoken+annotator"),
}
# Rows beyond the paper, run only when ``--rows`` names them (the default job stays the paper's table).
EXTENSION_ROWS: dict[Table, tuple[str, ...]] = {7: ("fmix", "resizemix", "saliencymix", "gridmix", "tokenmix")}


def row_ids(table: Table) -> tuple[str, ...]:
    """Every row id ``--rows`` accepts for ``table``: the paper's, then the extension's."""
    return ROW_IDS[table] + EXTENSION_ROWS.get(table, ())


@dataclass(frozen=True)
class MixerFlags:
    """The check marks of Table 7's mixer columns."""

    mixup: bool = False
    cutmix: bool = False
    random: bool = False
    blockwise: bool = False
    other: str = ""  # a mixer beyond the paper's columns (Table 7's extension rows)


@dataclass(frozen=True)
class Cell:
    """One (row, column) of a table: a mixer and a scheme; ``aligned`` picks the TL-Align column.

    ``annotated``: the run's token targets come from the job's teacher (the annotator row).
    """

    row: str
    label: str
    flags: MixerFlags
    aligned: bool
    mixer: MixerConfig | None
    scheme: SchemeConfig | None
    annotated: bool = False


def paper_layers(depth: int, layers: tuple[int, ...] = (2, 4, 6, 8), paper_depth: int = 12) -> tuple[int, ...]:
    """The paper's 1-based layers of a depth-12 DeiT, scaled to ``depth``, 0-based and deduplicated.

    Example:
        >>> paper_layers(6), paper_layers(12)
        ((0, 1, 2, 3), (1, 3, 5, 7))
    """
    scaled = (max(1, round(layer * depth / paper_depth)) - 1 for layer in layers)
    return tuple(sorted(set(scaled)))


def _official_label(drop_path: float | None) -> str:
    """Table 8's drop-path row, naming the rate that makes it differ from the default."""
    label = "TL-Align, official code's drop-path rule (dropped samples' labels mix too)"
    if drop_path is None:
        return label
    if drop_path == 0.0:
        return f"{label}; drop-path 0: identical to the default"
    return f"{label}; drop-path {drop_path:g}"


def _mixers(num_classes: int, label_smoothing: float, prob: float, cell: int, grid_cells: int) -> dict[str, MixerConfig]:
    """Table 7's mixers for ``num_classes`` classes on a grid of ``grid_cells`` cells of side ``cell``."""
    n, ls, p = num_classes, label_smoothing, prob
    # BEiT's smallest block (16 of 196 cells) scaled by area to this grid
    min_cells = max(1, round(16 * grid_cells / 196))
    side = math.isqrt(grid_cells)
    return {
        "cutmix": CutMixConfig(num_classes=n, label_smoothing=ls, prob=p, alpha=1.0),
        "mixup+cutmix": SwitchConfig(
            mixers=[
                MixUpConfig(num_classes=n, label_smoothing=ls, prob=p, alpha=0.8),
                CutMixConfig(num_classes=n, label_smoothing=ls, prob=p, alpha=1.0),
            ],
            probs=[0.5, 0.5],
        ),
        "random": RandomPatchMixConfig(num_classes=n, label_smoothing=ls, prob=p, cell_size=cell, alpha=1.0),
        "blockwise": BlockwiseMixConfig(
            num_classes=n, label_smoothing=ls, prob=p, cell_size=cell, alpha=1.0, min_cells=min_cells
        ),
        "fmix": FMixConfig(num_classes=n, label_smoothing=ls, prob=p, alpha=1.0, decay_power=3.0),
        "resizemix": ResizeMixConfig(num_classes=n, label_smoothing=ls, prob=p, scale=(0.1, 0.8)),
        "saliencymix": SaliencyMixConfig(num_classes=n, label_smoothing=ls, prob=p, alpha=1.0),
        "gridmix": GridMixConfig(
            num_classes=n, label_smoothing=ls, prob=p, alpha=1.0, cell_sizes=tuple(cell * k for k in (1, 2, 4) if side % k == 0)
        ),
        "tokenmix": TokenMixConfig(
            num_classes=n, label_smoothing=ls, prob=p, patch_size=cell, alpha=1.0, min_tokens=max(1, round(14 * grid_cells / 196))
        ),
    }


_FLAGS = {
    "none": MixerFlags(),
    "cutmix": MixerFlags(cutmix=True),
    "mixup+cutmix": MixerFlags(mixup=True, cutmix=True),
    "random": MixerFlags(random=True),
    "blockwise": MixerFlags(blockwise=True),
    "fmix": MixerFlags(other="FMix"),
    "resizemix": MixerFlags(other="ResizeMix"),
    "saliencymix": MixerFlags(other="SaliencyMix"),
    "gridmix": MixerFlags(other="GridMix"),
    "tokenmix": MixerFlags(other="TokenMix"),
}


def table_cells(
    table: Table,
    *,
    num_classes: int,
    label_smoothing: float,
    prob: float,
    patch_size: int,
    img_size: int,
    depth: int,
    drop_path: float | None = None,
    extension: bool = False,
) -> list[Cell]:
    """Every cell of Table 7, Table 8 or the token-labeling table, in the paper's order.

    ``drop_path``: the model's stochastic depth rate, named in Table 8's drop-path row.
    ``extension``: Table 7 also gets the rows beyond the paper (``EXTENSION_ROWS``), after its own.
    """
    grid = img_size // patch_size
    mixers = _mixers(num_classes, label_smoothing, prob, patch_size, grid * grid)
    cutmix = mixers["cutmix"]
    if table == 7:
        cells = [Cell("none", "no mixing", _FLAGS["none"], False, None, None)]
        for row in ROW_IDS[7][1:] + (EXTENSION_ROWS[7] if extension else ()):
            cells.append(Cell(row, row, _FLAGS[row], False, mixers[row], NoAlignConfig()))
            cells.append(Cell(row, row, _FLAGS[row], True, mixers[row], TLAlignConfig()))
        return cells
    if table == 8:
        layers = paper_layers(depth)
        one_based = ",".join(str(i + 1) for i in layers)
        return [
            Cell("none", "None (CutMix baseline)", _FLAGS["cutmix"], False, cutmix, NoAlignConfig()),
            Cell("layer-last", f"TL-Align (layer {depth} only)", _FLAGS["cutmix"], True, cutmix,
                 TLAlignConfig(layers=(depth - 1,))),
            Cell("layers-2468", f"TL-Align (layers {one_based} of {depth}; paper: 2,4,6,8 of 12)", _FLAGS["cutmix"],
                 True, cutmix, TLAlignConfig(layers=layers)),
            Cell("no-norm", "Normalization disabled", _FLAGS["cutmix"], True, cutmix, TLAlignConfig(normalize=False)),
            Cell("tl-align", "Default (TL-Align)", _FLAGS["cutmix"], True, cutmix, TLAlignConfig()),
            Cell("official-drop-path", _official_label(drop_path), _FLAGS["cutmix"], True, cutmix,
                 TLAlignConfig(drop_path="official")),
        ]
    if table == "tokenlabel":
        n, ls, p = num_classes, label_smoothing, prob
        mixtoken = MixTokenConfig(num_classes=n, label_smoothing=ls, prob=p, alpha=1.0, patch_size=patch_size)
        dense = TokenLabelingConfig(beta=0.5)
        return [
            Cell("cutmix", "CutMix, image labels", _FLAGS["cutmix"], False, cutmix, NoAlignConfig()),
            Cell("mixtoken", "MixToken, image labels", MixerFlags(), False, mixtoken, NoAlignConfig()),
            Cell("mixtoken+mask-labels", "MixToken + token loss, labels from the mask (no annotator)", MixerFlags(),
                 False, mixtoken, dense),
            Cell("mixtoken+annotator", "MixToken + token loss, annotator's token labels", MixerFlags(), False,
                 mixtoken, dense, annotated=True),
        ]
    raise ValueError(f"table must be 7, 8 or 'tokenlabel', got {table!r}")
