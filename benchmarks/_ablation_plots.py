"""The ablation's chart: mean top-1 per cell with the spread over seeds."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks._ablation_plan import Planned
from benchmarks._ablation_stats import cell_stat, summarise
from benchmarks._ablation_config import AblationConfig

__all__ = ["plot"]


def plot(path: Path, cfg: AblationConfig, planned: Sequence[Planned], records: Sequence[dict[str, Any]]) -> None:
    """A bar chart of the table: mean top-1 per cell with the std over seeds as error bars."""
    import matplotlib

    matplotlib.use("Agg")  # no display: the chart goes to a file
    import matplotlib.pyplot as plt

    cells = summarise(records)
    order = list(dict.fromkeys(p.cell.row for p in planned))
    fig, ax = plt.subplots(figsize=(max(5.0, 1.4 * len(order) + 1.5), 4.0), dpi=120)
    columns = [(False, "baseline", "#9aa5b1"), (True, "+TL-Align", "#d1495b")] if cfg.table == 7 else [(None, "", "")]
    width = 0.8 / len(columns)
    lows: list[float] = []
    for j, (aligned, name, color) in enumerate(columns):
        xs, means, errs = [], [], []
        for i, row in enumerate(order):
            key = (row, aligned) if aligned is not None else next(k for k in cells if k[0] == row)
            stat = cell_stat(list(cells.get(key, {}).values()))
            if stat is None:
                continue
            xs.append(i + (j - (len(columns) - 1) / 2) * width)
            means.append(stat.mean)
            errs.append(stat.std or 0.0)
            lows.append(stat.mean - (stat.std or 0.0))
        kwargs: dict[str, Any] = {"label": name, "color": color} if name else {"color": "#3c6e71"}
        ax.bar(xs, means, width=width, yerr=errs, capsize=4, **kwargs)
    ax.set_xticks(range(len(order)))
    ax.set_xticklabels(order, rotation=15)
    xlabels: dict[int | str, str] = {7: "mixing strategy", 8: "alignment", "tokenlabel": "training"}
    ax.set_xlabel(xlabels[cfg.table])
    ax.set_ylabel("top-1 accuracy (%)")
    if lows:  # bars start near the data: at this scale the differences are a few points
        ax.set_ylim(bottom=max(0.0, math.floor(min(lows) - 5)))
    ax.set_title(f"{'Token labeling' if cfg.table == 'tokenlabel' else f'Table {cfg.table}'}: {cfg.data.source}, {cfg.model.name}, seeds {','.join(map(str, cfg.seeds))}")
    if cfg.table == 7:
        ax.legend()
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.tmp{os.getpid()}.png")
    fig.savefig(tmp)
    plt.close(fig)
    os.replace(tmp, path)
