"""The ablation's numbers: top-1 per cell over seeds, and every paired delta the table reports."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from benchmarks._ablation_plan import Planned
from benchmarks._ablation_config import AblationConfig
from benchmarks._stats import PairedDelta, paired_delta

__all__ = ["Stat", "Delta", "cell_stat", "summarise", "table_deltas"]


@dataclass(frozen=True)
class Stat:
    """Mean and sample std over seeds of one cell (``std`` is None with one seed)."""

    mean: float
    std: float | None
    n: int

    def __str__(self) -> str:
        return f"{self.mean:.2f}" if self.std is None else f"{self.mean:.2f} ± {self.std:.2f}"


def cell_stat(values: Sequence[float]) -> Stat | None:
    if not values:
        return None
    return Stat(statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else None, len(values))


@dataclass(frozen=True)
class Delta:
    """One reported difference: a row's cell against its reference (same seeds, same data order)."""

    row: str
    label: str
    against: str  # "without TL-Align" (Table 7) or the baseline row's id
    delta: PairedDelta


def table_deltas(cfg: AblationConfig, planned: Sequence[Planned], records: Sequence[dict[str, Any]]) -> list[Delta]:
    """Every delta the table reports: Table 7's aligned minus unaligned per row, else each row minus the baseline."""
    cells = summarise(records)
    rows = list(dict.fromkeys((p.cell.row, p.cell.label) for p in planned))
    out: list[Delta] = []
    if cfg.table == 7:
        for row, label in rows:
            d = paired_delta(cells.get((row, False), {}), cells.get((row, True), {}))
            if d is not None:
                out.append(Delta(row, label, "without TL-Align", d))
        return out
    first = "cutmix" if cfg.table == "tokenlabel" else "none"
    baseline = cells.get((first, False), {})
    for row, label, aligned in dict.fromkeys((p.cell.row, p.cell.label, p.cell.aligned) for p in planned):
        d = paired_delta(baseline, cells.get((row, aligned), {})) if row != first else None
        if d is not None:
            out.append(Delta(row, label, first, d))
    return out


def summarise(records: Sequence[dict[str, Any]]) -> dict[tuple[str, bool], dict[int, float]]:
    """``(row, aligned) -> {seed: top-1}``."""
    by_cell: dict[tuple[str, bool], dict[int, float]] = {}
    for rec in records:
        by_cell.setdefault((rec["row"], rec["aligned"]), {})[rec["seed"]] = float(rec["result"]["top1"])
    return by_cell
