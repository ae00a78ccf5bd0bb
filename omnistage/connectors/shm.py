"""The ``shm`` connector: tensor bytes in shared memory, for two replicas on one host.

A sending replica keeps one ring per receiving replica: a file in /dev/shm it writes each
payload into once; only a ``PayloadRef`` (name, offset, length) travels on the data plane.
The receiver maps the ring on the first ref, copies each payload out as its chunk arrives
and marks the space free (the ring's header holds how far it has read). Chunks of one
peer connection arrive in the order they were written, so one counter is all the state
the two sides share. A payload that does not fit (or a full ring: a receiver that stopped
reading) goes inline on the data plane instead, so nothing waits and nothing is lost.

Cleanup, with no one to coordinate it: each side holds a POSIX lock on one byte of the
ring's header while it lives (the kernel drops it when the process dies, SIGKILL
included). The receiver unlinks the name as soon as it has mapped the ring, so the memory
goes with the last of the two mappings. Each side's ``prune`` drops the ring once the
other side's lock is free (it died); a name left by a sender that died before any receiver
mapped it is swept by the next replica on the host to start a shm connector.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import secrets
import struct
from typing import Any

import msgspec

from omnistage.connectors.base import ConnectorError
from omnistage.protocol.messages import OutputChunk, PayloadRef

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
PREFIX = "omnistage-ring-"
# A ring is made under a name the sweep skips, then renamed once its owner holds its lock.
_MAKING = ".omnistage-making-"
_HEADER = 64  # bytes before the data: [0:8) read up to (virtual offset), [8:16) mapped
_U64 = struct.Struct("<Q")
_READ_AT, _MAPPED_AT = 0, 8
# The header byte each side keeps locked while it lives.
_SENDER_BYTE, _RECEIVER_BYTE = 0, 1
DEFAULT_SEGMENT_BYTES = 64 * 1024 * 1024

_swept = False


def host_key() -> str:
    """Which shared memory this process sees: the boot and the /dev/shm mount. Two
    replicas with the same key can open each other's rings; "" when there is none."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        st = os.stat(SHM_DIR)
    except OSError:
        return ""
    return f"{boot}:{st.st_dev}:{st.st_ino}"


def _lock(fd: int, byte: int) -> bool:
    """Take the lock on header ``byte``; False when another process holds it."""
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, byte)
    except OSError:
        return False
    return True


def _holder_gone(fd: int, byte: int) -> bool:
    """Whether nobody holds header ``byte`` (its holder died). Only for a byte this
    process does not hold itself: a process never conflicts with its own locks."""
    if not _lock(fd, byte):
        return False
    fcntl.lockf(fd, fcntl.LOCK_UN, 1, byte)
    return True


class _Ring:
    """The sending side of one ring."""

    def __init__(self, size: int) -> None:
        self.name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
        making = os.path.join(SHM_DIR, f"{_MAKING}{self.name}")
        fd = os.open(making, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            _lock(fd, _SENDER_BYTE)
            os.ftruncate(fd, _HEADER + size)
            self.mm = mmap.mmap(fd, _HEADER + size)
            os.rename(making, os.path.join(SHM_DIR, self.name))
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(making)
            raise
        self.fd, self.size = fd, size
        self.head = 0  # virtual offset of the next write

    def put(self, data: bytes) -> int | None:
        """Write ``data``; its virtual offset, or None when it does not fit now."""
        n, size = len(data), self.size
        if n > size:
            return None
        start = self.head
        at = start % size
        if at + n > size:  # never split a payload: skip the ring's tail
            start += size - at
            at = 0
        if start + n - _U64.unpack_from(self.mm, _READ_AT)[0] > size:
            return None
        self.mm[_HEADER + at : _HEADER + at + n] = data
        self.head = start + n
        return start

    def receiver_gone(self) -> bool:
        mapped = _U64.unpack_from(self.mm, _MAPPED_AT)[0]
        return bool(mapped) and _holder_gone(self.fd, _RECEIVER_BYTE)

    def close(self) -> None:
        self.mm.close()
        os.close(self.fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(SHM_DIR, self.name))  # no receiver ever mapped it


class _Mapped:
    """The receiving side of one ring."""

    def __init__(self, key: str) -> None:
        if not key.startswith(PREFIX) or "/" in key or "\0" in key:
            raise ConnectorError(f"not a ring name: {key!r}")
        path = os.path.join(SHM_DIR, key)
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as exc:
            raise ConnectorError(f"cannot open ring {key}: {exc}") from None
        try:
            _lock(fd, _RECEIVER_BYTE)
            self.mm = mmap.mmap(fd, 0)
        except BaseException:
            os.close(fd)
            raise
        self.fd, self.size = fd, len(self.mm) - _HEADER
        _U64.pack_into(self.mm, _MAPPED_AT, 1)
        # Both sides hold it now: the name is no longer needed, and the memory goes with
        # the last mapping, however either side ends.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)

    def take(self, ref: PayloadRef) -> bytes:
        n = ref.nbytes
        at = ref.offset % self.size if self.size > 0 else 0
        if n < 0 or ref.offset < 0 or at + n > self.size:
            raise ConnectorError(f"ref outside ring {ref.key}: {ref.offset}+{n}")
        data = self.mm[_HEADER + at : _HEADER + at + n]
        _U64.pack_into(self.mm, _READ_AT, ref.offset + n)
        return data

    def sender_gone(self) -> bool:
        return _holder_gone(self.fd, _SENDER_BYTE)

    def close(self) -> None:
        self.mm.close()
        os.close(self.fd)


class ShmConnector:
    name = "shm"
    same_host_only = True

    def __init__(self) -> None:
        global _swept
        if not _swept:
            _swept = True
            sweep()
        self._rings: dict[str, _Ring] = {}  # peer address -> ring we write
        self._mapped: dict[str, _Mapped] = {}  # ring name -> ring we read
        self._full = 0  # payloads sent inline because they did not fit

    def send(self, peer: str, chunk: OutputChunk, options: dict[str, Any]) -> OutputChunk | None:
        ring = self._rings.get(peer)
        if ring is None:
            size = int(options.get("segment_bytes", DEFAULT_SEGMENT_BYTES))
            try:
                ring = self._rings[peer] = _Ring(size)
            except OSError as exc:
                log.warning("cannot make a shared-memory ring (%s); tensors go inline", exc)
                return None
        offset = ring.put(chunk.data)
        if offset is None:
            self._full += 1
            if self._full in (1, 100) or self._full % 10_000 == 0:
                log.warning(
                    "shared-memory ring to %s full or payload of %d bytes too large: "
                    "sent inline (%d so far)",
                    peer,
                    len(chunk.data),
                    self._full,
                )
            return None
        ref = PayloadRef(self.name, ring.name, offset, len(chunk.data))
        return msgspec.structs.replace(chunk, data=b"", ref=ref)

    def receive(self, ref: PayloadRef) -> bytes:
        mapped = self._mapped.get(ref.key)
        if mapped is None:
            mapped = self._mapped[ref.key] = _Mapped(ref.key)
        return mapped.take(ref)

    def forget_peer(self, peer: str) -> None:
        ring = self._rings.pop(peer, None)
        if ring is not None:
            ring.close()

    def prune(self) -> None:
        for peer, ring in list(self._rings.items()):
            if ring.receiver_gone():
                del self._rings[peer]
                ring.close()
        for key, mapped in list(self._mapped.items()):
            if mapped.sender_gone():
                del self._mapped[key]
                mapped.close()

    def close(self) -> None:
        for ring in self._rings.values():
            ring.close()
        for mapped in self._mapped.values():
            mapped.close()
        self._rings.clear()
        self._mapped.clear()


def sweep() -> None:
    """Unlink the rings on this host whose sender died before any receiver mapped them
    (nobody holds their sender lock). This process's own are never touched."""
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return
    mine = f"{PREFIX}{os.getpid()}-"
    for name in names:
        if not name.startswith(PREFIX) or name.startswith(mine):
            continue
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError:
            continue
        try:
            if _holder_gone(fd, _SENDER_BYTE):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                log.info("removed %s, left by a replica that died", path)
        finally:
            os.close(fd)
