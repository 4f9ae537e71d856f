"""What a worker role adds when it may be a rank of an expert-parallel group.

``GroupedRole`` is a ``WorkerRole`` (``engine.worker.shell``) whose engine steps go through
``engine_step``: a plain ``EngineCore.step`` for a worker of its own, or its group's round
(``engine.ep.group``) — called from ``step`` and ``tick`` alike, so that every rank takes
part in every round. It joins the group before the engine loads (``join_group``), keeps
the shell waiting only ``IDLE_WAIT_MS`` between an idle group's rounds, lets the shell
return on drain only once the whole group may (``stoppable``), names the group in its
ready message and sends its experts' load with its stats at most once a second.
``Shutdown`` stops every rank at the same round, once all have been told. A failed
collective ends the worker (``RoleStopped``); the frontend takes the rest of the group
down. The prefill and decode roles are grouped roles; the same loop runs them.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

from engine.ep.comm import GroupFailed
from engine.ep.experts import ExpertParallel
from engine.ep.group import ExpertGroup
from engine.messages import ExpertStats, RequestOutput
from engine.worker.config import WorkerConfig
from engine.worker.shell import HEARTBEAT_S, RoleStopped, WorkerRole

if TYPE_CHECKING:
    from engine.core import EngineCore


class GroupedRole(WorkerRole):
    core: EngineCore
    group: ExpertGroup | None = None
    _experts_sent = 0.0
    _stopping = False  # a frontend sent Shutdown: leave with the group

    def join_group(self, config: WorkerConfig) -> ExpertParallel | None:
        """Join the group ``config`` names, if any (or record the routing trace on this
        worker alone); returns the experts to hand to ``EngineCore``."""
        ep = config.engine.ep
        if config.group is None and not ep.routing_trace:
            return None
        parent = os.getppid()

        def orphaned() -> bool:  # the frontend that started it is gone: stop waiting
            return config.exit_with_parent and os.getppid() != parent

        self.group = ExpertGroup(config.group, ep, config.engine.device, config.name, orphaned)
        return self.group.experts

    def engine_step(self) -> list[RequestOutput]:
        """One engine step: the group's round (every rank, every iteration), or, alone,
        ``core.step()`` when there is work."""
        if self.group is None:
            return self.core.step() if self.core.has_work else []
        leaving = self._stopping or (self.draining and self.settled)
        try:
            return self.group.round(self.core, leaving)
        except GroupFailed as exc:
            raise RoleStopped(f"its expert-parallel group failed: {exc}") from None

    @property
    def group_busy(self) -> bool:
        """Another rank of the group ran something last round: keep stepping."""
        return self.group is not None and self.group.busy

    @property
    def stoppable(self) -> bool:
        if self.group is None or self.group.member is None:
            return self.settled
        return self.group.all_leaving

    def shutdown(self) -> bool:
        """Alone: stop at once. A rank: stop when every rank of the group has been told
        (the frontend tells them all), at the same round, so none waits for the others."""
        if self.group is None or self.group.member is None:
            return True
        self._stopping = True
        return False

    @property
    def wait_ms(self) -> int:
        if self.group is not None and self.group.member is not None:
            return self.group.wait_ms
        return super().wait_ms

    def group_ready(self) -> dict[str, Any]:
        """The ready message's fields about the group (none for a worker alone)."""
        group = self.group
        if group is None or group.member is None:
            return {}
        member = group.member
        return {"group": member.name, "rank": member.rank, "group_size": member.size,
                "startup": {"group": group.join_seconds}}  # fmt: skip

    def expert_stats(self) -> ExpertStats | None:
        """The experts' load, when a second has passed since it was last sent."""
        now = time.monotonic()
        if self.group is None or now - self._experts_sent < HEARTBEAT_S:
            return None
        self._experts_sent = now
        return self.group.stats()

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
