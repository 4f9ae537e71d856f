"""The ``ferry`` command line: ``ferry <subcommand> ...``.

Each subcommand is a module with ``add_parser(subparsers)`` (define its flags) and
``run(args) -> int | None`` (do it). Add one by listing its module in ``SUBCOMMANDS``;
modules are imported when the parser is built, so keep heavy imports inside ``run``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

SUBCOMMANDS: dict[str, str] = {
    "serve": "server.serve",
    "worker": "server.worker",
    "bench": "bench.load.cli",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ferry", description="OpenAI-compatible LLM serving with E/P/D disaggregation."
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="<command>")
    for name, module_name in SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        sub = module.add_parser(subparsers)
        sub.set_defaults(run=module.run)
        assert sub.prog.endswith(name), f"{module_name} registered {sub.prog!r}, not {name!r}"
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args) or 0


if __name__ == "__main__":
    sys.exit(main())
