"""Table 7's extension beyond the paper: the new mixers' rows, only when asked for, in their own column."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import ablation
from benchmarks._rows import EXTENSION_ROWS, ROW_IDS, row_ids, table_cells
from mixlabels import NoAlignConfig, TLAlignConfig
from mixlabels.strategies import FMixConfig, GridMixConfig, ResizeMixConfig, SaliencyMixConfig, TokenMixConfig
from test_ablation import TINY, needs_cifar

KW = dict(num_classes=10, label_smoothing=0.1, prob=1.0, patch_size=4, img_size=32, depth=6)


def test_extension_rows_follow_the_paper_rows_with_and_without_tl_align() -> None:
    assert row_ids(7) == ROW_IDS[7] + ("fmix", "resizemix", "saliencymix", "gridmix", "tokenmix")
    assert row_ids(8) == ROW_IDS[8]
    paper = table_cells(7, **KW)  # type: ignore[arg-type]
    assert {c.row for c in paper} == set(ROW_IDS[7])  # the default job is the paper's table
    cells = table_cells(7, extension=True, **KW)  # type: ignore[arg-type]
    assert [(c.row, c.aligned) for c in cells] == [(c.row, c.aligned) for c in paper] + [
        (row, aligned) for row in EXTENSION_ROWS[7] for aligned in (False, True)
    ]
    by = {(c.row, c.aligned): c for c in cells}
    types = {"fmix": FMixConfig, "resizemix": ResizeMixConfig, "saliencymix": SaliencyMixConfig, "gridmix": GridMixConfig,
             "tokenmix": TokenMixConfig}
    for row, cls in types.items():
        assert isinstance(by[(row, False)].mixer, cls) and by[(row, False)].mixer == by[(row, True)].mixer
        assert by[(row, False)].scheme == NoAlignConfig() and by[(row, True)].scheme == TLAlignConfig()
        assert by[(row, True)].flags.other and not by[(row, True)].flags.cutmix
        assert by[(row, True)].mixer.label_smoothing == 0.1  # type: ignore[union-attr]
    grid = by[("gridmix", True)].mixer
    assert isinstance(grid, GridMixConfig) and grid.cell_sizes == (4, 8, 16)  # 1, 2 and 4 patches of 4 px
    token = by[("tokenmix", True)].mixer
    assert isinstance(token, TokenMixConfig) and token.patch_size == 4 and token.min_tokens == 5  # 14/196 of 64


def test_plan_accepts_the_extension_rows(tmp_path: Path) -> None:
    cfg, _ = ablation.resolve_config(["--rows", "cutmix,fmix,tokenmix", "--seeds", "0", "--out", str(tmp_path)])
    planned = ablation.plan(cfg, 10, "cpu")
    assert [(p.cell.row, p.cell.aligned) for p in planned] == [
        ("cutmix", False), ("cutmix", True), ("fmix", False), ("fmix", True), ("tokenmix", False), ("tokenmix", True)
    ]
    with pytest.raises(ValueError, match="unknown row id.*its rows are: .*saliencymix"):
        ablation.plan(cfg.model_copy(update={"rows": ("fmixx",)}), 10, "cpu")


@needs_cifar
def test_end_to_end_extension_row(tmp_path: Path) -> None:
    out = tmp_path / "out"
    cfg, _ = ablation.resolve_config(["--rows", "cutmix,saliencymix", "--seeds", "0", "--out", str(out), *TINY])
    result = ablation.run_ablation(cfg)
    assert result.trained == 4
    table = (out / "table.md").read_text()
    assert "| MixUp | CutMix | Random | Block-wise | Beyond the paper | Top-1 (%) | +TL-Align Top-1 (%) | Δ |" in table
    assert "| × | ✓ | × | × | × |" in table and "| × | × | × | × | SaliencyMix |" in table
