"""House rules a tool can check (import-linter contracts in pyproject.toml): the engine never
imports Qt, its imports only point down its layers, and no package has an import circle."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_import_linter_contracts_hold():
    lint = Path(sys.executable).with_name("lint-imports")
    proc = subprocess.run([str(lint)], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert " 0 broken" in proc.stdout


def test_engine_runs_without_qt_loaded():
    code = ("import sys, engine.cli, engine.llama.runtime, engine.gguf.info, engine.synth.projector_gen, "
            "engine.media.projector, engine.media.images, engine.events; "
            "sys.exit(1 if any(m.startswith(('PySide6', 'pyqtgraph', 'app')) for m in sys.modules) else 0)")
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0


def test_engine_is_mypy_strict_clean():
    proc = subprocess.run([sys.executable, "-m", "mypy", "engine"], cwd=ROOT, capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_app_is_mypy_clean():
    """#28: the window's code is type-checked too (PySide6's property keywords excepted: see
    pyproject.toml)."""
    proc = subprocess.run([sys.executable, "-m", "mypy", "app"], cwd=ROOT, capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_no_unused_or_undefined_names_in_the_code_or_the_suite():
    """ruff's pyflakes rules (pyproject.toml: [tool.ruff.lint]): an import nobody uses, a
    variable never read, a name never defined."""
    ruff = Path(sys.executable).with_name("ruff")
    proc = subprocess.run([str(ruff), "check", "--output-format", "concise", "engine", "app", "tests",
                           "packaging"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
