"""`make test-numerics`: the tests that compare model outputs, run again with llama.cpp's
arithmetic changed on purpose, and green every time.

llama.cpp's logits depend on the evaluation path: the thread count, the batch size and the CPU
variant of ggml's kernels (AVX2, AVX-512, ...) each move them a little. A test that compares
two model outputs (marked `numerics`) must hold whatever they are (tests/helpers.py: SAME PATH
or DECIDED). This runs those tests:

- with the developer build, at 1 thread and at 3 (the suite's default is 2), and with prompts
  evaluated in batches of 96 instead of 512;
- with the portable build (the bundle's: ggml's CPU backend once per instruction-set level),
  with CPU variants this machine can run, each alone in its library folder so ggml loads that
  one: the best (what a user's machine like this one loads), AVX2's (haswell: most users'),
  and the plainest (x64: a CPU without AVX); `--all-variants` runs every one.

It ends with one line `N passed, N failed` over all runs; a run that fails names its settings.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bootstrap  # noqa: E402

ROOT = bootstrap.ROOT
WORK = ROOT / "build" / "numerics"
MARK = "numerics"
SHAKES: tuple[tuple[str, dict[str, str]], ...] = (
    ("1 thread", {"EBB_TEST_THREADS": "1"}),
    ("3 threads", {"EBB_TEST_THREADS": "3"}),
    ("batches of 96", {"EBB_TEST_N_BATCH": "96"}),
)
# ggml's score for a CPU variant: 0 where this CPU lacks what it was built for
SCORE = """
import ctypes, sys
ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL)
lib = ctypes.CDLL(sys.argv[2])
score = getattr(lib, "ggml_backend_score", None)
print(int(score()) if score is not None else 0)
"""


def say(msg: str) -> None:
    print(f"[ebb numerics] {msg}", flush=True)


def portable_package() -> Path:
    """The portable build's `llama_cpp` package, unpacked once per wheel (built by `make dist`
    or here, and cached outside the repository as every llama.cpp build is)."""
    backend, cmake_args, _why = bootstrap.detect_portable_backend()
    wheel = bootstrap.cached_wheel(backend, cmake_args)
    out = WORK / "portable"
    stamp = out / ".wheel"
    if not (stamp.exists() and stamp.read_text() == str(wheel)):
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        with zipfile.ZipFile(wheel) as z:
            z.extractall(out, [n for n in z.namelist() if n.startswith("llama_cpp/")])
        for so in (out / "llama_cpp" / "lib").glob("*.so*"):
            so.chmod(0o755)
        stamp.write_text(str(wheel))
    return out / "llama_cpp"


def cpu_variants(package: Path) -> list[tuple[str, int]]:
    """(variant, ggml's score) for each CPU variant of the portable build that runs here,
    best first."""
    lib = package / "lib"
    base = next((p for p in (lib / "libggml-base.so", lib / "libggml-base.so.0") if p.exists()), None)
    if base is None:
        return []
    found = []
    for module in sorted(lib.glob("libggml-cpu-*.so")):
        r = subprocess.run([sys.executable, "-c", SCORE, str(base), str(module)],
                           capture_output=True, text=True)
        score = int(r.stdout.strip() or 0) if r.returncode == 0 else 0
        if score > 0:
            found.append((module.name[len("libggml-cpu-"):-len(".so")], score))
    return sorted(found, key=lambda v: -v[1])


def chosen(variants: list[tuple[str, int]]) -> list[tuple[str, int]]:
    """The best of them, haswell's (AVX2) and the plainest, each once, best first."""
    if not variants:
        return []
    picks = [variants[0], *[v for v in variants if v[0] == "haswell"], variants[-1]]
    return list(dict.fromkeys(picks))


def variant_overlay(package: Path, variant: str) -> Path:
    """A folder to put first on PYTHONPATH whose `llama_cpp` has only this CPU variant (hard
    links: no copies), so ggml can load no other."""
    top = WORK / f"cpu-{variant}"
    target = top / "llama_cpp"
    if not target.exists():
        for src in package.rglob("*"):
            dst = target / src.relative_to(package)
            if src.is_dir():
                dst.mkdir(parents=True, exist_ok=True)
                continue
            if src.name.startswith("libggml-cpu-") and src.name != f"libggml-cpu-{variant}.so":
                continue
            dst.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(src, dst)
            except OSError:
                shutil.copy2(src, dst)
    return top


LOADED = ("from engine.llama.lib import llama; llama(); "
          "from engine.llama.about import cpu_backend_file; print(cpu_backend_file())")


def loaded_variant(env: dict[str, str]) -> str:
    """The CPU backend library a process with `env` loads (what the run really tests)."""
    r = subprocess.run([str(bootstrap.venv_python()), "-c", LOADED], cwd=ROOT, capture_output=True,
                       text=True, env=dict(os.environ, **env))
    return r.stdout.strip().splitlines()[-1] if r.returncode == 0 and r.stdout.strip() else "none"


def run_tests(label: str, env: dict[str, str], pytest_args: list[str]) -> tuple[int, int]:
    """One run of the numerics tests; (passed, failed)."""
    report = WORK / f"report-{re.sub(r'[^a-z0-9]+', '-', label.lower())}.xml"
    cmd = [str(bootstrap.venv_python()), "-m", "pytest", "-m", MARK, "-q", "-p", "no:cacheprovider",
           "--junit-xml", str(report), *pytest_args]
    say(f"{label}: {' '.join(f'{k}={v}' for k, v in env.items()) or 'as the suite runs'}")
    started = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, **env))
    passed, failed = _counts(report)
    if proc.returncode != 0 and not failed:
        failed = 1  # it ended before reporting (a crash), or collected nothing (5): a failure
    if not passed:  # a run that shook nothing proves nothing: every test skipped, or none ran
        say(f"{label}: ran no {MARK} test (pytest's exit {proc.returncode}): counted as a failure")
        failed = max(failed, 1)
    say(f"{label}: {passed} passed, {failed} failed in {time.monotonic() - started:.0f}s")
    return passed, failed


def _counts(report: Path) -> tuple[int, int]:
    import xml.etree.ElementTree as ET

    if not report.exists():
        return 0, 0
    suite = ET.parse(report).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    if suite is None:
        return 0, 0
    total = int(suite.get("tests", 0))
    failed = int(suite.get("failures", 0)) + int(suite.get("errors", 0))
    skipped = int(suite.get("skipped", 0))
    return total - failed - skipped, failed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-variants", action="store_true",
                    help="only the developer build's shakes (no portable build)")
    ap.add_argument("--all-variants", action="store_true",
                    help="every CPU variant this machine runs (default: best, haswell, plainest)")
    ap.add_argument("pytest_args", nargs="*", help="passed to pytest (e.g. -k reopen)")
    args = ap.parse_args(argv)
    WORK.mkdir(parents=True, exist_ok=True)
    runs: list[tuple[str, dict[str, str]]] = list(SHAKES)
    if not args.no_variants:
        package = portable_package()
        variants = cpu_variants(package)
        say("CPU variants this machine runs: "
            + (", ".join(f"{v} ({s})" for v, s in variants) or "none (not a portable build)"))
        if not variants:  # the shakes alone would go green having run no CPU variant
            say("no CPU variant of the portable build runs here: nothing to shake by CPU variant "
                "(pass --no-variants to run the other shakes alone)")
            print("0 passed, 1 failed")
            return 1
        if not args.all_variants:
            variants = chosen(variants)
        for variant, _score in variants:
            overlay = variant_overlay(package, variant)
            env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(overlay),
                                                               os.environ.get("PYTHONPATH")]))}
            loaded = loaded_variant(env)
            if loaded != f"libggml-cpu-{variant}.so":  # a run that tests another variant is none
                say(f"CPU variant {variant}: the process loaded {loaded}, not it")
                return 1
            runs.append((f"CPU variant {variant}", env))
    results = {label: run_tests(label, env, args.pytest_args) for label, env in runs}
    failing = [label for label, (_p, f) in results.items() if f]
    passed = sum(p for p, _f in results.values())
    failed = sum(f for _p, f in results.values())
    (WORK / "last.json").write_text(json.dumps(results, indent=1))
    for label in failing:
        say(f"failed with {label}")
    print(f"{passed} passed, {failed} failed")
    return 1 if failed or not passed else 0


if __name__ == "__main__":
    sys.exit(main())
