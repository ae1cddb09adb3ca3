"""Loading over RPC from the server's own copy: ggml's tensor cache, warmed by rpc-serve."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from engine.synth.model_gen import ModelShape, write_model
from engine.llama.rpc_server import cacheable_bytes
from tests.helpers import RpcServer, run_cli

# Two layers of width 2304 in f16: every weight matrix is over ggml's 10 MiB hash threshold.
WIDE = ModelShape(n_layers=2, n_embd=2304, n_ff=6144, n_head=18, n_head_kv=18)


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory, model_path):
    return write_model(tmp_path_factory.mktemp("wide") / "wide.gguf", WIDE, model_path)


def _load(endpoint, model, *extra):
    proc = run_cli("chat", "--rpc", endpoint, "--model", str(model), "--prompt", "Hello",
                   "--max-tokens", "6", "--temp", "0", "--threads", "2", "--json", "--ctx", "512",
                   *extra, timeout=600)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


# the reload mover's run: make test-slow (CI runs it); the live mover's stays in make test
@pytest.mark.parametrize("mover", [pytest.param("reload", marks=pytest.mark.slow), "live"])
def test_warm_cache_sends_hashes_instead_of_weights(tmp_path, wide_model, mover):
    """Both movers use the server's cache: the live mover sends each tensor over ggml's hash
    threshold in one copy of its own bytes. A cold load sends what is placed, once."""
    cacheable, total = cacheable_bytes(wide_model)
    assert cacheable > 0.95 * total
    # every layer and the (tied) output matrix go to the device; the input embeddings stay
    placed = total
    cold_server = RpcServer()
    warm_server = RpcServer("--cache", str(tmp_path / "cache"), "--warm-from", str(wide_model),
                            ready_line="ready")
    try:
        assert any("is cacheable" in line and "10 MiB" in line for line in warm_server.output)
        # the first start on a device runs the live mover's self-test references (remembered):
        # the second is what every later start sends
        _load(cold_server.endpoint, wide_model, "--mover", mover)
        cold = _load(cold_server.endpoint, wide_model, "--mover", mover)
        _load(warm_server.endpoint, wide_model, "--mover", mover)
        warm = _load(warm_server.endpoint, wide_model, "--mover", mover)
    finally:
        cold_server.stop()
        warm_server.stop()
    print(f"\n{mover}: cold load sent {cold['rpc_bytes_sent'] / 2**20:.1f} MiB in "
          f"{cold['load_s']:.2f}s ({placed / 2**20:.1f} MiB placed); warm load sent "
          f"{warm['rpc_bytes_sent'] / 2**20:.2f} MiB in {warm['load_s']:.2f}s")
    assert cold["mover"] == warm["mover"] == mover, cold["mover_note"]
    assert cold["n_layers_on_accel"] == warm["n_layers_on_accel"] == WIDE.n_layers
    assert 0.97 * placed <= cold["rpc_bytes_sent"] <= 1.05 * placed
    assert warm["rpc_bytes_sent"] < 0.05 * cold["rpc_bytes_sent"]
    # SAME PATH: one layout, the same prompt, on two servers of one build and thread count;
    # the weights are the same bytes whether sent or read from the server's cache
    assert warm["text"] == cold["text"]


def _netns_available() -> bool:
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return False
    probe = subprocess.run(["ip", "netns", "add", "ebb-probe"], capture_output=True)
    subprocess.run(["ip", "netns", "del", "ebb-probe"], capture_output=True)
    return probe.returncode == 0


class SlowLink:
    """A network namespace joined to ours by a veth pair shaped to 1 Gbit/s both ways."""

    NS, HOST_IF, NS_IF = "ebb-slow", "ebb-veth0", "ebb-veth1"
    HOST_IP, NS_IP = "10.231.0.1", "10.231.0.2"

    def __enter__(self) -> "SlowLink":
        self.__exit__()
        cmds = [
            ["ip", "netns", "add", self.NS],
            ["ip", "link", "add", self.HOST_IF, "type", "veth", "peer", "name", self.NS_IF],
            ["ip", "link", "set", self.NS_IF, "netns", self.NS],
            ["ip", "addr", "add", f"{self.HOST_IP}/30", "dev", self.HOST_IF],
            ["ip", "link", "set", self.HOST_IF, "up"],
            ["ip", "netns", "exec", self.NS, "ip", "addr", "add", f"{self.NS_IP}/30", "dev", self.NS_IF],
            ["ip", "netns", "exec", self.NS, "ip", "link", "set", self.NS_IF, "up"],
            ["ip", "netns", "exec", self.NS, "ip", "link", "set", "lo", "up"],
            ["tc", "qdisc", "add", "dev", self.HOST_IF, "root", "tbf", "rate", "1gbit", "burst",
             "256kb", "latency", "50ms"],
            ["ip", "netns", "exec", self.NS, "tc", "qdisc", "add", "dev", self.NS_IF, "root", "tbf",
             "rate", "1gbit", "burst", "256kb", "latency", "50ms"],
        ]
        for c in cmds:
            subprocess.run(c, check=True, capture_output=True)
        return self

    def __exit__(self, *exc: object) -> None:
        subprocess.run(["ip", "link", "del", self.HOST_IF], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.NS], capture_output=True)


@pytest.mark.skipif(not _netns_available(), reason="needs root and iproute2 (ip netns, tc)")
@pytest.mark.slow  # a measurement: `make test-slow` (CI runs it after `make test`)
def test_warm_load_over_a_1_gbit_link(tmp_path, wide_model):
    link_Bps = 1e9 / 8
    with SlowLink() as link:
        prefix = ("ip", "netns", "exec", link.NS)
        cold_server = RpcServer(host=link.NS_IP, prefix=prefix)
        warm_server = RpcServer("--cache", str(tmp_path / "cache"), "--warm-from", str(wide_model),
                                host=link.NS_IP, prefix=prefix, ready_line="ready")
        try:
            cold = _load(cold_server.endpoint, wide_model, "--mover", "reload")
            warm = _load(warm_server.endpoint, wide_model, "--mover", "reload")
        finally:
            cold_server.stop()
            warm_server.stop()
    saved = cold["rpc_bytes_sent"] - warm["rpc_bytes_sent"]
    expected_s = saved / link_Bps
    print(f"\n1 Gbit/s link: cold {cold['load_s']:.2f}s ({cold['rpc_bytes_sent'] / 2**20:.0f} MiB), "
          f"warm {warm['load_s']:.2f}s ({warm['rpc_bytes_sent'] / 2**20:.2f} MiB); "
          f"time saved {cold['load_s'] - warm['load_s']:.2f}s, the saved bytes take "
          f"{expected_s:.2f}s on the link")
    assert warm["text"] == cold["text"]  # SAME PATH, as in the test above
    # the saved bytes would have taken expected_s on the link; allow for noise on 2 busy cores
    assert cold["load_s"] - warm["load_s"] >= 0.75 * expected_s


LOSE_SERVER = """
import json, sys
from pathlib import Path
from engine.llama.devices import connect_rpc
from engine.models.default import default_model_path
from engine.llama.sampling import GenParams
from engine.session import Session, SessionConfig, turn_with_recovery
connect_rpc(sys.argv[1])
gp = GenParams(max_tokens=8, temperature=0)
s = Session(SessionConfig(default_model_path(), Path(sys.argv[2]), n_ctx=1024, n_threads=2,
                          vision="cpu", rpc=(sys.argv[1],)))
s, first = turn_with_recovery(s, "What is the capital of France? Answer in one word.", [], gp)
print(json.dumps({"accel": s.model.accel, "text": first.text}), flush=True)
input()  # the test kills the server now
# the window opens the chat again first: its take-up finds the server gone (a loss is reported
# once) and leaves it to the turn, which must still recover rather than run on the dead device
s.set_history([(t.role, t.text, []) for t in s.history], tag="lost")
taken = s.take_up()
s, second = turn_with_recovery(s, "And of Italy?", [sys.argv[3]], gp)
out = {"accel": s.model.accel, "lost": second.device_lost, "error": second.error, "taken": taken,
       "strategy": second.strategy, "history": [t.role for t in s.history],
       "n_prompt_tokens": second.gen.n_prompt_tokens}
s.close()
print(json.dumps(out), flush=True)
"""


def test_a_server_that_disappears_leaves_the_conversation_on_local_devices(tiny_projector, pictures):
    server = RpcServer()
    proc = subprocess.Popen([sys.executable, "-c", LOSE_SERVER, server.endpoint, str(tiny_projector),
                             str(pictures["a.png"])], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    first = json.loads(proc.stdout.readline())
    assert first["accel"] == "RPC0" and "Paris" in first["text"]
    server.stop()
    proc.stdin.write("\n")
    proc.stdin.flush()
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    second = json.loads(out.strip().splitlines()[-1])
    assert "went away" in second["lost"] and second["error"] is None and second["taken"] == 0
    assert second["accel"] is None and second["strategy"] == "cpu"
    assert second["history"] == ["user", "assistant", "user", "assistant"]
    assert second["n_prompt_tokens"] > 40  # the first exchange is still in the prompt


def test_ctrl_c_during_a_model_load_ends_at_once_with_one_line(wide_model):
    """Ctrl-C while llama.cpp loads (here: the self-test's references and the live layout of a
    459 MiB model going to an RPC device) ends the process with exit 130 and one line, not a
    traceback and not a silent exit 0 after the load."""
    import signal

    server = RpcServer()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "engine", "chat", "--rpc", server.endpoint, "--model",
             str(wide_model), "--prompt", "Hello", "--max-tokens", "4", "--ctx", "512", "--json",
             "--threads", "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=dict(os.environ, EBB_TEST_SAY_LOADING="1", EBB_CACHE_DIR=str(wide_model.parent)))
        assert proc.stderr is not None
        assert proc.stderr.readline().strip() == "ebb-engine: loading"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        server.stop()
    assert proc.returncode == 130, err
    assert out == "" and err.strip() == "ebb-engine: interrupted"
