"""One API server process of ``--api-server-count N``: ``python -m omnistage.api.server``.

Started by the head with its options in ``OMNISTAGE_API_SERVER_OPTIONS`` and the HTTP
listening socket inherited (every server accepts from the same socket). It serves the
same app as the head does with one server, over ``api.remote.RemoteService``.
"""

from __future__ import annotations

import logging
import socket
import sys

import uvicorn

from omnistage import aio, envs
from omnistage.api.app import create_app
from omnistage.api.media_parts import MediaFetch
from omnistage.api.remote import RemoteService
from omnistage.api.routes.realtime import RealtimeLimits
from omnistage.api.server_options import ApiServerOptions, decode_options
from omnistage.config.schema import DeployConfig
from omnistage.heap import freeze_startup_objects
from omnistage.jobs.setup import StoreUnavailable, open_persistence
from omnistage.logs import setup_logging
from omnistage.protocol.errors import ProtocolError

log = logging.getLogger(__name__)


async def serve(opts: ApiServerOptions) -> int:
    service = RemoteService(
        DeployConfig.model_validate(opts.config),
        opts.head_address,
        opts.index,
        opts.started_at,
        opts.refresh_s,
        opts.served_model_names,
    )
    try:
        await service.start()
    except TimeoutError:
        log.error("API server %d: no answer from the head at %s", opts.index, opts.head_address)
        return 1
    limits = RealtimeLimits(
        opts.realtime_max_sessions, opts.realtime_idle_timeout_s, opts.realtime_resume_ttl_s
    )
    # Jobs are created here and run by the head's runner, which polls the store.
    try:
        persist = await open_persistence(opts.store_url, opts.media_url, opts.media_ttl_s)
    except StoreUnavailable as exc:
        log.error("API server %d: %s", opts.index, exc)
        await service.close()
        return 1
    fetch = MediaFetch(
        opts.allowed_media_domains, opts.media_fetch_timeout_s, opts.media_fetch_max_bytes
    )
    app = create_app(service, opts.api_key, opts.max_request_bytes, limits, persist, fetch)
    service.my_responses = app.state.response_counts
    service.my_realtime = app.state.realtime_stats
    sock = socket.socket(fileno=opts.listen_fd)
    freeze_startup_objects()  # see omnistage.heap
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            log_level=opts.log_level.lower(),
            lifespan="off",
            access_log=False,
            proxy_headers=False,
        )
    )
    try:
        # uvicorn handles SIGTERM/SIGINT: stop accepting, finish what is in flight.
        await server.serve([sock])
    finally:
        await service.close()
        await persist.store.close()
    return 0


def main() -> int:
    blob = envs.api_server_options()
    if blob is None:
        print("python -m omnistage.api.server is started by the head", file=sys.stderr)
        return 2
    try:
        opts = decode_options(blob)
    except ProtocolError as exc:
        print(f"invalid OMNISTAGE_API_SERVER_OPTIONS: {exc}", file=sys.stderr)
        return 2
    setup_logging(opts.log_level)
    return aio.run(serve(opts))


if __name__ == "__main__":
    sys.exit(main())
