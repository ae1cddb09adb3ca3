"""Devices as llama.cpp sees them, and RPC servers as extra devices."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from engine.llama.rpc_server import is_loopback
from tests.helpers import free_port, run_cli


def test_local_devices_and_nvml_not_available_here():
    proc = run_cli("devices", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    cpu = [d for d in out["devices"] if d["kind"] == "cpu"]
    assert cpu and cpu[0]["total_bytes"] > 0 and cpu[0]["remote"] is False
    if not any(d["name"].startswith("CUDA") for d in out["devices"]):
        assert out["nvml"] is None  # "not available", not an exception


def test_rpc_server_is_a_remote_device_with_memory(rpc_server):
    proc = run_cli("devices", "--json", "--rpc", rpc_server.endpoint)
    assert proc.returncode == 0, proc.stderr
    remote = [d for d in json.loads(proc.stdout)["devices"] if d["remote"]]
    assert len(remote) == 1
    assert remote[0]["name"] == "RPC0" and rpc_server.endpoint in remote[0]["description"]
    assert remote[0]["total_bytes"] > 0 and remote[0]["kind"] != "cpu"


def test_unreachable_or_malformed_rpc_address():
    port = free_port()
    proc = run_cli("devices", "--rpc", f"127.0.0.1:{port}")
    assert proc.returncode == 2 and "cannot reach RPC server" in proc.stderr
    proc = run_cli("chat", "--prompt", "hi", "--rpc", "nonsense")
    assert proc.returncode == 2 and "not an RPC server address" in proc.stderr


def test_loopback_detection():
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.0.2.1")


def _first_lines(host: str) -> str:
    """What rpc-serve says up to its "serving ..." line (the warning comes before it): read
    until that line, not for a while."""
    proc = subprocess.Popen([sys.executable, "-m", "engine", "rpc-serve", "--host", host,
                             "--port", str(free_port()), "--threads", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if "rpc-serve: serving" in line:
                break
    finally:
        proc.kill()
        proc.communicate()
    return "".join(lines)


def test_rpc_serve_warns_unless_loopback():
    assert "WARNING" not in _first_lines("127.0.0.1")
    out = _first_lines("0.0.0.0")
    assert "WARNING: ggml RPC has no authentication" in out and "trusted network" in out


FAULTS = """
import ctypes, resource, sys
from engine.llama.rpc_server import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
def cycle(n):
    p = libc.malloc(n)
    ctypes.memset(p, 1, n)
    libc.free(p)
cycle(8 << 20)  # a freed mapped block moves glibc's own threshold to 8 MiB
cycle(30 << 20)
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    cycle(30 << 20)  # a restore-sized device buffer, allocated and freed
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_rpc_server_memory_is_reused_like_vram():
    """rpc-serve keeps freed device memory resident: a buffer allocated again is not a fresh
    run of page faults (with glibc's moving thresholds it was, on every swap)."""
    faults = {mode: int(subprocess.run([sys.executable, "-c", FAULTS, mode], capture_output=True,
                                       text=True, check=True).stdout) for mode in ("default", "keep")}
    print(f"\npage faults over 5 reallocations of 30 MiB: glibc defaults {faults['default']}, "
          f"rpc-serve's settings {faults['keep']}")
    assert faults["default"] > 1000  # the problem is real here
    assert faults["keep"] < 50
