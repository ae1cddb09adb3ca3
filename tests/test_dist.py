"""The desktop bundle, run like a user runs it (`make test-dist`, which builds it first).

The tarball `make dist` made is unpacked into a fresh folder and run with no venv, no Python
and no source tree on the path, and with HOME an empty folder: the command line answers a
prompt (with the model the bundle carries), the stand-in accelerator starts from the bundle
(no compiler needed), and the window opens under Xvfb. The bundle's llama.cpp is checked for
native-only code, its desktop entry with desktop-file-validate, and the pip-installed entry
points of the bundle's venv are run. Sizes and the cold start time are printed.
"""
from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.dist

ROOT = Path(__file__).resolve().parent.parent
INFO = ROOT / "dist" / "build-info.json"


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    if not INFO.exists():
        pytest.fail("no bundle: run `make test-dist` (it runs `make dist` first)")
    info = json.loads(INFO.read_text())
    where = tmp_path_factory.mktemp("unpacked")
    subprocess.run(["tar", "-xzf", info["tarball"], "-C", str(where)], check=True)
    mib = 1 << 20
    print(f"\nbundle: {info['bundle_bytes'] / mib:.0f} MiB unpacked, tarball "
          f"{info['tarball_bytes'] / mib:.0f} MiB; PyInstaller {info['pyinstaller_s']}s; "
          f"llama.cpp portable build {info['llama_build_s']}s (cached after the first)")
    return where / "Ebb"


def user_env(home: Path, **extra: str) -> dict[str, str]:
    """What a desktop session gives a program: no venv, no PYTHONPATH, no EBB_* overrides."""
    home.mkdir(parents=True, exist_ok=True)
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(home), "LANG": "C.UTF-8"}
    env.update(extra)
    return env


def test_bundle_answers_a_prompt_with_no_python_and_an_empty_home(bundle, tmp_path):
    home = tmp_path / "home"
    r = subprocess.run([str(bundle / "ebb-engine"), "chat", "--prompt", "What is 2+2?", "--temp", "0",
                        "--max-tokens", "12", "--json"], env=user_env(home), cwd=tmp_path,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    turn = json.loads(r.stdout.strip().splitlines()[-1])
    assert turn["text"].strip() and turn["n_gen_tokens"] > 0
    # the model is the one the bundle carries: nothing fetched, nothing in the empty HOME's cache
    about = json.loads(subprocess.run([str(bundle / "ebb-engine"), "about", "--json"],
                                      env=user_env(home), capture_output=True, text=True,
                                      timeout=120, check=True).stdout)
    assert about["frozen"] and Path(about["default_model"]).is_relative_to(bundle)
    assert about["sound_decoder"].startswith("PyAV "), about["sound_decoder"]  # FFmpeg's libraries came
    assert not (home / ".cache" / "ebb" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf").exists()
    # ggml picked a CPU variant for this machine from the bundle's own modules
    assert re.fullmatch(r"libggml-cpu-[a-z0-9_.]+\.so", about["cpu_backend"]), about["cpu_backend"]
    assert "RPC" in about["backends"] and "CPU" in about["backends"]
    print(f"\nbundle's CPU backend on this machine: {about['cpu_backend']}; reply: "
          f"{turn['text'].strip()!r}")


def _ymm_zmm(lib: Path) -> int:
    out = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(lib)], capture_output=True,
                         text=True, check=True).stdout
    return len(re.findall(r"%[yz]mm\d", out))


@pytest.mark.skipif(shutil.which("objdump") is None, reason="objdump (binutils) not installed")
def test_bundle_calls_a_tool_of_its_own_mcp_server(bundle, tmp_path):
    """Tools from the bundle: the MCP SDK, its protocol versions' modules and jsonschema's data
    came along; the bundle's own demo server (`ebb-engine mcp-demo`) is the server."""
    servers = tmp_path / "mcp.json"
    servers.write_text(json.dumps({"mcpServers": {"demo": {"command": str(bundle / "ebb-engine"),
                                                           "args": ["mcp-demo"]}}}))
    r = subprocess.run([str(bundle / "ebb-engine"), "chat", "--mcp", str(servers), "--allow-tools",
                        "--tool-choice", "echo", "--prompt", "Say hello.", "--temp", "0",
                        "--max-tokens", "40", "--max-tool-rounds", "1", "--json"],
                       env=user_env(tmp_path / "home"), cwd=tmp_path, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    (call,) = json.loads(r.stdout.strip().splitlines()[-1])["tool_calls"]
    assert call["tool"] == "demo:echo" and call["state"] == "done", (call, r.stderr[-2000:])


def test_bundle_llama_cpp_forces_no_native_only_instructions(bundle):
    """Only the per-CPU variants use AVX and up, each loaded only on a CPU that has it: the
    libraries every machine loads (ggml, llama, mtmd) and the baseline variant use none."""
    lib = bundle / "_internal" / "llama_cpp" / "lib"
    variants = sorted(p.name for p in lib.glob("libggml-cpu-*.so"))
    assert {"libggml-cpu-x64.so", "libggml-cpu-sse42.so", "libggml-cpu-haswell.so"} <= set(variants)
    assert not list(lib.glob("libggml-cpu.so*")), "a CPU backend built for the build machine"
    # PyInstaller puts what libraries link to at the top as well: links to the same files, or
    # a second ggml would load (its pointers garbage in the first)
    for top in (bundle / "_internal").glob("lib*.so*"):
        if top.name.startswith(("libggml", "libllama", "libmtmd")):
            assert top.is_symlink() and top.resolve().parent == lib.resolve(), top
    for name in ("libggml-base.so.0", "libggml.so.0", "libllama.so.0", "libmtmd.so.0",
                 "libggml-rpc.so", "libggml-cpu-x64.so", "libggml-cpu-sse42.so"):
        assert _ymm_zmm(lib / name) == 0, f"{name} uses AVX registers"
    assert _ymm_zmm(lib / "libggml-cpu-haswell.so") > 0  # the check can see AVX when it is there
    print(f"\nCPU variants in the bundle: {', '.join(variants)}")


def _cpu_variants_this_machine_runs(lib: Path) -> list[str]:
    """The bundle's CPU variants whose own score says this CPU can run them (ggml asks each the
    same way before it loads one: 0 means the CPU lacks an instruction set it uses)."""
    code = ("import ctypes, sys; ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL); "
            "score = ctypes.CDLL(sys.argv[2]).ggml_backend_score; "
            "score.restype = ctypes.c_int; print(score())")
    runs = []
    for variant in sorted(lib.glob("libggml-cpu-*.so")):
        r = subprocess.run([sys.executable, "-c", code, str(lib / "libggml-base.so.0"), str(variant)],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr[-2000:]
        if int(r.stdout.strip()) > 0:
            runs.append(variant.name)
    return runs


@pytest.mark.timeout(1800)  # a dozen variants, a colour check each: minutes more on a busy machine
def test_the_demo_names_every_colour_on_each_cpu_variant_this_machine_runs(bundle, tmp_path):
    """A user's CPU picks another variant than this machine's best: each one this CPU can run,
    loaded alone (a copy of the bundle, hard-linked, with the other variants taken out), names
    the demo's colours in every shade, with two threads."""
    lib = Path("_internal") / "llama_cpp" / "lib"
    variants = _cpu_variants_this_machine_runs(bundle / lib)
    assert "libggml-cpu-x64.so" in variants and "libggml-cpu-sse42.so" in variants
    gaps = {}
    for variant in variants:
        copy = tmp_path / ("bundle-" + variant.removeprefix("libggml-cpu-").removesuffix(".so"))
        subprocess.run(["cp", "-al", str(bundle), str(copy)], check=True)
        for other in (copy / lib).glob("libggml-cpu-*.so"):
            if other.name != variant:
                other.unlink()
        r = subprocess.run([str(copy / "ebb-engine"), "colour-check", "--threads", "2", "--json"],
                           env=user_env(tmp_path / "home"), capture_output=True, text=True,
                           timeout=600)
        assert r.stdout.strip(), r.stderr[-2000:]
        out = json.loads(r.stdout.strip().splitlines()[-1])
        assert out["cpu_backend"] == variant, out["cpu_backend"]
        wrong = [(a["rgb"], a["text"]) for a in out["answers"] if a["named"] != a["colour"]]
        assert r.returncode == 0 and not wrong, (variant, wrong)
        gaps[variant] = out["smallest_gap"]
    print("\nsmallest logit gap per CPU variant: "
          + ", ".join(f"{v.removeprefix('libggml-cpu-').removesuffix('.so')} {g:.2f}"
                      for v, g in gaps.items()))
    assert min(gaps.values()) > 1.0


@pytest.mark.skipif(shutil.which("objdump") is None, reason="objdump (binutils) not installed")
def test_bundle_has_no_amx_code(bundle):
    """ggml's AMX path segfaults on Sapphire Rapids and later (#25): the bundle ships no library
    with an AMX tile instruction; the AMX variant is left out, zen4's (AVX-512) serves those CPUs."""
    import sys

    sys.path.insert(0, str(ROOT / "packaging"))
    import bootstrap

    libs = [p for p in (bundle / "_internal").rglob("*.so*") if p.is_file() and not p.is_symlink()
            and p.name.startswith(("libggml", "libllama", "libmtmd"))]
    assert len(libs) > 10
    found = {p.name: bootstrap.amx_instruction_count(p) for p in libs}
    assert not any(found.values()), {k: v for k, v in found.items() if v}
    lib = bundle / "_internal" / "llama_cpp" / "lib"
    assert not list(lib.glob("libggml-cpu-sapphirerapids*"))
    assert (lib / "libggml-cpu-zen4.so").exists()


def test_bundle_starts_the_stand_in_accelerator_without_a_compiler(bundle, tmp_path):
    """The stand-in's memory cap is a preloaded library: the bundle carries it built."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = user_env(tmp_path / "home", PATH="/nonexistent")  # no cc to be found
    proc = subprocess.Popen([str(bundle / "ebb-engine"), "rpc-serve", "--port", str(port),
                             "--device-memory", "64MiB"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.1)
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        r = subprocess.run([str(bundle / "ebb-engine"), "devices", "--json", "--rpc",
                            f"127.0.0.1:{port}"], env=user_env(tmp_path / "home"),
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
        remote = [d for d in json.loads(r.stdout)["devices"] if d["remote"]]
        assert remote and remote[0]["total_bytes"] == 64 << 20
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.skipif(shutil.which("Xvfb") is None, reason="Xvfb not installed")
def test_bundle_opens_its_window(bundle, tmp_path):
    xvfb = subprocess.Popen(["Xvfb", "-displayfd", "1", "-screen", "0", "1280x800x24", "-nolisten", "tcp"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        display = xvfb.stdout.readline().strip() if xvfb.stdout else ""
        assert display, "Xvfb did not start"
        env = user_env(tmp_path / "home", DISPLAY=f":{display}", EBB_QUIT_WHEN_SHOWN="1")
        started = time.monotonic()
        proc = subprocess.Popen([str(bundle / "Ebb")], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
        lines, cold = [], None
        assert proc.stdout is not None
        for line in proc.stdout:  # the window says when it is on screen, then quits
            lines.append(line.rstrip())
            if line.startswith("shown ") and cold is None:
                cold = time.monotonic() - started
        proc.wait(timeout=180)
        ended = time.monotonic() - started
        assert proc.returncode == 0, "\n".join(lines)[-3000:]
        assert cold is not None and any(ln.startswith("shown ") and ln.endswith(" True")
                                        for ln in lines), "\n".join(lines)[-3000:]
        print(f"\nbundle cold start to a visible window: {cold:.2f}s (process start to shown, "
              f"first run, empty HOME); the process ended {ended:.1f}s after its start (it "
              f"finishes the model load it began)")
    finally:
        xvfb.terminate()
        xvfb.wait(timeout=10)


@pytest.mark.skipif(shutil.which("desktop-file-validate") is None,
                    reason="desktop-file-validate (desktop-file-utils) not installed")
def test_install_desktop_writes_a_valid_entry_and_uninstall_removes_it(bundle, tmp_path):
    data = tmp_path / "xdg"
    env = dict(user_env(tmp_path / "home"), XDG_DATA_HOME=str(data))
    r = subprocess.run(["bash", str(bundle / "install-desktop.sh")], env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    entry = data / "applications" / "ebb.desktop"
    v = subprocess.run(["desktop-file-validate", str(entry)], capture_output=True, text=True)
    assert v.returncode == 0 and "error" not in v.stdout.lower(), v.stdout + v.stderr
    text = entry.read_text()
    assert f'Exec="{bundle}/Ebb" %F' in text and f"TryExec={bundle}/Ebb" in text
    assert (data / "icons" / "hicolor" / "scalable" / "apps" / "ebb.svg").exists()
    assert (data / "mime" / "packages" / "ebb-gguf.xml").exists()
    r = subprocess.run(["bash", str(bundle / "install-desktop.sh"), "--uninstall"], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert not entry.exists() and not (data / "mime" / "packages" / "ebb-gguf.xml").exists()
    assert not (data / "icons" / "hicolor" / "scalable" / "apps" / "ebb.svg").exists()


def test_pip_installed_entry_points_run(tmp_path):
    """`make dist` installs Ebb into .venv-dist with `pip install .` (not editable): its
    entry points run, and the installed app finds its icon outside any checkout."""
    bindir = ROOT / ".venv-dist" / "bin"
    if not (bindir / "ebb-engine").exists():
        pytest.fail("no .venv-dist: run `make test-dist`")
    env = user_env(tmp_path / "home")
    for cmd in (["ebb-engine", "--help"], ["ebb", "--help"]):
        r = subprocess.run([str(bindir / cmd[0]), *cmd[1:]], env=env, cwd=tmp_path,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and "usage" in r.stdout, r.stderr
    r = subprocess.run([str(bindir / "python"), "-c", "import app.core.resources as r; "
                        "print(r.__file__); print(r.resource_path('ebb.svg'))"],
                       env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    module, icon = r.stdout.split()
    assert ".venv-dist" in module and Path(icon).is_file(), r.stdout + r.stderr
    assert "/.venv-dist/share/ebb/resources/" in icon  # from the wheel, not the checkout


def test_bundle_serves_the_openai_api(bundle, tmp_path):
    """`ebb-engine serve` from the bundle: uvicorn's protocol modules, loaded by name at run
    time, must be in it."""
    import http.client

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([str(bundle / "ebb-engine"), "serve", "--port", str(port), "--ctx", "1024"],
                            env=user_env(tmp_path / "home"), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline, status = time.monotonic() + 120, ""
        while time.monotonic() < deadline and status != "ok":
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
                conn.request("GET", "/health")
                status = json.loads(conn.getresponse().read()).get("status", "")
                conn.close()
            except (OSError, ValueError, http.client.HTTPException):
                time.sleep(0.3)
        assert status == "ok"
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        conn.request("POST", "/v1/chat/completions", body=json.dumps({
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}),
            headers={"Content-Type": "application/json"})
        answer = json.loads(conn.getresponse().read())
        assert answer["choices"][0]["message"]["content"] and answer["usage"]["completion_tokens"] > 0
    finally:
        proc.terminate()
        proc.wait(timeout=30)
