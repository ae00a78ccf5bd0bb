"""A request's stages run again after a replica failed them (or refused them as BUSY).

The stages joined to the failed one by direct edges (``run.restart_group``) go with it,
as a new attempt, to other replicas, up to ``max_retries`` times per failed stage; a
final stage that fed them over a direct edge keeps running, and sends the new replicas
again what it kept (``run.redirects``): its text is the client's already. When it
cannot (its replica is gone too, or it kept nothing: ``refeed``), it runs again with
them, resuming after what the client has. A
BUSY refusal (replicas shared by several heads: full with other heads' requests) is not
a failure: it costs no retry, and the stage is dispatched again after a short pause, a
bounded number of times.
"""

from __future__ import annotations

import asyncio
import logging

from omnistage.dataplane.dispatch import Dispatcher
from omnistage.dataplane.run import Feeds, Run, redirects, restart_group
from omnistage.protocol.enums import Outcome
from omnistage.protocol.errors import (
    StageFailedError,
    StageOverloadedError,
    StageUnavailableError,
)
from omnistage.protocol.messages import Abort

log = logging.getLogger(__name__)

# A stage refused as BUSY is dispatched again after this pause, up to this many times
# per stage and request: a few heartbeats' worth.
BUSY_PAUSE_S = 0.02
MAX_BUSY = 200


class Failover:
    def __init__(self, dispatcher: Dispatcher, max_retries: int) -> None:
        # The dispatcher's pools, channels and observers (latency, traces) are ours too.
        self.dispatcher = dispatcher
        self.max_retries = max_retries
        self.retried_total = 0
        self.busy_total = 0  # dispatches a replica refused as full (several heads)

    def retry(self, run: Run, failed: int, reason: str, busy: bool = False) -> None:
        """Dispatch ``failed``'s part of ``run`` again, with every stage joined to it by
        a direct edge, as a new attempt; or fail the request. ``busy``: the replica
        refused it as full, which does not count against --omni-max-retries, and the
        dispatch waits a moment first."""
        st = run.progress(failed)
        if busy:
            st.busy += 1
            self.busy_total += 1
            if st.busy > MAX_BUSY:
                run.fail(StageOverloadedError(failed, self._name(failed), reason))
                return
        elif st.retries >= self.max_retries:
            detail = f"{reason}; gave up after {st.retries} retries (--omni-max-retries)"
            self.dispatcher.traces.stage_ended(run, failed, Outcome.REPLICA_LOST)
            run.fail(StageFailedError(failed, self._name(failed), detail))
            return
        if not busy:
            st.retries += 1
            self.retried_total += 1
        # A final stage that finished has delivered everything: it never runs again.
        group = restart_group(run, failed) - (run.finished & run.finals)
        feeds = redirects(run, group)
        for keeper in [up for up in feeds if not _alive(run, up)]:
            # Its replica is gone, and what it kept with it: it runs again too.
            del feeds[keeper]
            group |= _with_keeper(run, keeper)
        log.log(
            logging.DEBUG if busy else logging.INFO,
            "request %s: stage %d (%s) %s; retry %d of %d%s",
            run.request_id,
            failed,
            self._name(failed),
            reason,
            st.retries,
            self.max_retries,
            f" (with stage(s) {sorted(group - {failed})})" if len(group) > 1 else "",
        )
        self._again(run, group, feeds, failed, reason, busy)

    def refeed(self, run: Run, keeper: int, reason: str) -> None:
        """``keeper``'s replica kept nothing to feed the replicas that replaced its lost
        peers (it answered their Redirect so): it runs again with them, resuming after
        what the client has, as for a lost replica (no retry is spent: the lost peer's
        retry was)."""
        if run.progress(keeper).attempt == run.attempt:
            return  # already running again with them
        group = _with_keeper(run, keeper)
        log.info(
            "request %s: stage %d (%s): %s; it runs again (with stage(s) %s)",
            run.request_id,
            keeper,
            self._name(keeper),
            reason,
            sorted(group - {keeper}),
        )
        self._again(run, group, redirects(run, group), keeper, reason)

    def _again(
        self, run: Run, group: set[int], feeds: Feeds, failed: int, reason: str, busy: bool = False
    ) -> None:
        """Dispatch ``group`` again as a new attempt (``feeds``: keepers outside it that
        feed it again, see ``Dispatcher.send_group``)."""
        self._restart(run, group, failed)
        if not busy and self.dispatcher.try_acquire(run, group) is None:
            self.dispatcher.send_group(run, group, feeds)
            return
        pause = BUSY_PAUSE_S if busy else 0.0
        again = self._dispatch_again(run, group, feeds, failed, reason, pause)
        task = asyncio.get_running_loop().create_task(again)
        run.tasks.add(task)
        task.add_done_callback(run.tasks.discard)

    def _restart(self, run: Run, group: set[int], failed: int) -> None:
        """A new attempt of ``group``'s stages: each leaves its replica (aborted there
        unless finished) and waits for a new one."""
        d = self.dispatcher
        run.attempt += 1
        # Stages whose outputs the head did not see (a final stage's it saw, but its
        # tensors: those go to the peers again from its replica, see ``run.redirects``).
        hidden = {up for up, _ in run.direct if up not in run.finals}
        # A keeper's edges stay direct: the head never has its tensors to pass on.
        run.direct = {
            (u, d) for u, d in run.direct if u not in group and (d not in group or u in run.keepers)
        }
        run.keepers -= group
        for sid in group:
            handle = run.assigned.pop(sid, None)
            if handle is not None and sid not in run.finished:
                lost = Outcome.REPLICA_LOST if sid == failed else Outcome.RESTARTED
                d.traces.stage_ended(run, sid, lost)
                if handle.up:
                    d.channels.post(handle.identity, Abort(run.request_id))
                d.pools[sid].release(handle, run.request_id)
            run.finished.discard(sid)
            progress = run.progress(sid)
            progress.waiting = True
            d.latency.waiting(progress)
            if sid in hidden:
                progress.restart_hidden()

    async def _dispatch_again(
        self, run: Run, group: set[int], feeds: Feeds, failed: int, why: str, pause_s: float
    ) -> None:
        try:
            if pause_s:
                await asyncio.sleep(pause_s)
            await self.dispatcher.dispatch(run, group, feeds)
        except (StageUnavailableError, StageOverloadedError) as exc:
            # A retry that found no replica in time.
            run.fail(StageFailedError(failed, self._name(failed), f"{why}; retry: {exc}"))

    def _name(self, sid: int) -> str:
        return self.dispatcher.graph.stages[sid].name


def _alive(run: Run, keeper: int) -> bool:
    handle = run.assigned.get(keeper)
    return handle is not None and handle.up


def _with_keeper(run: Run, keeper: int) -> set[int]:
    """The stages that run again with a keeper that cannot feed them: it (finished or
    not: the client's text is skipped) and those it feeds, transitively; not another
    final stage that finished."""
    return restart_group(run, keeper) - ((run.finished & run.finals) - {keeper})
