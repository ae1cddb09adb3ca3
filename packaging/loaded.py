"""`make test-loaded`: the test suite with busy processes beside it (default two: a 2-core
machine fully taken), as on a loaded CI runner. The suite must stay green: no sleeps as
synchronisation, no timing asserts, deadlines generous enough for a machine at half speed.

    python packaging/loaded.py [--hogs N] -- PYTEST_ARGS...
"""
from __future__ import annotations

import argparse
import subprocess
import sys

HOG = "while True: pass"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hogs", type=int, default=2, help="busy processes beside the suite")
    p.add_argument("pytest_args", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    rest = args.pytest_args[1:] if args.pytest_args[:1] == ["--"] else args.pytest_args
    hogs = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(args.hogs)]
    print(f"[ebb] {args.hogs} busy processes beside the suite (pids "
          f"{', '.join(str(h.pid) for h in hogs)})", flush=True)
    try:
        return subprocess.call([sys.executable, "-m", "pytest", *rest])
    finally:
        for h in hogs:
            h.kill()
            h.wait()


if __name__ == "__main__":
    sys.exit(main())
