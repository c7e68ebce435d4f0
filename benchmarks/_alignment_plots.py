"""The alignment analysis' pictures: label maps (Figure 5), mixing ratio per block (Figure 4), RMSE by size (Figure 3)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from torch import Tensor

from benchmarks._alignment_data import Batch

__all__ = ["SCHEMES", "plot_label_maps", "plot_mixing_ratio", "plot_rmse"]

SCHEMES = ("cutmix", "transmix", "token_labeling", "tl_align")
SCHEME_LABELS = {
    "similarity": "token similarity (Eq. 13, 'ground truth')",
    "cutmix": "CutMix",
    "transmix": "TransMix",
    "token_labeling": "TokenLabeling",
    "tl_align": "TL-Align",
}
SCHEME_STYLE: dict[str, dict[str, Any]] = {
    "similarity": {"color": "black", "linewidth": 2.5, "marker": "o"},
    "cutmix": {"color": "tab:gray", "linestyle": "--"},
    "transmix": {"color": "tab:orange", "linestyle": "-."},
    "token_labeling": {"color": "tab:green", "linestyle": ":", "linewidth": 2.0},
    "tl_align": {"color": "tab:red", "marker": "s"},
}



def _rgb(x: Tensor) -> Any:
    return x.clamp(0, 1).permute(1, 2, 0).numpy()


def plot_label_maps(path: Path, batch: Batch, label_map: Any, result: Any, pairs: int, title: str) -> None:
    """Figure 5's layout: sources, mixed image, original and aligned label maps (red: source 0)."""
    import matplotlib.pyplot as plt

    grid = result.mixed.grid
    p = result.mixed.num_prefix
    mixed_raw = label_map.mix_pixels(batch.raw)
    original = result.ratios.token_labeling[:, 0, p:, 0]  # b n: weight of source 0
    first = result.ratios.tl_align[:, 0, p:, 0]
    aligned = result.ratios.tl_align[:, -1, p:, 0]
    depth = result.mixed.depth
    fig, axes = plt.subplots(pairs, 6, figsize=(18, 3.2 * pairs + 0.8), squeeze=False)
    image = None
    for row in range(pairs):
        s0, s1 = (int(i) for i in label_map.sources[row])
        lam = float(label_map.image_weights[row, 0])
        lam_aligned = float(result.tl_align_target[row, 0])
        panels = [
            (_rgb(batch.raw[s0]), f"source 1 (red): {batch.classes[int(batch.labels[s0])]}"),
            (_rgb(batch.raw[s1]), f"source 2 (blue): {batch.classes[int(batch.labels[s1])]}"),
            (_rgb(mixed_raw[row]), f"CutMix image, lambda = {lam:.2f}"),
        ]
        for col, (img, text) in enumerate(panels):
            axes[row, col].imshow(img)
            axes[row, col].set_title(text, fontsize=9)
        maps = [
            (original[row], f"original label map ({grid[0]}x{grid[1]} tokens)"),
            (first[row], f"aligned after block 1 (extra panel)\n"
             f"token range [{float(first[row].min()):.2f}, {float(first[row].max()):.2f}]"),
            (aligned[row], f"aligned after block {depth}: cls lambda = {lam_aligned:.2f}\n"
             f"token range [{float(aligned[row].min()):.2f}, {float(aligned[row].max()):.2f}]"),
        ]
        for col, (values, text) in enumerate(maps, start=3):
            image = axes[row, col].imshow(
                values.reshape(grid).numpy(), cmap="bwr", vmin=0.0, vmax=1.0, interpolation="nearest"
            )
            axes[row, col].set_title(text, fontsize=9)
        for ax in axes[row]:
            ax.set_xticks([])
            ax.set_yticks([])
    fig.suptitle(title, fontsize=11)
    fig.tight_layout(rect=(0, 0, 0.93, 0.97))
    assert image is not None
    cax = fig.add_axes((0.94, 0.15, 0.012, 0.7))
    fig.colorbar(image, cax=cax, label="weight of source 1 (red) in the token's label")
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_mixing_ratio(path: Path, curves: dict[str, Any], title: str) -> None:
    """Figure 4: mixing ratio per block, similarity 'ground truth' against each scheme; presence."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    for ax, key, what in (
        (axes[0], "class_token", "class token"),
        (axes[1], "fluctuating_token", f"most fluctuating patch token (#{curves['fluctuating_token']['token_index']})"),
    ):
        entry = curves[key]
        layers = np.arange(1, len(entry["similarity"]) + 1)
        for name in ("similarity", *SCHEMES):
            if name in entry:
                ax.plot(layers, entry[name], label=SCHEME_LABELS[name], **SCHEME_STYLE[name])
        ax.set_xlabel("transformer block")
        ax.set_ylabel("mixing ratio lambda (weight of source 1)")
        ax.set_title(what, fontsize=10)
        ax.set_ylim(-0.02, 1.02)
        ax.set_xticks(layers)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8, loc="best")
    pres = curves["presence_patch_tokens"]
    layers = np.arange(1, len(pres["median"]) + 1)
    floor = 1e-3  # log scale: presence can reach 0 (a token no output attends to)

    def clip(values: list[float]) -> Any:
        return np.maximum(np.asarray(values), floor)

    band = {"color": "tab:purple", "alpha": 0.25, "label": "10-90th percentile"}
    axes[2].fill_between(layers, clip(pres["p10"]), clip(pres["p90"]), **band)
    axes[2].plot(layers, clip(pres["median"]), color="tab:purple", marker="o", label="median")
    axes[2].plot(layers, clip(pres["min"]), color="tab:purple", linestyle=":", label="min / max")
    axes[2].plot(layers, clip(pres["max"]), color="tab:purple", linestyle=":")
    axes[2].axhline(1.0, color="black", linewidth=0.8)
    axes[2].set_yscale("log")
    axes[2].set_xlabel("transformer block")
    axes[2].set_ylabel("token presence p(z_i) (Eq. 2), log scale")
    axes[2].set_title(
        "presence of patch tokens in the attention output\n"
        "(1 = no fluctuation, as a convolution; the mean over all tokens is 1)",
        fontsize=10,
    )
    axes[2].set_xticks(layers)
    axes[2].grid(alpha=0.3)
    axes[2].legend(fontsize=8, loc="lower right")
    fig.suptitle(title, fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.94))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_rmse(path: Path, bars: list[dict[str, Any]], title: str) -> None:
    """Figure 3: RMSE between CutMix targets and TL-Align labels per model size."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(1.6 * len(bars) + 3, 4.5))
    xs = np.arange(len(bars))
    values = [b["rmse"] for b in bars]
    colours = ["tab:blue" if b["kind"] == "size" else "tab:red" for b in bars]
    rects = ax.bar(xs, values, color=colours, width=0.6)
    for rect, v in zip(rects, values):
        ax.annotate(f"{v:.4f}", (rect.get_x() + rect.get_width() / 2, v), ha="center", va="bottom", fontsize=9)
    ax.set_xticks(xs)
    ax.set_xticklabels([b["label"] for b in bars], fontsize=9)
    ax.set_ylabel("RMSE(CutMix target, TL-Align target)\nover source weights")
    ax.set_xlabel("model")
    ax.set_ylim(0, max(max(values) * 1.25, 1e-3))
    ax.set_title(title, fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
