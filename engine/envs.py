"""The one registry of environment variables ferry reads, all prefixed ``FERRY_``.

Behaviour belongs in frozen configs built from CLI flags; an environment variable is
only for secrets and debugging switches. Read them through ``EnvVar.get()``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")

_TRUE = {"1", "true", "yes", "on"}


@dataclass(frozen=True)
class EnvVar(Generic[T]):
    name: str
    kind: type
    default: T
    help: str

    def get(self) -> T:
        raw = os.environ.get(self.name)
        if raw is None or raw == "":
            return self.default
        if self.kind is bool:
            return raw.strip().lower() in _TRUE  # type: ignore[return-value]
        return self.kind(raw)  # type: ignore[return-value]


API_KEY: EnvVar[str | None] = EnvVar("FERRY_API_KEY", str, None, "API key clients must send")
DEBUG_INTEGRITY: EnvVar[bool] = EnvVar(
    "FERRY_DEBUG_INTEGRITY", bool, False, "check KV block bookkeeping whenever the engine idles"
)
CLUSTER_SECRET: EnvVar[str | None] = EnvVar(
    "FERRY_CLUSTER_SECRET", str, None,
    "the secret every frontend and worker of a deployment proves on the control plane",
)
LOG_LEVEL: EnvVar[str] = EnvVar("FERRY_LOG_LEVEL", str, "info", "log level of ferry's processes")
LOG_FORMAT: EnvVar[str] = EnvVar(
    "FERRY_LOG_FORMAT", str, "text", "log format of ferry's processes: text or json"
)
KV_DIR: EnvVar[str | None] = EnvVar(
    "FERRY_KV_DIR", str, None, "default of ferry serve --kv-dir (else ~/.cache/ferry/kv)"
)


def user_cache_dir() -> str:
    """The user's cache directory: ``$XDG_CACHE_HOME``, else ``~/.cache``."""
    return os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")


def cpu_kernels_dir() -> str:
    """Where the CPU kernels are built, once per user: ``ferry/kernels`` in the cache."""
    return os.path.join(user_cache_dir(), "ferry", "kernels")


REGISTRY = {
    v.name: v for v in (API_KEY, CLUSTER_SECRET, DEBUG_INTEGRITY, LOG_LEVEL, LOG_FORMAT, KV_DIR)
}
