"""Recording a clip from the microphone (miniaudio's capture: PulseAudio/PipeWire or ALSA on
Linux, WASAPI on Windows, Core Audio on macOS).

The device's own thread hands samples to `_sink`; the GUI thread reads the level and the time
so far (`level`, `seconds`) on a timer and `stop()`s it into a 16 kHz mono WAV, the rate the
audio encoders take. No microphone, access denied, a device that fails: `RecordError` with
words for the window, never a crash.
"""
from __future__ import annotations

import contextlib
import math
import os
import threading
import time
import wave
from pathlib import Path
from typing import Any, Generator

RATE = 16000  # what Whisper-like encoders take: no resampling later
NULL_DEVICE = "generate zero samples"  # miniaudio's stand-in when a machine has no capture


class RecordError(Exception):
    """Why recording cannot start or go on, in the window's words."""


def _backends(name: str) -> Any:
    import miniaudio

    return None if not name else [getattr(miniaudio.Backend, name.upper())]


class Recorder:
    """One recording. `backend`: "" for the system's (tests name "null": miniaudio's silent
    device; a machine whose only capture device is that one has no microphone)."""

    def __init__(self, backend: str = "") -> None:
        self.backend = backend
        self._lock = threading.Lock()
        self._chunks: list[bytes] = []
        self._n_samples = 0
        self._level = 0.0
        self._device: Any = None
        self.started = 0.0

    def start(self) -> None:
        import miniaudio

        try:
            if not self.backend:
                devices = miniaudio.Devices().get_captures()
                if not devices or all(NULL_DEVICE in str(d.get("name", "")) for d in devices):
                    raise RecordError("No microphone found: connect one, or check that the system "
                                      "lets Ebb use it")
            device = miniaudio.CaptureDevice(input_format=miniaudio.SampleFormat.SIGNED16,
                                             nchannels=1, sample_rate=RATE,
                                             backends=_backends(self.backend), app_name="Ebb")
            sink = self._sink()
            next(sink)
            device.start(sink)
        except RecordError:
            raise
        except (miniaudio.MiniaudioError, OSError, AttributeError) as exc:
            raise RecordError(f"The microphone could not be opened ({exc}): check that one is "
                              "connected and that the system lets Ebb use it") from None
        self._device, self.started = device, time.monotonic()

    def _sink(self) -> Generator[None, Any, None]:
        """Runs on miniaudio's thread: keep the samples, note the level."""
        import array

        while True:
            data = yield
            if not data:
                continue
            raw = bytes(data)
            samples = array.array("h", raw)
            peak = max(1, max(abs(min(samples)), abs(max(samples)))) if samples else 1
            with self._lock:
                self._chunks.append(raw)
                self._n_samples += len(samples)
                self._level = min(1.0, math.log10(peak) / math.log10(32768))

    @property
    def recording(self) -> bool:
        return self._device is not None

    def seconds(self) -> float:
        """Sound captured so far."""
        with self._lock:
            return self._n_samples / RATE

    def level(self) -> float:
        """The last block's peak, 0..1 on a log scale (what a level meter shows)."""
        with self._lock:
            return self._level

    def _close(self) -> None:
        if self._device is not None:
            try:
                self._device.close()
            except Exception:  # noqa: BLE001 - a device that is already gone
                pass
            self._device = None

    def cancel(self) -> None:
        self._close()
        with self._lock:
            self._chunks.clear()

    def stop(self, folder: Path) -> Path:
        """End the recording; the clip as a WAV in `folder` (the data folder's `recordings`:
        a voice stays with the user's data), the folder and the file readable by the user
        alone. RecordError when nothing was captured."""
        self._close()
        with self._lock:
            data = b"".join(self._chunks)
            self._chunks.clear()
        if not data:
            raise RecordError("Nothing was recorded: the microphone sent no sound")
        private_folder(folder)
        path = folder / time.strftime("recording-%H%M%S.wav")
        n = 1
        while path.exists():
            n += 1
            path = path.with_name(time.strftime(f"recording-%H%M%S-{n}.wav"))
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # never world-readable
        with os.fdopen(fd, "wb") as f, wave.open(f, "wb") as w:
            w.setnchannels(1)
            w.setsampwidth(2)
            w.setframerate(RATE)
            w.writeframes(data)
        return path


def private_folder(folder: Path) -> Path:
    """`folder`, made if need be, that only the user may enter (0700)."""
    folder.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(OSError):  # a file system without modes: as it is
        folder.chmod(0o700)
    return folder


def clear_recordings(folder: Path) -> None:
    """The recordings that were never sent (a sent one's copy is the store's, with its chat)."""
    if folder.is_dir():
        for f in folder.glob("recording-*.wav"):
            f.unlink(missing_ok=True)
