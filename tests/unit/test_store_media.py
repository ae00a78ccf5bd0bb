"""MediaStore: bytes by key in a local directory (or any fsspec filesystem)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from omnistage.protocol.errors import ConfigError
from omnistage.store.media import MediaStore


@pytest.mark.parametrize("form", ["path", "file-url"])
async def test_media_are_put_read_sized_and_deleted(tmp_path: Path, form: str) -> None:
    root = tmp_path / "media"
    media = MediaStore(str(root) if form == "path" else f"file://{root}")
    await media.put("videos/v1.mp4", b"\x00video")
    assert (root / "videos" / "v1.mp4").read_bytes() == b"\x00video"
    assert await media.get("videos/v1.mp4") == b"\x00video"
    assert await media.size("videos/v1.mp4") == 6
    await media.put("videos/v1.mp4", b"new")  # replaced whole
    assert await media.get("videos/v1.mp4") == b"new"
    await media.delete("videos/v1.mp4")
    await media.delete("videos/v1.mp4")  # already gone: fine
    assert await media.get("videos/v1.mp4") is None
    assert await media.size("videos/v1.mp4") is None
    assert os.listdir(root / "videos") == []  # no temporary file left behind


async def test_a_write_that_fails_leaves_nothing_under_the_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    media = MediaStore(str(tmp_path))
    await media.put("videos/v1.mp4", b"old")

    def disk_failure(fd: int) -> None:
        raise OSError("disk failed")

    monkeypatch.setattr(os, "fsync", disk_failure)
    with pytest.raises(OSError, match="disk failed"):
        await media.put("videos/v1.mp4", b"new and never whole")
    with pytest.raises(OSError, match="disk failed"):
        await media.put("videos/v2.mp4", b"never whole")
    assert await media.get("videos/v1.mp4") == b"old"
    assert await media.get("videos/v2.mp4") is None
    assert os.listdir(tmp_path / "videos") == ["v1.mp4"]


@pytest.mark.parametrize(
    "key", ["", "../x.mp4", "videos/../../x", "/etc/passwd", "\\x", "a//b", "./a", "C:x", "a\0b"]
)
async def test_keys_that_could_leave_the_root_are_refused(tmp_path: Path, key: str) -> None:
    media = MediaStore(str(tmp_path / "media"))
    with pytest.raises(ValueError, match="invalid media key"):
        await media.put(key, b"x")
    with pytest.raises(ValueError, match="invalid media key"):
        await media.get(key)
    assert not (tmp_path / "x.mp4").exists()


async def test_any_fsspec_filesystem_serves_media() -> None:
    media = MediaStore("memory://omnistage-test-media")
    await media.put("images/i1.png", b"png")
    assert (await media.get("images/i1.png"), await media.size("images/i1.png")) == (b"png", 3)
    await media.delete("images/i1.png")
    assert await media.get("images/i1.png") is None


def test_a_filesystem_whose_package_is_missing_names_the_flag() -> None:
    if importlib.util.find_spec("gcsfs") is not None:
        pytest.skip("gcsfs is installed here")
    with pytest.raises(ConfigError, match=r"--media-url.*gcsfs"):
        MediaStore("gcs://bucket/prefix")
    with pytest.raises(ConfigError, match="--media-url"):
        MediaStore("nosuchprotocol://x")
