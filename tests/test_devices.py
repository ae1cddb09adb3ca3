"""Devices as llama.cpp sees them, and RPC servers as extra devices."""
from __future__ import annotations

import json
import subprocess
import sys
import time

from engine.rpc_server import is_loopback
from tests.conftest import free_port, run_cli


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
    proc = subprocess.Popen([sys.executable, "-m", "engine", "rpc-serve", "--host", host,
                             "--port", str(free_port()), "--threads", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    time.sleep(1.5)
    proc.kill()
    out, _ = proc.communicate()
    return out


def test_rpc_serve_warns_unless_loopback():
    assert "WARNING" not in _first_lines("127.0.0.1")
    out = _first_lines("0.0.0.0")
    assert "WARNING: ggml RPC has no authentication" in out and "trusted network" in out
