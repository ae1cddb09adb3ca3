"""#53: videos and documents through the engine. The tests write their own videos (PyAV: MP4,
MOV, MKV, WebM, AVI, GIF) and PDFs (Pillow's picture PDFs as a scanner writes them, a text PDF
written by hand, one locked by pikepdf). The demo colour projector names what it is shown, so
a frame or a page that reached the model is checked by its colour, not only by its bytes."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from engine.errors import EbbError
from engine.synth.projector_gen import COLOURS
from engine.llama.sampling import GenParams
from engine.measure.colour_check import QUESTION, SHADES
from engine.media import attachments, documents, kinds, video
from engine.session import Session, SessionConfig
from tests.helpers import N_THREADS, first_colour
from tests.media_files import (encrypt_pdf, write_encoded_tone, write_picture_pdf, write_text_pdf,
                               write_video)

RED, GREEN, BLUE = (SHADES[c][0] for c in ("red", "green", "blue"))
GREEDY = GenParams(max_tokens=12, temperature=0)


@pytest.fixture(scope="module")
def seeing(model_path, colour_projector):
    with Session(SessionConfig(model_path, colour_projector, n_ctx=2048, n_threads=N_THREADS,
                               vision="cpu")) as s:
        yield s


@pytest.fixture(scope="module")
def reading(model_path):
    with Session(SessionConfig(model_path, None, n_ctx=2048, n_threads=N_THREADS)) as s:
        yield s


def test_every_container_is_a_video_and_gives_the_frame_on_screen(tmp_path):
    """MP4 (H.264), MOV, MKV (VP9), WebM (VP8, with sound), AVI (MJPEG) and an animated GIF:
    each is told a video by its content, and a frame asked for at a time is the scene then."""
    for suffix in video_suffixes():
        path = write_video(tmp_path / f"scenes{suffix}", [(RED, 2.0), (BLUE, 2.0)],
                           sound_hz=440 if suffix == ".webm" else 0)
        assert kinds.kind_of(path) == kinds.VIDEO, suffix
        info = video.probe(path)
        assert abs(info.seconds - 4.0) < 0.1 and (info.width, info.height) == (96, 64), (suffix, info)
        frames = video.decode(path, [0.5, 1.9, 2.1, 3.9], (48, 32))
        got = [_nearest(im.getpixel((10, 10))) for _, im in frames]
        assert got == ["red", "red", "blue", "blue"], (suffix, got)
    voice = write_encoded_tone(tmp_path / "voice.webm", 440, 1.0)  # WebM with sound alone: a clip
    assert kinds.kind_of(voice) == kinds.CLIP


def video_suffixes() -> list[str]:
    return [".mp4", ".mov", ".mkv", ".webm", ".avi", ".gif"]


def _nearest(rgb) -> str:
    return min(("red", RED), ("green", GREEN), ("blue", BLUE),
               key=lambda c: sum((a - b) ** 2 for a, b in zip(rgb, c[1])))[0]


def test_frames_fit_the_room_repeats_go_and_the_layout_is_llama_cpps():
    info = video.VideoInfo(130.0, 30.0, 1920, 1080, "h264", "MP4", True)
    s = video.plan(info, tokens_per_frame=64, room_tokens=2048)  # 32 frames fit
    assert len(s.times()) == 32 and s.every_s == pytest.approx(130 / 32, abs=1e-3)
    assert video.plan(info, 64, 10**9).every_s == pytest.approx(130 / video.MAX_FRAMES, abs=1e-3)
    short = video.VideoInfo(2.0, 30.0, 64, 64, "h264", "MP4", False)
    assert video.plan(short, 1, 10**9).every_s == 1 / video.MAX_FPS  # never more than 4 a second
    assert video.plan(info, 64, 2048, start=10, end=70, every_s=30).times() == [10.0, 40.0]
    with pytest.raises(EbbError, match="room for 10"):
        video.plan(info, 64, 10)
    assert video.frame_size(info, 448) == (448, 252)
    # llama.cpp's helper: "Video:" first, a timestamp after the first frame at or past each 5 s
    assert video.layout([0.0, 2.5, 5.0, 7.5, 10.0]) == [
        ("Video:", "[0m0.00s]"), ("", ""), ("", "[0m5.00s]"), ("", ""), ("", "[0m10.00s]")]
    assert video.layout([0.0, 65.5])[1] == ("", "[1m5.50s]")


def test_a_video_reaches_the_model_frame_by_frame_and_is_encoded_once(seeing, tmp_path):
    """A video of one colour is named right; one whose colour changes gives a frame from each
    part (repeats left out, and said); the prompt is laid out as llama.cpp's; the same video in
    a later message, and the chat reopened from its saved reference, encode nothing."""
    green = write_video(tmp_path / "green.webm", [(GREEN, 3.0)])
    seeing.set_history([])
    res = seeing.turn(QUESTION, [green], GREEDY)
    assert res.error is None and first_colour(res.text) == "green", (res.error, res.text)
    assert res.n_images_encoded == 1 and "repeated the one before" in " ".join(res.notes)
    changing = write_video(tmp_path / "changing.mp4", [(RED, 2.0), (GREEN, 2.0), (BLUE, 2.0)])
    seeing.set_history([])
    res = seeing.turn(QUESTION, [changing], GREEDY)
    assert res.error is None, res.error
    ref = attachments.parse(res.attachments[0])
    assert ref.frames == (0.0, 2.0, 4.0), res.attachments  # one frame from each part
    assert res.n_images_encoded == 3 and "3 frames" in res.attachment_lines[0]
    content = seeing.messages[0]["content"]
    marker = seeing.encoder.marker
    assert content.startswith(f"Video:{marker}[0m0.00s]{marker}{marker}\n"), content
    one_token = GenParams(max_tokens=1, temperature=0)  # what is checked is the encoding
    again = seeing.turn("And this one?", [changing], one_token)
    assert again.error is None and again.n_image_tokens_encoded == 0  # cached by content
    seeing.set_history([("user", QUESTION, res.attachments), ("assistant", res.text, [])])
    reopened = seeing.turn("What colour came last?", [], one_token)
    assert reopened.error is None and reopened.n_image_tokens_encoded == 0
    assert seeing.messages[0]["content"] == content


def test_a_pdf_is_pages_to_a_model_that_sees_and_text_to_one_that_reads(seeing, reading, tmp_path):
    scan = write_picture_pdf(tmp_path / "scan.pdf", [RED, BLUE, GREEN])
    seeing.set_history([])
    res = seeing.turn(QUESTION, [f"{scan}#pages=2"], GREEDY)
    assert res.error is None and first_colour(res.text) == "blue", (res.error, res.text)
    assert res.attachments == [f"{scan}#pages=2"] and "1 page as pictures" in res.attachment_lines[0]
    letter = write_text_pdf(tmp_path / "letter.pdf", ["The secret word is marmalade.", "Page two."])
    reading.set_history([])
    res = reading.turn("What is the secret word?", [letter], GREEDY)
    assert res.error is None, res.error
    assert "marmalade" in reading.messages[0]["content"] and "[page 2]" in reading.messages[0]["content"]
    kept = list(reading.history)
    refusals = {scan: "no text in it: it is scanned",
                encrypt_pdf(letter, tmp_path / "locked.pdf", "hunter2"): "locked with a password",
                _damaged(tmp_path / "damaged.pdf"): "damaged",
                write_picture_pdf(tmp_path / "long.pdf", [RED] * 100, (20, 20)): "has 100 pages; Ebb takes up to 64"}
    for path, words in refusals.items():
        res = reading.turn("What does it say?", [path], GREEDY)
        assert res.error and words in res.error and path.name in res.error, (path, res.error)
        assert reading.history == kept
    res = reading.turn("And these?", [f"{tmp_path / 'long.pdf'}#pages=98-100&as=text"], GREEDY)
    assert res.error and "no text" in res.error  # a range of a long one is taken (then read)


def _damaged(path: Path) -> Path:
    path.write_bytes(b"%PDF-1.4\n1 0 obj << /Type /Catalog >> endobj\ngarbage")
    return path


def test_a_text_file_goes_in_fenced_and_named_and_a_binary_one_is_refused(reading, tmp_path):
    notes = tmp_path / "notes.md"
    notes.write_text("# Plan\nBuy ```milk```.\n")
    reading.set_history([])
    res = reading.turn("Summarise.", [notes], GREEDY)
    assert res.error is None, res.error
    content = reading.messages[0]["content"]
    assert content.startswith("notes.md:\n````markdown\n# Plan\nBuy ```milk```.\n````\n\nSummarise.")
    blob = tmp_path / "data.txt"
    blob.write_bytes(b"ab\x00\x01" * 100)
    res = reading.turn("And this?", [blob], GREEDY)
    assert res.error and "not text" in res.error


def test_a_video_with_no_pictures_a_damaged_one_and_a_ten_hour_one_are_refused(seeing, tmp_path):
    from fractions import Fraction

    import av

    long = tmp_path / "ten-hours.mkv"
    with av.open(str(long), "w") as out:  # two frames ten hours apart
        s = out.add_stream("libvpx-vp9", rate=1)
        s.width, s.height, s.pix_fmt = 32, 32, "yuv420p"
        s.codec_context.time_base = s.time_base = Fraction(1, 1)
        import numpy as np

        for pts in (0, 36000):
            f = av.VideoFrame.from_ndarray(np.zeros((32, 32, 3), np.uint8), format="rgb24")
            f.pts = pts
            out.mux(s.encode(f))
        out.mux(s.encode(None))
    whole = write_video(tmp_path / "whole.mp4", [(RED, 2.0)])
    cut = tmp_path / "cut.mp4"
    cut.write_bytes(whole.read_bytes()[:400])
    sound_only = write_encoded_tone(tmp_path / "sound-only.m4a", 440, 1.0)
    for path, words in {long: "10:00:0. long", cut: "damaged", sound_only: "no pictures"}.items():
        with pytest.raises(EbbError, match=words):
            video.probe(path)
    seeing.set_history([])
    res = seeing.turn(QUESTION, [cut], GREEDY)
    assert res.error and "cut.mp4" in res.error
    res = seeing.turn(QUESTION, [f"{whole}#frames=0"], GREEDY)  # a saved reference works
    assert res.error is None and first_colour(res.text) == "red", (res.error, res.text)


@pytest.mark.slow  # a stand-in or a server of its own: CI's test-slow runs it
def test_the_frames_of_a_video_borrow_the_stand_in_device_once(model_path, colour_projector,
                                                               rpc_server, tmp_path):
    """A video of three scenes through the swap on the RPC device: the three frames are
    encoded under one borrow (one evict, one restore), and the reply names a colour."""
    from tests.helpers import run_cli

    clip = write_video(tmp_path / "three.mp4", [(RED, 1.0), (GREEN, 1.0), (BLUE, 1.0)])
    proc = run_cli("chat", "--model", str(model_path), "--mmproj", str(colour_projector),
                   "--rpc", rpc_server.endpoint, "--vision", "swap", "--prompt", QUESTION,
                   "--image", str(clip), "--temp", "0", "--max-tokens", "8", "--ctx", "2048",
                   "--threads", str(N_THREADS), "--json", timeout=300)
    assert proc.returncode == 0, proc.stderr
    turn = json.loads(proc.stdout.strip().splitlines()[-1])
    assert turn["strategy"] == "swap" and turn["n_images_encoded"] == 3, turn
    steps = [s["name"] for s in turn["spans"]]
    assert steps.count("evict") == 1 and steps.count("restore") == 1, steps
    # the Steps lane names each: frame i of n
    assert [s.get("detail") for s in turn["spans"] if s["name"] == "encode"] == [
        f"three.mp4 frame {i} of 3" for i in (1, 2, 3)], turn["spans"]
    assert first_colour(turn["text"]) in COLOURS


def test_one_place_decides_what_a_file_is(tmp_path):
    from PIL import Image

    png = tmp_path / "picture.txt"  # a picture with a text file's name is a picture
    Image.new("RGB", (4, 4)).save(png, format="PNG")
    plain = tmp_path / "README"
    plain.write_text("hello")
    still = tmp_path / "still.gif"
    Image.new("RGB", (4, 4)).save(still)
    assert [kinds.kind_of(p) for p in (png, plain, still)] == [kinds.PICTURE, kinds.TEXT, kinds.PICTURE]
    assert kinds.kind_of(write_text_pdf(tmp_path / "doc.bin", ["x"])) == kinds.PDF
    assert documents.parse_pages("3-5", 10) == (3, 5) and documents.parse_pages("", 4) == (1, 4)
    with pytest.raises(EbbError, match="outside"):
        documents.parse_pages("9-12", 10)
    ref = attachments.parse("/x/clip #1.mp4#every=4&from=10&to=70")
    assert (ref.path, ref.every_s, ref.start, ref.end) == (Path("/x/clip #1.mp4"), 4.0, 10.0, 70.0)
    assert attachments.parse(str(ref)) == ref
    assert attachments.parse("/x/odd#name.mp4").path == Path("/x/odd#name.mp4")


def test_the_window_attaches_a_video_and_pdfs_shows_their_cost_and_keeps_what_was_taken(
        qtbot, model_path, colour_projector, tmp_path, monkeypatch):
    """The composer takes a video (its chip: length, container, the frames planned and their
    tokens; the message's total against the context's room), a locked PDF (its password asked,
    an unlocked copy attached) and a 100-page one (a range asked); sent, the transcript says
    what was taken, the store keeps it, and the chat reopened answers with nothing encoded."""
    from PySide6.QtWidgets import QLabel

    from tests.helpers import fresh_store, open_window, send

    store = fresh_store(tmp_path)
    store.settings.set("ctx", 2048)
    w = open_window(qtbot, store, str(model_path), str(colour_projector), max_tokens=8)
    clip = write_video(tmp_path / "changing.mp4", [(RED, 2.0), (GREEN, 2.0), (BLUE, 2.0)])
    assert w.composer.attach(clip)
    chip = " ".join(lbl.text() for lbl in w.composer.findChildren(QLabel))
    assert "▣ changing.mp4 · 0:06 · MP4 · up to 24 frames, 4 a second" in chip, chip
    assert w.composer.budget.isVisible() and "tokens of the" in w.composer.budget.text()
    letter = write_text_pdf(tmp_path / "letter.pdf", ["The secret word is marmalade."])
    locked = encrypt_pdf(letter, tmp_path / "statement.pdf", "hunter2")
    answers = iter(["wrong", "hunter2"])  # a wrong password is asked again, saying so (#67)
    asked: list[str] = []
    monkeypatch.setattr(w.composer, "ask_text", lambda t, label, *a, **k: asked.append(label) or next(answers))
    assert w.composer.attach(locked)
    assert "Wrong password" not in asked[0] and asked[1].startswith("Wrong password: statement.pdf")
    unlocked = w.composer.attachments[-1]
    assert unlocked.name == "statement.pdf" and unlocked != locked
    assert unlocked.stat().st_mode & 0o777 == 0o600 and documents.pdf_info(unlocked).pages == 1
    w.composer.detach(unlocked)
    long = write_picture_pdf(tmp_path / "long.pdf", [RED] * 100, (20, 20))
    monkeypatch.setattr(w.composer, "ask_text", lambda *a, **k: "99-100")
    assert w.composer.attach(long)
    assert str(w.composer.attachments[-1]).endswith("long.pdf#pages=99-100")
    chip = " ".join(lbl.text() for lbl in w.composer.findChildren(QLabel))
    assert "▤ long.pdf · 100 pages · pages 99-100 · as pictures" in chip, chip
    monkeypatch.setattr(w.composer, "ask_text", lambda *a, **k: "98-99 text")  # its ⋯: as text
    w.composer.choose(w.composer.attachments[-1])  # a scan has no text: refused, kept as it was
    assert "no text in it" in w.composer.error.text() and w.composer.error.isVisible()
    assert str(w.composer.attachments[-1]).endswith("long.pdf#pages=99-100")
    monkeypatch.setattr(w.composer, "ask_text", lambda *a, **k: "98-99")  # other pages
    w.composer.choose(w.composer.attachments[-1])
    assert str(w.composer.attachments[-1]).endswith("long.pdf#pages=98-99")
    w.composer.detach(w.composer.attachments[-1])
    monkeypatch.setattr(w.composer, "ask_text", lambda *a, **k: "0.5, 0:01-0:04")  # the video's ⋯
    w.composer.choose(clip)
    chosen = w.composer.attachments[0]
    assert attachments.parse(chosen) == attachments.Ref(clip, every_s=0.5, start=1.0, end=4.0)
    chip = " ".join(lbl.text() for lbl in w.composer.findChildren(QLabel))
    assert "up to 6 frames of 0:01-0:04, 2 a second" in chip, chip
    monkeypatch.setattr(w.composer, "ask_text", lambda *a, **k: "")  # empty: Ebb's choice again
    w.composer.choose(chosen)
    assert w.composer.attachments == [clip]
    w.grab().save(str(tmp_path / "video-chip.png"))
    send(qtbot, w, QUESTION)
    assert not w.notices.last_error, w.notices.last_error
    user = store.messages(w.conv_id)[-2]
    assert list(user.fragments.values()) == ["frames=0,2,4"], user.fragments
    assert "▣ changing.mp4 · 0:06 · MP4 · 3 frames" in w.transcript.toPlainText()
    w.sending.send_history()  # the chat as reopened: its references, nothing decoded
    send(qtbot, w, "And the colour before that?")
    assert not w.notices.last_error, w.notices.last_error
    reply = store.messages(w.conv_id)[-1]
    assert reply.stats.encode_s == 0 and first_colour(reply.text) in COLOURS, reply
    w.grab().save(str(tmp_path / "video-sent.png"))
    w.close()


@pytest.mark.slow  # a stand-in or a server of its own: CI's test-slow runs it
def test_the_endpoint_takes_input_video_and_file_parts(model_path, colour_projector, tmp_path):
    """llama-server's `input_video` (data) and OpenAI's `file` part (a PDF as file_data, a text
    file by its name) reach the model; what the window refuses, the endpoint refuses in
    OpenAI's error shape."""
    import base64

    import openai

    from tests.test_server import Server

    def b64(path: Path) -> str:
        return base64.b64encode(path.read_bytes()).decode()

    green = write_video(tmp_path / "green.mp4", [(GREEN, 2.0)])
    scan = write_picture_pdf(tmp_path / "scan.pdf", [BLUE])
    notes = tmp_path / "notes.txt"
    notes.write_text("The meeting is on Tuesday.")
    locked = encrypt_pdf(write_text_pdf(tmp_path / "l.pdf", ["x"]), tmp_path / "locked.pdf", "pw")
    server = Server("--model", str(model_path), "--mmproj", str(colour_projector), "--ctx", "2048",
                    api_key=None)
    try:
        client = server.client(key="none")

        def ask(part: dict) -> str:
            got = client.chat.completions.create(
                model="m", temperature=0, max_tokens=12,
                messages=[{"role": "user", "content": [{"type": "text", "text": QUESTION}, part]}])
            return got.choices[0].message.content or ""

        video_part = {"type": "input_video", "input_video": {"data": b64(green), "format": "mp4"}}
        assert first_colour(ask(video_part)) == "green"
        pdf_part = {"type": "file", "file": {"filename": "scan.pdf",
                                             "file_data": f"data:application/pdf;base64,{b64(scan)}"}}
        assert first_colour(ask(pdf_part)) == "blue"
        assert ask({"type": "file", "file": {"filename": "notes.txt", "file_data": b64(notes)}})
        refusals = [({"type": "input_video", "input_video": {"data": b64(notes), "format": "mp4"}},
                     "not a video"),
                    ({"type": "file", "file": {"file_id": "file-abc"}}, "no Files API"),
                    ({"type": "file", "file": {"filename": "locked.pdf", "file_data": b64(locked)}},
                     "locked with a password")]
        for part, words in refusals:
            with pytest.raises(openai.BadRequestError) as e:
                ask(part)
            assert words in str(e.value), (words, str(e.value))
    finally:
        server.stop()


_THREE_SWAPS = """
import sys
from pathlib import Path
from typing import Any
from engine.config import SessionConfig
from engine.llama.sampling import GenParams
from engine.media.images import write_noise_picture
from engine.session import Session
model, projector, endpoint, folder, threads = sys.argv[1:6]
cfg = SessionConfig(model_path=Path(model), mmproj_path=Path(projector), n_ctx=4096,
                    n_threads=int(threads), vision="swap", rpc=(endpoint,))
with Session(cfg) as s:
    print("layers on the device:", s.model.placement.n_gpu_layers, flush=True)
    # what the projector in RAM is bound to must outlive a swap (the runtime does not)
    print("bound to the runtime:", s.model.host_model() is s.model.runtime, flush=True)
    for i in range(3):
        r = s.turn("And this?", [write_noise_picture(Path(folder) / f"{i}.png", i)],
                   GenParams(max_tokens=1, temperature=0))
        print(i, r.strategy, r.error, flush=True)
"""


@pytest.mark.slow  # a stand-in or a server of its own: CI's test-slow runs it
def test_a_swap_with_no_layer_on_the_device_leaves_a_model_for_the_next_message(
        model_path, base_projector, tmp_path):
    """Found by `bench media`: with a device too small for any layer, a swap (the reload mover)
    still frees the model, and the projector in RAM was bound to it; the next message's
    pictures were tokenized against a freed model and the process died (SIGSEGV; a freed
    model's memory is not always reused at once, so the binding is checked too). Three
    messages with a picture each now get three replies."""
    import subprocess
    import sys

    from tests.helpers import RpcServer

    server = RpcServer("--device-memory", "400M")
    try:
        proc = subprocess.run([sys.executable, "-c", _THREE_SWAPS, str(model_path), str(base_projector),
                               server.endpoint, str(tmp_path), str(N_THREADS)],
                              capture_output=True, text=True, timeout=300)
    finally:
        server.stop()
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-3000:])
    lines = proc.stdout.splitlines()
    assert lines[:2] == ["layers on the device: 0", "bound to the runtime: False"], lines
    assert lines[2:] == ["0 swap None", "1 swap None", "2 swap None"], lines


@pytest.mark.skipif(__import__("shutil").which("ffmpeg") is None,
                    reason="ffmpeg not installed (make test installs it where it can)")
def test_the_same_video_gives_the_frames_and_prompt_llama_cpps_helper_gives(model_path,
                                                                             colour_projector,
                                                                             tmp_path):
    """This llama.cpp build's own video helper (`mtmd_helper_video`, which runs an ffmpeg binary
    at 4 frames a second, a timestamp every 5 s) beside Ebb's frames of the same video taken at
    the same times, whole size: the same pieces in the same order (text "Video:", frame,
    "[0m0.00s]", frame, …), each frame the same size, and the same pixels (ffmpeg's command
    line as the helper runs it, against PyAV's decode)."""
    import ctypes
    import subprocess

    import llama_cpp.mtmd_cpp as M
    import numpy as np

    from engine.llama.lib import llama

    clip = write_video(tmp_path / "scenes.mp4", [(RED, 2.0), (GREEN, 2.0), (BLUE, 2.5)], fps=10)
    L = llama()
    mp = L.llama_model_default_params()
    mp.n_gpu_layers = 0
    no_devices = (ctypes.c_void_p * 1)(None)  # the CPU only: never a device registered earlier
    mp.devices = ctypes.cast(no_devices, ctypes.c_void_p)  # in this process (a stand-in gone)
    model_p = L.llama_model_load_from_file(str(model_path).encode(), mp)
    params = M.mtmd_context_params_default()
    params.use_gpu, params.n_threads, params.print_timings = False, N_THREADS, False
    mctx = M.mtmd_init_from_file(str(colour_projector).encode(), model_p, params)
    vocab = L.llama_model_get_vocab(model_p)

    def words(tokens: list[int]) -> str:
        out = b""
        for tok in tokens:
            buf = ctypes.create_string_buffer(64)
            n = L.llama_token_to_piece(vocab, tok, buf, len(buf), 0, True)
            out += buf.raw[:n]
        return out.decode()

    chunks = M.mtmd_input_chunks_init()
    try:
        got = M.mtmd_helper_bitmap_init_from_file_wrapper(mctx, str(clip).encode(), False,
                                                          M.mtmd_helper_init_opt_default())
        assert got.bitmap, "the helper could not open the video"
        text = M.mtmd_input_text()
        raw = M.mtmd_default_marker()
        text.text, text.text_len, text.add_special, text.parse_special = raw, len(raw), False, True
        arr = (M.mtmd_bitmap_p_ctypes * 1)(got.bitmap)
        assert M.mtmd_tokenize(mctx, chunks, ctypes.byref(text), arr, 1) == 0
        helper: list[tuple[str, Any]] = []
        for i in range(M.mtmd_input_chunks_size(chunks)):
            chunk = M.mtmd_input_chunks_get(chunks, i)
            if M.mtmd_input_chunk_get_type(chunk) == M.MTMD_INPUT_CHUNK_TYPE_TEXT:
                n = ctypes.c_size_t()
                toks = M.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(n))
                helper.append(("text", words([toks[j] for j in range(n.value)])))
            else:
                image = M.mtmd_input_chunk_get_tokens_image(chunk)
                helper.append(("frame", (M.mtmd_image_tokens_get_nx(image), M.mtmd_image_tokens_get_ny(image))))
        M.mtmd_bitmap_free(got.bitmap)
        if got.video_ctx:
            M.mtmd_helper_video_free(got.video_ctx)
    finally:
        M.mtmd_input_chunks_free(chunks)
        M.mtmd_free(mctx)
        L.llama_model_free(model_p)
    n_frames = sum(kind == "frame" for kind, _ in helper)
    assert n_frames == 26  # 6.5 s at 4 a second
    times = [k / video.MAX_FPS for k in range(n_frames)]
    e = attachments.expand(f"{clip}#frames={','.join(f'{t:g}' for t in times)}",
                           attachments.Projector(True, 10_000, lambda w, h: 1), 10**6,
                           lambda p: None)  # type: ignore[arg-type,return-value]
    ebb: list[tuple[str, Any]] = []
    for (before, after), m in zip(e.labels, e.media):
        ebb += [("text", before)] if before else []
        ebb.append(("frame", (m.width, m.height)))
        ebb += [("text", after.rstrip("\n"))] if after.rstrip("\n") else []
    helper_sizes = {size for kind, size in helper if kind == "frame"}
    assert helper_sizes and all(kind == "frame" for kind, _ in helper if kind == "frame")
    assert [(k, v) for k, v in helper if k == "text"] == [(k, v) for k, v in ebb if k == "text"]
    assert [k for k, _ in helper] == [k for k, _ in ebb]  # the same pieces in the same order
    # the helper's frames: ffmpeg as it runs it; Ebb's: PyAV at the same times
    raw_frames = subprocess.run(["ffmpeg", "-nostdin", "-i", str(clip), "-vf", "fps=4.000000", "-f",
                                 "rawvideo", "-pix_fmt", "rgb24", "pipe:1", "-loglevel", "error"],
                                capture_output=True, check=True).stdout
    theirs = np.frombuffer(raw_frames, np.uint8).reshape(-1, 64, 96, 3)
    assert len(theirs) == n_frames
    ours = np.stack([np.frombuffer(m.rgb, np.uint8).reshape(64, 96, 3) for m in e.media])
    diff = np.abs(theirs.astype(int) - ours.astype(int)).mean(axis=(1, 2, 3))
    assert diff.max() < 3.0, diff  # colour conversion rounding, not another frame


def test_stop_between_two_frames_keeps_the_frames_encoded(seeing, tmp_path, monkeypatch):
    """Stop lands between two frames of a video: the turn ends there, the frame already encoded
    stays cached, and sent again the video encodes only the two left."""
    import threading

    clip = write_video(tmp_path / "three.mp4", [(RED, 1.0), (GREEN, 1.0), (BLUE, 1.0)])
    stop = threading.Event()
    real = seeing.encoder.encode
    encoded = []

    def encode_then_stop(*args, **kwargs):
        out = real(*args, **kwargs)
        encoded.append(args[2])
        stop.set()  # as if Stop were pressed while this frame encoded
        return out

    monkeypatch.setattr(seeing.encoder, "encode", encode_then_stop)
    seeing.set_history([])
    res = seeing.turn(QUESTION, [clip], GREEDY, cancel=stop)
    assert "stopped while encoding" in res.reason and len(encoded) == 1, (res.reason, encoded)
    # #67: the turn says what was encoded, not what was planned (it said 3 of a stopped 3)
    assert res.n_image_chunks_encoded == 1 and res.n_images_encoded == 1, res
    monkeypatch.undo()
    again = seeing.turn(QUESTION, [clip], GREEDY)
    assert again.error is None and again.n_image_chunks_encoded == 2, again


def test_a_video_attached_before_the_model_loads_waits_and_is_costed_once_it_has(qtbot, tmp_path):
    """`ebb clip.mp4` (or Open with Ebb) attaches before the model has loaded: the video waits
    in the composer, and its frames and tokens are said once the window knows the projector."""
    from app.widgets.composer import Composer

    composer = Composer()
    qtbot.addWidget(composer)
    clip = write_video(tmp_path / "early.mp4", [(RED, 2.0)])
    assert composer.attach(clip) and composer.attachments == [clip]
    assert composer.look(clip).words == "▣ early.mp4 · 0:02 · MP4" and not composer.error.isVisible()
    composer.picture_tokens, composer.room_tokens = 16, 1000  # the model loaded
    composer.recount()
    assert "up to 8 frames, 4 a second · ≈128 tokens" in composer.look(clip).words


def test_a_scanned_pdf_attached_before_the_model_loads_waits_and_is_refused_by_it_if_at_all(qtbot, tmp_path):
    """#67: `ebb scan.pdf` before the model has loaded: the PDF waits (whether it goes as pages
    or text is the projector's to say); a model that sees takes it as pictures, one that does
    not takes it off with the refusal in the composer (it vanished unsaid)."""
    from app.widgets.composer import Composer

    scan = write_picture_pdf(tmp_path / "scan.pdf", [RED], (40, 40))
    for picture_tokens, kept in ((16, True), (0, False)):
        composer = Composer()
        qtbot.addWidget(composer)
        assert composer.attach(scan) and not composer.error.isVisible()
        assert "judged once the model is loaded" in composer.look(scan).words
        composer.picture_tokens, composer.room_tokens = picture_tokens, 1000  # the model loaded
        composer.recount()
        assert (composer.attachments == [scan]) == kept
        if kept:
            assert "as pictures · ≈16 tokens" in composer.look(scan).words
        else:
            assert composer.error.text() == ("scan.pdf: it (pages 1-1) has no text in it: it is "
                                             "scanned pictures — taken off")
