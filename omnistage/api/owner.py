"""Who owns a stored row: the API key that created it.

``--api-key`` takes one key or several, comma-separated (one per user or team). A job
or stored response is visible only to requests made with the key that created it. The
store keeps a fingerprint of the key (a SHA-256 prefix), never the key itself; without
``--api-key`` every row belongs to no one (``None``) and everyone sees it.
"""

from __future__ import annotations

import hashlib

from starlette.requests import HTTPConnection

OWNER = "owner"  # the scope state key the auth middleware fills


def split_keys(api_key: str | None) -> list[str]:
    """The keys ``--api-key`` names (comma-separated); [] for none."""
    if not api_key:
        return []
    return [k.strip() for k in api_key.split(",") if k.strip()]


def fingerprint(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:32]


def owner_of(conn: HTTPConnection) -> str | None:
    """The fingerprint of the key this request was made with (None without keys)."""
    state = conn.scope.get("state") or {}
    return state.get(OWNER)
