"""ScoreMapDataset: the image and its score map cropped and flipped together, fed to the annotator in batches."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from einops import rearrange
from PIL import Image
from torch.utils.data import DataLoader

from mixlabels import TokenLabelMap
from mixlabels.score_maps import (
    ScoreMapDataset,
    ScoreMapError,
    ScoreMaps,
    ScoreMapWriter,
    align_score_maps,
    compress,
    crop_resize,
    sample_resized_crops,
)

H, W = 24, 32  # the original images; their maps are stored at pixel resolution


def _field(n: int) -> torch.Tensor:
    """``(n, H, W)`` probabilities of class 0: a horizontal gradient (a flip reverses it), other slopes per image."""
    x = (torch.arange(W) + 0.5) / W
    y = (torch.arange(H) + 0.5) / H
    slopes = torch.linspace(0.3, 0.8, n).view(n, 1, 1)
    return 0.1 + slopes * x.view(1, 1, W) + 0.05 * y.view(1, H, 1)


def _store(root: Path, p0: torch.Tensor) -> ScoreMaps:
    maps = torch.stack([p0, 1 - p0], dim=-1)  # n H W 2: two classes, so top-2 is exact
    with ScoreMapWriter(root, num_classes=2, map_size=(H, W), k=2) as w:
        w.append([f"img{i}" for i in range(len(p0))], compress(maps, k=2))
    return ScoreMaps(root)


def test_labels_follow_the_pixels_through_crop_and_flip(tmp_path: Path) -> None:
    # Channel 0 of each image is its map's class-0 probability: whatever the crop and flip,
    # each token's target must equal the mean of channel 0 over that token's pixels. The field
    # is linear, so bilinear sampling is exact and both sides are its value at the bin centres.
    p0 = _field(6)
    images = [(torch.stack([p0[i], torch.rand(H, W), torch.rand(H, W)]), i % 2) for i in range(6)]
    ds = ScoreMapDataset(images, _store(tmp_path, p0), size=(16, 16), grid=(4, 4), scale=(0.2, 1.0),
                         generator=torch.Generator().manual_seed(0))
    flips = 0
    for _ in range(4):
        for i in range(len(ds)):
            image, label, targets = ds[i]
            assert label == i % 2 and image.shape == (3, 16, 16) and targets.shape == (4, 4, 2)
            per_token = F.avg_pool2d(image[0:1], 4)[0]  # 4 4: the mean pixel of every token
            torch.testing.assert_close(targets[..., 0], per_token, atol=2e-3, rtol=0)  # fp16 storage
            torch.testing.assert_close(targets.sum(-1), torch.ones(4, 4))
            slope = per_token[:, -1].mean() - per_token[:, 0].mean()
            flips += int(slope < 0)  # the gradient runs right to left only in a flipped crop
    assert 0 < flips < 24


def test_replaying_params_matches_the_batch_functions(tmp_path: Path) -> None:
    p0 = _field(2)
    store = _store(tmp_path, p0)
    images = [(torch.rand(3, H, W), 0), (torch.rand(3, H, W), 1)]
    ds = ScoreMapDataset(images, store, size=(8, 8), grid=(2, 2), positions=[1, 0])
    params = sample_resized_crops((H, W), 1, generator=torch.Generator().manual_seed(3))
    x, targets = ds.apply(images[0][0], 0, params)  # dataset image 0 has map 1
    torch.testing.assert_close(x, crop_resize(images[0][0][None], params, (8, 8))[0])
    torch.testing.assert_close(targets, align_score_maps(store.get([1]), params, (2, 2))[0])


def test_pil_images_transform_and_a_loader_into_the_annotator(tmp_path: Path) -> None:
    p0 = _field(4)
    store = _store(tmp_path, p0)
    rgb = (torch.rand(4, H, W, 3) * 255).to(torch.uint8).numpy()
    images = [(Image.fromarray(rgb[i]), i) for i in range(4)]
    mean = torch.tensor([0.5, 0.5, 0.5]).view(3, 1, 1)
    ds = ScoreMapDataset(images, store, size=(8, 8), grid=(2, 2), transform=lambda x: (x - mean) / 0.25)
    x, y, targets = next(iter(DataLoader(ds, batch_size=4)))
    assert x.shape == (4, 3, 8, 8) and y.tolist() == [0, 1, 2, 3] and targets.shape == (4, 2, 2, 2)
    assert float(x.min()) < -1.0  # normalised by the transform, after the crop
    label_map = TokenLabelMap.unmixed(y % 2, num_classes=2, image_size=(8, 8))
    out = label_map.with_token_targets(targets).mixed_token_targets((2, 2))  # b n c: each image's own aligned map, unmixed
    torch.testing.assert_close(out, rearrange(targets, "b h w c -> b (h w) c"))


def test_bad_inputs_are_named(tmp_path: Path) -> None:
    store = _store(tmp_path, _field(2))
    three = [(torch.rand(3, H, W), 0)] * 3
    with pytest.raises(ScoreMapError, match="holds 2 maps but the dataset has 3 images"):
        ScoreMapDataset(three, store, size=(8, 8), grid=(2, 2))
    with pytest.raises(ScoreMapError, match=r"a map in \[0, 2\)"):
        ScoreMapDataset(three, store, size=(8, 8), grid=(2, 2), positions=[0, 1, 2])
    gray = ScoreMapDataset([(np.zeros((H, W), np.uint8), 0), (torch.rand(1, H, W), 0)], store, size=(8, 8), grid=(2, 2))
    with pytest.raises(ValueError, match=r"RGB \(H, W, 3\)"):
        gray[0]
    with pytest.raises(ValueError, match=r"must be \(3, H, W\)"):
        gray[1]
