"""Models that hear (#42): audio and omni projectors against llama.cpp's own pipeline, and the
clips a user can get wrong.

Generated pairs (random weights, llama.cpp's real tensor layouts: Ultravox, Qwen2-Audio, and
Qwen2.5-Omni with both encoders in one file): Ebb's greedy reply must be llama.cpp's
(`mtmd_tokenize` + `mtmd_helper_eval_chunks`, sound decoded by mtmd's helper; see
tests/mtmd_reference.py) token for token wherever the model decided it, with a 16 kHz clip, a
44.1 kHz stereo one (resampled), an earlier clip from the cache, and (omni) a picture beside a
clip in one message. Ebb's later turns reuse its cache where the reference evaluates the whole
prompt: DECIDED (tests/helpers.py).
"""
from __future__ import annotations

from pathlib import Path

import pytest

from engine.gguf.families import GENERATED_AUDIO
from engine.synth.model_gen import ModelShape, write_model
from engine.synth.projector_gen import write_audio_projector
from engine.llama.sampling import GenParams
from engine.session import Session, SessionConfig
from engine.synth.sounds import write_tone
from tests.helpers import N_THREADS, agree_turn_by_turn, agree_where_decided
from tests.media_files import write_encoded_tone
from tests.mtmd_reference import reference_reply

SHAPE = ModelShape(n_layers=2, n_embd=256, n_ff=512, n_head=4, n_head_kv=2, n_ctx_train=4096)
N_REPLY = 8
N_CTX = 4096  # Qwen2-Audio: 750 tokens a 30-second chunk, and a conversation holds two clips


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("clips")
    return {"a.wav": write_tone(d / "a.wav", 440, 2.0),
            "b.wav": write_tone(d / "b.wav", 880, 3.0, rate=44100, channels=2),
            "noise.wav": write_tone(d / "noise.wav", 100, 1.0, noise=0.25)}


@pytest.fixture(scope="module")
def pairs(model_path: Path, tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    d = tmp_path_factory.mktemp("audio-families")
    # stack factor 4: the real 8 is refused (see the test below); the graph is the family's
    return {f: (write_model(d / f"lm-{f}.gguf", SHAPE, model_path, seed=1, family=f),
                write_audio_projector(d / f"mm-{f}.gguf", SHAPE.n_embd, family=f, seed=2,
                                      stack_factor=4))
            for f in GENERATED_AUDIO}


def _session(lm: Path, mm: Path, n_ctx: int = N_CTX) -> Session:
    return Session(SessionConfig(lm, mm, n_ctx=n_ctx, n_threads=N_THREADS, vision="cpu",
                                 flash_attn=True))


@pytest.mark.numerics
@pytest.mark.parametrize("family", GENERATED_AUDIO)
def test_audio_family_equals_llama_cpp(family, pairs, clips, pictures):
    """DECIDED: each turn against llama.cpp's own pipeline (its mtmd helper, another program
    and path), the decided steps counted over the turns."""
    lm, mm = pairs[family]
    turns = [("What is this sound?", [clips["a.wav"]]),
             ("And this one?", [clips["b.wav"]] + ([pictures["a.png"]] if family == "qwen2.5o" else [])),
             ("Which was louder?", [])]
    gp = GenParams(max_tokens=N_REPLY, temperature=0, top_logprobs=2)
    compared = 0  # decided steps over the turns (a random family's reply may be close at once)
    with _session(lm, mm) as s:
        seen: list[Path] = []
        for text, files in turns:
            res = s.turn(text, files, gp)
            assert res.error is None, res.error
            seen += files
            assert s.model.runtime is not None
            prompt, _ = s.model.runtime.format_chat(s.messages[:-1])
            ref, steps = reference_reply(lm, mm, prompt, seen, N_REPLY, n_threads=N_THREADS,
                                         n_ctx=N_CTX)
            assert res.gen.logprobs is not None
            compared += agree_where_decided(res.gen.logprobs, steps, at_least=0)
            if text.startswith("What"):
                first, first_tokens = res.text, res.to_dict()["n_image_tokens_encoded"]
        assert res.to_dict()["n_image_tokens_encoded"] == 0  # nothing new: the clips are cached
    assert compared > 0, "no decided step in any turn: nothing was compared with llama.cpp's"
    with _session(lm, mm) as s:  # the sound reaches the model: another clip, other embeddings
        for clip in ("a.wav", "noise.wav"):
            assert s.turn(turns[0][0], [clips[clip]], gp).error is None
        enc = s.encoder
        a, noise = (enc.embeddings(enc.chunk_key(t.image_keys[0], 0)) for t in s.history[::2])
        assert a.shape == noise.shape and abs(a - noise).max() > 1e-3
        counted = enc.ram.clip_tokens(16000)[0] if enc.ram else -1
    assert first_tokens == counted == a.shape[0] > 0  # what mtmd counts for a clip under 30 s
    print(f"\n{family}: {first!r}")


def test_an_ultravox_with_its_real_stack_factor_leaves_a_text_model_not_a_crash(
        pairs, tmp_path, clips, qtbot):
    """Ultravox's real stack factor (8) makes this llama.cpp count 187 tokens a chunk while its
    graph makes 188, and clip.cpp aborts the process on encoding. Ebb refuses the projector for
    sound and loads the language model for text, saying why sound is off: in a session, in the
    window (it was left with no model and Send off: #52) and at `serve` (it answered 503 for
    ever and `/v1/models` said vision)."""
    from tests.helpers import fresh_store, open_window
    from tests.test_server import Server

    lm, _ = pairs["ultravox"]
    mm = write_audio_projector(tmp_path / "mm-ultravox-8.gguf", SHAPE.n_embd, family="ultravox")
    with _session(lm, mm) as s:
        assert "187" in s.projector_refused and "188" in s.projector_refused
        assert "sound is off" in s.projector_refused and s.proj_info is None
        assert s.turn("Hello", [], GenParams(max_tokens=2, temperature=0)).error is None
        res = s.turn("What is this?", [clips["a.wav"]], GenParams(max_tokens=2, temperature=0))
        assert res.error and "a.wav" in res.error  # a clip is refused by name, nothing aborts
        # #67: and it says the projector was refused (it said "no projector is loaded")
        assert "refused" in res.error and "no projector is loaded" not in res.error, res.error
    w = open_window(qtbot, fresh_store(tmp_path), str(lm), str(mm), max_tokens=2)
    assert w.chat.loaded and w.send_button.isEnabled()
    assert "sound is off" in w.notices.area.text() and w.notices.area.isVisible()
    server = Server("--model", str(lm), "--mmproj", str(mm), api_key=None)
    try:
        model = server.client(key="none").models.list().data[0]
        assert not {"audio", "vision"} & set(model.model_extra["capabilities"])
        reply = server.client(key="none").chat.completions.create(
            model="m", max_tokens=2, messages=[{"role": "user", "content": "Hi"}])
        assert reply.choices[0].message.content is not None
    finally:
        server.stop()
    assert any("sound is off" in line for line in server.log)


def test_bad_clips_get_a_clear_message_and_keep_the_conversation(pairs, clips, tmp_path, pictures):
    lm, mm = pairs["qwen2a"]
    empty = tmp_path / "empty.wav"
    empty.write_bytes(b"")
    silent = write_tone(tmp_path / "silent.wav", 440, 0.0)  # a header and no samples
    damaged = tmp_path / "damaged.wav"
    damaged.write_bytes(clips["a.wav"].read_bytes()[:20] + b"\x00" * 8)
    ogg = tmp_path / "voice.ogg"
    ogg.write_bytes(b"OggS" + bytes(200))
    cut = tmp_path / "cut.m4a"  # a voice note whose download stopped half-way
    cut.write_bytes(write_encoded_tone(tmp_path / "whole.m4a", 440, 2.0).read_bytes()[:3000])
    silent_film = tmp_path / "no-sound.webm"  # pictures alone: a video, told by its streams
    _write_silent_film(silent_film)
    long = tmp_path / "two-hours.wav"  # a header that says two hours (a sparse file)
    long.write_bytes(_wav_header(rate=8000, bits=8, n_bytes=8000 * 7200))
    with open(long, "r+b") as f:
        f.truncate(44 + 8000 * 7200)
    gp = GenParams(max_tokens=4, temperature=0)
    slow = tmp_path / "one-hertz.wav"  # 5 samples at 1 Hz: no 5-second clip (#52)
    slow.write_bytes(_wav_header(rate=1, bits=8, n_bytes=5) + bytes(5))
    expect = {empty: "empty", silent: "no sound", damaged: "damaged", ogg: "damaged",
              long: "2:00:00 long", slow: "1 samples a second", cut: "damaged",
              silent_film: "is a video, and the loaded projector does not see"}
    with _session(lm, mm, n_ctx=1024) as s:
        ok = s.turn("Hello", [], gp)
        assert ok.error is None
        kept = list(s.history)
        for path, words in expect.items():
            res = s.turn("What is this?", [path], gp)
            assert res.error and words in res.error and path.name in res.error, (path, res.error)
            assert s.history == kept
        # longer than the context allows: refused with the numbers, before anything is encoded
        long_clip = write_tone(tmp_path / "long.wav", 440, 31.0)  # two chunks: 1500 tokens
        res = s.turn("What is this?", [long_clip], gp)
        assert res.error and "tokens; the context holds 1024" in res.error, res.error
        assert res.to_dict()["n_image_tokens_encoded"] == 0 and s.history == kept
        # a picture to a projector that only hears
        res = s.turn("And this?", [pictures["a.png"]], gp)
        assert res.error and "does not see" in res.error and s.history == kept
        assert s.turn("Still there?", [], gp).error is None


def _write_silent_film(path: Path) -> None:
    """A WebM with pictures and no sound track."""
    import av
    import numpy as np

    with av.open(str(path), "w") as out:
        stream = out.add_stream("libvpx", rate=10)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        for i in range(5):
            frame = av.VideoFrame.from_ndarray(np.full((48, 64, 3), i * 40, np.uint8), format="rgb24")
            out.mux(stream.encode(frame))
        out.mux(stream.encode(None))


def test_voice_notes_in_ogg_m4a_and_webm_are_heard(pairs, clips, tmp_path):
    """#52: Ogg/Opus (a phone's voice note), M4A/AAC and WebM/Opus (a browser's recording,
    written as MediaRecorder writes it: no length in the header) were refused. PyAV decodes
    them to the samples mtmd's helper makes of a WAV: 16 kHz mono float, the tone's pitch and
    length; the engine hears each, and asked again, encodes nothing."""
    import numpy as np

    from engine.media import avfile
    from engine.media.audio import clip_info
    from engine.media.kinds import is_clip

    notes = [write_encoded_tone(tmp_path / "note.ogg", 440, 2.0),
             write_encoded_tone(tmp_path / "note.m4a", 440, 2.0),
             write_encoded_tone(tmp_path / "note.webm", 440, 2.0, streamed=True)]
    formats = {n.suffix: clip_info(n).format for n in notes}
    assert formats == {".ogg": "Ogg/Opus", ".m4a": "M4A/AAC", ".webm": "WebM/Opus"}
    for note in notes:
        assert is_clip(note) and abs(clip_info(note).seconds - 2.0) < 0.1, note
        x = np.frombuffer(avfile.samples(note, 16000), np.float32)
        assert abs(len(x) / 16000 - 2.0) < 0.1
        pitch = np.argmax(np.abs(np.fft.rfft(x))) * 16000 / len(x)
        assert abs(pitch - 440) < 5, (note, pitch)
    lm, mm = pairs["qwen2a"]
    gp = GenParams(max_tokens=2, temperature=0)
    with _session(lm, mm, n_ctx=4096) as s:
        for note in notes:
            res = s.turn("What is this sound?", [note], gp)
            assert res.error is None, res.error
            assert res.to_dict()["n_image_tokens_encoded"] > 0
        res = s.turn("And the first one again?", [notes[0]], gp)
        assert res.error is None and res.to_dict()["n_image_tokens_encoded"] == 0


def _wav_header(rate: int, bits: int, n_bytes: int) -> bytes:
    import struct

    block = bits // 8
    return (b"RIFF" + struct.pack("<I", 36 + n_bytes) + b"WAVEfmt "
            + struct.pack("<IHHIIHH", 16, 1, 1, rate, rate * block, block, bits)
            + b"data" + struct.pack("<I", n_bytes))


def test_the_endpoint_takes_input_audio_from_the_official_client(pairs, clips):
    """OpenAI's `input_audio` part (base64 WAV) gets the reply the engine gives the same clip
    (DECIDED: the endpoint runs with its own context and flash attention setting);
    /v1/models says the model hears; a format Ebb does not decode is a 400 naming it."""
    import base64

    import openai

    from tests.test_server import Server

    lm, mm = pairs["qwen2a"]
    with _session(lm, mm, n_ctx=2048) as s:
        # a.wav: a reply whose first steps are decided (b.wav's first is close): compared DECIDED
        want = s.turn("What is this sound?", [clips["a.wav"]],
                      GenParams(max_tokens=N_REPLY, temperature=0, top_logprobs=2))
        # #67: a transcript is no longer than speech of the clip's length can be
        from engine.media.audio import clip_info
        from engine.server.answering import TRANSCRIPT_EXTRA_TOKENS, TRANSCRIPT_TOKENS_PER_S, _transcript_cap

        cap = int(clip_info(clips["b.wav"]).seconds * TRANSCRIPT_TOKENS_PER_S) + TRANSCRIPT_EXTRA_TOKENS
        assert _transcript_cap(s, [clips["b.wav"]], 0, str) == cap
        assert _transcript_cap(s, [clips["b.wav"]], 5, str) == 5
    server = Server("--model", str(lm), "--mmproj", str(mm), api_key=None)
    try:
        client = server.client(key="none")
        assert "audio" in client.models.list().data[0].model_extra["capabilities"]
        audio = {"data": base64.b64encode(clips["a.wav"].read_bytes()).decode(), "format": "wav"}
        got = client.chat.completions.create(
            model="m", temperature=0, max_tokens=N_REPLY, logprobs=True, top_logprobs=2,
            messages=[{"role": "user", "content": [{"type": "text", "text": "What is this sound?"},
                                                   {"type": "input_audio", "input_audio": audio}]}])
        assert got.choices[0].message.content and want.gen.logprobs
        agree_where_decided([lp.model_dump() for lp in got.choices[0].logprobs.content],
                            want.gen.logprobs)
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="m", max_tokens=2, messages=[{"role": "user", "content": [
                {"type": "input_audio", "input_audio": {**audio, "format": "midi"}}]}])
        assert "'midi' is not one Ebb decodes" in str(e.value)
        # a browser's recording (WebM/Opus, no length in its header) is heard too (#52)
        note = write_encoded_tone(clips["b.wav"].with_name("note.webm"), 440, 1.5, streamed=True)
        voice = {"data": base64.b64encode(note.read_bytes()).decode(), "format": "webm"}
        got = client.chat.completions.create(model="m", max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "text", "text": "What is this sound?"}, {"type": "input_audio", "input_audio": voice}]}])
        assert got.choices[0].message.content is not None and got.usage.prompt_tokens > 100
        # /v1/audio/transcriptions, as OpenAI's client sends it (#53): json, text, refusals
        with open(clips["a.wav"], "rb") as f:
            heard = client.audio.transcriptions.create(model="m", file=f)
        assert isinstance(heard.text, str)
        heard = client.audio.transcriptions.create(model="m", file=("note.webm", note.read_bytes()),
                                                   response_format="text")
        assert isinstance(heard, str)
        with pytest.raises(openai.BadRequestError) as e:
            client.audio.transcriptions.create(model="m", file=("notes.txt", b"hello there"))
        assert "is not one Ebb decodes" in str(e.value)
        with pytest.raises(openai.BadRequestError) as e:
            client.audio.transcriptions.create(model="m", file=("a.wav", clips["a.wav"].read_bytes()),
                                               response_format="srt")
        assert "json or text" in str(e.value)
        # a video with no sound has no speech to write down (#67: it was 200 with made-up text)
        from tests.media_files import write_video

        silent = write_video(clips["b.wav"].with_name("silent.mp4"), [((255, 0, 0), 1.0)])
        with pytest.raises(openai.BadRequestError) as e:
            client.audio.transcriptions.create(model="m", file=("silent.mp4", silent.read_bytes()))
        assert "silent.mp4 is a video with no sound" in str(e.value), str(e.value)
        # a damaged clip is named as the client named it, not by the copy written of it
        with pytest.raises(openai.BadRequestError) as e:
            client.audio.transcriptions.create(model="m", file=("voice.ogg", b"OggS" + bytes(300)))
        assert "voice.ogg" in str(e.value) and ".ogg is" not in str(e.value).replace("voice.ogg is", ""), \
            str(e.value)
    finally:
        server.stop()


def test_the_window_attaches_plays_and_sends_a_clip(qtbot, pairs, tmp_path):
    """A clip in the composer is a chip (name, length, format); sent, the transcript shows it
    with a play link and the model answers; a damaged one is named in the window, not attached;
    the switch is named for what the projector takes."""
    from tests.helpers import fresh_store, open_window, send

    lm, mm = pairs["ultravox"]
    store = fresh_store(tmp_path)
    w = open_window(qtbot, store, str(lm), str(mm), max_tokens=4)
    assert w.vision.switch.text() == "Hearing"
    clip = write_tone(tmp_path / "doorbell.wav", 660, 2.5)
    assert w.composer.attach(clip)
    chip = " ".join(lbl.text() for lbl in w.composer.findChildren(type(w.composer.error)))
    assert "♪ doorbell.wav · 0:02 · WAV" in chip  # 2.5 s rounds to even
    # #67: the message's cost counts the clip as its chunk (375 tokens here), not as 0
    per = w.models.loaded.clip_chunk_tokens
    assert per > 100 and f"≈{per:,} tokens" in w.composer.budget.text(), w.composer.budget.text()
    send(qtbot, w, "What is this sound?")
    assert not w.notices.last_error, w.notices.last_error
    assert "▶ ♪ doorbell.wav · 0:02 · WAV" in w.transcript.toPlainText()  # its own name, kept
    bad = tmp_path / "broken.wav"
    bad.write_bytes(b"RIFF\x00\x00\x00\x00WAVEjunk")
    assert not w.composer.attach(bad)
    assert w.composer.error.isVisible() and "header is damaged" in w.composer.error.text()
    # recording: miniaudio's silent capture device stands in for a microphone; the limit is
    # what the context has room for: 1024 cells, 256 for the reply, 375 a chunk, and the first
    # turn's ~420 leave less than a chunk, so one chunk (older turns make room), less a second
    assert w.record_button.isVisible()
    w.composer.record_backend = "null"
    w.record_button.click()
    assert w.composer.record_bar.isVisible()
    qtbot.waitUntil(lambda: w.composer.recorder is not None and w.composer.recorder.seconds() >= 1.0,
                    timeout=30_000)
    assert w.composer.record_label.text().endswith("/ 0:29"), w.composer.record_label.text()
    recorded = w.composer.stop_recording()
    assert recorded is not None and recorded in w.composer.attachments and not w.composer.record_bar.isVisible()
    # a voice stays in the user's data folder, readable by the user alone (#52: it went to a
    # shared /tmp folder anyone could read)
    assert recorded.parent == store.folder / "recordings"
    assert recorded.parent.stat().st_mode & 0o777 == 0o700 and recorded.stat().st_mode & 0o777 == 0o600
    send(qtbot, w, "And this?")
    assert not w.notices.last_error, w.notices.last_error
    assert "▶ ♪ recording-" in w.transcript.toPlainText()
    kept = store.messages(w.conv_id)[-2].images[0]  # the store's copy goes with its chat
    assert kept.parent == store.images_dir and store.images_dir.stat().st_mode & 0o777 == 0o700
    w.close()
    assert not recorded.exists()  # the unsent original leaves with the window


def test_a_clip_swaps_onto_the_stand_in_accelerator_as_a_picture_does(pairs, clips, pictures,
                                                                      rpc_server, tmp_path):
    """The omni projector on the RPC device: a clip and a picture are encoded by the swap (the
    live mover) and by the CPU, and the replies agree where decided; the plan names the swap."""
    import json

    from tests.helpers import run_cli

    lm, mm = pairs["qwen2.5o"]
    script = tmp_path / "script.json"
    script.write_text(json.dumps([
        {"text": "What is this sound?", "images": [str(clips["a.wav"])]},
        {"text": "And these?", "images": [str(pictures["a.png"]), str(clips["b.wav"])]}]))
    runs = {}
    for vision in ("swap", "cpu"):
        proc = run_cli("chat", "--model", str(lm), "--mmproj", str(mm), "--rpc", rpc_server.endpoint,
                       "--script", str(script), "--temp", "0", "--max-tokens", str(N_REPLY),
                       "--ctx", str(N_CTX), "--threads", str(N_THREADS), "--vision", vision,
                       "--mover", "live", "--json", "--top-logprobs", "2", timeout=300)
        assert proc.returncode == 0, proc.stderr
        runs[vision] = [json.loads(line) for line in proc.stdout.splitlines()]
        assert all("error" not in t for t in runs[vision]), runs[vision]
    assert [t["strategy"] for t in runs["swap"]] == ["swap", "swap"]
    agree_turn_by_turn(runs["swap"], runs["cpu"])  # encoded on the device or the CPU: DECIDED


@pytest.fixture
def virtual_microphone(tmp_path, monkeypatch):
    """A private PulseAudio server whose default source is a sine at 880 Hz: a microphone that
    says something known (skipped where PulseAudio is not installed: `make test` installs it
    where it can)."""
    import shutil
    import subprocess
    import time

    if not shutil.which("pulseaudio") or not shutil.which("pactl"):
        pytest.skip("PulseAudio is not installed (sudo apt-get install pulseaudio)")
    run = tmp_path / "pulse"
    run.mkdir()
    server = f"unix:{run / 'native'}"
    env = {**__import__("os").environ, "PULSE_RUNTIME_PATH": str(run), "HOME": str(run)}
    proc = subprocess.Popen(
        ["pulseaudio", "-n", "--daemonize=no", "--exit-idle-time=-1", "--use-pid-file=no",
         "-L", f"module-native-protocol-unix socket={run / 'native'} auth-anonymous=1",
         "-L", "module-null-sink", "-L", "module-sine-source frequency=880 source_name=tone"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while subprocess.run(["pactl", "-s", server, "set-default-source", "tone"], env=env,
                             capture_output=True).returncode != 0:
            assert proc.poll() is None, f"pulseaudio ended: {proc.stderr.read() if proc.stderr else ''}"
            assert time.monotonic() < deadline, "pulseaudio did not come up"
            time.sleep(0.1)
        monkeypatch.setenv("PULSE_SERVER", server)
        yield server
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_a_recording_from_a_virtual_microphone_is_what_it_heard(virtual_microphone, tmp_path, qtbot):
    """The system's capture (no test backend) through PulseAudio: the WAV holds the sine."""
    import wave

    import numpy as np

    from app.sound.recorder import RATE, Recorder

    rec = Recorder()
    rec.start()
    qtbot.waitUntil(lambda: rec.seconds() >= 1.5, timeout=30_000)  # the sound itself, however long
    assert rec.level() > 0.5  # the meter sees the tone
    path = rec.stop(tmp_path)
    assert rec.shortfall(rec.seconds()) == ""  # whole
    # #67: a take the sound system dropped most of (1 s of 60) is said, with both lengths
    assert rec.shortfall(60.0).startswith(f"The microphone delivered {rec.seconds():.1f} s of sound in a 60.0 s take")
    with wave.open(str(path)) as w:
        assert (w.getnchannels(), w.getframerate()) == (1, RATE)
        x = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2").astype(float)
    spectrum = np.abs(np.fft.rfft(x[-RATE:]))  # the last second: 1 Hz a bin
    assert abs(int(np.argmax(spectrum)) - 880) <= 2


PLAY_AND_EXIT = """
import sys, time
from pathlib import Path
from app.sound.clips import ClipPlayer
player = ClipPlayer(print)
player.toggle(Path(sys.argv[1]))
while not player.poll():  # the stream says when it ends
    time.sleep(0.05)
assert player.playing is None
player.toggle(Path(sys.argv[1]))  # and ▶ again plays it again
assert player.playing is not None
print("playing again", flush=True)
# the process ends here with the device open: it must not wait on it
"""


def test_a_clip_that_played_plays_again_and_never_holds_the_process(virtual_microphone, tmp_path,
                                                                    qtbot):
    """#52: after a clip ended the next ▶ was silent, and a process that had played a clip
    never ended (miniaudio's device thread). Played through a private PulseAudio server."""
    import subprocess
    import sys

    from app.widgets.composer import Composer

    clip = write_tone(tmp_path / "ding.wav", 660, 0.3)
    proc = subprocess.run([sys.executable, "-c", PLAY_AND_EXIT, str(clip)], capture_output=True,
                          text=True, timeout=120)  # before: it never ended
    assert proc.returncode == 0 and "playing again" in proc.stdout, proc.stderr
    composer = Composer()
    qtbot.addWidget(composer)
    assert composer.attach(clip)
    button = composer._play_buttons[clip]
    composer.toggle_play(clip)
    assert button.text() == "■"  # a stop state while it plays
    qtbot.waitUntil(lambda: button.text() == "▶", timeout=60_000)  # back at its end
    composer.toggle_play(clip)
    assert button.text() == "■" and composer.player.playing == clip
    composer.toggle_play(clip)
    assert button.text() == "▶" and composer.player.playing is None
    # a phone's voice note plays too (PyAV decodes it on the device's thread) and ends
    note = write_encoded_tone(tmp_path / "voice-note.ogg", 440, 0.3)
    assert composer.attach(note)
    chip = " ".join(lbl.text() for lbl in composer.findChildren(type(composer.error)))
    assert "♪ voice-note.ogg · 0:00 · Ogg/Opus" in chip, chip
    composer.toggle_play(note)
    assert composer._play_buttons[note].text() == "■" and composer.player.playing == note
    qtbot.waitUntil(lambda: composer._play_buttons[note].text() == "▶", timeout=60_000)


def test_an_omni_projector_hears_a_videos_sound_with_its_frames(pairs, tmp_path):
    """#53: a video to a projector that sees and hears: its frames, then its sound as a clip;
    reopened from the saved reference, nothing is encoded again."""
    from tests.media_files import write_video

    lm, mm = pairs["qwen2.5o"]
    clip = write_video(tmp_path / "talk.mp4", [((220, 20, 30), 1.0), ((20, 30, 220), 1.0)],
                       sound_hz=440)
    gp = GenParams(max_tokens=2, temperature=0)
    with _session(lm, mm) as s:
        res = s.turn("What happens here?", [clip], gp)
        assert res.error is None, res.error
        assert res.n_images_encoded == 3 and "with its sound" in res.attachment_lines[0]
        marker = s.encoder.marker
        assert s.messages[0]["content"].count(marker) == 3
        s.set_history([("user", "What happens here?", res.attachments), ("assistant", res.text, [])])
        again = s.turn("And then?", [], gp)
        assert again.error is None and again.n_image_tokens_encoded == 0
