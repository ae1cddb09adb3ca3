"""Models from the Hub (engine/hub), through the real `huggingface_hub` client against a hub of
our own on loopback (tests/hub.py): search, a repo's quantisations and projectors, the verdict
from a remote header (the same as from the downloaded file, for every generated family), and
downloads that survive cut connections, a damaged byte, a pause, a second download of the
same file and a gated repo."""
from __future__ import annotations

import hashlib
import json
import threading
from pathlib import Path

import pytest

from engine.errors import EbbError
from engine.gguf.families import GENERATED
from engine.gguf.info import model_info, projector_info, read_gguf
from engine.synth.model_gen import ModelShape, write_model
from engine.synth.projector_gen import write_projector
from engine.hub.catalog import HubFile, repo_files, search, sort_files
from engine.hub.download import DownloadPaused, download_file, part_path
from engine.hub.remote import remote_gguf
from engine.hub.verdict import Machine, judge
from tests.helpers import run_cli
from tests.hub import LoopbackHub

SHAPE = ModelShape(n_layers=4, n_embd=128, n_ff=256, n_head=2, n_head_kv=1)
MACHINES = [Machine(None, 0, 64 << 30, 2), Machine("CUDA0", 8 << 30, 64 << 30, 8),
            Machine("CUDA0", 3 << 20, 64 << 30, 8), Machine(None, 0, 1 << 20, 2)]


@pytest.fixture(scope="module")
def families(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    d = tmp_path_factory.mktemp("hub-families")
    return {f: (write_model(d / f"lm-{f}-Q8_0.gguf", SHAPE, model_path, family=f),
                write_projector(d / f"mmproj-{f}-f16.gguf", SHAPE.n_embd, family=f))
            for f in GENERATED}


@pytest.fixture
def hub():
    with LoopbackHub() as h:
        yield h


def test_the_verdict_from_the_remote_header_is_the_verdict_from_the_file(hub, families):
    """Every generated family: the ranged header parses to the same file as the download, so
    every machine's verdict is the same before and after; only the front of the file moved."""
    for family, (lm, mm) in families.items():
        repo = f"ebb/{family}-GGUF"
        hub.add(repo, {lm.name: lm, mm.name: mm}, tags=["gguf"])
        for path in (lm, mm):
            remote = remote_gguf(repo, path.name, endpoint=hub.endpoint)
            local = read_gguf(path)
            assert (remote.metadata, remote.tensors, remote.file_bytes) == \
                (local.metadata, local.tensors, local.file_bytes), (family, path.name)
        r_model = model_info(remote_gguf(repo, lm.name, endpoint=hub.endpoint))
        r_proj = projector_info(remote_gguf(repo, mm.name, endpoint=hub.endpoint))
        l_model, l_proj = model_info(read_gguf(lm)), projector_info(read_gguf(mm))
        for machine in MACHINES:
            assert judge(r_model, r_proj, machine) == judge(l_model, l_proj, machine), family
    served = sum(int(r.split("-")[1]) - int(r.split("=")[1].split("-")[0]) + 1
                 for _, path, r in hub.requests if r and "/cdn/" in path)
    whole = sum(p.stat().st_size for pair in families.values() for p in pair)
    print(f"\nranged reads: {served / 2**20:.1f} MiB asked for {whole / 2**20:.1f} MiB of files")
    verdicts = {m.accel or "CPU": judge(model_info(read_gguf(families["mlp"][0])),
                                        projector_info(read_gguf(families["mlp"][1])), m).text
                for m in MACHINES[1:3]}
    assert verdicts["CUDA0"]  # both GPU machines have words; the split one says how many
    assert judge(l_model, l_proj, MACHINES[3]).text.startswith("does not fit in RAM")


def test_search_filters_sorts_and_lists_quants_and_projectors(hub, families, model_path):
    lm, mm = families["gemma3"]
    hub.add("ebb/gemma-vision-GGUF", {lm.name: lm, mm.name: mm, "README.md": lm}, tags=["gguf"],
            downloads=10, last_modified="2026-03-01T00:00:00.000Z")
    hub.add("ebb/smol-text-GGUF", {"smol-Q4_1.gguf": model_path}, tags=["gguf"], downloads=99)
    hub.add("ebb/not-gguf", {"model.safetensors": lm}, tags=["safetensors"], downloads=500)
    by_downloads = [h.repo for h in search("", endpoint=hub.endpoint)]
    assert by_downloads == ["ebb/smol-text-GGUF", "ebb/gemma-vision-GGUF"]  # GGUF only
    assert [h.repo for h in search("", sort="updated", endpoint=hub.endpoint)][0] == \
        "ebb/gemma-vision-GGUF"
    seeing = search("", sees_images=True, endpoint=hub.endpoint)
    assert [(h.repo, h.sees_images) for h in seeing] == [("ebb/gemma-vision-GGUF", True)]
    files = repo_files("ebb/gemma-vision-GGUF", endpoint=hub.endpoint)
    assert [q.label for q in files.quants] == ["Q8_0"] and files.projectors[0].name == mm.name
    assert files.quants[0].parts[0].sha256 == hashlib.sha256(lm.read_bytes()).hexdigest()
    hub.add("ebb/mmproj-only", {mm.name: mm}, tags=["gguf"])
    with pytest.raises(EbbError, match="only projector files"):
        repo_files("ebb/mmproj-only", endpoint=hub.endpoint)
    with pytest.raises(EbbError, match="no GGUF files"):
        repo_files("ebb/not-gguf", endpoint=hub.endpoint)
    with pytest.raises(EbbError, match="not found"):
        repo_files("ebb/missing", endpoint=hub.endpoint)


def test_a_speed_without_this_machines_measurements_says_it_is_an_estimate(families):
    """#52: on a fresh install the verdict's tokens/s was 3-50x off and read as a fact."""
    from engine.placement.calibration import DeviceCal

    model = model_info(read_gguf(families["mlp"][0]))
    bare = Machine(None, 0, 64 << 30, 2)
    measured = Machine(None, 0, 64 << 30, 2, cpu_cal=DeviceCal("CPU", 1e-10, 1e-11))
    assert "(estimate, uncalibrated: ebb-engine calibrate)" in judge(model, None, bare).text
    assert "estimate" not in judge(model, None, measured).text
    gpu = Machine("CUDA0", 8 << 30, 64 << 30, 8, cpu_cal=DeviceCal("CPU", 1e-10, 1e-11))
    assert "uncalibrated" in judge(model, None, gpu).text  # the GPU's own was never measured


def test_split_files_are_one_quantisation_and_an_incomplete_set_names_what_it_lacks():
    def f(name: str, size: int = 10) -> HubFile:
        return HubFile(name, size, None)

    files = [f("m-Q4_K_M-00002-of-00002.gguf"), f("m-Q4_K_M-00001-of-00002.gguf"),
             f("m-Q8_0-00001-of-00003.gguf"), f("m-Q8_0-00003-of-00003.gguf"),
             f("m-IQ4_XS.gguf", 5), f("mmproj-m-f16.gguf", 9), f("mmproj-m-Q8_0.gguf", 5),
             f("README.md")]
    out = sort_files("r", files)
    assert [(q.label, [p.name for p in q.parts], q.missing) for q in out.quants] == [
        ("IQ4_XS", ["m-IQ4_XS.gguf"], ()),
        ("Q4_K_M", ["m-Q4_K_M-00001-of-00002.gguf", "m-Q4_K_M-00002-of-00002.gguf"], ()),
        ("Q8_0", ["m-Q8_0-00001-of-00003.gguf", "m-Q8_0-00003-of-00003.gguf"],
         ("m-Q8_0-00002-of-00003.gguf",))]  # listed, so that it is said it cannot be loaded
    assert [p.name for p in out.projectors] == ["mmproj-m-f16.gguf", "mmproj-m-Q8_0.gguf"]


def test_a_download_survives_cut_connections_and_a_pause(hub, families, tmp_path):
    """Twenty cuts at random bytes, then a pause: the file ends byte-identical, each resume
    asking only for the rest."""
    import random

    lm, _ = families["qwen2.5vl"]
    hub.add("ebb/q-GGUF", {lm.name: lm}, tags=["gguf"])
    [quant] = repo_files("ebb/q-GGUF", endpoint=hub.endpoint).quants
    size = lm.stat().st_size
    hub.cuts = sorted(random.Random(7).sample(range(1, size), 20))
    dest = tmp_path / "models" / lm.name
    cancel = threading.Event()
    seen: list[int] = []

    def pause_half_way(p) -> None:
        seen.append(p.done_bytes)
        if p.done_bytes > size // 2:
            cancel.set()

    with pytest.raises(DownloadPaused):
        download_file("ebb/q-GGUF", quant.parts[0], dest, hub.endpoint, on_progress=pause_half_way,
                      cancel=cancel, retries=30, backoff_s=0.01)
    assert part_path(dest).exists() and not dest.exists()
    kept = part_path(dest).stat().st_size
    assert 0 < kept < size
    download_file("ebb/q-GGUF", quant.parts[0], dest, hub.endpoint, retries=30, backoff_s=0.01)
    assert dest.read_bytes() == lm.read_bytes() and not part_path(dest).exists()
    ranges = [r for _, path, r in hub.requests if "/cdn/" in path and r]
    assert f"bytes={kept}-" in ranges  # the resume asked for the rest only
    assert not hub.cuts  # every cut was met and survived


def test_a_damaged_byte_is_said_and_the_file_kept_aside(hub, families, tmp_path):
    lm, _ = families["gemma3"]
    hub.add("ebb/g-GGUF", {lm.name: lm}, tags=["gguf"])
    hub.flip[lm.name] = lm.stat().st_size // 3
    [quant] = repo_files("ebb/g-GGUF", endpoint=hub.endpoint).quants
    dest = tmp_path / lm.name
    with pytest.raises(EbbError, match="does not match the Hub's sha256") as err:
        download_file("ebb/g-GGUF", quant.parts[0], dest, hub.endpoint)
    aside = dest.with_name(dest.name + ".sha256-mismatch")
    assert aside.exists() and aside.stat().st_size == lm.stat().st_size and not dest.exists()
    assert aside.name in str(err.value)
    del hub.flip[lm.name]
    download_file("ebb/g-GGUF", quant.parts[0], dest, hub.endpoint)  # again: a good copy
    assert dest.read_bytes() == lm.read_bytes()


def test_a_file_is_ready_only_when_it_is_the_hubs_and_a_gguf(hub, families, tmp_path):
    """#52: a finished file replaced upstream by a same-size one was called ready; a part whose
    saved ETag names another file was spliced; a file that is not a GGUF was called ready; a
    retry showed a frozen bar; a failed run left a .lock."""
    lm, mm = families["mlp"]
    hub.add("ebb/m-GGUF", {"m.gguf": lm}, tags=["gguf"])
    [quant] = repo_files("ebb/m-GGUF", endpoint=hub.endpoint).quants
    dest = tmp_path / "m.gguf"
    download_file("ebb/m-GGUF", quant.parts[0], dest, hub.endpoint)
    assert dest.read_bytes() == lm.read_bytes()
    # upstream, a new file of the same size: found by its sha256, downloaded again
    newer = tmp_path / "newer.gguf"
    data = bytearray(lm.read_bytes())
    data[-1] ^= 0xFF
    newer.write_bytes(bytes(data))
    hub.add("ebb/m-GGUF", {"m.gguf": newer}, tags=["gguf"])
    [quant] = repo_files("ebb/m-GGUF", endpoint=hub.endpoint).quants
    n_before = len(hub.requests)
    download_file("ebb/m-GGUF", quant.parts[0], dest, hub.endpoint)
    assert dest.read_bytes() == newer.read_bytes() and len(hub.requests) > n_before
    # a part left from the older file (its ETag saved) is started again before any byte
    part = part_path(dest)
    part.write_bytes(lm.read_bytes()[:1000])
    part.with_name(part.name + ".etag").write_text(f'"{hub.sha256(lm)}"')
    dest.unlink()
    hub.requests.clear()
    download_file("ebb/m-GGUF", quant.parts[0], dest, hub.endpoint)
    assert dest.read_bytes() == newer.read_bytes()
    assert all(r in ("", "bytes=0-") for _, path, r in hub.requests if "/cdn/" in path)
    # a "model" that is not a GGUF is kept aside, never ready; nothing left locked
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"<html>not a model</html>" * 100)
    hub.add("ebb/fake-GGUF", {"fake.gguf": fake}, tags=["gguf"])
    [quant] = repo_files("ebb/fake-GGUF", endpoint=hub.endpoint).quants
    out = tmp_path / "dl" / "fake.gguf"
    with pytest.raises(EbbError, match="not a GGUF file"):
        download_file("ebb/fake-GGUF", quant.parts[0], out, hub.endpoint)
    assert not out.exists() and out.with_name("fake.gguf.not-gguf").exists()
    assert not list(out.parent.glob("*.lock")) and not list(out.parent.glob("*.etag"))
    # a link that stops: the wait before the next try is said
    (tmp_path / "m2").mkdir()
    hub.cuts = [1000]
    said: list[str] = []
    download_file("ebb/m-GGUF", quant_of(hub, "ebb/m-GGUF"), tmp_path / "m2" / "m.gguf",
                  hub.endpoint, on_progress=lambda p: said.append(p.words()),
                  cancel=threading.Event(), backoff_s=0.01)
    assert any("retrying (1), next try in 0 s" in w for w in said), said


def quant_of(hub, repo: str):
    [quant] = repo_files(repo, endpoint=hub.endpoint).quants
    return quant.parts[0]


def test_two_downloads_of_one_file_one_wins_and_a_gated_repo_says_what_to_do(hub, families,
                                                                              tmp_path):
    lm, _ = families["idefics3"]
    hub.add("ebb/i-GGUF", {lm.name: lm}, tags=["gguf"])
    [quant] = repo_files("ebb/i-GGUF", endpoint=hub.endpoint).quants
    dest = tmp_path / lm.name
    started, release = threading.Event(), threading.Event()
    results: list[object] = []

    def slow(p) -> None:
        started.set()
        release.wait(60)

    first = threading.Thread(target=lambda: results.append(download_file(
        "ebb/i-GGUF", quant.parts[0], dest, hub.endpoint, on_progress=slow)))
    first.start()
    assert started.wait(60)
    with pytest.raises(EbbError, match="being downloaded already"):
        download_file("ebb/i-GGUF", quant.parts[0], dest, hub.endpoint)
    release.set()
    first.join(60)
    assert results == [dest] and dest.read_bytes() == lm.read_bytes()
    hub.add("ebb/gated-GGUF", {lm.name: lm}, tags=["gguf"], gated=True)
    with pytest.raises(EbbError, match="accept the licence"):
        repo_files("ebb/gated-GGUF", endpoint=hub.endpoint)
    assert repo_files("ebb/gated-GGUF", endpoint=hub.endpoint, token="hf_test").quants


def test_models_get_fetches_the_pair_where_open_model_finds_it(hub, families, tmp_path,
                                                               monkeypatch):
    """The terminal: search, show with this machine's verdict, get the pair (the projector
    beside its model), and a file that is not a GGUF said plainly."""
    lm, mm = families["mlp"]
    hub.add("ebb/llava-GGUF", {lm.name: lm, mm.name: mm, "broken-Q2_K.gguf": tmp_path / "x"},
            tags=["gguf"])
    (tmp_path / "x").write_bytes(b"<html>not a model</html>" * 10)
    monkeypatch.setenv("EBB_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)  # a mirror, as a user sets one
    shown = run_cli("models", "show", "ebb/llava-GGUF", "--json")
    got = run_cli("models", "get", "ebb/llava-GGUF", "Q8_0", "--json")
    assert shown.returncode == 0, shown.stderr
    rows = {r["quant"]: r["verdict"] for r in json.loads(shown.stdout)["quants"]}
    assert rows["Q8_0"]["fits"] and "on the CPU" in rows["Q8_0"]["text"]
    assert rows["Q2_K"]["text"].startswith("cannot judge") and "not a GGUF" in rows["Q2_K"]["text"]
    assert got.returncode == 0, got.stderr
    broken = run_cli("models", "get", "ebb/llava-GGUF", "Q2_K", "--json")  # #67: refused unread
    assert broken.returncode != 0 and "not a GGUF" in broken.stderr, broken.stderr
    assert not list((tmp_path / "cache").rglob("broken-Q2_K.gguf*"))
    out = json.loads(got.stdout)
    model, proj = Path(out["model"]), Path(out["projector"])
    assert model.parent == proj.parent == tmp_path / "cache" / "models" / "hub" / "ebb" / "llava-GGUF"
    assert model.read_bytes() == lm.read_bytes() and proj.read_bytes() == mm.read_bytes()
    note = json.loads((model.parent / "ebb-pair.json").read_text())
    assert note[model.name]["projector"] == proj.name
    from engine.hub.fetch import paired_projector

    assert paired_projector(model) == proj  # what Open model offers first (#70: read, not only written)
    (model.parent / "ebb-pair.json").write_text("{damaged")  # a damaged note is written anew
    # no quantisation named: the one that suits this machine, said with why (#52)
    auto = run_cli("models", "get", "ebb/llava-GGUF", "--json")
    assert auto.returncode == 0, auto.stderr
    assert "picked Q8_0 for this machine" in auto.stderr
    assert Path(json.loads(auto.stdout)["model"]) == model
    hub.add("ebb/junk-GGUF", {"broken-Q2_K.gguf": tmp_path / "x"}, tags=["gguf"])
    junk = run_cli("models", "get", "ebb/junk-GGUF", "--json")  # not "none fits this machine"
    assert junk.returncode != 0 and "can be loaded: Q2_K: " in junk.stderr and "not a GGUF" in junk.stderr


def test_a_split_set_missing_a_part_is_listed_and_refused_by_name(hub, tmp_path, model_path, monkeypatch):
    """#67: a repo whose split set lacks one part of three was "has no GGUF files"; it is listed,
    judged "cannot be loaded" naming the part, and `get` refuses it before downloading."""
    from engine.hub.catalog import repo_files
    from engine.hub.verdict import judge_remote, this_machine
    from engine.synth.model_gen import ModelShape, write_model

    shape = ModelShape(n_layers=4, n_embd=128, n_ff=256, n_head=4, n_head_kv=2, n_ctx_train=2048)
    first = write_model(tmp_path / "m.gguf", shape, model_path, seed=2, split_max_tensors=16)
    parts = sorted(tmp_path.glob("m-*-of-*.gguf"))
    assert first == parts[0] and len(parts) >= 3
    hub.add("ebb/split-GGUF", {p.name: p for p in parts if p != parts[1]}, tags=["gguf"])
    [quant] = repo_files("ebb/split-GGUF", endpoint=hub.endpoint).quants
    assert quant.missing == (parts[1].name,)
    with pytest.raises(EbbError, match=f"lacks {parts[1].name}: it cannot be loaded"):
        judge_remote("ebb/split-GGUF", quant, None, this_machine(1), hub.endpoint)
    monkeypatch.setenv("EBB_CACHE_DIR", str(tmp_path / "cache"))
    got = run_cli("models", "get", "ebb/split-GGUF", quant.label, "--endpoint", hub.endpoint)
    assert got.returncode != 0 and f"lacks {parts[1].name}" in got.stderr, got.stderr
    assert not (tmp_path / "cache" / "models").exists()


def test_the_quantisation_recommended_suits_the_machine():
    from engine.hub.verdict import Verdict, recommend

    def v(fits, on, accel="CUDA0", n=28):
        return Verdict(fits, n, on, accel, 10.0, None, None, 0, f"{on} layers")

    gpu = [("Q2_K", v(True, 28)), ("Q4_K_M", v(True, 28)), ("Q8_0", v(True, 20)), ("F16", v(False, 9))]
    assert recommend(gpu)[0] == "Q4_K_M" and "all fit on CUDA0" in recommend(gpu)[1]
    partial = [("Q4_K_M", v(True, 20)), ("Q8_0", v(True, 12))]
    assert recommend(partial)[0] == "Q4_K_M" and "most layers" in recommend(partial)[1]
    cpu = [("Q2_K", v(True, 0, None)), ("Q4_K_M", v(True, 0, None)), ("Q8_0", v(True, 0, None))]
    assert recommend(cpu)[0] == "Q4_K_M"
    assert recommend([("Q2_K", v(True, 0, None)), ("Q8_0", v(True, 0, None))])[0] == "Q8_0"
    assert recommend([("F16", v(False, 0, None))]) is None


def test_get_models_in_the_window_search_verdict_download_and_chat_with_a_picture(
        qtbot, store, model_path, tmp_path, monkeypatch, pictures):
    """The real window: Model → Get models…, search with the images filter, the verdict beside
    each file, download the pair, Open now, and a picture answered by the downloaded pair."""
    from PIL import Image

    from engine.synth.projector_gen import write_colour_projector
    from tests.helpers import open_window, send, wait_for

    monkeypatch.setenv("EBB_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "cache" / "models").mkdir(parents=True)
    for f in model_path.parent.glob(model_path.stem + ".*"):  # the default model, not fetched again
        (tmp_path / "cache" / "models" / f.name).symlink_to(f)
    projector = write_colour_projector(tmp_path / "mmproj-smol-f16.gguf", model_path)
    red = tmp_path / "red.png"
    Image.new("RGB", (300, 200), (220, 20, 30)).save(red)
    with LoopbackHub() as hub:
        hub.add("ebb/smol-colour-GGUF", {"smol-Q4_1.gguf": model_path, projector.name: projector},
                tags=["gguf"], downloads=3)
        hub.add("ebb/smol-text-GGUF", {"smol-Q4_1.gguf": model_path}, tags=["gguf"], downloads=7)
        store.settings.set("hub_endpoint", hub.endpoint)
        w = open_window(qtbot, store)
        w.get_models_action.trigger()
        dlg = w.models.hub_dialog
        assert dlg.mirror.text() == hub.endpoint
        # it opens on the most downloaded models that see images, not on a blank list (#52)
        wait_for(lambda: dlg.results.count() == 1)
        assert "ebb/smol-colour-GGUF" in dlg.results.item(0).text()
        dlg.images.setChecked(False)  # "Can see images" is remembered
        assert store.settings.get("hub_images") is False
        dlg.images.setChecked(True)
        dlg.query.setText("smol")
        dlg.search()
        wait_for(lambda: dlg.results.count() == 1)  # "can see images" leaves the text-only repo out
        dlg.results.setCurrentRow(0)
        wait_for(lambda: dlg.table.rowCount() == 1 and dlg.table.item(0, 2) is not None
                 and "reading" not in dlg.table.item(0, 2).text())
        verdict = dlg.table.item(0, 2).text()
        assert "on the CPU" in verdict and "pictures" in verdict, verdict
        # no row clicked: Download takes the quantisation that suits this machine
        assert dlg.download.isEnabled() and "suits this machine" in dlg.download.text()
        assert dlg.projector.currentData() == projector.name
        folder = tmp_path / "cache" / "models" / "hub" / "ebb" / "smol-colour-GGUF"
        hub.stall = (1 << 20, 3.0)  # a slow link: Cancel lands while it downloads
        dlg.start_download()
        wait_for(lambda: dlg.bar.value() > 0 or dlg.error.isVisible())
        dlg.stop.click()
        wait_for(lambda: "Cancelled" in dlg.status.text() or dlg.error.isVisible())
        assert not dlg.error.isVisible(), dlg.error.text()
        assert not list(folder.glob("*.part")) and not list(folder.glob("*.etag"))
        hub.stall = None
        dlg.start_download()
        wait_for(lambda: dlg.open_now.isEnabled() or dlg.error.isVisible())
        assert not dlg.error.isVisible(), dlg.error.text()
        assert (folder / projector.name).read_bytes() == projector.read_bytes()
        dlg.open_now.click()
        wait_for(lambda: w.chat.loaded and w.chat.last_cfg is not None
                 and w.chat.last_cfg.model_path.parent == folder)
        assert w.chat.last_cfg.mmproj_path == folder / projector.name
        w.composer.attach(str(red))
        send(qtbot, w, "What colour is this picture? Answer with one word.")
        reply = store.messages(w.conv_id)[-1].text.lower()
        assert "red" in reply, reply


def test_a_download_goes_on_when_the_dialog_closes_and_the_window_says_when_it_is_done(
        qtbot, store, model_path, tmp_path, monkeypatch):
    """#52: closing Get models paused its download, and nothing showed downloads once it was
    shut. Downloads belong to the window: one goes on with the dialog closed (the menu says
    so), the window's notice offers to open it when done, the dialog opened again lists it;
    closing the window pauses one under way and keeps its part."""
    from tests.helpers import open_window, wait_for

    monkeypatch.setenv("EBB_CACHE_DIR", str(tmp_path / "cache"))
    with LoopbackHub() as hub:
        for repo in ("ebb/first-GGUF", "ebb/second-GGUF"):
            hub.add(repo, {"smol-Q4_1.gguf": model_path}, tags=["gguf"])
        store.settings.set("hub_endpoint", hub.endpoint)
        store.settings.set("hub_images", False)
        w = open_window(qtbot, store)
        w.get_models_action.trigger()
        dlg = w.models.hub_dialog

        def download(row: int) -> None:
            wait_for(lambda: dlg.results.count() == 2)
            dlg.results.setCurrentRow(row)
            wait_for(lambda: dlg.download.isEnabled() and dlg.table.rowCount() == 1)
            hub.stall = (1 << 20, 2.0)  # a slow link: the download is under way when we look
            dlg.start_download()
            wait_for(lambda: dlg.bar.value() > 0 or dlg.error.isVisible())
            assert not dlg.error.isVisible(), dlg.error.text()

        download(0)
        first = w.downloads.running()[0]
        dlg.close()
        assert w.get_models_action.text() == "Get models… (1 downloading)"
        wait_for(lambda: first.state != "downloading")
        assert first.state == "done" and w.get_models_action.text() == "Get models…"
        got = first.fetched.model
        assert got.read_bytes() == model_path.read_bytes()
        notice = w.notices.area.notices()[0]
        assert f"Downloaded {got.name}" in notice.text() and notice.action_button.text() == "Open it"
        w.grab().save(str(tmp_path / "downloaded-notice.png"))
        w.get_models_action.trigger()  # the same dialog, as it was, with the list
        assert w.models.hub_dialog is dlg and dlg.isVisible()
        assert dlg.list.count() == 1 and "done" in dlg.list.item(0).text() and dlg.open_now.isEnabled()
        download(1)
        second = w.downloads.running()[0]
        assert dlg.list.count() == 2 and second.repo in dlg.list.item(1).text()
        dlg.grab().save(str(tmp_path / "downloads-list.png"))
        w.close()  # mid-download: paused, its part kept for the next start
        wait_for(lambda: second.state != "downloading")
        assert second.state == "paused"
        from engine.hub.download import part_path

        assert part_path(second.folder / "smol-Q4_1.gguf").stat().st_size >= 1 << 20


def test_a_disk_that_fills_keeps_the_part_and_the_download_goes_on_once_there_is_room(
        hub, families, tmp_path, monkeypatch):
    """A small tmpfs as the models disk: once the download has begun, something else fills
    the disk; the part is kept, the message says so, and after room is made it resumes. With
    too little room from the start, nothing begins."""
    import subprocess

    import engine.hub.download as dl

    lm, _ = families["gemma3"]
    size = lm.stat().st_size
    room_mib = size // 2**20 + 4  # the file fits; the file and a ballast as big do not
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={room_mib}m", "tmpfs", str(disk)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (not root, or no mount namespace)")
    try:
        hub.add("ebb/d-GGUF", {lm.name: lm}, tags=["gguf"])
        [quant] = repo_files("ebb/d-GGUF", endpoint=hub.endpoint).quants
        dest = disk / lm.name
        with pytest.raises(EbbError, match="not enough free disk"):
            download_file("ebb/d-GGUF", quant.parts[0], dest, hub.endpoint)  # 256 MiB margin
        monkeypatch.setattr(dl, "FREE_MARGIN_BYTES", 0)
        ballast = disk / "ballast"

        def fill_the_disk(p) -> None:
            if not ballast.exists():
                with open(ballast, "wb") as fh:
                    try:
                        fh.write(b"\0" * (room_mib << 20))
                    except OSError:
                        pass  # as much as there was room for

        with pytest.raises(EbbError, match="the disk filled"):
            download_file("ebb/d-GGUF", quant.parts[0], dest, hub.endpoint,
                          on_progress=fill_the_disk)
        kept = part_path(dest).stat().st_size
        assert 0 < kept < size and not dest.exists()
        ballast.unlink()
        download_file("ebb/d-GGUF", quant.parts[0], dest, hub.endpoint)
        assert dest.read_bytes() == lm.read_bytes()
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)


def test_no_network_is_one_line_at_once():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"  # bound, not listening: refused
    with pytest.raises(EbbError, match="cannot reach the Hub") as err:
        search("qwen", endpoint=closed)
    assert "mirror" in str(err.value)


def test_a_hub_that_takes_the_connection_and_never_answers_is_said_not_waited_on(monkeypatch):
    """#52: `models search` and the dialog waited for ever on a hub that accepted the connection
    and sent nothing (huggingface_hub's client has no timeout). Now every Hub call has connect
    and read timeouts (here shortened) and says so."""
    import socket

    from huggingface_hub.utils import close_session

    from engine.hub import remote
    from engine.hub.catalog import repo_files

    monkeypatch.setattr(remote, "HUB_READ_S", 1.0)
    close_session()  # the next client is made with these timeouts
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # accepts (the kernel does), never reads or answers
        endpoint = f"http://127.0.0.1:{silent.getsockname()[1]}"
        for call in (lambda: search("qwen", endpoint=endpoint),
                     lambda: repo_files("ebb/any-GGUF", endpoint=endpoint)):
            with pytest.raises(EbbError, match="did not answer within 1 s") as err:
                call()
            assert "mirror" in str(err.value)
    close_session()


def test_a_stalled_link_is_dropped_and_tried_again_and_a_split_model_comes_whole(
        hub, families, tmp_path, monkeypatch):
    """A link that stops sending is given up after the stall time and the rest asked for; a
    split model's parts all come, side by side, the first one named as the model."""
    import engine.hub.download as dl
    from engine.hub.fetch import fetch_pair

    monkeypatch.setattr(dl, "STALL_S", 0.5)
    a, _ = families["mlp"]
    b, mm = families["internvl"]
    hub.add("ebb/split-GGUF", {"m-Q8_0-00001-of-00002.gguf": a, "m-Q8_0-00002-of-00002.gguf": b,
                               "mmproj-m-f16.gguf": mm}, tags=["gguf"])
    files = repo_files("ebb/split-GGUF", endpoint=hub.endpoint)
    [quant] = files.quants
    assert quant.label == "Q8_0" and len(quant.parts) == 2
    hub.stall = (a.stat().st_size // 2, 3.0)  # the server goes quiet half-way through part 1
    attempts: list[int] = []
    got = fetch_pair("ebb/split-GGUF", quant, files.projectors[0], hub.endpoint,
                     on_progress=lambda p: attempts.append(p.attempt), root=tmp_path)
    assert got.model.name == "m-Q8_0-00001-of-00002.gguf" and max(attempts) >= 2
    assert got.model.read_bytes() == a.read_bytes()
    assert (got.model.parent / "m-Q8_0-00002-of-00002.gguf").read_bytes() == b.read_bytes()
    assert got.projector is not None and got.projector.parent == got.model.parent


def test_settings_keep_the_hub_mirror_and_token_and_need_no_reload(qtbot):
    from app.dialogs.settings import SettingsDialog
    from app.core.settings import Settings, reload_changes

    dlg = SettingsDialog(Settings(hub_endpoint="https://hf-mirror.example"))
    qtbot.addWidget(dlg)
    assert dlg.hub_endpoint.text() == "https://hf-mirror.example"
    dlg.hub_token.setText("hf_abc")
    after = dlg.values()
    assert (after["hub_endpoint"], after["hub_token"]) == ("https://hf-mirror.example", "hf_abc")
    assert reload_changes(Settings(**{**after, "hub_token": ""}), Settings(**after)) == ""


def test_a_paused_download_goes_on_in_its_own_row(qtbot, model_path, tmp_path, monkeypatch):
    """#67: Download after a pause added a second row and the old "paused at 15 %" stayed; the
    same download goes on in its own row, and ends done."""
    from app.widgets.downloads import Downloads
    from tests.helpers import wait_for

    monkeypatch.setenv("EBB_CACHE_DIR", str(tmp_path / "cache"))
    with LoopbackHub() as hub:
        hub.add("ebb/p-GGUF", {"smol-Q4_1.gguf": model_path}, tags=["gguf"])
        [quant] = repo_files("ebb/p-GGUF", endpoint=hub.endpoint).quants
        downloads = Downloads()
        hub.stall = (1 << 20, 2.0)  # slow after the first MiB: it is under way when paused
        first = downloads.start("ebb/p-GGUF", quant, None, hub.endpoint, None)
        wait_for(lambda: first.fraction > 0)
        downloads.pause(first.number)
        wait_for(lambda: first.state == "paused")
        assert first.line().startswith("ebb/p-GGUF Q4_1: paused at")
        hub.stall = None
        again = downloads.start("ebb/p-GGUF", quant, None, hub.endpoint, None)
        assert again is first and len(downloads.all) == 1
        wait_for(lambda: first.state != "downloading")
        assert first.state == "done" and first.fetched.model.read_bytes() == model_path.read_bytes()
