"""Paired statistics of the ablation's deltas: the t quantile against scipy, intervals by hand, tables, seeds."""

from __future__ import annotations

import argparse
import math
from typing import Any

import pytest
import scipy.stats

from benchmarks import ablation
from benchmarks._stats import NO_DIFFERENCE, paired_delta, t_quantile


@pytest.mark.parametrize("df", [1, 2, 3, 4, 5, 9, 19, 29, 99, 1000, 0.5, 2.5])
@pytest.mark.parametrize("p", [0.5, 0.6, 0.9, 0.95, 0.975, 0.995, 0.9995, 0.025, 1e-4])
def test_t_quantile_matches_scipy(p: float, df: float) -> None:
    expected = float(scipy.stats.t.ppf(p, df))
    assert t_quantile(p, df) == pytest.approx(expected, rel=1e-9, abs=1e-12)


def test_t_quantile_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="0 < p < 1"):
        t_quantile(1.0, 3)
    with pytest.raises(ValueError, match="df > 0"):
        t_quantile(0.9, 0)


def test_paired_delta_by_hand() -> None:
    # differences 1.0, 0.5, 1.5, 2.0: mean 1.25, sd sqrt(0.41667), t(0.975, 3) = 3.182446305
    base = {0: 50.0, 1: 51.0, 2: 52.0, 3: 49.0, 9: 10.0}  # seed 9 has no partner: left out
    other = {0: 51.0, 1: 51.5, 2: 53.5, 3: 51.0}
    d = paired_delta(base, other)
    assert d is not None
    half = 3.182446305 * math.sqrt((2 * 0.25**2 + 2 * 0.75**2) / 3) / 2  # deviations -0.25, -0.75, +0.25, +0.75
    assert (d.n, d.positive, d.mean) == (4, 4, pytest.approx(1.25))
    assert d.low == pytest.approx(1.25 - half, rel=1e-8) and d.high == pytest.approx(1.25 + half, rel=1e-8)
    assert d.significant and d.verdict == "higher"
    assert str(d) == f"+1.25 [{1.25 - half:+.2f}, {1.25 + half:+.2f}], 4/4 > 0, higher"


def test_paired_delta_spanning_zero_and_one_seed() -> None:
    d = paired_delta({0: 50.0, 1: 50.0}, {0: 50.3, 1: 49.9})  # +0.3, -0.1: t(0.975, 1) = 12.7 makes it wide
    assert d is not None and d.low is not None and d.high is not None
    assert d.low < 0 < d.high and d.verdict == NO_DIFFERENCE and d.positive == 1
    assert str(d).endswith(NO_DIFFERENCE)
    lower = paired_delta({0: 50.0, 1: 50.0, 2: 50.0}, {0: 49.0, 1: 49.1, 2: 48.9})
    assert lower is not None and lower.verdict == "lower" and lower.positive == 0
    one = paired_delta({0: 50.0}, {0: 50.5})
    assert one is not None and one.low is None and one.high is None and one.significant is None
    assert str(one) == "+0.50, 1/1 > 0, interval undefined (1 seed)"
    assert paired_delta({0: 1.0}, {1: 2.0}) is None  # no shared seed: nothing to pair


def test_seed_ranges() -> None:
    assert ablation._int_list("0-9") == list(range(10))
    assert ablation._int_list("0,1") == [0, 1]
    assert ablation._int_list("0-2, 7") == [0, 1, 2, 7]
    assert ablation.resolve_config(["--seeds", "3-5"])[0].seeds == (3, 4, 5)
    with pytest.raises(argparse.ArgumentTypeError, match="backwards"):
        ablation._int_list("5-3")
    with pytest.raises(argparse.ArgumentTypeError, match="0-9"):
        ablation._int_list("0-x")


def _records(planned: list[ablation.Planned], top1: dict[tuple[str, bool], list[float]]) -> list[dict[str, Any]]:
    return [{"table": 7, "row": p.cell.row, "label": p.cell.label, "aligned": p.cell.aligned, "seed": p.seed,
             "key": p.key, "run": {}, "result": {"top1": top1[(p.cell.row, p.cell.aligned)][p.seed], "steps": 2}}
            for p in planned if (p.cell.row, p.cell.aligned) in top1]


def test_table_deltas_and_markdown() -> None:
    cfg, _ = ablation.resolve_config(["--rows", "cutmix,random", "--seeds", "0-2", "--embed-dim", "16", "--depth", "2"])
    planned = ablation.plan(cfg, 10, "cpu")
    top1 = {("cutmix", False): [50.0, 51.0, 52.0], ("cutmix", True): [50.3, 50.9, 52.1],  # +0.3, -0.1, +0.1
            ("random", False): [40.0, 41.0, 42.0], ("random", True): [42.0, 43.1, 43.9]}  # +2.0, +2.1, +1.9
    records = _records(planned, top1)
    deltas = {d.row: d for d in ablation.table_deltas(cfg, planned, records)}
    assert set(deltas) == {"cutmix", "random"} and deltas["cutmix"].against == "without TL-Align"
    expected = paired_delta(dict(enumerate(top1[("cutmix", False)])), dict(enumerate(top1[("cutmix", True)])))
    assert deltas["cutmix"].delta == expected
    assert deltas["cutmix"].delta.verdict == NO_DIFFERENCE and deltas["random"].delta.verdict == "higher"
    table = ablation.render_markdown(cfg, planned, records)
    assert f"| {deltas['cutmix'].delta} |" in table and NO_DIFFERENCE in table
    assert "95% t interval" in table  # the caption says what the brackets are


def test_a_zero_difference_is_not_counted_as_positive() -> None:
    """Ties (the same top-1 with and without) count neither as positive: ``k/n > 0`` counts strict gains only."""
    d = paired_delta({0: 50.0, 1: 51.0, 2: 52.0, 3: 40.0}, {0: 50.0, 1: 52.0, 2: 51.0, 3: 40.0})  # 0, +1, -1, 0
    assert d is not None and (d.n, d.positive) == (4, 1)
    assert ", 1/4 > 0, " in str(d) and d.as_dict()["positive"] == 1
    ties = paired_delta({0: 50.0, 1: 51.0}, {0: 50.0, 1: 51.0})
    assert ties is not None and (ties.positive, ties.mean, ties.low, ties.high) == (0, 0.0, 0.0, 0.0)
    assert ties.verdict == NO_DIFFERENCE and ", 0/2 > 0, " in str(ties)
    one = paired_delta({3: 70.0}, {3: 70.0})
    assert one is not None and one.positive == 0 and "0/1 > 0" in str(one)
    # a reference count by the definition, over every sign pattern of three seeds
    for signs in [(a, b, c) for a in (-1, 0, 1) for b in (-1, 0, 1) for c in (-1, 0, 1)]:
        got = paired_delta({0: 10.0, 1: 10.0, 2: 10.0}, {s: 10.0 + v for s, v in enumerate(signs)})
        assert got is not None and got.positive == sum(1 for v in signs if v > 0), signs
