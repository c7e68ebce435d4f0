"""Score maps: top-k storage round trip, bad files, resumable writing, crop/flip alignment, the annotator, training."""

from __future__ import annotations

import io
import json
import math
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from einops import rearrange
from timm.models.vision_transformer import VisionTransformer
from torch.testing import assert_close

from mixlabels import backbones
from mixlabels import AlignedOutput, TokenLabeling, TokenLabelMap
from mixlabels.score_maps import (
    CropParams,
    ScoreMapError,
    ScoreMaps,
    ScoreMapWriter,
    align_score_maps,
    compress,
    crop_resize,
    sample_padded_crops,
    sample_resized_crops,
    to_dense,
)
from mixlabels.strategies import MixToken

CIFAR = Path(__file__).resolve().parents[2] / "shared" / "data" / "cifar10-jpg.tar.gz"


def random_maps(shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(3 * torch.randn(*shape, generator=g), dim=-1)


def write_store(root: Path, maps: torch.Tensor, k: int, shard_size: int, close: bool = True) -> ScoreMapWriter:
    hm, wm = int(maps.shape[1]), int(maps.shape[2])
    w = ScoreMapWriter(root, num_classes=maps.shape[-1], map_size=(hm, wm), k=k, shard_size=shard_size)
    w.append([f"img{i:03d}" for i in range(len(maps))], compress(maps, k))
    if close:
        w.close()
    return w


# ---------------------------------------------------------------------- storage
def test_round_trip_keeps_the_top_k_exactly(tmp_path: Path) -> None:
    maps = random_maps((7, 5, 6, 12))
    write_store(tmp_path, maps, k=4, shard_size=3)  # shards of 3, 3, 1
    store = ScoreMaps(tmp_path)
    assert len(store) == 7 and store.map_size == (5, 6) and store.k == 4 and store.num_classes == 12
    assert sorted(p.name for p in tmp_path.glob("shard-*")) == ["shard-00000.npy", "shard-00001.npy", "shard-00002.npy"]
    ref_v, ref_i = maps.topk(4, dim=-1)
    order = [6, 0, 4, 3, 3, 1]  # random access across shards, repeats allowed
    got = store.get(order)
    assert got.values.dtype == torch.float16 and got.indices.dtype == torch.int16
    assert torch.equal(got.values, ref_v[order].half())
    assert torch.equal(got.indices.long(), ref_i[order])
    everything = store.load_all()
    # the dense reconstruction's own top-k is the original top-k, exactly up to fp16 rounding
    zeros = everything.dense("zeros")
    rv, ri = zeros.topk(4, dim=-1)
    assert torch.equal(rv, ref_v.half().float()) and torch.equal(ri, ref_i)
    assert_close(store[5].values, everything.values[5], rtol=0, atol=0)
    picked = everything[torch.tensor(order)]
    assert torch.equal(picked.values, got.values) and torch.equal(picked.indices, got.indices)
    assert store.index_of("img004") == 4
    with pytest.raises(KeyError, match="img999"):
        store.index_of("img999")


def test_fill_modes_are_distributions_with_the_top_k_ratios() -> None:
    maps = random_maps((2, 3, 3, 9), seed=1)
    top = compress(maps, k=3)
    v = top.values.float()
    renorm = top.dense("renormalize")
    spread = top.dense("spread")
    for dense in (renorm, spread):
        assert_close(dense.sum(-1), torch.ones(2, 3, 3))
    # renormalize: top-k over their sum, nothing elsewhere
    assert_close(renorm.gather(-1, top.indices.long()), v / v.sum(-1, keepdim=True))
    assert_close(renorm.sum(-1) - renorm.gather(-1, top.indices.long()).sum(-1), torch.zeros(2, 3, 3))
    # spread: the remaining mass evenly over the other 6 classes, the top-k untouched
    assert_close(spread.gather(-1, top.indices.long()), v, atol=1e-3, rtol=0)
    other = spread.scatter(-1, top.indices.long(), -1.0)
    rest = ((1 - v.sum(-1)) / 6).unsqueeze(-1).expand_as(other)
    assert_close(other[other >= 0].view(2, 3, 3, 6), rest[..., :6], atol=1e-3, rtol=0)
    assert_close(to_dense(top.values, top.indices, 9), renorm)


def test_storage_is_compact(tmp_path: Path) -> None:
    maps = random_maps((64, 8, 8, 10))
    write_store(tmp_path, maps, k=5, shard_size=64)
    store = ScoreMaps(tmp_path)
    payload = 8 * 8 * 5 * 4  # fp16 + int16 per kept score
    assert payload * 64 < store.nbytes < payload * 64 + 4096  # npy header and the index (64 ids)


# ---------------------------------------------------------------------- bad files
def test_truncated_missing_and_corrupted_files_name_the_file(tmp_path: Path) -> None:
    maps = random_maps((6, 4, 4, 10))
    write_store(tmp_path, maps, k=2, shard_size=2)
    shard = tmp_path / "shard-00001.npy"
    data = shard.read_bytes()

    shard.write_bytes(data[:-7])  # truncated
    with pytest.raises(ScoreMapError, match=r"shard-00001\.npy is truncated"):
        ScoreMaps(tmp_path)
    shard.unlink()  # missing
    with pytest.raises(ScoreMapError, match=r"shard-00001\.npy is missing"):
        ScoreMaps(tmp_path)
    shard.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))  # same size, flipped bits
    store = ScoreMaps(tmp_path)
    with pytest.raises(ScoreMapError, match=r"shard-00001\.npy is corrupted"):
        store.load_all()
    shard.write_bytes(data)
    ScoreMaps(tmp_path).verify()

    index = tmp_path / "index.json"
    good = index.read_text()
    index.write_text(good[: len(good) // 2])  # cut JSON
    with pytest.raises(ScoreMapError, match=r"corrupted score-map index .*index\.json"):
        ScoreMaps(tmp_path)
    blob = json.loads(good)
    blob["k"] = 3  # an index that does not describe its shards
    index.write_text(json.dumps(blob))
    with pytest.raises(ScoreMapError, match=r"shard-00000\.npy holds uint16 \(2, 2, 4, 4, 2\)"):
        ScoreMaps(tmp_path).get([0])
    index.unlink()
    with pytest.raises(ScoreMapError, match=r"no score-map index at .*index\.json"):
        ScoreMaps(tmp_path)


def test_resuming_with_other_settings_is_refused(tmp_path: Path) -> None:
    write_store(tmp_path, random_maps((3, 2, 2, 10)), k=2, shard_size=2)
    with pytest.raises(ScoreMapError, match=r"index\.json was written with \{'k': 2\}"):
        ScoreMapWriter(tmp_path, num_classes=10, map_size=(2, 2), k=3, shard_size=2)


def test_interrupted_writing_resumes(tmp_path: Path) -> None:
    maps = random_maps((10, 3, 3, 10))
    ids = [f"img{i:03d}" for i in range(10)]
    w = write_store(tmp_path, maps[:9], k=3, shard_size=4, close=False)  # a crash: 2 shards done, 1 map in flight
    del w
    (tmp_path / "shard-00002.npy").write_bytes(b"half a shard")  # what an interrupted write leaves
    (tmp_path / ".shard-00003.npy.tmp123").write_bytes(b"x")
    first = (tmp_path / "shard-00000.npy").stat()
    w = ScoreMapWriter(tmp_path, num_classes=10, map_size=(3, 3), k=3, shard_size=4)
    assert w.ids == tuple(ids[:8])  # completed shards kept, the lost map is redone
    assert sorted(p.name for p in tmp_path.iterdir()) == ["index.json", "shard-00000.npy", "shard-00001.npy"]
    w.append(ids[8:9], compress(maps[8:9], 3))
    w.close()  # a short last shard
    w = ScoreMapWriter(tmp_path, num_classes=10, map_size=(3, 3), k=3, shard_size=4)
    assert w.ids == tuple(ids[:9])  # the short shard is read back into the buffer and rewritten
    w.append(ids[9:], compress(maps[9:], 3))
    w.close()
    store = ScoreMaps(tmp_path)
    assert store.ids == tuple(ids)
    assert (tmp_path / "shard-00000.npy").stat().st_mtime_ns == first.st_mtime_ns
    assert torch.equal(store.load_all().values, compress(maps, 3).values)
    with pytest.raises(ValueError, match="unique"):
        ScoreMapWriter(tmp_path, num_classes=10, map_size=(3, 3), k=3, shard_size=4).append(ids[:1], compress(maps[:1], 3))


# ---------------------------------------------------------------------- alignment
def test_cell_aligned_crops_are_exact_and_flips_mirror() -> None:
    maps = rearrange(random_maps((3, 8, 8, 5)), "b h w c -> b c h w")
    cell = 4  # a 32x32 image, an 8x8 map
    cells = [(1, 2, 4, 3), (0, 0, 8, 8), (5, 3, 2, 5)]  # r0, c0, rows, cols
    out = []
    for i, (r0, c0, rows, cols) in enumerate(cells):
        box = torch.tensor([[c0 * cell, r0 * cell, (c0 + cols) * cell, (r0 + rows) * cell]], dtype=torch.float32)
        for flip in (False, True):
            params = CropParams(box, torch.tensor([flip]), torch.tensor([[32, 32]]))
            got = align_score_maps(maps[i : i + 1], params, (rows, cols))
            want = rearrange(maps[i, :, r0 : r0 + rows, c0 : c0 + cols], "c h w -> 1 h w c")
            assert_close(got, want.flip(2) if flip else want, rtol=0, atol=1e-6)
            out.append(got)


def test_alignment_matches_a_crop_of_the_full_resolution_map() -> None:
    # An affine full-resolution map: block averages keep it exactly and bilinear sampling is
    # exact on it, so RoIAlign of the 8x8 map must equal cropping the 32x32 map by brute force.
    g = torch.Generator().manual_seed(3)
    c, size, cell = 3, 32, 4
    ys, xs = torch.meshgrid(torch.arange(size) + 0.5, torch.arange(size) + 0.5, indexing="ij")
    a, bx, by = torch.rand(c, 1, 1, generator=g), torch.randn(c, 1, 1, generator=g) / 10, torch.randn(c, 1, 1, generator=g) / 10
    full = a + bx * xs + by * ys  # c H W
    low = F.avg_pool2d(full.unsqueeze(0), cell)  # 1 c 8 8
    grid = (4, 2)
    for trial in range(12):
        # integer boxes inside [cell/2, size - cell/2] (no border clamping), sizes multiples of the grid
        hh = 4 * int(torch.randint(1, 7, (1,), generator=g))
        ww = 2 * int(torch.randint(2, 14, (1,), generator=g))
        y0 = int(torch.randint(2, size - 2 - hh + 1, (1,), generator=g))
        x0 = int(torch.randint(2, size - 2 - ww + 1, (1,), generator=g))
        flip = bool(trial % 2)
        params = CropParams(torch.tensor([[x0, y0, x0 + ww, y0 + hh]], dtype=torch.float32), torch.tensor([flip]), torch.tensor([[size, size]]))
        got = align_score_maps(low, params, grid)
        crop = full[:, y0 : y0 + hh, x0 : x0 + ww]
        crop = crop.flip(-1) if flip else crop
        want = rearrange(F.adaptive_avg_pool2d(crop.unsqueeze(0), grid), "1 c h w -> 1 h w c")
        assert_close(got, want, rtol=0, atol=1e-5)


def roi_reference(maps: torch.Tensor, params: CropParams, grid: tuple[int, int]) -> torch.Tensor:
    """RoIAlign by hand: average of bilinear samples (border-clamped) on each bin's regular sub-grid."""
    b, c, hm, wm = maps.shape
    h, w = grid
    out = torch.zeros(b, h, w, c)
    for i in range(b):
        H, W = params.image_sizes[i].tolist()
        x0, y0, x1, y1 = (params.boxes[i].double() * torch.tensor([wm / W, hm / H, wm / W, hm / H])).tolist()
        bh, bw = (y1 - y0) / h, (x1 - x0) / w
        gh, gw = math.ceil(bh), math.ceil(bw)
        for ph in range(h):
            for pw in range(w):
                ys = torch.tensor([y0 + ph * bh + (iy + 0.5) * bh / gh for iy in range(gh)])
                xs = torch.tensor([x0 + pw * bw + (ix + 0.5) * bw / gw for ix in range(gw)])
                yy, xx = torch.meshgrid(ys, xs, indexing="ij")
                pts = torch.stack([2 * xx / wm - 1, 2 * yy / hm - 1], dim=-1).float().unsqueeze(0)
                val = F.grid_sample(maps[i : i + 1], pts, mode="bilinear", padding_mode="border", align_corners=False)
                out[i, ph, pw] = val.mean(dim=(2, 3))[0]
    if params.flips.any():
        out = torch.where(params.flips.view(b, 1, 1, 1), out.flip(2), out)
    return out


@pytest.mark.parametrize("kind", ["resized", "padded"])
def test_alignment_matches_a_hand_written_roi_align(kind: str) -> None:
    g = torch.Generator().manual_seed(5)
    maps = rearrange(random_maps((6, 8, 8, 4), seed=2), "b h w c -> b c h w")
    if kind == "resized":
        params = sample_resized_crops((32, 32), 6, generator=g)
    else:  # boxes reaching past the image: the map's border cells extend it
        params = sample_padded_crops((32, 32), 6, padding=6, generator=g)
        assert (params.boxes[:, :2] < 0).any() and (params.boxes[:, 2:] > 32).any()
    assert params.flips.any() and not params.flips.all()
    got = align_score_maps(maps, params, (4, 4))
    assert_close(got, roi_reference(maps, params, (4, 4)), rtol=0, atol=1e-5)
    assert_close(got.sum(-1), torch.ones(6, 4, 4))
    # a flip mirrors the token grid and nothing else
    unflipped = CropParams(params.boxes, torch.zeros(6, dtype=torch.bool), params.image_sizes)
    assert_close(got, torch.where(params.flips.view(6, 1, 1, 1), align_score_maps(maps, unflipped, (4, 4)).flip(2), got))


def test_top_k_maps_align_like_their_dense_reconstruction() -> None:
    top = compress(random_maps((4, 6, 6, 20)), k=5)
    params = sample_resized_crops(torch.tensor([[48, 48], [48, 64], [30, 48], [48, 48]]), 4, generator=torch.Generator().manual_seed(0))
    dense = rearrange(top.dense("spread"), "b h w c -> b c h w")
    assert_close(align_score_maps(top, params, (3, 3), fill="spread"), align_score_maps(dense, params, (3, 3)))


def test_crop_resize_of_images_zero_pads_and_is_exact_on_integer_crops() -> None:
    images = torch.rand(4, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    params = sample_padded_crops((16, 16), 4, padding=3, generator=torch.Generator().manual_seed(2))
    got = crop_resize(images, params, (16, 16), padding="zeros")
    padded = F.pad(images, (3, 3, 3, 3))
    for i in range(4):
        x0, y0 = (int(v) + 3 for v in params.boxes[i, :2].tolist())
        want = padded[i, :, y0 : y0 + 16, x0 : x0 + 16]
        assert_close(got[i], want.flip(-1) if params.flips[i] else want, rtol=0, atol=1e-6)


# ---------------------------------------------------------------------- the annotator
def test_dense_token_annotator_mixes_like_the_tokens() -> None:
    b, c, grid = 3, 5, (2, 2)
    targets = random_maps((b, 4, 4, c), seed=7)  # aligned on a 4x4 grid, the model uses 2x2
    mask = torch.ones(b, 8, 8)
    mask[0, :4, :] = 0.0  # sample 0: top half from its partner
    mask[1, :, 6:] = 0.0  # sample 1: a strip cutting through the right tokens (weight 1/2 there)
    lm = TokenLabelMap.from_mask(mask, torch.tensor([2, 0, 1]), torch.tensor([0, 1, 2]), num_classes=c, label_smoothing=0.1)
    got = lm.with_token_targets(targets).mixed_token_targets(grid)
    pooled = rearrange(F.avg_pool2d(rearrange(targets, "b h w c -> b c h w"), 2), "b c h w -> b (h w) c")
    want = torch.empty(b, 4, c)
    weights = {0: [0.0, 0.0, 1.0, 1.0], 1: [1.0, 0.5, 1.0, 0.5], 2: [1.0, 1.0, 1.0, 1.0]}  # own share per token
    partner = {0: 2, 1: 0, 2: 1}
    for i in range(b):
        for t in range(4):
            w = weights[i][t]
            want[i, t] = w * pooled[i, t] + (1 - w) * pooled[partner[i], t]
    assert_close(got, 0.9 * want + 0.1 / c)
    with pytest.raises(ValueError, match="cannot serve a 3x3"):
        TokenLabelMap.unmixed(torch.tensor([0, 1, 2]), c, (12, 12)).with_token_targets(targets).mixed_token_targets((3, 3))
    with pytest.raises(ValueError, match=r"token_targets must be float \(batch=3, h, w, num_classes=5\)"):
        lm.with_token_targets(rearrange(targets, "b h w c -> b (h w) c"))  # flat maps: give them as (b, h, w, c)
    with pytest.raises(ValueError, match="carries no token targets"):
        lm.mixed_token_targets(grid)


def test_one_training_step_with_mixtoken_and_annotator_token_labels() -> None:
    torch.manual_seed(0)
    model = VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=10)
    g = torch.Generator().manual_seed(0)
    originals = torch.rand(4, 3, 40, 48, generator=g)  # uncropped images of another size
    maps = compress(random_maps((4, 5, 6, 10), seed=4), k=5)  # the store's maps of those images
    labels = torch.tensor([1, 2, 3, 4])
    params = sample_resized_crops((40, 48), 4, generator=g)
    images = crop_resize(originals, params, (32, 32))
    aligned = align_score_maps(maps, params, (4, 4))  # b 4 4 c, before mixing
    images, lm = MixToken(num_classes=10, patch_size=8, generator=g)(images, labels)
    lm = lm.with_token_targets(aligned)  # the batch's maps travel with its label map; the scheme is fixed
    adapted = backbones.adapt(model, TokenLabeling(beta=0.5))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out: AlignedOutput = adapted(images, lm)
    assert out.token_logits is not None and out.token_target is not None
    assert_close(out.token_target, lm.mixed_token_targets((4, 4)))
    assert_close(out.target, lm.image_targets())
    assert not torch.allclose(out.token_target, lm.targets(lm.token_weights((4, 4))))  # not the image labels
    loss = out.loss()
    assert torch.isfinite(loss)
    head: torch.Tensor = model.get_classifier().weight
    before = head.detach().clone()
    torch.autograd.backward(loss)
    opt.step()
    assert not torch.equal(before, head)


def _tiny_cifar(dest: Path, per_class: int = 8, classes: int = 2) -> Path:
    """A tar.gz of the first ``per_class`` train images of the first ``classes`` classes met in the archive."""
    picked: dict[str, list[tuple[str, bytes]]] = {}
    with tarfile.open(CIFAR, mode="r|*") as tar:
        for m in tar:
            parts = Path(m.name).parts
            if not m.isfile() or len(parts) < 3 or parts[-3] != "train":
                continue
            cls = parts[-2]
            if cls not in picked and len(picked) == classes:
                continue
            bucket = picked.setdefault(cls, [])
            if len(bucket) < per_class:
                handle = tar.extractfile(m)
                assert handle is not None
                bucket.append((m.name, handle.read()))
            if len(picked) == classes and all(len(v) == per_class for v in picked.values()):
                break
    path = dest / "tiny.tar.gz"
    with tarfile.open(path, "w:gz") as out:
        for items in picked.values():
            for name, data in items:
                info = tarfile.TarInfo(name)
                info.size = len(data)
                out.addfile(info, io.BytesIO(data))
    return path


@pytest.mark.skipif(not CIFAR.exists(), reason=f"the CIFAR-10 archive is absent ({CIFAR})")
def test_annotator_command_end_to_end_and_resume(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks.annotate import _decode, dense_scores, list_images, main

    data = _tiny_cifar(tmp_path)
    out = tmp_path / "store"
    kwargs = '{"img_size": 32, "patch_size": 4, "embed_dim": 16, "depth": 1, "num_heads": 2}'
    common = ["--data", str(data), "--out", str(out), "--model-kwargs", kwargs, "--shard-size", "5",
              "--batch-size", "4", "--no-progress", "--threads", "1", "--num-classes", "10"]  # fmt: skip
    assert main([*common, "--limit", "7"]) == 0  # stands for a run interrupted after 7 images
    first = (out / "shard-00000.npy").stat().st_mtime_ns
    assert len(ScoreMaps(out)) == 7
    assert main(common) == 0  # resumes
    printed = capsys.readouterr().out
    assert "bytes per image" in printed
    store = ScoreMaps(out)
    store.verify()
    items = list_images(data, "train")
    with tarfile.open(data) as tar:  # an ImageFolder directory lists the same ids and bytes
        tar.extractall(tmp_path / "folder", filter="data")
    folder = list_images(tmp_path / "folder", "train")
    assert [i for i, _ in folder] == [i for i, _ in items] and folder[3][1]() == items[3][1]()
    assert store.ids == tuple(i for i, _ in items) and len(store) == 16
    assert store.map_size == (8, 8) and store.k == 5 and store.num_classes == 10
    assert (out / "shard-00000.npy").stat().st_mtime_ns == first  # the completed shard was kept
    assert store.meta["model"] == "deit_tiny_patch16_224" and store.meta["img_size"] == [32, 32]
    # the stored maps are the model's dense scores: rebuild the seeded random annotator and compare
    import timm
    from timm.data.config import resolve_data_config

    torch.manual_seed(0)
    model = timm.create_model("deit_tiny_patch16_224", pretrained=False, num_classes=10, **json.loads(kwargs)).eval()
    cfg = resolve_data_config({}, model=model)  # type: ignore[no-untyped-call]
    x = torch.from_numpy(np.stack([_decode(load(), (32, 32)) for _, load in items[10:13]])).permute(0, 3, 1, 2).float() / 255
    x = (x - torch.tensor(cfg["mean"]).view(1, 3, 1, 1)) / torch.tensor(cfg["std"]).view(1, 3, 1, 1)
    with torch.no_grad():
        want = compress(dense_scores(model, x), k=5)
    got = store.get([10, 11, 12])
    assert_close(got.values, want.values, rtol=0, atol=1e-3)
    assert (got.indices == want.indices).float().mean() > 0.99  # near-ties may swap after fp16 rounding
