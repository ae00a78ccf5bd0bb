"""Entry of one replica process: ``python -m omnistage.replica``, started by a launcher with
its options in ``OMNISTAGE_REPLICA_OPTIONS`` (see ``replica.options``). Operators start
replicas with ``omnistage serve --headless`` instead."""

from __future__ import annotations

import sys

from omnistage import aio, envs, tracing
from omnistage.logs import setup_logging
from omnistage.protocol.errors import ProtocolError
from omnistage.replica import load_priority
from omnistage.replica.options import decode_options
from omnistage.replica.runtime import ReplicaRuntime


def main() -> int:
    blob = envs.replica_options()
    if blob is None:
        print(
            "python -m omnistage.replica is started by omnistage itself; "
            "run `omnistage serve --headless --stage-id N -oma HOST -omp PORT` instead",
            file=sys.stderr,
        )
        return 2
    try:
        opts = decode_options(blob)
    except ProtocolError as exc:
        print(f"invalid OMNISTAGE_REPLICA_OPTIONS: {exc}", file=sys.stderr)
        return 2
    setup_logging(opts.log_level)
    tracing.configure(opts.otlp_traces_endpoint, f"omnistage-replica-{opts.stage_id}")
    # Before any thread starts: those the load starts inherit the lower priority.
    niced = load_priority.lower_for_load(opts.load_nice)
    try:
        return aio.run(ReplicaRuntime(opts, load_niced=niced).run())
    finally:
        tracing.shutdown()  # export the last batch of spans


if __name__ == "__main__":
    sys.exit(main())
