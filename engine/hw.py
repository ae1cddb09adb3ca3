"""Host facts the engine needs: physical core count (ggml's thread pool spins, so never
use more threads than real cores)."""
from __future__ import annotations

import functools
import os
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
