"""An image edit's uploads (engines/edit_images.py): which are refused and naming what,
OpenAI's mask as diffusers' repaint mask, the init image at the output size, and the
overlay that keeps every pixel outside the mask."""

from __future__ import annotations

import io

import pytest

from omnistage.engines.image.edits import (
    MAX_SOURCE_PIXELS,
    check_edit,
    overlay,
    prepare,
    repaint_mask,
)
from omnistage.protocol.errors import BadRequestError

Image = pytest.importorskip("PIL.Image")


def _encoded(image: object, fmt: str = "PNG", **save: object) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **save)  # type: ignore[attr-defined]
    return buf.getvalue()


def _gradient(size: tuple[int, int]) -> object:
    width, height = size
    image = Image.new("RGB", size)
    image.putdata(
        [(x * 255 // width, y * 255 // height, 90) for y in range(height) for x in range(width)]
    )
    return image


def _mask(size: tuple[int, int], hole: tuple[int, int, int, int]) -> object:
    """Opaque white, with a fully transparent rectangle: where to edit."""
    mask = Image.new("RGBA", size, (255, 255, 255, 255))
    mask.paste((0, 0, 0, 0), hole)
    return mask


def test_mask_alpha_zero_becomes_white_everything_else_black() -> None:
    mask = Image.new("RGBA", (4, 1))
    mask.putdata([(0, 0, 0, 0), (255, 255, 255, 0), (0, 0, 0, 1), (9, 9, 9, 255)])
    repaint = repaint_mask(mask)
    assert repaint.mode == "L"
    assert list(repaint.tobytes()) == [255, 255, 0, 0]
    # A palette image's transparent index counts as alpha 0 too.
    palette = Image.new("P", (2, 1))
    palette.putdata([0, 1])
    palette.info["transparency"] = 1
    assert list(repaint_mask(palette).tobytes()) == [0, 255]


def test_a_good_edit_reports_the_source_size_with_or_without_a_mask() -> None:
    image = _encoded(_gradient((96, 64)))
    mask = _encoded(_mask((96, 64), (8, 8, 40, 40)))
    assert check_edit([image], None) == (96, 64)
    assert check_edit([image], mask) == (96, 64)
    assert check_edit([image], mask, full=False) == (96, 64)
    jpeg, webp = _encoded(_gradient((64, 80)), "JPEG"), _encoded(_gradient((64, 80)), "WEBP")
    assert check_edit([jpeg], None) == check_edit([webp], None) == (64, 80)


def test_an_upright_size_follows_the_exif_orientation() -> None:
    exif = Image.Exif()
    exif[0x0112] = 6  # turned a quarter
    turned = _encoded(_gradient((96, 64)), "JPEG", exif=exif.tobytes())
    assert check_edit([turned], None) == (64, 96)
    assert check_edit([turned], None, full=False) == (64, 96)


def _refused(images: list[bytes], mask: bytes | None, full: bool = True) -> BadRequestError:
    with pytest.raises(BadRequestError) as err:
        check_edit(images, mask, full)
    return err.value


def test_what_is_not_an_image_is_refused_naming_image_or_mask() -> None:
    image = _encoded(_gradient((64, 64)))
    for full in (True, False):
        assert _refused([b"not an image at all"], None, full).param == "image"
        assert _refused([image], b"GIF89a nonsense", full).param == "mask"
    gif = _encoded(_gradient((64, 64)), "GIF")
    assert "not a PNG, JPEG or WebP" in str(_refused([gif], None))
    # A damaged file: its header reads, its pixels do not (only a full decode sees it).
    truncated = image[: len(image) // 2]
    err = _refused([truncated], None)
    assert err.param == "image" and "could not be decoded" in str(err)


def test_too_many_images_none_or_too_large_are_refused_naming_image() -> None:
    image = _encoded(_gradient((64, 64)))
    err = _refused([image, image], None)
    assert err.param == "image" and "one image per request" in str(err)
    assert _refused([], None).param == "image"
    side = int(MAX_SOURCE_PIXELS**0.5) + 8
    huge = _encoded(Image.new("L", (side, side)), compress_level=1)
    err = _refused([huge], None, full=False)
    assert err.param == "image" and f"at most {MAX_SOURCE_PIXELS} pixels" in str(err)


def test_a_mask_of_another_size_or_without_alpha_is_refused_naming_mask() -> None:
    image = _encoded(_gradient((96, 64)))
    for full in (True, False):
        err = _refused([image], _encoded(_mask((64, 64), (0, 0, 8, 8))), full)
        assert err.param == "mask" and "64x64 but the image 96x64" in str(err)
        err = _refused([image], _encoded(Image.new("RGB", (96, 64))), full)
        assert err.param == "mask" and "no alpha channel" in str(err)


def test_prepare_resizes_the_source_and_the_mask_to_the_output_size() -> None:
    image = _encoded(Image.new("RGBA", (96, 64), (200, 10, 10, 128)))
    mask = _encoded(_mask((96, 64), (0, 0, 48, 64)))  # the left half
    init, repaint = prepare(image, mask, (48, 32))
    assert (init.mode, init.size) == ("RGB", (48, 32))
    assert init.getpixel((10, 10)) == (200, 10, 10)
    assert repaint is not None and (repaint.mode, repaint.size) == ("L", (48, 32))
    assert repaint.getpixel((5, 5)) == 255 and repaint.getpixel((40, 5)) == 0
    assert set(repaint.tobytes()) == {0, 255}  # still two-valued
    same, none = prepare(image, None, (96, 64))
    assert same.size == (96, 64) and none is None


def test_overlay_keeps_the_source_outside_the_mask_and_the_drawing_inside() -> None:
    source = _gradient((64, 64))
    drawn = Image.new("RGB", (64, 64), (0, 255, 0))
    repaint = repaint_mask(_mask((64, 64), (16, 16, 48, 48)))
    out = overlay(drawn, source, repaint)
    assert out.getpixel((0, 0)) == source.getpixel((0, 0))
    assert out.getpixel((63, 20)) == source.getpixel((63, 20))
    assert out.getpixel((20, 20)) == (0, 255, 0) == out.getpixel((47, 47))
