"""The ``ferry`` command line: ``ferry <subcommand> ...``.

Each subcommand is a module with ``add_parser(subparsers)`` (define its flags) and
``run(args) -> int | None`` (do it). Add one by listing its module in ``SUBCOMMANDS``;
modules are imported when the parser is built, so keep heavy imports inside ``run``.

``--help`` shows each flag's default; a mistake (an unknown flag, a bad value) is the
subcommand's one-line usage and one line saying what is wrong, never a traceback. A value
is checked where it is parsed, by its flag's ``type=`` or ``choices=``: the types below
(``positive_int``, ``tcp_port``, ``int_at_least(n)``, ``number_above(x)``, ...) say what a
flag takes, so a value the workers would refuse seconds later is refused here, naming the
flag. A subcommand with a ``--config`` flag reads a topology file (``server.topology``)
whose keys become flags in front of the command line's, and whose values go through the
same types (an error names the file and the key).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import math
import sys
from collections.abc import Callable, Sequence

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
        unset = default is None or default is False or default == [] or default == ()
        if "default" in text or unset or default == argparse.SUPPRESS:
            return text
        return f"{text} (default: %(default)s)"


def int_in(low: int | None = None, high: int | None = None) -> Callable[[str], int]:
    """A flag's type: an integer from ``low`` to ``high`` (either open when None)."""

    def parse(text: str) -> int:
        value = int(text)  # a ValueError reads "invalid int value: 'x'"
        if (low is not None and value < low) or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be {_range(low, high)}, got {text}")
        return value

    parse.__name__ = "int"
    return parse


def int_at_least(low: int) -> Callable[[str], int]:
    """A flag's type: an integer of at least ``low``."""
    return int_in(low)


positive_int = int_at_least(1)  # a count or a size where 0 means nothing
tcp_port = int_in(0, 65535)  # 0 picks a free one


def number_at_least(low: float) -> Callable[[str], float]:
    """A flag's type: a finite number of at least ``low``."""
    return _number(lambda v: v >= low, f"at least {low:g}")


def number_above(low: float) -> Callable[[str], float]:
    """A flag's type: a finite number greater than ``low``."""
    return _number(lambda v: v > low, f"more than {low:g}")


def _number(ok: Callable[[float], bool], allowed: str) -> Callable[[str], float]:
    def parse(text: str) -> float:
        value = float(text)  # a ValueError reads "invalid float value: 'x'"
        if not math.isfinite(value) or not ok(value):
            finite = "" if math.isfinite(value) else "a finite number "
            raise argparse.ArgumentTypeError(f"must be {finite}{allowed}, got {text}")
        return value

    parse.__name__ = "float"
    return parse


positive_number = number_above(0.0)  # a size or a timeout where 0 means nothing


def _range(low: int | None, high: int | None) -> str:
    if high is None:
        return f"at least {low}"
    if low is None:
        return f"at most {high}"
    return f"{low}-{high}" if low >= 0 else f"from {low} to {high}"


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
        from_file = topology.flags(path, command, others)
        check_values(path, command, from_file)
    except topology.TopologyError as exc:
        command.error(str(exc))
        raise  # error() exits
    return [argv[0], *from_file, *argv[1:]]


def check_values(path: str, command: argparse.ArgumentParser, argv: list[str]) -> None:
    """Each value in ``argv`` (the flags of the file at ``path``) through its flag's type
    and choices, as the command line's go, so that a bad one names the file and its key."""
    keys = {id(action): f"{name}.{key}" for name, found in topology.sections(command).items()
            for key, action in found.items()}  # fmt: skip
    actions = command._option_string_actions
    for flag, value in zip(argv, argv[1:]):
        action = actions.get(flag)
        if action is None or action.nargs is not None or value in actions:
            continue
        try:
            command._check_value(action, command._get_value(action, value))
        except argparse.ArgumentError as exc:
            where = keys.get(id(action), flag)
            raise topology.TopologyError(f"{path}: {where}: {exc}") from None


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
