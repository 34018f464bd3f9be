"""`dtorch-sim`: the simulator's command line (skeleton: the simulation itself is not built yet)."""

from __future__ import annotations

import argparse
import sys

from dtorch_sim import __version__


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dtorch-sim", description="Simulate a DTorch cluster with the real "
                                     "controller core and simulated workers.")
    parser.add_argument("--version", action="version", version=f"dtorch-sim {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("run", "validate", "compare"):
        cmd = sub.add_parser(name)
        cmd.add_argument("scenario")
    args = parser.parse_args(argv)
    print(f"dtorch-sim {args.command}: the simulator is not built yet in this version", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
