"""Dense score maps from a machine annotator (Token Labeling, sections 3.2-4.1).

An annotator model scores every region of every training image once, offline: a map
``(hm, wm, c)`` of class distributions per image. This module

1. stores those maps compactly: the top-k (default 5) scores of every map cell in
   fp16 and their class ids in int16 (``4 k`` bytes a cell instead of ``4 c``), in
   shards of many images with a JSON index (``ScoreMapWriter``, ``ScoreMaps``);
2. reconstructs dense distributions from the top-k (``to_dense``);
3. aligns each map to the random-resized crop and flip of its image, with RoIAlign,
   onto the token grid (``sample_resized_crops``, ``crop_resize``, ``align_score_maps``);
4. hands the aligned per-sample maps to the batch's label map
   (``label_map.with_token_targets(maps)``), which mixes them like the tokens for
   ``TokenLabeling`` (the maps travel with the batch, the scheme stays fixed);
5. wraps a dataset so that each item is a crop of the image with its map aligned to
   the same crop (``ScoreMapDataset``).

Storage layout (a directory)::

    index.json          {"format": "mixlabels.score_maps", "version": 1, "k": 5, "num_classes": c,
                         "map_size": [hm, wm], "shard_size": n, "meta": {...},
                         "shards": [{"file": "shard-00000.npy", "count": n, "bytes": ..., "sha256": ...,
                                     "ids": ["train/cls/img.jpg", ...]}, ...]}
    shard-00000.npy     uint16 (count, 2, hm, wm, k): [:, 0] the fp16 scores' bits (descending),
                        [:, 1] the int16 class ids' bits; memory-mapped for random access
    ...

Image ``i`` of the store is the ``i``-th id over the shards in order. The writer
appends whole shards atomically (temporary file, then rename) and rewrites the index
after each, so an interrupted run keeps every completed shard and redoes only the
last, partial one. The reader checks every shard's presence and size when opened and
its checksum, class ids and scores the first time it reads the shard (once per shard and
process, not per step); any mismatch is a ``ScoreMapError`` naming the file.

Reconstruction (``fill``): the paper stores "the top-5 score maps for each position in
half-precision"; LV-ViT's code scatters the five stored values into zeros (it then
RoIAligns and applies a softmax, as its stored values are scores before a softmax).
We store probabilities, so a softmax afterwards would flatten them; the default
``"renormalize"`` divides the top-k probabilities by their sum: exactly the softmax of
the annotator's logits restricted to its top-k classes. ``"spread"`` instead keeps the
annotator's remaining mass ``1 - sum(top-k)`` spread evenly over the other classes;
``"zeros"`` is the raw scatter (rows sum to less than 1; the alignment schemes start from each
cell renormalised, so for them it reads as ``"renormalize"``: ``mixed_token_targets(distributions=True)``).

Shapes, named once: ``b`` batch, ``hm wm`` map cells, ``k`` kept scores, ``c`` classes,
``h w`` token grid, ``n = h * w``.
"""

from mixlabels.score_maps._crops import (
    CropParams,
    align_score_maps,
    crop_resize,
    sample_padded_crops,
    sample_resized_crops,
)
from mixlabels.score_maps._dataset import ScoreMapDataset
from mixlabels.score_maps._store import FORMAT, ScoreMaps, ScoreMapWriter
from mixlabels.score_maps._topk import Fill, ScoreMapError, TopKMaps, compress, to_dense

__all__ = [
    "FORMAT",
    "ScoreMapError",
    "TopKMaps",
    "Fill",
    "compress",
    "to_dense",
    "ScoreMapWriter",
    "ScoreMaps",
    "CropParams",
    "sample_resized_crops",
    "sample_padded_crops",
    "crop_resize",
    "align_score_maps",
    "ScoreMapDataset",
]
