"""Sound clips without Qt: a clip's words and playback (`clips.py`) and the microphone
(`recorder.py`), both through miniaudio on its own audio thread."""
