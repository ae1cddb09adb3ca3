"""Inspection numbers against the file's own tensor table (read independently here)."""
from __future__ import annotations

import json
import re
from collections import defaultdict

import pytest
from gguf import GGUFReader

from tests.helpers import run_cli


def _table(path):
    reader = GGUFReader(path, "r")
    return {t.name: int(t.n_bytes) for t in reader.tensors}, reader


def test_inspect_default_matches_tensor_table(model_path):
    proc = run_cli("inspect", "default", "--json")
    assert proc.returncode == 0, proc.stderr
    m = json.loads(proc.stdout)["model"]
    table, reader = _table(model_path)
    per_layer = defaultdict(int)
    outside = {}
    for name, n in table.items():
        hit = re.match(r"blk\.(\d+)\.", name)
        if hit:
            per_layer[int(hit.group(1))] += n
        else:
            outside[name] = n
    assert m["architecture"] == "llama"
    assert m["n_layers"] == 30 == len(per_layer)
    assert m["layer_bytes"] == [per_layer[i] for i in range(30)]
    assert m["non_layer_tensors"] == outside
    assert sum(m["layer_bytes"]) + m["non_layer_bytes"] == m["tensor_bytes"] == sum(table.values())
    # The tensor data sits at the end of the file: header + data (+ alignment) = file size.
    data_start = min(int(t.data_offset) for t in reader.tensors)
    assert m["file_bytes"] - data_start - m["tensor_bytes"] < 32 * len(table)
    # KV cache: 3 KV heads x (64 + 64) dims x 2 bytes (f16) per layer per token.
    assert m["n_embd"] == 576 and m["n_head"] == 9 and m["n_head_kv"] == [3] * 30
    assert m["kv_bytes_per_token_per_layer"] == [3 * 128 * 2] * 30
    assert m["kv_bytes_per_token"] == 30 * 768
    assert m["n_ctx_train"] == 8192


def test_inspect_projector_matches_tensor_table(tiny_projector):
    proc = run_cli("inspect", "default", "--mmproj", str(tiny_projector), "--json")
    assert proc.returncode == 0, proc.stderr
    p = json.loads(proc.stdout)["projector"]
    table, _ = _table(tiny_projector)
    assert p["weight_bytes"] == sum(table.values())
    assert p["synthetic"] is True
    assert p["projector_type"] == "mlp"
    assert p["output_width"] == 576
    assert p["n_image_tokens"] == (28 // 14) ** 2
    assert 0 < p["compute_buffer_bytes_estimate_flash_attn"] <= p["compute_buffer_bytes_estimate"]


def test_inspect_human_output_names_the_parts():
    proc = run_cli("inspect", "default")
    assert proc.returncode == 0, proc.stderr
    for word in ("architecture llama", "layers", "token_embd.weight", "KV cache"):
        assert word in proc.stdout


def test_make_model_like_llama_8b_is_header_only(tmp_path):
    out = tmp_path / "llama-8b.gguf"
    proc = run_cli("make-model", "--like", "llama-8b", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    st = out.stat()
    assert st.st_size > 4 * 2**30 and st.st_blocks * 512 < 2**20  # real size, a hole on disk
    m = json.loads(run_cli("inspect", str(out), "--json").stdout)["model"]
    assert m["n_layers"] == 32 and m["n_embd"] == 4096 and m["n_head_kv"] == [8] * 32
    assert m["kv_bytes_per_token"] == 32 * 8 * 128 * 2 * 2  # Llama-3-8B, f16 KV: 128 KiB/token
    assert m["tensor_bytes"] <= st.st_size


def test_our_header_reader_equals_the_gguf_packages(model_path, tiny_projector):
    """#31: the header is read without building the vocabulary (98k strings for SmolLM2): the
    metadata Ebb keeps and the tensor table are exactly what the gguf package reads."""
    import dataclasses

    import numpy as np
    from gguf import GGUFReader

    from engine.gguf.info import MAX_ARRAY_KEPT, read_gguf

    for path in (model_path, tiny_projector):
        ours = read_gguf(path)
        reader = GGUFReader(path, "r")
        want = {}
        for name, fld in reader.fields.items():
            if name.startswith("GGUF.") or len(fld.data) > MAX_ARRAY_KEPT:
                continue
            v = fld.contents()
            want[name] = v.item() if isinstance(v, np.generic) else v
        assert ours.metadata == want
        assert [dataclasses.astuple(t) for t in ours.tensors] == [
            (t.name, t.tensor_type.name, tuple(int(x) for x in t.shape), int(t.n_bytes),
             int(t.data_offset)) for t in reader.tensors]
    assert "tokenizer.ggml.tokens" not in read_gguf(model_path).metadata  # stepped over



def test_our_tensor_type_table_equals_the_gguf_packages():
    """#31: the tensor sizes come from a table of our own (importing gguf.constants costs every
    start ~0.1 s); it must agree with gguf-py for every type both know, and name an unknown one."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    from engine.gguf.ggml_types import GGML_TYPES, UnknownTensorType, tensor_bytes

    theirs = {int(t): (t.name, *GGML_QUANT_SIZES[t]) for t in GGMLQuantizationType
              if t in GGML_QUANT_SIZES}
    assert {k: v for k, v in GGML_TYPES.items() if k in theirs} == {
        k: v for k, v in theirs.items() if k in GGML_TYPES}
    assert len(set(theirs) & set(GGML_TYPES)) >= 30
    assert tensor_bytes(12, 4096 * 4096) == ("Q4_K", 4096 * 4096 // 256 * 144)
    with pytest.raises(UnknownTensorType, match="tensor type 99"):
        tensor_bytes(99, 32)


def test_a_tensor_type_newer_than_ours_is_named_not_called_damage(tmp_path):
    import struct

    from engine.errors import EbbError
    from engine.gguf.info import read_gguf

    name = b"blk.0.attn_q.weight"
    head = (b"GGUF" + struct.pack("<IQQ", 3, 1, 0) + struct.pack("<Q", len(name)) + name
            + struct.pack("<IQIQ", 1, 32, 99, 0))
    f = tmp_path / "future.gguf"
    f.write_bytes(head + bytes(-len(head) % 32) + bytes(64))
    with pytest.raises(EbbError) as e:
        read_gguf(f)
    assert "ggml type 99" in e.value.what and "damaged" not in e.value.what
    assert "update Ebb" in e.value.fix

@pytest.mark.slow
def test_bench_start_prints_ratios_against_the_bare_library():
    import json

    from tests.helpers import run_cli

    proc = run_cli("bench", "start", "--rounds", "1", "--threads", "2", "--ctx", "1024", "--json",
                   timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    for key in ("start_s", "first_token_s"):
        assert out[key]["ebb"] > 0 and out[key]["bare"] > 0 and out[key]["ratio"] > 0
    print(f"\nstart to first token, Ebb ÷ bare: {out['first_token_s']['ratio']}")


@pytest.mark.slow
def test_bench_context_prints_flash_attention_ratios_per_fill():
    import json

    from tests.helpers import run_cli

    proc = run_cli("bench", "context", "--fills", "0,256", "--rounds", "1", "--threads", "2",
                   "--json", timeout=600)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)["rows"]
    assert [r["fill"] for r in rows] == [0, 256]
    for r in rows:
        assert r["prompt_ratio_on_off"] > 0 and r["gen_ratio_on_off"] > 0
    print("\nflash attention on ÷ off:", [(r["fill"], r["prompt_ratio_on_off"], r["gen_ratio_on_off"]) for r in rows])


def test_a_split_model_is_read_whole_from_its_first_part(tmp_path, model_path):
    """#52: `inspect`, `plan`, Open model's estimate and the planner read a split GGUF as its
    first part (49.83 MiB of 92.10; 30/30 layers planned where 13 fit). Real splits, written
    as llama.cpp's gguf-split writes them (split.no, split.count, NAME-0000k-of-0000n.gguf): the
    first part reads as the whole model, llama.cpp loads it, the Hub's verdict and the local
    one agree, and a later part or a missing one is said by name."""
    from engine.errors import EbbError
    from engine.gguf.info import model_info, read_gguf
    from engine.synth.model_gen import ModelShape, write_model
    from engine.hub.remote import remote_gguf
    from engine.gguf.info import merge_parts
    from engine.hub.verdict import judge
    from engine.llama.loaded_model import LoadParams
    from engine.llama.runtime import TextRuntime
    from engine.placement.plan import plan_placement
    from tests.hub import LoopbackHub
    from tests.test_hub import MACHINES

    shape = ModelShape(n_layers=6, n_embd=256, n_ff=512, n_head=4, n_head_kv=2, n_ctx_train=4096)
    (tmp_path / "whole").mkdir()
    (tmp_path / "split").mkdir()
    whole = write_model(tmp_path / "whole" / "m.gguf", shape, model_path, seed=1)
    first = write_model(tmp_path / "split" / "m.gguf", shape, model_path, seed=1,
                        split_max_tensors=20)
    parts = sorted(first.parent.glob("m-*-of-*.gguf"))
    assert first == parts[0] and len(parts) >= 3
    one, split = model_info(read_gguf(whole)), model_info(read_gguf(first))
    assert split.tensor_bytes == one.tensor_bytes and split.layer_bytes == one.layer_bytes
    assert split.non_layer_bytes == one.non_layer_bytes
    budget = one.non_layer_bytes + 3 * max(one.layer_bytes) + (64 << 20)
    a = plan_placement(split, "RPC0", budget, 1024, 512, True)
    b = plan_placement(one, "RPC0", budget, 1024, 512, True)
    assert a.n_layers_on_accel == b.n_layers_on_accel < shape.n_layers + 1
    proc = run_cli("inspect", str(first), "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["model"]["tensor_bytes"] == one.tensor_bytes
    TextRuntime(LoadParams(first, n_ctx=256, n_threads=1)).close()  # llama.cpp loads it so
    with LoopbackHub() as hub:  # the Hub's verdict reads every part's header: the same
        hub.add("ebb/split-GGUF", {p.name: p for p in parts}, tags=["gguf"])
        remote = model_info(merge_parts([remote_gguf("ebb/split-GGUF", p.name, endpoint=hub.endpoint)
                                         for p in parts]))
    for machine in MACHINES:
        assert judge(remote, None, machine) == judge(split, None, machine)
    with pytest.raises(EbbError, match="open its first part, m-00001-of-"):
        read_gguf(parts[1])
    # #67: parts whose names and headers disagree, and a count that lies, are refused by name
    # before anything says "ready" (llama.cpp would refuse them only as it loads)
    swapped = tmp_path / "swapped"
    swapped.mkdir()
    for p in parts:
        (swapped / p.name).write_bytes(p.read_bytes())
    a, b = swapped / parts[1].name, swapped / parts[2].name
    a.rename(swapped / "tmp.gguf")
    b.rename(a)
    (swapped / "tmp.gguf").rename(b)
    with pytest.raises(EbbError, match=f"{parts[1].name} is part 2 of the split model by its name, and part 3"):
        read_gguf(swapped / parts[0].name)
    lying = tmp_path / "lying"
    lying.mkdir()
    n = len(parts)
    for i, p in enumerate(parts[:-1]):  # the last part left out, the rest named as a whole set
        (lying / f"m-{i + 1:05d}-of-{n - 1:05d}.gguf").write_bytes(p.read_bytes())
    with pytest.raises(EbbError, match=f"says the model is split in {n} parts, and its name says {n - 1}"):
        read_gguf(lying / f"m-00001-of-{n - 1:05d}.gguf")
    parts[-1].unlink()
    with pytest.raises(EbbError, match=f"{parts[-1].name} is missing"):
        read_gguf(first)


def test_a_header_is_parsed_once_per_version_of_the_file(tmp_path):
    """Planning, measuring, loading and the demo projector all ask for the model's header: it
    is parsed once, and again when the file is replaced (#54)."""
    from engine.gguf.info import HEADER_READS, read_gguf
    from engine.synth.projector_gen import write_projector

    path = write_projector(tmp_path / "p.gguf", 64, "base")
    first = read_gguf(path)
    reads = HEADER_READS[0]
    assert read_gguf(path) is first and HEADER_READS[0] == reads
    link = tmp_path / "link.gguf"
    link.symlink_to(path)
    assert read_gguf(link).path == link and HEADER_READS[0] == reads  # named as asked
    write_projector(tmp_path / "new.gguf", 96, "base").replace(path)  # a new version
    assert read_gguf(path).metadata != first.metadata and HEADER_READS[0] == reads + 1


def test_a_header_is_read_back_from_disk_in_the_next_run_for_that_version_only(tmp_path):
    """A start reads the model's header as kept by the last run, equal to a parse (#54); a file
    rewritten in place with its old size and modification time is parsed again; a damaged
    kept header is ignored."""
    import os

    from engine.gguf import info, kept_headers
    from engine.synth.projector_gen import write_projector

    path = write_projector(tmp_path / "p.gguf", 64, "base")
    parsed = info.read_gguf(path)
    info._HEADERS.clear()  # as a new process
    reads = info.HEADER_READS[0]
    again = info.read_gguf(path)
    assert info.HEADER_READS[0] == reads and again is not parsed
    assert again == parsed  # path, bytes, every value and tensor

    st = path.stat()
    write_projector(tmp_path / "other.gguf", 64, "base", seed=7)
    data = (tmp_path / "other.gguf").read_bytes()
    assert len(data) == st.st_size
    path.write_bytes(data)  # same inode, same size
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # and the old modification time
    info._HEADERS.clear()
    changed = info.read_gguf(path)
    assert info.HEADER_READS[0] == reads + 1 and changed.metadata != parsed.metadata, "seed 7 names itself"

    kept = kept_headers._file_for(kept_headers.version_of(path))
    kept.write_text('{"format": 1, "version"')  # cut short
    info._HEADERS.clear()
    assert info.read_gguf(path) == changed and info.HEADER_READS[0] == reads + 2
