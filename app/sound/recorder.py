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
# the device's buffer: at miniaudio's 200 ms (and more so at 50) a PulseAudio source whose
# callbacks came late lost most of a take (seen: 0.2 s of 5 s at 50 ms); 500 ms kept up
BUFFER_MS = 500
SHORT_BY_S = 2.0  # a take that got this much less sound than it ran is said, not kept silent
NULL_DEVICE = "generate zero samples"  # miniaudio's stand-in when a machine has no capture


class RecordError(Exception):
    """Why recording cannot start or go on, in the window's words."""


def device_words(exc: BaseException) -> str:
    """A sound library's error in words: miniaudio's `(('failed to init device', -401))` is
    "failed to init device (error -401)"."""
    args: tuple[Any, ...] = exc.args
    while len(args) == 1 and isinstance(args[0], tuple):
        args = args[0]
    texts = [str(a) for a in args if isinstance(a, str) and a]
    codes = [a for a in args if isinstance(a, int) and not isinstance(a, bool)]
    words = "; ".join(texts) or getattr(exc, "strerror", None) or type(exc).__name__
    return f"{words} (error {codes[0]})" if codes else str(words)


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
        self.ran_s = 0.0  # how long the take ran, from start to stop

    def start(self) -> None:
        import miniaudio

        try:
            if not self.backend:
                devices = miniaudio.Devices().get_captures()
                if not devices or all(NULL_DEVICE in str(d.get("name", "")) for d in devices):
                    raise RecordError("No microphone found: connect one, or check that the system "
                                      "lets Ebb use it")
            device = miniaudio.CaptureDevice(input_format=miniaudio.SampleFormat.SIGNED16,
                                             nchannels=1, sample_rate=RATE, buffersize_msec=BUFFER_MS,
                                             backends=_backends(self.backend), app_name="Ebb")
            sink = self._sink()
            next(sink)
            device.start(sink)
        except RecordError:
            raise
        except (miniaudio.MiniaudioError, OSError, AttributeError) as exc:
            raise RecordError(f"The microphone could not be opened ({device_words(exc)}): check that one is "
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

    def shortfall(self, ran_s: float) -> str:
        """What to say when the sound captured is well short of how long the take ran (a sound
        system that dropped the rest), or "" when it is whole."""
        got = self.seconds()
        if ran_s - got < max(SHORT_BY_S, 0.2 * ran_s):
            return ""
        return (f"The microphone delivered {got:.1f} s of sound in a {ran_s:.1f} s take: the "
                "sound system dropped the rest. The clip holds what came; check the input "
                "device in the system's sound settings, or record again")

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
        self.ran_s = time.monotonic() - self.started if self.started else 0.0
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
