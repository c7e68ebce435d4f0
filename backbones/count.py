"""Print how many ``timm.list_models()`` names and torchvision classification builders ``backbones.adapt``
accepts, per scheme tier.

``python -m mixlabels.backbones.count`` counts from the families' declared timm modules and
torchvision builders (instant, builds nothing); ``--exact`` builds those names on the ``meta``
device (no memory, no weights; a few minutes) and asks the families' refusals.
``--list TIER`` prints that tier's timm names, ``--list torchvision:TIER`` its torchvision names.
"""

from __future__ import annotations

import argparse

import timm
import torchvision

from mixlabels.backbones._count import TierCount, count_timm_names, count_torchvision_names


def _table(rows: list[TierCount], what: str) -> None:
    print(f"| tier | {what} accepted |\n| --- | ---: |")
    for row in rows:
        print(f"| {row.tier} | {row.count} |")
    failed = [n for r in rows for n in r.failed]
    if failed:
        print(f"\n{len(failed)} names failed to build with their defaults (not counted): {', '.join(failed)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--exact", action="store_true", help="build every name on the meta device and ask the refusals")
    parser.add_argument("--list", default=None, metavar="TIER", help="print the names of this tier")
    args = parser.parse_args()
    rows = count_timm_names(exact=args.exact)
    tv_rows = count_torchvision_names(exact=args.exact)
    how = "exact (meta builds)" if args.exact else "declared timm modules and torchvision builders"
    print(f"timm {timm.__version__}: {len(timm.list_models())} names; {how}")
    _table(rows, "timm names")
    print(f"\ntorchvision {torchvision.__version__}: {tv_rows[-1].count} classification builders")
    _table(tv_rows, "torchvision builders")
    if args.list is not None:
        source, tier = (tv_rows, args.list.removeprefix("torchvision:")) if args.list.startswith("torchvision:") else (rows, args.list)
        chosen = [r for r in source if r.tier == tier]
        if not chosen:
            parser.error(f"no tier {args.list!r}; tiers: {', '.join(r.tier for r in rows)} (torchvision:TIER for torchvision's)")
        print("\n".join(chosen[0].names))


if __name__ == "__main__":
    main()
