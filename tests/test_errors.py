"""Errors a user will hit: one clear line on stderr, exit code 2, no traceback."""
from __future__ import annotations

import shutil

import numpy as np
import pytest

from engine.synth.projector_gen import write_projector
from tests.helpers import run_cli


def _assert_user_error(proc, *words):
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("ebb-engine: error: ")
    for w in words:
        assert w in lines[0], lines[0]


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory, model_path):
    d = tmp_path_factory.mktemp("bad")
    (d / "notes.gguf").write_text("this is not a model\n" * 10)
    data = model_path.read_bytes()
    (d / "cut_header.gguf").write_bytes(data[:4000])
    (d / "cut_data.gguf").write_bytes(data[: len(data) // 2])
    import gguf

    w = gguf.GGUFWriter(str(d / "alien.gguf"), arch="ebbalien")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    write_projector(d / "wide.gguf", 512, size="tiny")
    shutil.copy(model_path, d / "copy.gguf")
    return d


CHAT = ("chat", "--prompt", "hi", "--max-tokens", "4", "--threads", "2")


def test_missing_file(bad_files):
    _assert_user_error(run_cli(*CHAT, "--model", str(bad_files / "nope.gguf")), "not found")
    _assert_user_error(run_cli("inspect", str(bad_files / "nope.gguf")), "not found")


def test_not_a_gguf(bad_files):
    _assert_user_error(run_cli(*CHAT, "--model", str(bad_files / "notes.gguf")), "not a GGUF")
    proc = run_cli("inspect", str(bad_files / "notes.gguf"))
    _assert_user_error(proc, "not a GGUF file (it is text that starts “this is not”)")
    assert "b'" not in proc.stderr  # #67: what it is in words, not Python's bytes


def test_what_a_file_is_instead_of_a_gguf_is_said_in_words():
    from engine.gguf.info import not_gguf_words

    assert not_gguf_words(b"") == "it is empty"
    assert not_gguf_words(b"<!DOCTYPE html><html>").startswith("it is a web page")
    assert not_gguf_words(b"version https://git-lfs.github.com/spec/v1\n") == \
        "it is a Git LFS pointer, not the file itself"
    assert not_gguf_words(b"PK\x03\x04rest") == "it is a ZIP archive: unpack it first"
    assert not_gguf_words(b"\x00\x01\xfe\x80") == "its first bytes are 00 01 FE 80"


def test_truncated_header(bad_files):
    _assert_user_error(run_cli(*CHAT, "--model", str(bad_files / "cut_header.gguf")), "truncated")


def test_truncated_data(bad_files):
    _assert_user_error(run_cli(*CHAT, "--model", str(bad_files / "cut_data.gguf")), "truncated")
    _assert_user_error(run_cli("inspect", str(bad_files / "cut_data.gguf")), "truncated")


def test_unknown_architecture(bad_files):
    _assert_user_error(run_cli(*CHAT, "--model", str(bad_files / "alien.gguf")),
                       "architecture 'ebbalien'", "not supported")


def test_context_larger_than_model_allows(bad_files):
    _assert_user_error(run_cli(*CHAT, "--model", str(bad_files / "copy.gguf"), "--ctx", "100000"),
                       "8192", "--ctx")


def test_projector_width_mismatch(bad_files):
    _assert_user_error(run_cli("inspect", "default", "--mmproj", str(bad_files / "wide.gguf")),
                       "512", "576")


def test_projector_given_as_model(bad_files):
    _assert_user_error(run_cli("inspect", str(bad_files / "wide.gguf")), "projector")


def test_bad_numbers():
    _assert_user_error(run_cli(*CHAT, "--ctx", "0"), "positive")
    _assert_user_error(run_cli("chat", "--prompt", "hi", "--max-tokens", "-1"), "no cap")
