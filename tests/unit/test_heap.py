"""Start-up's objects are kept out of the collector's full collections (omnistage.heap)."""

from __future__ import annotations

import gc
import weakref

from omnistage.heap import freeze_startup_objects, thaw


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def _tracked_ids() -> set[int]:
    return {id(o) for o in gc.get_objects()}


def test_freezing_takes_live_objects_out_of_collections_after_freeing_garbage() -> None:
    thaw()
    try:
        kept = [_Cycle() for _ in range(100)]
        garbage = _Cycle()
        dropped = weakref.ref(garbage)
        del garbage
        assert dropped() is not None  # a cycle: only a collection frees it
        freeze_startup_objects()
        assert dropped() is None  # collected first, not frozen
        assert gc.get_freeze_count() >= len(kept)
        # Frozen objects are in no generation: collections do not walk them.
        assert not {id(o) for o in kept} & _tracked_ids()
        later = _Cycle()  # made after start-up: collected as usual
        assert id(later) in _tracked_ids()
        thaw()
        assert gc.get_freeze_count() == 0
        assert {id(o) for o in kept} <= _tracked_ids()
    finally:
        thaw()
