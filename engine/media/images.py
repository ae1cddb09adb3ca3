"""Load user images safely (pillow): RGB pixels plus a content hash, or a clear EbbError."""
from __future__ import annotations

import hashlib
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from engine.errors import EbbError
from engine.media.files import too_large

if TYPE_CHECKING:
    from PIL import Image

MAX_IMAGE_PIXELS = 50_000_000  # larger is refused before decoding
MAX_IMAGE_FILE_BYTES = 200 * 1024 * 1024


CLIP_HEIGHT = 0  # a sound clip's "height": its width is its samples, its bytes float32 mono


@dataclass(frozen=True)
class LoadedMedia:
    """A picture or a sound clip a message carries, decoded: what the projector takes."""
    path: str
    sha256: str  # of the file's bytes: the cache key for its embeddings
    width: int  # a clip: its samples at the projector's rate
    height: int  # a clip: CLIP_HEIGHT
    rgb: bytes  # width * height * 3, row-major; a clip: float32 samples

    @property
    def is_clip(self) -> bool:
        return self.height == CLIP_HEIGHT


def to_rgb(im: Image.Image) -> Image.Image:
    """8-bit RGB from any mode: 16-bit and float greyscale are scaled, alpha is dropped on
    white, CMYK and palettes are converted."""
    import numpy as np
    from PIL import Image

    if im.mode in ("I;16", "I;16B", "I;16L", "I", "F"):
        a = np.asarray(im, dtype=np.float64)
        lo, hi = float(a.min()), float(a.max())
        a = (a - lo) * (255.0 / (hi - lo)) if hi > lo else np.zeros_like(a)
        return Image.fromarray(a.astype(np.uint8)).convert("RGB")
    if im.mode in ("RGBA", "LA", "PA") or (im.mode == "P" and "transparency" in im.info):
        rgba = im.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return im.convert("RGB")


def _checked_size(path: Path) -> int:
    if not path.is_file():
        raise EbbError(f"image not found: {path}", "check the path")
    size = path.stat().st_size
    if size > MAX_IMAGE_FILE_BYTES:
        raise too_large(f"image {path.name}", size, MAX_IMAGE_FILE_BYTES, "an image")
    return size


def image_digest(path: Path) -> str:
    """The sha256 of an image file's bytes (its embeddings' cache key), without decoding it."""
    path = Path(path)
    _checked_size(path)
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_noise_picture(path: Path, seed: int, size: tuple[int, int] = (224, 224)) -> Path:
    """A PNG of random pixels (for benchmarks and calibration: nothing to recognise)."""
    import numpy as np
    from PIL import Image

    arr = (np.random.default_rng(seed).random((size[1], size[0], 3)) * 255).astype(np.uint8)
    Image.fromarray(arr).save(path)
    return Path(path)


def load_image(path: Path) -> LoadedMedia:
    """Decode an image file to RGB. Any thread. Raises EbbError naming the file and the cause."""
    from PIL import Image, ImageOps, UnidentifiedImageError

    path = Path(path)
    _checked_size(path)
    data = path.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(path) as im:
                if im.width * im.height > MAX_IMAGE_PIXELS:
                    raise EbbError(f"image {path.name} is {im.width}x{im.height} pixels "
                                   f"({im.width * im.height / 1e6:.0f} megapixels), too large",
                                   f"resize it below {MAX_IMAGE_PIXELS // 1_000_000} megapixels")
                im.seek(0)  # animated: the first frame
                im.load()
                rgb = to_rgb(ImageOps.exif_transpose(im))
    except EbbError:
        raise
    except (UnidentifiedImageError, Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise EbbError(f"{path.name} is not an image Ebb can read ({exc})",
                       "use a PNG, JPEG, WebP, GIF or BMP file") from None
    except (OSError, ValueError, SyntaxError, EOFError) as exc:
        raise EbbError(f"image {path.name} is damaged ({exc})", "use another copy of the image") from None
    if rgb.width == 0 or rgb.height == 0:
        raise EbbError(f"image {path.name} is empty", "use another image")
    return LoadedMedia(str(path), digest, rgb.width, rgb.height, rgb.tobytes())
