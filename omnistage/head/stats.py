"""``--log-stats``: one log line per interval with throughput and replica counts."""

from __future__ import annotations

import asyncio
import logging

from omnistage.dataplane.orchestrator import Orchestrator
from omnistage.dataplane.stage_pool import StagePool

log = logging.getLogger(__name__)


def stats_line(orchestrator: Orchestrator, pools: dict[int, StagePool], rate: float) -> str:
    per_stage = ", ".join(
        f"{p.name}: {len(p.live())} up/{sum(r.in_flight for r in p.live())} busy"
        for p in pools.values()
    )
    return (
        f"stats: {rate:.1f} req/s, {orchestrator.in_flight} in flight, "
        f"{orchestrator.started_total} total; {per_stage}"
    )


async def log_stats(
    orchestrator: Orchestrator, pools: dict[int, StagePool], interval_s: float
) -> None:
    last = orchestrator.started_total
    while True:
        await asyncio.sleep(interval_s)
        total = orchestrator.started_total
        log.info("%s", stats_line(orchestrator, pools, (total - last) / interval_s))
        last = total
