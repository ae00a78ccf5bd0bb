"""Opening the store for a --store-url and the media store for a --media-url.

The defaults put a SQLite file and a media directory in omnistage's cache directory. The
SQL side (SQLAlchemy, Alembic) is imported only when a store is opened: importing
``records`` or this module stays cheap.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from omnistage import defaults, envs

if TYPE_CHECKING:
    from omnistage.store.base import Store
    from omnistage.store.media import MediaStore


def default_store_url() -> str:
    return "sqlite:///" + os.path.join(envs.cache_dir(), defaults.STORE_FILE)


def default_media_url() -> str:
    return os.path.join(envs.cache_dir(), defaults.MEDIA_DIR)


def open_store(url: str | None = None) -> Store:
    """The store at ``url`` (default: OMNISTAGE_STORE_URL, else ``default_store_url()``,
    for heads built in-process as for the CLI), not yet started. Raises ConfigError
    naming --store-url for a URL it cannot serve."""
    from omnistage.store.sql import SqlStore

    return SqlStore(url or envs.store_url() or default_store_url())


def open_media(url: str | None = None) -> MediaStore:
    """The media store at ``url`` (default: OMNISTAGE_MEDIA_URL, else
    ``default_media_url()``)."""
    from omnistage.store.media import MediaStore

    return MediaStore(url or envs.media_url() or default_media_url())
