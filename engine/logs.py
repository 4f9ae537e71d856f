"""How every ferry process logs: the frontend and each worker alike, as text or as JSON.

``configure(LogConfig, process)`` sets up the root logger of a process once: one handler
on stderr, the level, and the format — ``text`` (``TEXT_FORMAT``, for people) or
``json`` (one object per line: ``ts``, ``level``, ``logger``, ``process``, ``pid``,
``msg``, and ``request_id`` / ``exc`` / a record's own ``fields`` when it has them, for
log collectors). A worker's ``process`` names it (``prefill p0``) so that the lines of
several workers sharing one terminal can be told apart.

A line about one HTTP request names it: ``log.info(..., extra=about(request_id))`` puts
the request id (the one returned as ``x-request-id``) on the record; text lines show it
in brackets after the logger name, JSON lines as ``request_id``. ``extra=about(rid,
fields)`` adds structured fields that only the JSON format shows (the text message says
them already).

``announce(message, **fields)`` is for the few lines a person waits for (what runs where,
``serving ... on URL``): ``ferry: <message>`` on stdout as text, or a JSON line there.
A process that spawns workers hands them its settings (``child_environment``), so one
``--log-format json`` makes every process of a topology write JSON.

No log line holds prompt or generated text at the default level.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

from engine import envs

FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


@dataclass(frozen=True)
class LogConfig:
    """``level``: a logging level name (``debug``, ``info``, ...); ``format``: ``text`` or
    ``json``."""

    level: str = "info"
    format: str = "text"

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"log format is one of {FORMATS}, not {self.format!r}")
        if not isinstance(logging.getLevelName(self.level.upper()), int):
            raise ValueError(f"unknown log level {self.level!r}")

    @classmethod
    def from_environment(cls) -> LogConfig:
        """``$FERRY_LOG_LEVEL`` and ``$FERRY_LOG_FORMAT`` (what a spawned worker gets)."""
        return cls(envs.LOG_LEVEL.get().lower(), envs.LOG_FORMAT.get().lower())


_current = LogConfig()
_process = ""


def size(num_bytes: float) -> str:
    """``num_bytes`` for people: ``512 KB``, ``19.3 MB``, ``1.50 GB``."""
    if num_bytes >= 2**30:
        return f"{num_bytes / 2**30:.2f} GB"
    if num_bytes >= 2**20:
        return f"{num_bytes / 2**20:.1f} MB"
    return f"{num_bytes / 2**10:.0f} KB"


def about(request_id: str, fields: dict[str, Any] | None = None) -> dict[str, Any]:
    """``extra`` for a log call about the HTTP request ``request_id`` (empty: none)."""
    extra: dict[str, Any] = {"request_id": request_id} if request_id else {}
    if fields:
        extra["fields"] = fields
    return extra


class TextFormatter(logging.Formatter):
    """``TEXT_FORMAT``, with the process name before the logger's and the request id in
    brackets before the message."""

    def __init__(self, process: str = "") -> None:
        who = f"{process} " if process else ""
        super().__init__(TEXT_FORMAT.replace("%(name)s", who + "%(name)s"))

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 - logging's name
        request_id = getattr(record, "request_id", "")
        if request_id:
            record = logging.makeLogRecord(record.__dict__)
            record.message = f"[{request_id}] {record.message}"
        return super().formatMessage(record)


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line."""

    def __init__(self, process: str = "") -> None:
        super().__init__()
        self.process = process

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": _timestamp(record.created), "level": record.levelname,
            "logger": record.name, "process": self.process or "frontend", "pid": record.process,
            "msg": record.getMessage(),
        }  # fmt: skip
        request_id = getattr(record, "request_id", "")
        if request_id:
            line["request_id"] = request_id
        line.update(getattr(record, "fields", None) or {})
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def _timestamp(created: float) -> str:
    millis = int(created * 1000) % 1000
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(created)) + f".{millis:03d}Z"


def configure(config: LogConfig, process: str = "") -> None:
    """Make ``config`` this process's logging (replacing any handler set before);
    ``process``: how its lines name it (empty: the frontend)."""
    global _current, _process
    _current, _process = config, process
    formatter = JsonFormatter(process) if config.format == "json" else TextFormatter(process)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    for old in root.handlers[:]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(config.level.upper())
    logging.captureWarnings(True)  # warnings.warn goes through the same handler


def current() -> LogConfig:
    """The settings ``configure`` last made."""
    return _current


def child_environment() -> dict[str, str]:
    """What a spawned worker needs in its environment to log as this process does."""
    return {envs.LOG_LEVEL.name: _current.level, envs.LOG_FORMAT.name: _current.format}


def announce(message: str, level: str = "INFO", **fields: Any) -> None:
    """A line a person waits for, on stdout: ``ferry: <message>``, or with the JSON format
    a JSON line with ``level`` and ``fields``."""
    if _current.format == "json":
        line = {"ts": _timestamp(time.time()), "level": level, "logger": "ferry",
                "process": _process or "frontend", "pid": os.getpid(), "msg": message,
                **fields}  # fmt: skip
        print(json.dumps(line, default=str), flush=True)
    else:
        print(f"ferry: {message}", flush=True)
