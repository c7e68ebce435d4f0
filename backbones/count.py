"""Print how many ``timm.list_models()`` names ``backbones.adapt`` accepts, per scheme tier.

``python -m mixlabels.backbones.count`` counts from the families' declared timm modules
(instant, builds nothing); ``--exact`` builds those names on the ``meta`` device (no memory,
no weights; a few minutes) and asks the families' refusals.
``--list TIER`` prints that tier's names.
"""

from __future__ import annotations

import argparse

import timm

from mixlabels.backbones._count import count_timm_names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--exact", action="store_true", help="build every name on the meta device and ask the refusals")
    parser.add_argument("--list", default=None, metavar="TIER", help="print the names of this tier")
    args = parser.parse_args()
    rows = count_timm_names(exact=args.exact)
    print(f"timm {timm.__version__}: {len(timm.list_models())} names; {'exact (meta builds)' if args.exact else 'declared timm modules'}")
    print("| tier | timm names accepted |\n| --- | ---: |")
    for row in rows:
        print(f"| {row.tier} | {row.count} |")
    failed = [n for r in rows for n in r.failed]
    if failed:
        print(f"\n{len(failed)} names failed to build with their defaults (not counted): {', '.join(failed)}")
    if args.list is not None:
        chosen = [r for r in rows if r.tier == args.list]
        if not chosen:
            parser.error(f"no tier {args.list!r}; tiers: {', '.join(r.tier for r in rows)}")
        print("\n".join(chosen[0].names))


if __name__ == "__main__":
    main()
