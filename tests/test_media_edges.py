"""#67: last round's media at its edges, with files the tests write: a 64-frame reference is
not a path, repeats are found in colour, a phone's portrait video stands upright, an MP4 with
sound alone is a clip, a UTF-16 text file is text, and the figures a chip says read right."""
from __future__ import annotations

import pytest

from engine.errors import EbbError
from engine.media import attachments, documents, kinds, video
from engine.media.files import over_words
from tests.helpers import run_cli
from tests.media_files import write_encoded_tone, write_video

RED, GREEN, BLUE = (255, 0, 0), (0, 128, 0), (0, 0, 255)


def test_a_reference_of_64_frames_is_never_taken_for_a_path(tmp_path):
    """A sent video keeps `clip.mp4#frames=…`; with 64 frames the text is longer than a file's
    name may be, and asking the file system whether it exists raised "File name too long"
    (the window's Send never came back)."""
    clip = write_video(tmp_path / "walk.mp4", [(RED, 1.0)])
    times = tuple(round(i * 0.938, 3) for i in range(video.MAX_FRAMES))
    ref = str(attachments.Ref(clip, frames=times))
    assert len(ref.rpartition("/")[2]) > 255
    r = attachments.parse(ref)
    assert r.path == clip and r.frames == times
    assert attachments.split(ref) == (clip, ref.partition("#")[2])
    assert not attachments.is_part(ref) and attachments.is_part(f"{clip}#t=0.938")
    keys = attachments.saved_keys(ref, attachments.Projector(True, 64, lambda w, h: 4),
                                  lambda k: k, lambda p: None)  # type: ignore[arg-type, return-value]
    assert len(keys.keys) == video.MAX_FRAMES
    assert attachments.shown_names([k[1] for k in keys.keys])[-1] == "walk.mp4 frame 64 of 64"


def test_repeats_are_found_in_colour(tmp_path):
    """Red, then green of the same brightness, then blue: three scenes, not two (grey
    thumbnails took the green for a repeat of the red)."""
    clip = write_video(tmp_path / "rgb.mp4", [(RED, 3.0), (GREEN, 3.0), (BLUE, 3.0)])
    frames = video.decode(clip, [0.0, 1.5, 3.0, 4.5, 6.0, 7.5], video.frame_size(video.probe(clip), 64))
    kept, n_repeats = video.drop_repeats(frames)
    assert [t for t, _ in kept] == [0.0, 3.0, 6.0] and n_repeats == 3


def test_a_phone_video_is_shown_upright(tmp_path):
    """A portrait video as a phone writes it: landscape pictures and a display matrix that turns
    them. The frames come out as they are shown (taller than wide, the turned left half at the
    bottom for a quarter turn counter-clockwise)."""
    clip = write_video(tmp_path / "phone.mp4", [(BLUE, 1.0)], size=(96, 64), rotation=90, left=RED)
    info = video.probe(clip)
    assert (info.width, info.height, info.rotation) == (64, 96, 90)
    [(_, frame)] = video.decode(clip, [0.5], video.frame_size(info, 896))
    assert frame.size == (64, 96)
    top, bottom = frame.getpixel((32, 10)), frame.getpixel((32, 86))
    assert top[2] > 200 and top[0] < 60, top  # blue above
    assert bottom[0] > 200 and bottom[2] < 60, bottom  # red below
    flat = write_video(tmp_path / "flat.mp4", [(BLUE, 1.0)], size=(96, 64), left=RED)
    assert (video.probe(flat).width, video.probe(flat).rotation) == (96, 0)


def test_an_mp4_with_sound_alone_is_a_clip_everywhere(tmp_path, colour_projector, model_path):
    """An MP4 (brand isom, as a video's) with a sound track and no pictures is a clip to the one
    place that decides, and to everything that asks it: the CLI refuses it as a clip the loaded
    projector cannot hear, by the projector's name, not as "not an image"."""
    from engine.media.kinds import is_clip

    clip = write_encoded_tone(tmp_path / "voice.mp4", 440, 1.0)
    assert clip.read_bytes()[4:8] == b"ftyp"
    assert kinds.kind_of(clip) == kinds.CLIP and is_clip(clip)
    proc = run_cli("chat", "--model", str(model_path), "--mmproj", str(colour_projector),
                   "--prompt", "What is said?", "--image", str(clip), "--max-tokens", "2",
                   "--ctx", "512", "--threads", "1")
    assert proc.returncode != 0
    assert "not an image" not in proc.stderr
    assert f"voice.mp4 is a sound clip, and the loaded projector ({colour_projector.name}) does not hear" in proc.stderr


def test_a_utf16_text_file_is_text_and_not_mp3(tmp_path):
    """UTF-16's byte-order mark (FF FE) is also an MP3 frame's sync: text comes first where the
    bytes go on as text, in the window's kinds and the endpoint's."""
    words = "Grüße aus Köln: the meeting moved to Tuesday.\n" * 20
    for name, data in {"le.txt": b"\xff\xfe" + words.encode("utf-16-le"),
                       "be.txt": b"\xfe\xff" + words.encode("utf-16-be"),
                       "noname": b"\xff\xfe" + words.encode("utf-16-le"),
                       "bom8.md": b"\xef\xbb\xbf" + words.encode()}.items():
        path = tmp_path / name
        path.write_bytes(data)
        assert kinds.kind_of(path) == kinds.TEXT, name
        assert kinds.kind_of_bytes(data) == kinds.TEXT, name
        assert "Grüße aus Köln" in documents.text_file(path)
    mp3ish = tmp_path / "noise.bin"
    mp3ish.write_bytes(b"\xff\xfb\x90\x64" + bytes(range(256)) * 8)  # an MP3 frame's header
    assert kinds.kind_of(mp3ish) != kinds.TEXT


def test_the_figures_a_chip_says_read_right(tmp_path):
    assert video.spacing_words(0.26) == "3.8 a second"
    assert video.spacing_words(4.0) == "one every 4 s"
    assert video.spacing_words(2.031) == "one every 2.03 s"
    limit = documents.MAX_TEXT_FILE_BYTES
    assert over_words(limit + 1, limit) == (f"{limit + 1:,} bytes", f"{limit:,} bytes")
    assert over_words(3 * limit, limit) == ("6.0 MiB", "2.0 MiB")
    big = tmp_path / "big.txt"
    big.write_bytes(b"a" * (limit + 1))
    with pytest.raises(EbbError, match=f"{limit + 1:,} bytes of text, more than the {limit:,} bytes"):
        documents.text_file(big)


def test_a_transcription_needs_sound_and_a_model_that_hears(tmp_path, model_path, colour_projector):
    """/v1/audio/transcriptions answered a silent video, to a model that does not hear, with
    made-up text: now each is a 400 that says which."""
    from engine.server.answering import _transcript_cap
    from engine.server.api.common import ApiError
    from engine.session import Session, SessionConfig
    from engine.synth.sounds import write_tone

    silent = write_video(tmp_path / "silent.mp4", [(RED, 1.0)])
    tone = write_tone(tmp_path / "tone.wav", 440, 1.0)
    with Session(SessionConfig(model_path, colour_projector, n_ctx=512, n_threads=1, vision="cpu")) as s:
        with pytest.raises(ApiError, match="silent.mp4 is a video with no sound"):
            _transcript_cap(s, [silent], 0, str)
        with pytest.raises(ApiError, match=f"needs a model that hears, and the loaded projector "
                                           f"\\({colour_projector.name}\\) does not hear"):
            _transcript_cap(s, [tone], 0, str)


def test_chat_json_says_what_was_taken_of_each_attachment(tmp_path, model_path, colour_projector):
    """`ebb-engine chat --json`: each attachment's resolved reference (the frames that went
    in), its line and its notes (repeats left out)."""
    import json

    clip = write_video(tmp_path / "still.mp4", [(RED, 2.0)])
    proc = run_cli("chat", "--model", str(model_path), "--mmproj", str(colour_projector), "--json",
                   "--prompt", "What colour?", "--image", f"{clip}#every=0.5", "--max-tokens", "1",
                   "--ctx", "1024", "--threads", "1", "--vision", "cpu")
    assert proc.returncode == 0, proc.stderr
    [taken] = json.loads(proc.stdout.splitlines()[-1])["attachments"]
    assert taken["ref"] == f"{clip}#frames=0"  # the still video's repeats left out
    assert "3 repeats left out" in taken["line"]
    assert taken["notes"] == ["still.mp4: 3 frames that repeated the one before left out"]
