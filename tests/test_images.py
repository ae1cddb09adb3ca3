"""Image loading: every odd or broken file gets a clear message or a correct RGB picture."""
from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from engine.errors import EbbError
from engine.media.images import load_image


def _save(path, im, **kw):
    im.save(path, **kw)
    return path


def test_plain_rgb(tmp_path):
    img = load_image(_save(tmp_path / "a.png", Image.new("RGB", (30, 20), (10, 20, 30))))
    assert (img.width, img.height) == (30, 20)
    assert img.rgb[:3] == bytes([10, 20, 30]) and len(img.rgb) == 30 * 20 * 3


@pytest.mark.parametrize("name,make", [
    ("cmyk.jpg", lambda: Image.new("CMYK", (16, 8), (0, 255, 0, 0))),
    ("palette.png", lambda: Image.new("RGB", (16, 8), (200, 10, 10)).convert("P")),
    ("grey16.png", lambda: Image.fromarray(np.arange(128, dtype=np.uint16).reshape(8, 16) * 500)),
    ("alpha.png", lambda: Image.new("RGBA", (16, 8), (0, 0, 255, 128))),
])
def test_odd_modes_become_rgb(tmp_path, name, make):
    img = load_image(_save(tmp_path / name, make()))
    assert (img.width, img.height) == (16, 8)
    arr = np.frombuffer(img.rgb, np.uint8).reshape(8, 16, 3)
    assert arr.std() > 0 or name != "grey16.png"
    if name == "grey16.png":  # scaled to the full 8-bit range, not clipped to white
        assert arr.min() == 0 and arr.max() == 255


def test_animated_gif_uses_first_frame(tmp_path):
    frames = [Image.new("RGB", (8, 8), c) for c in ((255, 0, 0), (0, 255, 0))]
    path = tmp_path / "anim.gif"
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=100, loop=0)
    img = load_image(path)
    r, g, _ = img.rgb[:3]
    assert r > 200 and g < 50


def test_exif_rotation_is_honoured(tmp_path):
    im = Image.new("RGB", (40, 10), (255, 255, 255))
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90° clockwise on display
    path = _save(tmp_path / "rot.jpg", im, exif=exif.tobytes())
    img = load_image(path)
    assert (img.width, img.height) == (10, 40)


def test_same_bytes_same_hash(tmp_path):
    a = _save(tmp_path / "a.png", Image.new("RGB", (4, 4), (1, 2, 3)))
    b = tmp_path / "b.png"
    b.write_bytes(a.read_bytes())
    assert load_image(a).sha256 == load_image(b).sha256


@pytest.mark.parametrize("name,content,words", [
    ("notes.png", b"hello, I am text\n" * 20, "not an image"),
    ("empty.jpg", b"", "not an image"),
])
def test_not_images(tmp_path, name, content, words):
    (tmp_path / name).write_bytes(content)
    with pytest.raises(EbbError, match=words):
        load_image(tmp_path / name)


def test_truncated_image(tmp_path):
    full = _save(tmp_path / "full.jpg", Image.fromarray(
        (np.random.default_rng(0).random((64, 64, 3)) * 255).astype(np.uint8)), quality=95)
    cut = tmp_path / "cut.jpg"
    cut.write_bytes(full.read_bytes()[:600])
    with pytest.raises(EbbError, match="damaged"):
        load_image(cut)


def test_huge_image_is_refused_before_decoding(tmp_path):
    # An 8000 x 8000 PNG of one colour is small on disk but 64 megapixels.
    path = _save(tmp_path / "huge.png", Image.new("L", (8000, 8000), 0))
    with pytest.raises(EbbError, match="megapixels"):
        load_image(path)


def test_missing_image(tmp_path):
    with pytest.raises(EbbError, match="not found"):
        load_image(tmp_path / "nope.png")
