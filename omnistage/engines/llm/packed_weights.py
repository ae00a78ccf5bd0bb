"""The fast backend's packed weights, built once per checkpoint and kernel and kept on disk.

Packing a checkpoint (reading its float weights, quantizing every projection to int4,
laying the bytes out for the kernel) takes seconds of CPU per replica start; on a busy
machine, with two replicas restarting at once, it took the better part of a restart. So
the packed tensors are written once to the cache (beside the converted GGUFs, keyed the
same way: the checkpoint's files, their sizes and times, plus the kernel's layout and
this format's version) and every later start maps the file instead: no CPU work, and
replicas on one host share its pages through the page cache.

A lock file makes replicas that start together pack once: the first packs and writes,
the others wait for it and map what it wrote. A cache that cannot be written (a
read-only disk) costs nothing but the time saved: the weights are used from memory.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

from omnistage import envs

log = logging.getLogger(__name__)

# Bump when the packed layout changes (Int4Linear / TiedTable state, a kernel's pack).
FORMAT = 1

State = dict[str, torch.Tensor]


class Tensors:
    """A model directory's safetensors by name (without "model."), each read when asked:
    only the layer being quantized is in memory as float32, not the model. Each read maps
    the file afresh and unmaps it after copying: the mapped pages of the whole file would
    otherwise count in the process's memory until the end of the load."""

    def __init__(self, directory: Path) -> None:
        from safetensors import safe_open

        self._open = safe_open
        self._files: dict[str, tuple[Path, str]] = {}
        for file in sorted(directory.glob("*.safetensors")):
            with safe_open(file, framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                    self._files[name.removeprefix("model.")] = (file, name)

    def __contains__(self, name: str) -> bool:
        return name in self._files

    def __getitem__(self, name: str) -> torch.Tensor:
        file, full = self._files[name]
        with self._open(file, framework="pt") as handle:
            # A copy: a tensor read may share the mapping.
            return handle.get_tensor(full).to(torch.float32, copy=True)


def cache_file(directory: Path, layout: str, cache_dir: str | None = None) -> Path:
    """Where the packed weights of ``directory`` for kernel layout ``layout`` live."""
    key = [f"format={FORMAT}", f"layout={layout}", f"torch={torch.__version__}"]
    for file in sorted(directory.glob("*.safetensors")):
        st = file.stat()
        key.append(f"{file.resolve()}:{st.st_size}:{st.st_mtime_ns}")
    digest = hashlib.sha256("\n".join(key).encode()).hexdigest()[:16]
    root = Path(cache_dir or envs.cache_dir()).expanduser() / "packed"
    return root / f"{directory.name}-{layout}-{digest}.pt"


def load_or_pack(path: Path, pack: Callable[[], State]) -> tuple[State, str]:
    """The packed state at ``path``, mapped; or ``pack()``ed (once among the processes
    that ask together), written there and mapped. Also says which it was: "mapped",
    "packed" or "packed (not cached: ...)"."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = _lock(path.with_suffix(".lock"))  # waits while another process packs
    except OSError as exc:
        return pack(), f"packed (not cached: {exc})"
    try:
        if path.exists():
            try:
                return _mapped(path), "mapped"
            except Exception as exc:  # a torn or foreign file: pack it again
                log.warning("%s is unreadable (%s): packing again", path, exc)
        started = time.monotonic()
        state = pack()
        try:
            _write(path, state)
        except OSError as exc:
            return state, f"packed (not cached: {exc})"
        log.info("packed weights written to %s in %.1fs", path, time.monotonic() - started)
        del state  # the mapped copy replaces the one in memory
        return _mapped(path), "packed"
    finally:
        os.close(lock)  # closing drops the lock


def _lock(path: Path) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError:
        os.close(fd)
        raise
    return fd


def _write(path: Path, state: State) -> None:
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        torch.save(state, tmp)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def _mapped(path: Path) -> State:
    # mmap: the tensors are the file's pages (copy-on-write, never written), read as
    # they are touched and shared with every process that maps the same file.
    state = torch.load(path, mmap=True, weights_only=True)
    if not isinstance(state, dict):
        raise ValueError(f"{path}: not a packed-weights file")
    return state
