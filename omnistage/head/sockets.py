"""The head's sockets: the ZMQ context (CURVE-secured when asked), the three control
routers (master, handshake, coordinator) and the data channels, bound at construction so
every address is known before any handler or replica exists."""

from __future__ import annotations

import logging

import zmq

from omnistage import curve
from omnistage.control.master import HeadAddresses
from omnistage.control.plane import bind_router
from omnistage.dataplane.channels import DataChannels
from omnistage.head.options import HeadOptions
from omnistage.net import is_loopback, tcp_url

log = logging.getLogger(__name__)


class HeadSockets:
    def __init__(self, opts: HeadOptions) -> None:
        self.ctx = zmq.Context()
        # CURVE goes on the context before any socket exists (see omnistage.curve).
        self._zauth = curve.secure_head(self.ctx, opts.curve_keys) if opts.curve_keys else None
        host = opts.master_host
        if not (opts.auth_token or opts.curve_keys) and not is_loopback(host):
            log.warning(
                "the control plane listens on %s without --omni-auth-token or "
                "--omni-curve-keys: anyone who can reach it can register replicas or "
                "forge heartbeats",
                host,
            )
        self.master, self.master_url = bind_router(self.ctx, tcp_url(host, opts.master_port))
        self.handshake, handshake_url = bind_router(self.ctx, tcp_url(host, 0))
        self.coordinator, coordinator_url = bind_router(self.ctx, tcp_url(host, 0))
        self.channels = DataChannels(self.ctx, host)
        self.addresses = HeadAddresses(
            handshake=handshake_url,
            input=self.channels.input_url,
            output=self.channels.output_url,
            coordinator=coordinator_url,
        )

    @property
    def master_port(self) -> int:
        return int(self.master_url.rsplit(":", 1)[1])

    def close(self) -> None:
        """After the control plane (which owns the routers) and the channels stopped, or
        before they started (a store that cannot open): sockets still open are closed
        unsent, else ``term`` would wait for them forever."""
        if self._zauth is not None:
            self._zauth.stop()
        self.ctx.destroy(linger=0)
