"""The topology file: ``ferry serve --config topo.yaml`` (and ``ferry worker --config``).

One YAML file describes a deployment — the model and its devices, the worker pools, how
KV moves, the tiers, Redis, logging — so that every frontend and worker of it reads the
same thing. Its sections are the option groups of ``ferry serve --help`` and ``ferry
worker --help`` (``model``, ``engine``, ``tiers``, ``log``, ``server``, ``control``,
``pools``, ``transfer``, ``worker``), its keys those groups' flags without the leading
dashes (``kv-transport``; ``kv_transport`` too)::

    model: {model: /models/SmolLM2-135M-Instruct.Q4_1.gguf, device: cpu}
    pools: {prefill: 0, decode: 0}
    transfer: {kv-transport: tcp}
    tiers: {kv-tiers: [host, file], kv-dir: /var/lib/ferry/kv, kv-file-ttl-hours: 24}
    control: {redis: "redis://ferry-redis:6379/0"}
    log: {log-format: json}

The file fills exactly what the flags fill: each key becomes its flag, in front of the
flags given on the command line, so the command line overrides the file, the values go
through the same parsing and checks, and every default stays where it is declared (the
frozen configs, through the flags). A command takes the keys it has and leaves the rest
(``ferry worker`` has no ``pools``); a key no command has is an error, and so are secrets
(``cluster-secret``, ``api-key``: their environment variables keep them out of files).
Booleans switch flags on (``aggregated: true``; ``overlap-scheduling: false`` gives
``--no-overlap-scheduling``), lists become repeated flags where a flag repeats
(``frontend``) and comma-joined values elsewhere (``kv-tiers``).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

SECRETS = {"cluster-secret": "FERRY_CLUSTER_SECRET", "api-key": "FERRY_API_KEY"}


class TopologyError(ValueError):
    """The file cannot be read as a topology (the message names the file and the key)."""


def section(parser: argparse.ArgumentParser, name: str, description: str = "") -> Any:
    """The option group ``name`` of ``parser`` (titled ``name: description`` in ``--help``),
    made on first use; its flags are the keys of the topology file's ``name`` section."""
    for group in parser._action_groups:
        if group.title and group.title.split(":")[0] == name:
            return group
    return parser.add_argument_group(f"{name}: {description}" if description else name)


def sections(parser: argparse.ArgumentParser) -> dict[str, dict[str, argparse.Action]]:
    """Section → key → the flag's action, for every option group made by ``section``."""
    found: dict[str, dict[str, argparse.Action]] = {}
    for group in parser._action_groups:
        if not group.title or group.title in ("options", "positional arguments"):
            continue
        name = group.title.split(":")[0]
        for action in group._group_actions:
            longs = [o for o in action.option_strings if o.startswith("--")]
            if longs:
                found.setdefault(name, {})[longs[0][2:]] = action
    return found


def read(path: str) -> dict[str, dict[str, Any]]:
    """The file's sections as plain data; ``TopologyError`` when it is not YAML of
    sections of keys."""
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise TopologyError(f"{path}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise TopologyError(f"{path}: not valid YAML: {_one_line(exc)}") from None
    data = data or {}
    if not isinstance(data, dict):
        raise TopologyError(f"{path}: expected sections (model:, pools:, ...) at the top")
    for name, keys in data.items():
        if not isinstance(keys, dict):
            raise TopologyError(f"{path}: section {name!r} must hold keys, not {keys!r}")
    return {str(name): {str(k).replace("_", "-"): v for k, v in keys.items()}
            for name, keys in data.items()}  # fmt: skip


def flags(path: str, command: argparse.ArgumentParser,
          others: list[argparse.ArgumentParser]) -> list[str]:  # fmt: skip
    """The file at ``path`` as ``command``'s flags. ``others``: the other commands that read
    topology files, whose keys ``command`` leaves alone."""
    mine = sections(command)
    known: dict[str, set[str]] = {}
    for parser in [command, *others]:
        for name, keys in sections(parser).items():
            known.setdefault(name, set()).update(keys)
    argv: list[str] = []
    for name, keys in read(path).items():
        if name not in known:
            raise TopologyError(f"{path}: unknown section {name!r}; the sections are "
                                f"{', '.join(sorted(known))}")  # fmt: skip
        for key, value in keys.items():
            if key in SECRETS:
                raise TopologyError(f"{path}: {name}.{key}: keep secrets out of files; give "
                                    f"${SECRETS[key]} instead")  # fmt: skip
            if key not in known[name]:
                raise TopologyError(f"{path}: section {name!r} has no key {key!r}; it has "
                                    f"{', '.join(sorted(known[name]))}")  # fmt: skip
            action = mine.get(name, {}).get(key)
            if action is not None and value is not None:
                argv += _as_flags(f"{path}: {name}.{key}", action, value)
    return argv


def _as_flags(where: str, action: argparse.Action, value: Any) -> list[str]:
    flag = next(o for o in action.option_strings if o.startswith("--"))
    if isinstance(action, argparse.BooleanOptionalAction):
        return [flag if _boolean(where, value) else f"--no-{flag[2:]}"]
    if action.nargs == 0:  # store_true
        return [flag] if _boolean(where, value) else []
    if isinstance(value, bool):
        raise TopologyError(f"{where}: expected a value, not {str(value).lower()}")
    if isinstance(action, argparse._AppendAction):
        items = value if isinstance(value, list) else [value]
        return [part for item in items for part in (flag, str(item))]
    if isinstance(value, list):
        value = ",".join(str(v) for v in value)
    if isinstance(value, dict):
        raise TopologyError(f"{where}: expected a value, not a mapping")
    return [flag, str(value)]


def _boolean(where: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TopologyError(f"{where}: expected true or false, not {value!r}")
    return value


def _one_line(exc: Exception) -> str:
    return " ".join(str(exc).split())
