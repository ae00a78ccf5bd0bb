"""Registration (replica DEALER -> master ROUTER): one msgpack *map* each way with the
seed's keys, so a client written against vLLM-Omni's ``register_stage_with_omni_master``
registers unchanged. Unknown keys are ignored for forward compatibility.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from omnistage.protocol.messages import PROTOCOL_VERSION

# Registration sentinel: any negative replica id asks the master to pick one.
AUTO_ASSIGN_REPLICA_ID = -1

StageId = Annotated[int, msgspec.Meta(ge=0)]


class RegisterRequest(msgspec.Struct, omit_defaults=True):
    stage_id: StageId
    # The seed defaults a missing replica_id to 0 (a pre-allocated slot).
    replica_id: int = 0
    stage_config: Any = None
    coordinator_input: str | None = None
    coordinator_output: str | None = None
    frontend_stats_publish_address: str | None = None
    replica_bind_address: str | None = None
    replica_handshake_port: int | None = None
    replica_input_port: int | None = None
    replica_output_port: int | None = None
    replica_binds_sockets: bool | None = None
    # Absent in seed clients, which the head accepts: this map keeps the seed's keys.
    protocol_version: int | None = None
    # A replica rejoining after losing its head: the head instance and replica id it
    # had. A head that is that same instance gives the replica its old id back.
    previous_head: str | None = None
    previous_replica_id: int | None = None
    # The head's secret for its own local replicas (from their environment): only a
    # registration carrying it may fill a head-local slot.
    local_key: str | None = None
    # Our replicas' own extensions for a fleet of heads. ``replica_instance``: random per
    # replica process, so a head tells replicas apart and sees one registering again
    # under a new id (its old slot is then let go at once). ``assigned_id``: the
    # replica_id was assigned by another head of the fleet, not given by the operator:
    # a head refuses it while another live replica holds that id here (``ErrorReply.
    # held_by``), where the seed's rule (an explicit id takes the slot over) would let
    # two replicas share one id.
    replica_instance: str | None = None
    assigned_id: bool | None = None
    # An auto-assign registration that can follow a ``RegisterRedirect``: in a fleet,
    # only one head hands out ids (``FleetView.id_owner``), so that two replicas
    # registering at once through two heads never get the same one. Seed clients never
    # send it and are never redirected.
    follows_redirect: bool | None = None


class RegisterReply(msgspec.Struct):
    handshake_address: str
    input_address: str
    output_address: str
    replica_id: int
    coordinator_router_address: str | None
    # Extensions; seed clients ignore unknown keys.
    stage_id: int = 0
    epoch: int = 0
    protocol_version: int = PROTOCOL_VERSION
    # Changes every time a head starts: lets a rejoining replica ask for its old id.
    head_instance: str = ""


class RegisterRedirect(msgspec.Struct):
    """The answer to a ``follows_redirect`` registration at a head of a fleet that does
    not hand out ids: register at ``redirect`` (that head's master URL) for an id, then
    here with it (``assigned_id``)."""

    redirect: str
    head_instance: str = ""


class ErrorReply(msgspec.Struct, omit_defaults=True):
    error: str
    # A refused ``assigned_id``: the instance of the replica holding that id here, or ""
    # when the head keeps the id for a replica of its own.
    held_by: str | None = None
