"""The ``ferry`` command line: ``ferry <subcommand> ...``.

Each subcommand is a module with ``add_parser(subparsers)`` (define its flags) and
``run(args) -> int | None`` (do it). Add one by listing its module in ``SUBCOMMANDS``;
modules are imported when the parser is built, so keep heavy imports inside ``run``.

``--help`` shows each flag's default; a mistake (an unknown flag, a bad value) is the
subcommand's one-line usage and one line saying what is wrong, never a traceback. A
subcommand with a ``--config`` flag reads a topology file (``server.topology``) whose
keys become flags in front of the command line's.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import sys
from collections.abc import Sequence

from server import topology

SUBCOMMANDS: dict[str, str] = {
    "serve": "server.serve",
    "worker": "server.worker",
    "bench": "bench.load.cli",
}


def version() -> str:
    try:
        return importlib.metadata.version("ferry")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout not installed
        return "unknown"


class DefaultsFormatter(argparse.HelpFormatter):
    """Help that ends with ``(default: X)`` where a flag has a default its help does not
    already state (switches and flags without a default say nothing)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if "default" in text or default in (None, False, [], argparse.SUPPRESS):
            return text
        return f"{text} (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors say what to read next."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", DefaultsFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="ferry", description="OpenAI-compatible LLM serving with E/P/D disaggregation."
    )
    parser.add_argument("--version", action="version", version=f"ferry {version()}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="<command>")
    for name, module_name in SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        sub = module.add_parser(subparsers)
        sub.set_defaults(run=module.run)
        assert sub.prog.endswith(name), f"{module_name} registered {sub.prog!r}, not {name!r}"
    return parser


def commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """Each subcommand's own parser, by name."""
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def with_topology(argv: list[str], parsers: dict[str, argparse.ArgumentParser]) -> list[str]:
    """``argv`` with the flags of its ``--config FILE`` (if its subcommand takes one) put in
    front of the command line's, which therefore win."""
    if not argv or argv[0] not in parsers:
        return argv
    command = parsers[argv[0]]
    readers = {n: p for n, p in parsers.items() if "--config" in p._option_string_actions}
    if argv[0] not in readers:
        return argv
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--config")
    path = pre.parse_known_args(argv[1:])[0].config
    if not path:
        return argv
    others = [p for n, p in readers.items() if n != argv[0]]
    try:
        return [argv[0], *topology.flags(path, command, others), *argv[1:]]
    except topology.TopologyError as exc:
        command.error(str(exc))
        raise  # error() exits


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    subs = commands(parser)
    args, unknown = parser.parse_known_args(with_topology(list(sys.argv[1:] if argv is None
                                                                else argv), subs))  # fmt: skip
    if unknown:
        subs[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    return args.run(args) or 0


if __name__ == "__main__":
    sys.exit(main())
