"""Host facts the engine needs: physical core count (ggml's thread pool spins, so never
use more threads than real cores)."""
from __future__ import annotations

import functools
import os
import time
from pathlib import Path


@functools.lru_cache(maxsize=1)
def physical_cores() -> int:
    """Physical cores available to this process (Linux sysfs; falls back to logical count)."""
    try:
        allowed = os.sched_getaffinity(0)
    except AttributeError:
        allowed = set(range(os.cpu_count() or 1))
    cores: set[tuple[str, str]] = set()
    for cpu in allowed:
        topo = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            pkg = (topo / "physical_package_id").read_text().strip()
            core = (topo / "core_id").read_text().strip()
        except OSError:
            return max(1, len(allowed))
        cores.add((pkg, core))
    return max(1, len(cores) or len(allowed))


_IMPORTED_AT = time.monotonic()


def process_age_s() -> float:
    """Seconds since this process started (the interpreter's own start-up included, from
    /proc/self/stat on Linux; elsewhere since this module was imported)."""
    try:
        with open("/proc/self/stat") as fh:
            started_ticks = int(fh.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as fh:
            uptime_s = float(fh.read().split()[0])
        return max(0.0, uptime_s - started_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.monotonic() - _IMPORTED_AT
