"""Load user images safely (pillow): RGB pixels plus a content hash, or a clear EbbError."""
from __future__ import annotations

import hashlib
import warnings
from dataclasses import dataclass
from pathlib import Path

from engine.errors import EbbError

MAX_IMAGE_PIXELS = 80_000_000  # ~ 9000 x 9000; larger is refused, never decoded
MAX_IMAGE_FILE_BYTES = 200 * 1024 * 1024


@dataclass(frozen=True)
class LoadedImage:
    path: str
    sha256: str  # of the file's bytes: the cache key for its embeddings
    width: int
    height: int
    rgb: bytes  # width * height * 3, row-major


def load_image(path: Path) -> LoadedImage:
    """Decode an image file to RGB. Any thread. Raises EbbError naming the file and the cause."""
    from PIL import Image, UnidentifiedImageError

    path = Path(path)
    if not path.is_file():
        raise EbbError(f"image not found: {path}", "check the path")
    size = path.stat().st_size
    if size > MAX_IMAGE_FILE_BYTES:
        raise EbbError(f"image {path.name} is {size // (1024 * 1024)} MiB, too large",
                       f"use an image under {MAX_IMAGE_FILE_BYTES // (1024 * 1024)} MiB")
    data = path.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(path) as im:
                if im.width * im.height > MAX_IMAGE_PIXELS:
                    raise EbbError(f"image {path.name} is {im.width}x{im.height} pixels, too large",
                                   "resize it below 80 megapixels")
                im.load()
                rgb = im.convert("RGB")
    except EbbError:
        raise
    except (UnidentifiedImageError, Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise EbbError(f"{path.name} is not an image Ebb can read ({exc})",
                       "use a PNG, JPEG, WebP, GIF or BMP file") from None
    except (OSError, ValueError, SyntaxError) as exc:
        raise EbbError(f"image {path.name} is damaged ({exc})", "use another copy of the image") from None
    if rgb.width == 0 or rgb.height == 0:
        raise EbbError(f"image {path.name} is empty", "use another image")
    return LoadedImage(str(path), digest, rgb.width, rgb.height, rgb.tobytes())
