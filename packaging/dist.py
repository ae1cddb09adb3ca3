#!/usr/bin/env python3
"""`make dist`: the one-folder desktop bundle dist/Ebb/ and its tarball.

Run with the system Python (stdlib only), like bootstrap.py. Steps:
1. the portable llama-cpp-python wheel (no -march=native; ggml's CPU backend built once per
   instruction-set level, picked at start), cached under its own key beside the developer build;
2. a separate venv, .venv-dist, with that wheel, Ebb itself (`pip install .`, so the wheel's
   entry points are built the way a user's pip builds them) and PyInstaller;
3. PyInstaller with packaging/pyinstaller/ebb.spec: launchers `Ebb` and `ebb-engine`;
4. the default model copied in (98 MB; a first run then needs no network, and a bundle has no
   pip to fetch it with);
5. dist/Ebb-<version>-linux-<arch>[-cuda].tar.gz, and dist/build-info.json with sizes and times.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bootstrap  # noqa: E402

ROOT = bootstrap.ROOT
DIST_VENV = ROOT / ".venv-dist"
DIST = ROOT / "dist"
PYINSTALLER = "pyinstaller==6.22.3"


def say(msg: str) -> None:
    print(f"[ebb dist] {msg}", flush=True)


def version() -> str:
    m = re.search(r'^version\s*=\s*"([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M)
    if not m:
        raise SystemExit("[ebb dist] no version in pyproject.toml")
    return m.group(1)


def tarball_name(backend: str) -> str:
    suffix = "-cuda" if backend.startswith("cuda") else ""
    return f"Ebb-{version()}-{platform.system().lower()}-{platform.machine()}{suffix}.tar.gz"


def dist_venv(backend: str, wheel: Path) -> Path:
    py = DIST_VENV / "bin" / "python"
    stamp = DIST_VENV / ".ebb-dist.json"
    want = {"fingerprint": bootstrap.fingerprint(backend), "wheel": str(wheel)}
    if not (py.exists() and stamp.exists() and json.loads(stamp.read_text()) == want):
        if not py.exists():
            say(f"creating {DIST_VENV}")
            bootstrap.run([sys.executable, "-m", "venv", str(DIST_VENV)])
        bootstrap.run([str(py), "-m", "pip", "install", "-q", "--force-reinstall", "--no-deps", str(wheel)])
        say("installing Ebb's dependencies and PyInstaller into the bundle's venv")
        bootstrap.run([str(py), "-m", "pip", "install", "-q", str(wheel), PYINSTALLER, str(ROOT),
                       *bootstrap.cuda_runtime_packages(backend)])
        stamp.write_text(json.dumps(want))
    # Ebb itself again each time, as a user's `pip install .` builds it (not editable)
    bootstrap.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--force-reinstall", str(ROOT)])
    return py


def dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def build() -> dict[str, object]:
    started = time.monotonic()
    backend, cmake_args, why = bootstrap.detect_portable_backend()
    say(f"llama.cpp for the bundle: {backend} ({why}): {' '.join(cmake_args)}")
    wheel = bootstrap.cached_wheel(backend, cmake_args)
    py = dist_venv(backend, wheel)
    model = subprocess.run([str(py), "-c", "from engine.models.default import fetch_default_model as f; "
                            "print(f())"], cwd=ROOT, capture_output=True, text=True)
    if model.returncode != 0:
        raise SystemExit(f"[ebb dist] could not fetch the default model: {model.stderr.strip()}")
    model_path = model.stdout.strip().splitlines()[-1]
    bundle = DIST / "Ebb"
    say("running PyInstaller (a few minutes)")
    t_pyi = time.monotonic()
    devcap = ROOT / "build" / "devcap" / "libebb-devcap.so"
    devcap.parent.mkdir(parents=True, exist_ok=True)
    bootstrap.run(["cc", "-shared", "-fPIC", "-O2", "-o", str(devcap),
                   str(ROOT / "engine" / "llama" / "devcap.c"), "-ldl", "-lpthread"])
    env = dict(os.environ, EBB_DIST_MODEL=model_path, EBB_DIST_DEVCAP=str(devcap))
    bootstrap.run([str(py), "-m", "PyInstaller", "--noconfirm", "--log-level", "WARN",
                   "--distpath", str(DIST), "--workpath", str(ROOT / "build" / "pyinstaller"),
                   str(ROOT / "packaging" / "pyinstaller" / "ebb.spec")], env=env,
                  cwd=devcap.parent)  # not the checkout: its egg-info is not the installed Ebb
    pyi_s = time.monotonic() - t_pyi
    # beside the launchers: puts this bundle into the application menu (--uninstall removes it)
    shutil.copy2(ROOT / "packaging" / "install-desktop.sh", bundle / "install-desktop.sh")
    tar = DIST / tarball_name(backend)
    say(f"packing {tar.name}")
    tar.unlink(missing_ok=True)
    bootstrap.run(["tar", "-czf", str(tar), "-C", str(DIST), "Ebb"])
    info: dict[str, object] = {
        "version": version(), "backend": backend, "cmake_args": cmake_args,
        "bundle": str(bundle), "bundle_bytes": dir_size(bundle),
        "tarball": str(tar), "tarball_bytes": tar.stat().st_size,
        "pyinstaller_s": round(pyi_s, 1), "total_s": round(time.monotonic() - started, 1),
        "llama_build_s": json.loads((wheel.parent / "build-info.json").read_text()).get("build_s")
        if (wheel.parent / "build-info.json").exists() else None,
    }
    (DIST / "build-info.json").write_text(json.dumps(info, indent=1))
    mib = 1 << 20
    say(f"bundle {bundle}: {info['bundle_bytes'] // mib} MiB; tarball {tar.name}: "
        f"{info['tarball_bytes'] // mib} MiB; PyInstaller {pyi_s:.0f}s, all {info['total_s']}s "
        f"(llama.cpp's portable build, once, cached: {info['llama_build_s']}s)")
    return info


def ensure_test_tools() -> None:
    """`make test-dist` checks the .desktop file with desktop-file-validate and opens the
    bundled window under Xvfb: install them where we can (root with apt), else say how."""
    need = {"desktop-file-validate": "desktop-file-utils", "Xvfb": "xvfb"}
    missing = [pkg for tool, pkg in need.items() if not shutil.which(tool)]
    if not missing:
        return
    if hasattr(os, "geteuid") and os.geteuid() == 0 and shutil.which("apt-get"):
        say(f"installing {' '.join(missing)} for the bundle's tests")
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        subprocess.run(["apt-get", "update", "-q"], env=env, stdout=subprocess.DEVNULL)
        subprocess.run(["apt-get", "install", "-y", "-q", *missing], env=env, stdout=subprocess.DEVNULL)
    still = [pkg for tool, pkg in need.items() if not shutil.which(tool)]
    if still:
        say(f"the bundle's tests need: sudo apt-get install {' '.join(still)}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--test-tools", action="store_true",
                    help="only install what the bundle's tests need (desktop-file-utils, xvfb)")
    args = ap.parse_args(argv)
    if args.test_tools:
        ensure_test_tools()
        return 0
    build()
    return 0


if __name__ == "__main__":
    sys.exit(main())
