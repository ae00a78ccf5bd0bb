"""What the routes need to keep jobs and responses: the store, the media store, and a
way to wake the job runner (a no-op in API server processes: the runner polls)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from omnistage import defaults
from omnistage.store.base import Store
from omnistage.store.media import MediaStore


def _nothing() -> None:
    pass


@dataclass
class Persistence:
    store: Store
    media: MediaStore
    media_ttl_s: float = defaults.MEDIA_TTL_S
    wake: Callable[[], None] = field(default=_nothing)
