"""CIFAR-10 in torchvision's format, the fallback of ``--data cifar10``, offline.

The tests write a tiny data set in the ``cifar-10-batches-py`` layout themselves
(a few 32x32 images per batch file); torchvision's download is replaced by a
stand-in, so nothing here touches the network.
"""

from __future__ import annotations

import json
import pickle
import urllib.error
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from benchmarks import ablation, report
from benchmarks._archive import NAMED
from benchmarks._cifar_batches import (
    BASE_FOLDER,
    META_FILE,
    TEST_FILES,
    TRAIN_FILES,
    TorchvisionCIFAR10,
    ensure_files,
    read_split,
)

CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
PER_BATCH = 8  # images per batch file: 40 train, 8 test


def write_tiny_cifar(folder: Path, seed: int = 0) -> dict[str, tuple[np.ndarray, list[int]]]:
    """The layout torchvision keeps (pickled dicts, ``data`` rows of 3072 bytes: R, G, B planes); what was written."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    written = {}
    for name in (*TRAIN_FILES, *TEST_FILES):
        data = rng.integers(0, 256, (PER_BATCH, 3072), dtype=np.uint8)
        labels = [int(x) for x in rng.integers(0, 10, PER_BATCH)]
        with (folder / name).open("wb") as f:
            pickle.dump({"batch_label": name, "labels": labels, "data": data, "filenames": [f"{i}.png" for i in range(PER_BATCH)]}, f)
        written[name] = (data, labels)
    with (folder / META_FILE).open("wb") as f:
        pickle.dump({"label_names": CLASSES, "num_cases_per_batch": PER_BATCH, "num_vis": 3072}, f)
    return written


def test_read_split_matches_the_format(tmp_path: Path) -> None:
    written = write_tiny_cifar(tmp_path / BASE_FOLDER)
    data = TorchvisionCIFAR10(root=tmp_path, archive=tmp_path / "none" / NAMED["cifar10"])
    assert data.missing() == []
    train = read_split(data, "train")
    assert train.images.shape == (5 * PER_BATCH, 32, 32, 3) and train.images.dtype == torch.uint8
    assert train.classes == tuple(CLASSES)
    # reference: pixel (y, x) of channel c is byte c * 1024 + y * 32 + x of the row, batches in file order
    rows = np.concatenate([written[n][0] for n in TRAIN_FILES])
    for i in (0, 9, 39):
        for c, y, x in ((0, 0, 0), (1, 5, 31), (2, 31, 7)):
            assert int(train.images[i, y, x, c]) == int(rows[i, c * 1024 + y * 32 + x])
    assert train.labels.tolist() == sum((written[n][1] for n in TRAIN_FILES), [])
    test = read_split(data, "test", size=16)  # resized like the archive path: bicubic
    assert test.images.shape == (PER_BATCH, 16, 16, 3) and test.labels.tolist() == written["test_batch"][1]


def test_bad_files_are_named(tmp_path: Path) -> None:
    write_tiny_cifar(tmp_path / BASE_FOLDER)
    data = TorchvisionCIFAR10(root=tmp_path, archive=tmp_path / NAMED["cifar10"])
    with (tmp_path / BASE_FOLDER / "test_batch").open("wb") as f:
        pickle.dump({"labels": [0, 1], "data": np.zeros((2, 100), dtype=np.uint8)}, f)
    with pytest.raises(ValueError, match="test_batch.*3072"):
        read_split(data, "test")
    (tmp_path / BASE_FOLDER / "data_batch_3").unlink()
    with pytest.raises(FileNotFoundError, match="data_batch_3"):
        read_split(data, "train")


class FakeCIFAR10:
    """Stands in for ``torchvision.datasets.CIFAR10``: records its call and "downloads" the tiny files."""

    calls: list[dict[str, Any]] = []

    def __init__(self, root: str, train: bool = True, download: bool = False) -> None:
        FakeCIFAR10.calls.append({"root": root, "train": train, "download": download})
        write_tiny_cifar(Path(root) / BASE_FOLDER)


def test_files_present_are_used_without_download(tmp_path: Path) -> None:
    write_tiny_cifar(tmp_path / BASE_FOLDER)
    data = TorchvisionCIFAR10(root=tmp_path, archive=tmp_path / NAMED["cifar10"])
    FakeCIFAR10.calls = []
    ensure_files(data, allow_download=True, dataset=FakeCIFAR10, log=lambda m: None)
    ensure_files(data, allow_download=False)
    assert FakeCIFAR10.calls == []


def test_missing_files_are_downloaded_by_torchvision_and_announced(tmp_path: Path) -> None:
    data = TorchvisionCIFAR10(root=tmp_path / "cache" / "torchvision", archive=tmp_path / "data" / NAMED["cifar10"])
    logged: list[str] = []
    FakeCIFAR10.calls = []
    ensure_files(data, allow_download=True, dataset=FakeCIFAR10, log=logged.append)
    assert FakeCIFAR10.calls == [{"root": str(data.root), "train": True, "download": True}]
    assert "downloading CIFAR-10 with torchvision" in logged[0] and str(data.archive) in logged[0]
    assert data.missing() == [] and read_split(data, "test").images.shape[0] == PER_BATCH


def test_offline_without_either_names_both_ways(tmp_path: Path) -> None:
    data = TorchvisionCIFAR10(root=tmp_path / "cache" / "torchvision", archive=tmp_path / "data" / NAMED["cifar10"])
    with pytest.raises(FileNotFoundError) as forbidden:
        ensure_files(data, allow_download=False)

    def no_network(root: str, train: bool = True, download: bool = False) -> None:
        raise urllib.error.URLError("[Errno -3] Temporary failure in name resolution")

    with pytest.raises(FileNotFoundError) as failed:
        ensure_files(data, allow_download=True, dataset=no_network, log=lambda m: None)
    for err in (str(forbidden.value), str(failed.value)):
        assert str(data.archive) in err and "--data-root" in err  # way 1: the bundled archive
        assert "network" in err and str(data.root) in err  # way 2: torchvision's download into the cache
    assert "name resolution" in str(failed.value)


def test_ablation_falls_back_to_torchvision_files(tmp_path: Path) -> None:
    """No bundled archive: the job reads the torchvision files in the cache and says so in its records."""
    cache = tmp_path / "cache"
    write_tiny_cifar(cache / "torchvision" / BASE_FOLDER)
    out = tmp_path / "out"
    cfg, _ = ablation.resolve_config([
        "--data-root", str(tmp_path / "no-archive"), "--cache-dir", str(cache), "--no-download", "--out", str(out),
        "--rows", "cutmix", "--seeds", "0", "--subset", "32", "--test-subset", "8", "--batch-size", "16",
        "--max-steps", "1", "--eval-batch-size", "8", "--embed-dim", "16", "--depth", "1", "--heads", "2", "--quiet",
    ])
    assert isinstance(ablation.locate_data(cfg), TorchvisionCIFAR10)
    assert ablation.default_out(cfg, ablation.locate_data(cfg)).name.startswith("table7-cifar10-torchvision-")
    first = ablation.run_ablation(cfg)
    assert (first.trained, first.skipped) == (2, 0)
    results = json.loads((out / "results.json").read_text())
    assert {r["data_origin"] for r in results["runs"]} == {"torchvision-cifar10"}
    assert {r["result"]["evaluated"] for r in results["runs"]} == {8}
    assert results["provenance"]["data"] == str(cache / "torchvision" / BASE_FOLDER)
    assert results["provenance"]["torch"] == torch.__version__ and results["provenance"]["cores"] >= 1
    again = ablation.run_ablation(cfg)  # resumes: the runs' records match their data
    assert (again.trained, again.skipped) == (0, 2)
    # the job's output is what benchmarks/RESULTS.md is generated from
    name, summary = report.summarize_ablation(out)
    text = report.render_ablation(summary)
    assert name == "table7-rows" and "2 of 2 runs finished" in text and "Command: `python " in text  # --rows cutmix
    assert f"| × | ✓ | × | × | {results['runs'][0]['result']['top1']:.2f} |" in text
