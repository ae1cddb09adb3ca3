"""The projector side of a session, for pictures and sound clips alike: the projector held in
RAM, the one borrowed on the accelerator (resident, or for the length of a swap), the
embeddings of the pictures and clips seen (by content hash
and projector; at most `image_cache_bytes`, least recently used first out, an image that left
is encoded again when a turn needs it), and the vision costs the planner weighs, learned from
measured steps. Engine thread only."""
from __future__ import annotations

import collections
import contextlib
import hashlib
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from engine.config import SessionConfig
from engine.errors import EbbError
from engine.gguf.info import ProjectorInfo
from engine.units import fmt_bytes
from engine.ledger import Ledger
from engine.llama.devices import find_device
from engine.llama.loaded_model import HoldsModel
from engine.placement import calibration
from engine.placement.plan import CPU, Costs
from engine.llama.state_files import file_identity
from engine.media.embedding_files import EmbeddingFiles
from engine.media.attachments import (DEFAULT_SIDE, PICTURE_LABEL, Keys, Projector, is_part,
                                      load_part, saved_keys)
from engine.media.audio import clip_info, decode_for_projector
from engine.media.kinds import is_clip
from engine.media.images import CLIP_HEIGHT, LoadedMedia, image_digest, load_image
from engine.media.projector import Bitmap, Encoded, MediaPiece, ProjectorRuntime

if TYPE_CHECKING:
    import numpy as np


def _projector_identity(path: Path, image_max_tokens: int) -> str:
    """The projector by what its file holds (a moved or copied file is the same one) and the
    setting that changes how pictures are cut: part of every image key, in RAM, in a saved KV
    state's keys and in the encoded pictures kept on disk."""
    return hashlib.sha256(f"{file_identity(path)}:{image_max_tokens}".encode()).hexdigest()[:16]


def default_costs(info: ProjectorInfo | None, n_threads: int, accel: str | None,
                  remote: bool) -> Costs:
    """Vision costs before anything is measured: this machine's calibration where there is
    one, else rough rates (CPU FLOPs per thread, a GPU, a bus)."""
    flops_per_token = 2 * (info.weight_bytes // 2) if info else 1
    cpu_s = flops_per_token / (40e9 * n_threads)
    accel_s = cpu_s if (accel is None or remote) else flops_per_token / 20e12
    costs = Costs(bus_Bps=1e9 if remote or accel is None else 12e9,
                  cpu_encode_s_per_token=cpu_s, accel_encode_s_per_token=accel_s)
    cpu_cal = calibration.load(CPU)
    if cpu_cal is not None and info is not None:  # this machine's measurements
        dev = find_device(accel) if accel else None
        acc_cal = calibration.load(calibration.device_key(dev.name, dev.description)) if dev else None
        costs = calibration.vision_costs(cpu_cal, acc_cal, info.weight_bytes, costs)
    return costs


class MediaEncoder:
    def __init__(self, cfg: SessionConfig, info: ProjectorInfo | None, n_threads: int,
                 ledger: Ledger, accel: str | None, remote: bool) -> None:
        self.cfg = cfg
        self.info = info
        self.n_threads = n_threads
        self.ledger = ledger  # the model's ledger: the projector's bytes count beside it
        self.costs = default_costs(info, n_threads, accel, remote)
        self.enabled = info is not None
        self.ram: ProjectorRuntime | None = None
        self.refused = ""  # why the projector given is not used (sound it cannot encode), or ""
        self.on_device: ProjectorRuntime | None = None  # resident, or borrowed for a swap
        # chunk key (image key#index) -> embeddings, least recently used first
        self._cache: collections.OrderedDict[str, Encoded] = collections.OrderedDict()
        self.cache_bytes = 0
        self.n_evicted = 0  # chunks that left the cache for its limit
        self._pinned: set[str] = set()  # chunks the turn in progress needs: never evicted
        self._layout: dict[str, tuple[int, int, int]] = {}  # image key -> width, height, chunks
        self._paths: dict[str, str] = {}  # image key -> image file, to encode it again later
        self._proj_id = ""
        self._stack = contextlib.ExitStack()
        # the encoded pictures kept on disk too (cfg.state_dir; None: RAM only)
        self.disk = (EmbeddingFiles(cfg.state_dir / "pictures")
                     if cfg.state_dir is not None and cfg.state_disk_bytes > 0 else None)

    @property
    def marker(self) -> str:
        return self.ram.marker if self.ram is not None else ""

    def load_ram(self, holder: HoldsModel) -> None:
        """Load the projector into RAM, bound to `holder` (a model that outlives it)."""
        if self.cfg.mmproj_path is None:
            return
        self.ram = ProjectorRuntime(self.cfg.mmproj_path, holder, self.n_threads, device=None,
                                    flash_attn=self.cfg.flash_attn,
                                    image_max_tokens=self.cfg.image_max_tokens, info=self.info)
        self._stack.callback(self.ram.close)
        self.ledger.set(CPU, "projector", self.ram.info.weight_bytes)
        self._proj_id = _projector_identity(self.cfg.mmproj_path, self.cfg.image_max_tokens)

    def load_on_device(self, accel: str, bound_to: HoldsModel) -> ProjectorRuntime:
        """Put the projector on `accel` (bound to a live model) and count its bytes there."""
        assert self.cfg.mmproj_path is not None
        self._check_room(accel)
        pr = ProjectorRuntime(self.cfg.mmproj_path, bound_to, self.n_threads, device=accel,
                              flash_attn=self.cfg.flash_attn,
                              image_max_tokens=self.cfg.image_max_tokens, info=self.info)
        self.on_device = pr
        self.ledger.set(accel, "projector", pr.info.weight_bytes)
        self.ledger.set(accel, "projector_compute", pr.compute_buffer_bytes)
        return pr

    def _check_room(self, accel: str) -> None:
        """DeviceOutOfMemory when the device says it has less free than the projector needs.
        llama.cpp's clip loader aborts the process when its weights cannot be allocated (no
        error path), so this is asked first; a real GPU and an RPC server both report it."""
        from engine.errors import DeviceOutOfMemory
        from engine.llama.devices import find_device

        if self.info is None:
            return
        need = self.info.weight_bytes + self.info.compute_buffer_bytes
        free = find_device(accel).free_bytes
        if free is not None and free < need:
            raise DeviceOutOfMemory(f"{accel} has {fmt_bytes(free)} free, the projector needs "
                                    f"{fmt_bytes(need)}")

    def free_on_device(self, accel: str | None) -> bool:
        """Free the projector on the accelerator, if there is one. True when one was freed
        (the model must then re-plan its graphs)."""
        if self.on_device is None:
            return False
        self.on_device.close()
        self.on_device = None
        if accel:
            self.ledger.clear(accel, "projector", "projector_compute")
        return True

    # ------------------------------------------------------------ images and the cache

    def key(self, img: LoadedMedia) -> str:
        return f"{self._proj_id}:{img.sha256}"

    def key_of_file(self, path: Path) -> str:
        """The cache key of a saved image, from its bytes alone (no decoding); remembers the
        file so the image can be encoded when a turn needs it."""
        key = f"{self._proj_id}:{image_digest(path)}"
        self._paths[key] = str(path)
        return key

    @property
    def side(self) -> int:
        """The size video frames and PDF pages are made at: the projector's input size."""
        return int(self.info.image_size) if self.info and self.info.image_size else DEFAULT_SIDE

    def keys_of(self, ref: str, proj: Projector | None) -> Keys:
        """A saved message's attachment as image keys (remembered, to be loaded when a turn
        needs them), labels and text: a picture or clip from its bytes, a video's frames and a
        PDF's pages from the reference (attachments.saved_keys)."""
        got = saved_keys(ref, proj, lambda content: f"{self._proj_id}:{content}", self.load)
        if got.keys or got.text:
            for key, part in got.keys:
                self._paths[key] = part
            return got
        if self.ram is None:
            return got
        key = self.key_of_file(Path(ref))
        return Keys([(key, ref)], [PICTURE_LABEL])

    def remember(self, img: LoadedMedia) -> str:
        key = self.key(img)
        self._paths[key] = img.path
        return key

    def path_of(self, key: str) -> str | None:
        return self._paths.get(key)

    def adopt(self, other: "MediaEncoder") -> None:
        """Know the image files of another session's conversation (its cache is not ours)."""
        self._paths.update(other._paths)

    @staticmethod
    def chunk_key(image_key: str, index: int) -> str:
        return f"{image_key}#{index}"

    def is_cached(self, key: str) -> bool:
        """Every chunk of the image `key` is encoded (in RAM, or kept on disk)."""
        lay = self._layout.get(key)
        if lay is None and self.disk is not None:
            lay = self.disk.layout(self.chunk_key(key, 0))
            if lay is not None:
                self._layout[key] = lay
        return lay is not None and all(self.is_chunk_cached(self.chunk_key(key, i))
                                       for i in range(lay[2]))

    def holds(self, chunk_key: str) -> bool:
        """The chunk is encoded and in RAM now (what a turn just encoded is pinned there)."""
        return chunk_key in self._cache

    def is_chunk_cached(self, chunk_key: str) -> bool:
        """In RAM, or kept on disk (read into RAM now: the turn that asks uses it)."""
        if chunk_key in self._cache:
            return True
        enc = self.disk.load(chunk_key) if self.disk is not None else None
        if enc is not None:
            self._keep(chunk_key, enc)
        return enc is not None

    def load(self, path: Path) -> LoadedMedia:
        """A picture or a sound clip (told by its first bytes), decoded for the projector. A
        clip's header is checked first; its samples come from mtmd's own decoder (WAV, MP3,
        FLAC) or PyAV (the rest)."""
        if is_part(str(path)):  # a video's frame or a PDF's page of a saved message
            return load_part(str(path), self.side)
        path = Path(path)
        if not is_clip(path):
            return load_image(path)
        clip = clip_info(path)  # empty, damaged, unknown or too long: refused before decoding
        if self.ram is None or not self.ram.hears:
            raise EbbError(f"{path.name} is a sound clip, and " + self.why_deaf(),
                           "load a model with an audio or omni projector, or remove the clip")
        data = path.read_bytes()
        samples = decode_for_projector(path, data, clip, self.ram.sample_rate, self.ram.decode_audio)
        if len(samples) < 4:
            raise EbbError(f"{path.name} has no sound in it (0 samples)", "record or choose another clip")
        return LoadedMedia(str(path), hashlib.sha256(data).hexdigest(), len(samples) // 4,
                           CLIP_HEIGHT, samples)

    def why_deaf(self) -> str:
        """Why a clip cannot be heard: the projector was refused (and why), it does not hear
        (by its name), or there is none."""
        if self.ram is not None:
            name = self.cfg.mmproj_path.name if self.cfg.mmproj_path is not None else "the projector"
            return f"the loaded projector ({name}) does not hear"
        if self.refused:
            return f"the projector given was refused: {self.refused}"
        return "no projector is loaded"

    def bitmap(self, key: str, pixels: LoadedMedia | None) -> Bitmap:
        """The picture or clip for the tokenizer: its pixels or samples when given, else its
        size alone (one whose chunks are all encoded)."""
        if pixels is not None:
            return Bitmap(pixels.width, pixels.height, pixels.rgb, audio=pixels.is_clip)
        w, h, _ = self._layout[key]
        return Bitmap(w, h, None, audio=h == CLIP_HEIGHT)

    def note_layout(self, key: str, bitmap: Bitmap, n_chunks: int) -> None:
        self._layout[key] = (bitmap.width, bitmap.height, n_chunks)

    def embeddings(self, chunk_key: str) -> np.ndarray:
        if chunk_key not in self._cache and self.disk is not None:
            enc = self.disk.load(chunk_key)
            if enc is None:
                raise EbbError("an encoded picture kept on disk could not be read back",
                               "send the message again: the picture is encoded afresh")
            self._keep(chunk_key, enc)
        self._cache.move_to_end(chunk_key)  # used: the last to leave
        return self._cache[chunk_key].embeddings

    def _keep(self, chunk_key: str, enc: Encoded) -> None:
        old = self._cache.pop(chunk_key, None)
        if old is not None:
            self.cache_bytes -= old.embeddings.nbytes
        self._cache[chunk_key] = enc
        self.cache_bytes += enc.embeddings.nbytes
        self._trim()

    def pin(self, chunk_keys: set[str]) -> None:
        """The chunks of the turn in progress: kept whatever the limit until `pin(set())`."""
        self._pinned = set(chunk_keys)
        self._trim()

    def _trim(self) -> None:
        limit = self.cfg.image_cache_bytes
        for k in list(self._cache):
            if self.cache_bytes <= limit:
                break
            if k in self._pinned:
                continue
            self.cache_bytes -= self._cache.pop(k).embeddings.nbytes
            self.n_evicted += 1

    def forget_all(self) -> None:
        """Hold no encoded picture or clip in RAM (what a new process starts with; the disk's
        stay)."""
        self._cache.clear()
        self.cache_bytes = 0
        self._layout.clear()

    def forget(self, img: LoadedMedia) -> None:
        key = self.key(img)
        for k in [k for k in self._cache if k.startswith(key + "#")]:
            self.cache_bytes -= self._cache.pop(k).embeddings.nbytes

    def pending(self, keys: list[str]) -> tuple[list[LoadedMedia], list[str]]:
        """The images behind `keys` that are not encoded yet, decoded now, and the keys of
        those that can no longer be read (gone or damaged since they were saved)."""
        images, lost = [], []
        for k in dict.fromkeys(keys):
            if self.is_cached(k) or k not in self._paths:
                continue
            try:
                images.append(self.load(Path(self._paths[k])))
            except EbbError:
                lost.append(k)
        return images, lost

    def encode(self, pr: ProjectorRuntime, piece: MediaPiece, chunk_key: str, device: str,
               name: str = "") -> Encoded:
        """Encode one image chunk with `pr` and keep its embeddings."""
        enc = pr.encode_chunk(piece, name)
        self._keep(chunk_key, enc)
        lay = self._layout.get(chunk_key.rsplit("#", 1)[0])
        if self.disk is not None and lay is not None:
            self.disk.save(chunk_key, lay, enc)
        self.learn("encode", device, enc.encode_s, n_tokens=enc.n_tokens)
        return enc

    def learn(self, step: str, device: str, seconds: float, n_bytes: int = 0, n_tokens: int = 0,
              mover: str = "") -> None:
        """The one place the vision costs change: from a measured step. `encode`: seconds per
        image token on `device`; `restore`: the live mover's copy rate, or the reload mover's
        overhead beyond its bytes over the bus."""
        c = self.costs
        if step == "encode" and n_tokens:
            per_token = seconds / n_tokens
            c = (replace(c, cpu_encode_s_per_token=per_token) if device == CPU
                 else replace(c, accel_encode_s_per_token=per_token))
        elif step == "restore" and mover == "live" and n_bytes and seconds > 0:
            c = replace(c, bus_Bps=n_bytes / seconds)
        elif step == "restore" and mover == "reload":
            c = replace(c, reload_overhead_s=max(0.0, seconds - n_bytes / c.bus_Bps))
        self.costs = c

    def close(self) -> None:
        self.free_on_device(None)
        self._stack.close()
