"""SlotTable: which (stage, replica) slot a registration gets, and its epoch."""

from __future__ import annotations

import pytest

from omnistage.control.slots import SlotTable
from omnistage.protocol.errors import IdConflict, RegistrationError
from omnistage.protocol.registration import AUTO_ASSIGN_REPLICA_ID, RegisterRequest


def auto(stage_id: int = 0) -> RegisterRequest:
    return RegisterRequest(stage_id=stage_id, replica_id=AUTO_ASSIGN_REPLICA_ID)


def test_seed_default_replica_id_is_zero_when_absent():
    assert RegisterRequest(stage_id=1).replica_id == 0
    assert AUTO_ASSIGN_REPLICA_ID == -1


def test_request_without_replica_id_fills_slot_zero():
    table = SlotTable([1], preallocated={1: 2})
    slot = table.register(RegisterRequest(stage_id=1))
    assert (slot.stage_id, slot.replica_id, slot.filled) == (1, 0, True)


def test_auto_assign_fills_lowest_preallocated_slot_then_new_ids():
    table = SlotTable([0], preallocated={0: 3})
    ids = [table.register(auto()).replica_id for _ in range(5)]
    assert ids == [0, 1, 2, 3, 4]


def test_auto_assign_skips_slots_already_filled_explicitly():
    table = SlotTable([0], preallocated={0: 3})
    table.register(RegisterRequest(stage_id=0, replica_id=0))
    table.register(RegisterRequest(stage_id=0, replica_id=2))
    assert table.register(auto()).replica_id == 1
    assert table.register(auto()).replica_id == 3


def test_auto_assign_never_takes_head_local_slot_before_head_registers():
    table = SlotTable([0], preallocated={0: 3}, head_local={0: [0]})
    slot0 = table.get(0, 0)
    assert slot0 is not None and slot0.head_local and not slot0.filled
    ids = [table.register(auto()).replica_id for _ in range(3)]
    assert ids == [1, 2, 3]
    assert not table.get(0, 0).filled
    # The head's own replica then takes its reserved slot.
    assert table.register(RegisterRequest(stage_id=0, replica_id=0)).replica_id == 0


def test_head_local_slot_beyond_preallocated_is_reserved_too():
    table = SlotTable([0], preallocated={0: 1}, head_local={0: [1]})
    ids = [table.register(auto()).replica_id for _ in range(3)]
    assert ids == [0, 2, 3]


def test_auto_assign_is_per_stage():
    table = SlotTable([0, 1], preallocated={0: 1, 1: 1})
    assert table.register(auto(0)).replica_id == 0
    assert table.register(auto(0)).replica_id == 1
    assert table.register(auto(1)).replica_id == 0


def test_twenty_auto_assign_registrations_get_distinct_ids():
    table = SlotTable([0], preallocated={0: 2}, head_local={0: [0]})
    ids = [table.register(auto()).replica_id for _ in range(20)]
    assert len(set(ids)) == 20
    assert 0 not in ids


def test_explicit_registration_is_idempotent_and_bumps_epoch():
    table = SlotTable([0], preallocated={0: 1})
    first = table.register(RegisterRequest(stage_id=0, replica_id=4))
    epoch1 = first.epoch
    second = table.register(RegisterRequest(stage_id=0, replica_id=4))
    assert second is first
    assert (second.stage_id, second.replica_id) == (0, 4)
    assert second.epoch > epoch1
    assert [s.replica_id for s in table.slots()] == [0, 4]


def test_epoch_is_global_and_strictly_increasing():
    table = SlotTable([0, 1])
    epochs = [
        table.register(RegisterRequest(stage_id=0, replica_id=0)).epoch,
        table.register(RegisterRequest(stage_id=1, replica_id=0)).epoch,
        table.register(RegisterRequest(stage_id=0, replica_id=0)).epoch,
    ]
    assert epochs == [1, 2, 3]


def test_is_current_only_for_latest_epoch():
    table = SlotTable([0])
    old = table.register(RegisterRequest(stage_id=0, replica_id=1)).epoch
    new = table.register(RegisterRequest(stage_id=0, replica_id=1)).epoch
    assert table.is_current(0, 1, new)
    assert not table.is_current(0, 1, old)
    assert not table.is_current(0, 2, new)  # no such slot
    assert not table.is_current(1, 1, new)  # no such stage


def test_is_current_false_for_unfilled_preallocated_slot():
    table = SlotTable([0], preallocated={0: 1})
    assert not table.is_current(0, 0, 0)


def test_unknown_stage_raises_registration_error_naming_it():
    table = SlotTable([0, 1])
    with pytest.raises(RegistrationError) as info:
        table.register(RegisterRequest(stage_id=7))
    assert "7" in str(info.value)
    assert "0, 1" in str(info.value)  # lists the stages the head serves


def test_binds_sockets_with_missing_ports_raises_registration_error():
    table = SlotTable([0])
    req = RegisterRequest(
        stage_id=0,
        replica_id=0,
        replica_binds_sockets=True,
        replica_bind_address="10.0.0.2",
        replica_handshake_port=6000,
        replica_input_port=None,
        replica_output_port=6002,
    )
    with pytest.raises(RegistrationError) as info:
        table.register(req)
    assert "replica_input_port" in str(info.value)
    assert not table.is_current(0, 0, 1)


def test_binds_sockets_with_out_of_range_port_raises_registration_error():
    table = SlotTable([0])
    req = RegisterRequest(
        stage_id=0,
        replica_binds_sockets=True,
        replica_bind_address="10.0.0.2",
        replica_handshake_port=6000,
        replica_input_port=6001,
        replica_output_port=70000,
    )
    with pytest.raises(RegistrationError):
        table.register(req)


def test_binds_sockets_records_ports_and_address():
    table = SlotTable([0])
    slot = table.register(
        RegisterRequest(
            stage_id=0,
            replica_binds_sockets=True,
            replica_bind_address="10.0.0.2",
            replica_handshake_port=6000,
            replica_input_port=6001,
            replica_output_port=6002,
            coordinator_input="tcp://h:1",
        )
    )
    assert slot.binds_sockets is True
    assert slot.replica_ports == (6000, 6001, 6002)
    assert slot.bind_address == "10.0.0.2"
    assert slot.coordinator_addresses["coordinator_input"] == "tcp://h:1"


def test_binds_sockets_without_bind_address_is_treated_as_not_binding():
    table = SlotTable([0])
    slot = table.register(RegisterRequest(stage_id=0, replica_binds_sockets=True))
    assert slot.binds_sockets is False
    assert slot.replica_ports is None


def test_negative_preallocated_count_is_rejected():
    with pytest.raises(ValueError):
        SlotTable([0], preallocated={0: -1})


def test_refused_registration_leaves_no_slot_behind():
    table = SlotTable([0], preallocated={0: 1})
    table.register(RegisterRequest(stage_id=0, replica_id=0))
    bad = RegisterRequest(
        stage_id=0,
        replica_id=5,
        replica_binds_sockets=True,
        replica_bind_address="10.0.0.2",
    )
    with pytest.raises(RegistrationError):
        table.register(bad)
    assert table.get(0, 5) is None
    assert table.register(auto()).replica_id == 1


def _req(stage_id: int, replica_id: int = -1, **extra: object) -> RegisterRequest:
    return RegisterRequest(stage_id=stage_id, replica_id=replica_id, **extra)  # type: ignore[arg-type]


def test_a_head_local_slot_needs_the_local_key_when_the_head_has_one():
    table = SlotTable([0], preallocated={0: 1}, head_local={0: [0]}, local_key="k")
    with pytest.raises(RegistrationError, match="reserved for the head's own replica"):
        table.register(_req(0, 0))
    with pytest.raises(RegistrationError):
        table.register(_req(0, 0, local_key="wrong"))
    assert table.register(_req(0, 0, local_key="k")).replica_id == 0


def test_a_released_slot_is_reused_by_auto_assign_but_not_after_a_newer_registration():
    table = SlotTable([0])
    a, b = table.register(_req(0)), table.register(_req(0))
    assert (a.replica_id, b.replica_id) == (0, 1)
    table.release(0, a.replica_id, a.epoch)
    assert table.register(_req(0)).replica_id == 0  # the lowest free id again
    stale_epoch = b.epoch
    b2 = table.register(_req(0, 1))  # replica 1 re-registered
    table.release(0, 1, stale_epoch)  # news about its old incarnation: ignored
    assert table.get(0, 1).filled and table.get(0, 1).epoch == b2.epoch
    assert table.register(_req(0)).replica_id == 2


def test_rejoining_the_same_head_instance_gets_the_old_id_back():
    table = SlotTable([0], instance="head-a")
    first = table.register(_req(0))
    first_id, first_epoch = first.replica_id, first.epoch  # the Slot is updated in place
    table.register(_req(0))
    again = table.register(_req(0, previous_head="head-a", previous_replica_id=first_id))
    assert again.replica_id == first_id and again.epoch > first_epoch
    other = table.register(_req(0, previous_head="head-b", previous_replica_id=0))
    assert other.replica_id == 2  # another head's id means nothing here


def _scan_for_auto_id(table: SlotTable, stage_id: int) -> int:
    """The seed's rule by brute force: the lowest vacant slot (not filled, not the
    head's), else the lowest id no slot has."""
    slots = {s.replica_id: s for s in table.slots() if s.stage_id == stage_id}
    for rid in sorted(slots):
        if not slots[rid].filled and not slots[rid].head_local:
            return rid
    rid = 0
    while rid in slots:
        rid += 1
    return rid


@pytest.mark.parametrize("seed", range(20))
def test_auto_assignment_follows_the_rule_through_any_history(seed: int) -> None:
    # The table finds the id without scanning its slots; it must agree with a scan after
    # any mix of registrations, explicit ids, releases and the head's reservations.
    import random

    rng = random.Random(seed)
    table = SlotTable([0, 1], preallocated={0: 3}, head_local={0: [1]})
    for _ in range(400):
        sid = rng.choice([0, 1])
        op = rng.random()
        filled = [s for s in table.slots() if s.stage_id == sid and s.filled]
        if op < 0.45:
            expected = _scan_for_auto_id(table, sid)
            assert table.register(auto(sid)).replica_id == expected
        elif op < 0.55:
            rid = rng.randrange(12)
            slot = table.get(sid, rid)
            if slot is None or not slot.head_local:
                table.register(RegisterRequest(stage_id=sid, replica_id=rid))
        elif op < 0.85 and filled:
            slot = rng.choice(filled)
            table.release(sid, slot.replica_id, slot.epoch)
        elif op < 0.93:
            table.reserve_local(sid, taken=set())
        else:
            local = [s for s in table.slots() if s.stage_id == sid and s.head_local]
            if local:
                table.unreserve(sid, rng.choice(local).replica_id)


# -- a fleet of heads: ids another head assigned -------------------------------------------


def fleet_id(rid: int, instance: str, stage_id: int = 0) -> RegisterRequest:
    """A replica asking a head for the id another head of the fleet gave it."""
    return RegisterRequest(
        stage_id=stage_id, replica_id=rid, replica_instance=instance, assigned_id=True
    )


def test_an_assigned_id_held_by_another_live_replica_is_refused_naming_the_holder():
    table = SlotTable([0])
    table.register(RegisterRequest(stage_id=0, replica_id=-1, replica_instance="b"))
    with pytest.raises(IdConflict) as err:
        table.register(fleet_id(0, "a"))
    assert err.value.held_by == "b" and "held here by another live replica" in str(err.value)
    assert table.get(0, 0).instance == "b"  # untouched


def test_an_assigned_id_is_taken_when_free_released_or_held_by_the_same_replica():
    table = SlotTable([0])
    assert table.register(fleet_id(3, "a")).replica_id == 3  # free
    assert table.register(fleet_id(3, "a")).replica_id == 3  # the same replica again
    slot = table.register(RegisterRequest(stage_id=0, replica_id=-1, replica_instance="b"))
    table.release(0, slot.replica_id, slot.epoch)  # b left: its id is free
    assert table.register(fleet_id(slot.replica_id, "c")).instance == "c"


def test_an_operators_explicit_id_held_by_a_live_replica_is_refused_until_it_is_fenced():
    table = SlotTable([0])
    epoch = table.register(RegisterRequest(stage_id=0, replica_id=2, replica_instance="old")).epoch
    # A second process started with --replica-id 2 while the first may still run.
    with pytest.raises(IdConflict) as err:
        table.register(RegisterRequest(stage_id=0, replica_id=2, replica_instance="new"))
    assert err.value.held_by == "old" and table.get(0, 2).instance == "old"
    table.fence(0, 2, epoch - 1)  # an older incarnation's death proves nothing
    with pytest.raises(IdConflict):
        table.register(RegisterRequest(stage_id=0, replica_id=2, replica_instance="new"))
    table.fence(0, 2, epoch)  # the coordinator saw it die (ERROR)
    slot = table.register(RegisterRequest(stage_id=0, replica_id=2, replica_instance="new"))
    assert slot.instance == "new" and slot.epoch > epoch and not slot.fenced


def test_the_same_process_a_seed_client_and_the_heads_own_replica_keep_the_seeds_rule():
    table = SlotTable([0], head_local={0: [0]}, local_key="k")
    first = table.register(RegisterRequest(stage_id=0, replica_id=1, replica_instance="a")).epoch
    again = table.register(RegisterRequest(stage_id=0, replica_id=1, replica_instance="a"))
    assert (again.replica_id, again.instance) == (1, "a") and again.epoch > first
    # A seed client names no process: it takes the slot over, as in the seed.
    assert table.register(RegisterRequest(stage_id=0, replica_id=1)).instance is None
    # The head restarts its own replicas itself: a new process keeps the slot.
    own = RegisterRequest(stage_id=0, replica_id=0, replica_instance="p1", local_key="k")
    table.register(own)
    restarted = RegisterRequest(stage_id=0, replica_id=0, replica_instance="p2", local_key="k")
    assert table.register(restarted).instance == "p2"


def test_an_assigned_id_a_head_keeps_for_its_own_replica_is_a_conflict_with_no_holder():
    table = SlotTable([0], head_local={0: [0]}, local_key="k")
    with pytest.raises(IdConflict) as err:
        table.register(fleet_id(0, "a"))
    assert err.value.held_by == ""


def test_held_names_the_slot_a_replica_process_holds_until_it_is_released():
    table = SlotTable([0, 1])
    first = table.register(RegisterRequest(stage_id=0, replica_id=-1, replica_instance="a"))
    assert table.held(0, "a") is first and table.held(1, "a") is None
    assert table.held(0, None) is None and table.held(0, "zz") is None
    # Registering again for a new id while the old slot is still filled: a new id.
    again = table.register(RegisterRequest(stage_id=0, replica_id=-1, replica_instance="a"))
    assert again.replica_id != first.replica_id and table.held(0, "a") is again
    table.release(0, again.replica_id, again.epoch)
    assert table.held(0, "a") is None
