"""The `cadence-fx` command line."""

from __future__ import annotations

import argparse
import json
import sys

__all__ = ["main"]


def _catalog(args: argparse.Namespace) -> int:
    from cadence_fx.catalog import derive
    from cadence_fx.models import family_contract
    from cadence_fx.report import catalog_table

    catalog = derive(family_contract(args.family), budget=args.budget)
    print(json.dumps(catalog.to_dict(), indent=2) if args.json else catalog_table(catalog))
    return 0


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    from cadence_fx.models import FAMILIES

    parser = argparse.ArgumentParser(prog="cadence-fx", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    catalog = commands.add_parser("catalog", help="derive a family's extents, bounds, bytes and shape classes")
    catalog.add_argument("family", choices=sorted(FAMILIES))
    catalog.add_argument("--budget", type=_positive_int, default=64, help="widest catalog still captured (classes)")
    catalog.add_argument("--json", action="store_true", help="print the derivation as JSON")
    catalog.set_defaults(run=_catalog)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except ValueError as error:
        print(f"cadence-fx {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
