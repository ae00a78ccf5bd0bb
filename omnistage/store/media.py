"""``MediaStore``: the bytes of generated media (videos, images), by key, over fsspec.

A local directory by default; any fsspec URL otherwise (``s3://bucket/prefix`` with s3fs
installed, ``memory://`` in tests). Keys are relative paths chosen by the server
(``videos/<id>.mp4``); one that could leave the root (``..``, absolute) is refused.

A local write goes to a temporary file beside its final name and is renamed into place,
so a crash never leaves half a file under a key: a reader sees all of it or nothing.
(Object stores replace an object whole on their own.) Calls block, so they run in a
worker thread.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from omnistage.protocol.errors import ConfigError


def check_key(key: str) -> str:
    """``key`` if it is a relative path that stays under the root, else ValueError."""
    parts = key.replace("\\", "/").split("/")
    if (
        not key
        or "\0" in key
        or key.startswith(("/", "\\"))
        or (len(key) > 1 and key[1] == ":")  # C:... on Windows
        or any(part in ("", ".", "..") for part in parts)
    ):
        raise ValueError(f"invalid media key {key!r}: a relative path without '..'")
    return key


def _open_fs(url: str) -> tuple[Any, str]:
    """The filesystem and the root path in it for --media-url ``url``."""
    if "://" not in url or url.startswith("file://"):
        path = url.removeprefix("file://")
        return LocalFileSystem(), os.path.abspath(os.path.expanduser(path))
    try:
        fs, root = fsspec.core.url_to_fs(url)
    except ImportError as e:
        protocol = url.split("://", 1)[0]
        raise ConfigError(
            "--media-url", f"{url}: the {protocol}:// protocol needs a package: {e}"
        ) from None
    except ValueError as e:  # an unknown protocol
        raise ConfigError("--media-url", f"{url}: {e}") from None
    return fs, root.rstrip("/")


class MediaStore:
    def __init__(self, url: str) -> None:
        self.url = url
        self._fs, self._root = _open_fs(url)
        self._local = isinstance(self._fs, LocalFileSystem)

    def _path(self, key: str) -> str:
        return f"{self._root}/{check_key(key)}"

    async def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        await asyncio.to_thread(self._put_local if self._local else self._fs.pipe_file, path, data)

    @staticmethod
    def _put_local(path: str, data: bytes) -> None:
        folder, name = os.path.split(path)
        os.makedirs(folder, exist_ok=True)
        # Hidden and unique: never taken for a key, and two writers of one key do not
        # write into each other's file (the last rename wins, whole).
        fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=folder)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise

    async def get(self, key: str) -> bytes | None:
        path = self._path(key)
        try:
            return await asyncio.to_thread(self._fs.cat_file, path)
        except FileNotFoundError:
            return None

    async def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            await asyncio.to_thread(self._fs.rm_file, path)
        except FileNotFoundError:
            pass

    async def size(self, key: str) -> int | None:
        path = self._path(key)
        try:
            return int(await asyncio.to_thread(self._fs.size, path))
        except FileNotFoundError:
            return None
