"""Entry of one replica process: ``python -m omnistage.replica --stage-id N -oma H -omp P``.

The head starts its local replicas this way; ``omnistage serve --headless`` runs the
same runtime in-process or through this entry for each of its replicas.
"""

from __future__ import annotations

import argparse
import json
import sys

from omnistage import aio, envs
from omnistage.logs import setup_logging
from omnistage.replica.runtime import ReplicaOptions, ReplicaRuntime


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m omnistage.replica")
    p.add_argument("--stage-id", type=int, required=True)
    p.add_argument("--replica-id", type=int, default=-1)
    p.add_argument("-oma", "--omni-master-address", required=True)
    p.add_argument("-omp", "--omni-master-port", type=int, required=True)
    p.add_argument("-ora", "--omni-replica-address", default=None)
    p.add_argument("--stage-init-timeout", type=float, default=300.0)
    p.add_argument("--stage-overrides", default=None, help="JSON fields for this stage")
    p.add_argument("--omni-replica-binds-sockets", action="store_true")
    p.add_argument("--drain-timeout", type=float, default=30.0)
    p.add_argument("--omni-auth-token", default=envs.auth_token())
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--omni-curve-keys", default=None)
    p.add_argument("--rejoin", action="store_true", help="register again when the head goes away")
    args = p.parse_args(argv)
    setup_logging(args.log_level)
    overrides = json.loads(args.stage_overrides) if args.stage_overrides else {}
    opts = ReplicaOptions(
        stage_id=args.stage_id,
        replica_id=args.replica_id,
        master_host=args.omni_master_address,
        master_port=args.omni_master_port,
        advertise_address=args.omni_replica_address,
        stage_init_timeout_s=args.stage_init_timeout,
        stage_overrides=overrides,
        binds_sockets=args.omni_replica_binds_sockets,
        drain_timeout_s=args.drain_timeout,
        auth_token=args.omni_auth_token,
        rejoin=args.rejoin,
        curve_keys=args.omni_curve_keys,
        local_key=envs.local_key(),
    )
    return aio.run(ReplicaRuntime(opts).run())


if __name__ == "__main__":
    sys.exit(main())
