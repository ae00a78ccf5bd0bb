"""Opening the store and the media store from the flags (a head or an API server process);
``head.jobs`` builds the job runner over them."""

from __future__ import annotations

import logging

from omnistage.jobs.state import Persistence
from omnistage.protocol.errors import OmniError
from omnistage.store.open import open_media, open_store

log = logging.getLogger(__name__)


class StoreUnavailable(OmniError):
    """The store or the media store could not be opened (a message naming the flag)."""


async def open_persistence(
    store_url: str | None, media_url: str | None, media_ttl_s: float
) -> Persistence:
    try:
        store = open_store(store_url)
        await store.start()
    except Exception as exc:
        raise StoreUnavailable(f"--store-url: cannot open the store: {exc}") from exc
    try:
        media = open_media(media_url)
    except Exception as exc:
        await store.close()
        raise StoreUnavailable(f"--media-url: cannot open the media store: {exc}") from exc
    return Persistence(store, media, media_ttl_s)
