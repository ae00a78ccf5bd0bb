"""Response ids: unique per server run and cheap (no syscall per request, unlike uuid4)."""

from __future__ import annotations

import itertools
import os

_prefix = os.urandom(6).hex()
_counter = itertools.count(1)


def next_id() -> str:
    return f"{_prefix}{next(_counter):010x}"
