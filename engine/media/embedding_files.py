"""Encoded pictures kept on disk: a reopened chat with pictures encodes none of them again.

The image embeddings the encoder caches in RAM (by picture hash and projector identity, one
entry per chunk) are written here too, one file per chunk, named by a hash of its key: a magic
line, the header's length, the header (JSON: the chunk's key, the picture's layout for the
tokenizer, the array's shape, the sha256 of its bytes: engine/kept_files.py), then the float32
embeddings. A file
that does not parse, whose key is not the one asked for or whose bytes do not hash to its
header's is passed over and removed, never trusted. The folder shares the states' budget
(state_files.trim_folder). Engine thread only.
"""
from __future__ import annotations

import hashlib
import struct
from pathlib import Path

from engine.kept_files import digests, read_checked, read_header, remove, touch, write_atomically
from engine.media.projector import Encoded

MAGIC = b"EBBEMB\x01\n"
SUFFIX = ".ebbemb"


class EmbeddingFiles:
    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.n_loaded = 0  # chunks read back instead of encoded

    def _path(self, chunk_key: str) -> Path:
        return self.folder / (hashlib.sha256(chunk_key.encode()).hexdigest()[:32] + SUFFIX)

    def save(self, chunk_key: str, layout: tuple[int, int, int], enc: Encoded) -> None:
        """Keep a chunk's embeddings (a full or read-only disk: not kept, nothing lost)."""
        import numpy as np

        arr = np.ascontiguousarray(enc.embeddings, dtype=np.float32)
        data = arr.tobytes()
        write_atomically(self._path(chunk_key), MAGIC, {
            "key": chunk_key, "layout": list(layout), "shape": list(arr.shape),
            "n_tokens": enc.n_tokens, "encode_s": enc.encode_s, **digests(data)}, data)

    def layout(self, chunk_key: str) -> tuple[int, int, int] | None:
        """The picture's layout (width, height, chunks) kept with this chunk, if it is kept."""
        path = self._path(chunk_key)
        try:
            with open(path, "rb") as f:
                head = read_header(f, MAGIC, 1 << 20)
            if head.get("key") != chunk_key:
                return None
            w, h, n = (int(v) for v in head["layout"])
            return w, h, n
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError, struct.error):
            remove(path)
            return None

    def load(self, chunk_key: str) -> Encoded | None:
        """A chunk's embeddings as encoded before, checked; None when not kept or damaged."""
        import numpy as np

        path = self._path(chunk_key)
        try:
            with open(path, "rb") as f:
                head = read_header(f, MAGIC, 1 << 20)
                shape = tuple(int(v) for v in head["shape"])
                if head.get("key") != chunk_key or len(shape) != 2:
                    return None
                if "nbytes" not in head:  # written before the header said it
                    head["nbytes"] = shape[0] * shape[1] * 4
                data = read_checked(f, head)
            if data is None or len(data) != shape[0] * shape[1] * 4:
                raise ValueError("the embeddings do not match their header")
            arr = np.frombuffer(data, dtype=np.float32).reshape(shape)
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError, struct.error):
            remove(path)
            return None
        touch(path)
        self.n_loaded += 1
        return Encoded(int(head.get("n_tokens", shape[0])), arr, 0.0)

