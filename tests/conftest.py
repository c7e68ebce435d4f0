"""Shared test settings: deterministic, small, and single-threaded enough for 2 cores."""

from __future__ import annotations

import os
from pathlib import Path

# Waiting OpenMP threads sleep instead of spinning: set before torch loads its OpenMP runtime (which reads it then),
# and inherited by the child processes tests start (the digest's 2-thread children, torchrun's, the benchmarks'). On
# 2 cores beside the other xdist worker a spinning thread holds the core its peer needs: a digest shard took 47 s
# so, 31 s sleeping (same bits). A caller's own setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=True,
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# pytest-xdist (pyproject's addopts: ``-n auto``, at most 4 workers) runs a worker per core: each takes its
# share of the cores, at most 2 threads, so that the workers do not oversubscribe the machine
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // _workers, torch.get_num_threads())))

# The files of the suite's longest tests (20-120 s each on 2 cores: a torchrun launch, child processes, compiles), run
# first: pyproject's ``--dist worksteal`` hands each worker a share and lets an idle one take the end of another's,
# so what ends the run is short tests, not a 2-minute one that one worker started last while the other sat idle.
# (Only the order changes; which tests run does not. A file missing here just runs in its collected place.)
FIRST = ("test_fsdp.py", "test_targets_unchanged.py", "test_compile.py", "test_speed.py", "test_shifted.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(FIRST)))  # stable: the rest keep their order


@pytest.fixture
def report_copy(tmp_path: Path) -> list[str]:
    """``python -m benchmarks.report``'s arguments onto a copy of the committed summaries (``tmp_path / "results"``),
    writing ``tmp_path / "RESULTS.md"`` and a copy of the README (``tmp_path / "README.md"``): the repository's own
    are left as they are."""
    import shutil

    from benchmarks import report

    shutil.copytree(report.RESULTS_DIR, tmp_path / "results")
    shutil.copy(report.README, tmp_path / "README.md")
    return ["--results-dir", str(tmp_path / "results"), "--output", str(tmp_path / "RESULTS.md"),
            "--readme", str(tmp_path / "README.md")]
