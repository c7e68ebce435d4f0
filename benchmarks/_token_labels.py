"""The token-labeling table's annotator: a teacher's dense score maps of the training images, per batch.

Token Labeling (section 4.1) scores every training image once with a strong
annotator, keeps the top-5 of each map cell, and at training time aligns each
image's map to the crop and flip it got (RoIAlign) and mixes it like the batch
(MixToken). Here the annotator is the job's own teacher run (nothing is
downloaded): ``annotate_split`` scores the decoded training images with the
teacher's checkpoint into a ``mixlabels.score_maps`` store (resumable), and
``TokenLabelSource`` turns a batch's split indices and crops into that batch's
aligned maps, which travel with the batch in its label map
(``label_map.with_token_targets``); the ``TokenLabeling`` scheme stays fixed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from benchmarks._archive import TensorSplit
from mixlabels.score_maps import (
    CropParams,
    Fill,
    ScoreMapError,
    ScoreMaps,
    ScoreMapWriter,
    TopKMaps,
    align_score_maps,
    compress,
)

__all__ = ["annotate_split", "TokenLabelSource"]


def _id(index: int) -> str:
    return f"train/{index}"


def annotate_split(
    model: nn.Module,
    split: TensorSplit,
    indices: Tensor,
    out: Path,
    *,
    mean: tuple[float, float, float],
    std: tuple[float, float, float],
    k: int,
    meta: dict[str, Any],
    device: torch.device,
    batch_size: int = 250,
    progress: bool = False,
) -> ScoreMaps:
    """Score the split's images ``indices`` (uncropped, unflipped) with ``model`` into the store ``out``.

    Ids are ``train/<split index>``. An interrupted annotation resumes where its last
    shard ended; a store that holds other images or another teacher's maps is an error.
    """
    from tqdm import tqdm

    from benchmarks.annotate import dense_scores

    model = model.eval().to(device)
    ids = [_id(int(i)) for i in indices]
    mean_t = torch.tensor(mean, device=device).view(1, 3, 1, 1)
    std_t = torch.tensor(std, device=device).view(1, 3, 1, 1)
    h, w = int(split.images.shape[1]), int(split.images.shape[2])
    with torch.inference_mode():
        shape = dense_scores(model, torch.zeros(1, 3, h, w, device=device)).shape  # 1 hm wm c
    writer = ScoreMapWriter(out, num_classes=int(shape[3]), map_size=(int(shape[1]), int(shape[2])), k=k, meta=meta)
    done = writer.ids
    if tuple(ids[: len(done)]) != done:  # (another teacher's meta is refused by the writer itself)
        raise ScoreMapError(f"{out / 'index.json'} holds other maps than this teacher's; delete {out} to redo them")
    with writer, tqdm(total=len(ids), initial=len(done), unit="img", desc="annotate", disable=not progress,
                      leave=False, dynamic_ncols=True) as bar:
        for start in range(len(done), len(ids), batch_size):
            chunk = indices[start : start + batch_size]
            x = split.images[chunk].to(device).permute(0, 3, 1, 2).float().div_(255.0)  # b 3 h w
            with torch.inference_mode():
                scores = dense_scores(model, (x - mean_t) / std_t)  # b hm wm c
            writer.append(ids[start : start + len(chunk)], compress(scores, k))
            bar.update(len(chunk))
    return ScoreMaps(out)


@dataclass(frozen=True, eq=False)
class TokenLabelSource:
    """A store's maps held on the training device, and each step's aligned maps from them.

    Args:
        maps: every annotated image's top-k map, in store order.
        position: ``(n,)`` long, each split index's place in ``maps`` (-1: not annotated).
        fill: how the mass beyond the top-k is restored.
        grid: the model's token grid ``(h, w)``.
    """

    maps: TopKMaps
    position: Tensor
    fill: Fill
    grid: tuple[int, int]

    @classmethod
    def open(cls, store: ScoreMaps, split_size: int, *, fill: Fill, grid: tuple[int, int],
             device: torch.device) -> TokenLabelSource:
        """Load (and verify) the whole store onto ``device``; its ids name split indices ``train/<i>``."""
        position = torch.full((split_size,), -1, dtype=torch.long)
        for place, image_id in enumerate(store.ids):
            head, _, tail = image_id.partition("/")
            if head != "train" or not tail.isdigit() or int(tail) >= split_size:
                raise ScoreMapError(f"{store.root / 'index.json'}: id {image_id!r} is not an image of this split")
            position[int(tail)] = place
        return cls(store.load_all().to(device), position.to(device), fill, grid)

    def targets(self, indices: Tensor, crops: CropParams) -> Tensor:
        """These images' maps ``(b, h, w, c)``, aligned to their crops and flips (for ``with_token_targets``)."""
        where = self.position[indices.to(self.position.device)]
        if bool((where < 0).any()):
            missing = indices[(where < 0).cpu()].tolist()[:5]
            raise ScoreMapError(f"no score map for split images {missing}: the store does not cover the training subset")
        return align_score_maps(self.maps[where], crops, self.grid, fill=self.fill)  # b h w c
