"""The devices llama.cpp sees (ggml backend registry), RPC servers, and NVML telemetry.

Missing data is "not available" (None), never an exception. Called from the engine's thread.
"""
from __future__ import annotations

import atexit
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

from engine.errors import EbbError
from engine.events import DeviceInfo as DeviceInfo  # where every device below is made
from engine.llama import ggml

if TYPE_CHECKING:
    import socket  # imported where used: only RPC needs it (~5 ms of every start)

_rpc_lock = threading.Lock()
_rpc_endpoints: dict[str, list[str]] = {}  # endpoint -> device names it added
_dead_endpoints: set[str] = set()  # servers that went away: never call into their devices again


def _usable_handles() -> list[tuple[int, bool]]:
    """(ggml device, remote?) for every device, less those of RPC servers that went away
    (asking a dead server anything makes ggml abort the process). No memory queries."""
    out = []
    for dev in ggml.device_handles():
        remote = ggml.device_reg_name(dev).upper() == "RPC"
        if remote and ggml.device_description(dev) in _dead_endpoints:
            continue
        out.append((dev, remote))
    return out


def _info(dev: int, remote: bool) -> DeviceInfo:
    free, total = ggml.device_memory(dev)  # a round trip for a remote device
    return DeviceInfo(name=ggml.device_name(dev), description=ggml.device_description(dev),
                      kind=ggml.device_kind(dev), free_bytes=free if total else None,
                      total_bytes=total or None, remote=remote, handle=dev)


def list_devices(endpoints: Sequence[str] | None = None) -> list[DeviceInfo]:
    """Every device llama.cpp sees (with its memory), less those of lost RPC servers.
    `endpoints`: of the remote devices, only those of these servers are asked (a server
    registered earlier may have gone since, and ggml-rpc aborts on a failed connection)."""
    return [_info(dev, remote) for dev, remote in _usable_handles()
            if not remote or endpoints is None or ggml.device_description(dev) in endpoints]


def accelerators() -> list[DeviceInfo]:
    return [d for d in list_devices() if d.is_accelerator]


def parse_endpoint(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise EbbError(f"'{text}' is not an RPC server address", "use HOST:PORT, e.g. 127.0.0.1:50052")
    return host.strip("[]"), int(port)


def connect_rpc(endpoint: str, timeout_s: float = 3.0) -> list[str]:
    """Add an RPC server's devices to llama.cpp's registry (once per endpoint). Returns names."""
    import socket

    host, port = parse_endpoint(endpoint)
    with _rpc_lock:
        if endpoint in _rpc_endpoints:
            return _rpc_endpoints[endpoint]
        g = ggml.lib()
        if g.rpc is None:
            raise EbbError("this llama.cpp was built without RPC support",
                           "rebuild with `make setup` (it builds with -DGGML_RPC=on)")
        try:
            socket.create_connection((host, port), timeout=timeout_s).close()
        except OSError as exc:
            raise EbbError(f"cannot reach RPC server {endpoint}: {exc.strerror or exc}",
                           "start it with `ebb-engine rpc-serve` and check the address") from None
        before = set(ggml.device_handles())  # no memory queries: other servers may be gone
        reg = g.rpc.ggml_backend_rpc_add_server(endpoint.encode())
        if not reg:
            raise EbbError(f"RPC server {endpoint} did not answer as a ggml RPC server",
                           "check that it runs the same llama.cpp version")
        g.core.ggml_backend_register(reg)
        names = [ggml.device_name(d) for d in ggml.device_handles() if d not in before]
        _rpc_endpoints[endpoint] = names
        return names


def _our_sockets() -> list[socket.socket]:
    """Duplicates of this process's TCP sockets (close them after use)."""
    import os
    import socket

    out: list[socket.socket] = []
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for fd in fds:
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                sock = socket.socket(fileno=os.dup(int(fd)))
                if sock.type == socket.SOCK_STREAM:
                    out.append(sock)
                else:
                    sock.close()
        except (OSError, ValueError):
            continue
    return out


def _peers(endpoint: str) -> set[tuple[str, int]]:
    import socket

    host, port = parse_endpoint(endpoint)
    try:
        return {(str(ai[4][0]), port) for ai in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)}
    except OSError:
        return set()


def _connection_alive(sock: socket.socket) -> bool:
    """False when the peer closed the connection or it broke (looks without reading)."""
    import socket

    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
    except BlockingIOError:
        return True  # open, nothing to read
    except OSError:
        return False


def forget_server(endpoint: str) -> None:
    """A server this process stopped itself (the window's stand-in accelerator): its devices
    are never asked anything again (ggml-rpc aborts when it cannot connect)."""
    _dead_endpoints.add(endpoint)


def check_rpc_servers(timeout_s: float = 1.0) -> list[str]:
    """Endpoints of registered RPC servers that went away (each reported once).

    Our open connections to a server tell, without a new connection (a busy ggml server
    accepts one client at a time and its backlog is short): a server that died has closed them.
    """
    if not _rpc_endpoints:
        return []
    import socket

    gone = []
    socks = _our_sockets()
    try:
        for endpoint in list(_rpc_endpoints):
            if endpoint in _dead_endpoints:
                continue
            peers = _peers(endpoint)
            mine = []
            for sock in socks:
                try:
                    if sock.getpeername()[:2] in peers:
                        mine.append(sock)
                except OSError:
                    continue
            if mine:
                alive = all(_connection_alive(s) for s in mine)
            else:
                host, port = parse_endpoint(endpoint)
                try:
                    socket.create_connection((host, port), timeout=timeout_s).close()
                    alive = True
                except OSError:
                    alive = False
            if not alive:
                _dead_endpoints.add(endpoint)
                gone.append(endpoint)
    finally:
        for sock in socks:
            sock.close()
    return gone


def refused_endpoints(timeout_s: float = 0.5) -> list[str]:
    """Registered RPC servers that refuse a fresh connection (nothing listens any more). A busy
    live server may not answer in time: only a refusal counts."""
    import socket

    out = []
    for endpoint in list(_rpc_endpoints):
        host, port = parse_endpoint(endpoint)
        try:
            socket.create_connection((host, port), timeout=timeout_s).close()
        except ConnectionRefusedError:
            out.append(endpoint)
        except OSError:
            continue
    return out


def _handle(name: str) -> tuple[int, bool]:
    for dev, remote in _usable_handles():
        if ggml.device_name(dev) == name:
            return dev, remote
    raise EbbError(f"no device named {name}", "see `ebb-engine devices`")


def remote_device_names(endpoint: str) -> list[str]:
    """The names of one RPC server's devices, in the server's order (no memory queries)."""
    return [ggml.device_name(d) for d, remote in _usable_handles()
            if remote and ggml.device_description(d) == endpoint]


def find_device(name: str) -> DeviceInfo:
    """One device by llama.cpp's name (only its memory is queried)."""
    return _info(*_handle(name))


def wait_until_done(name: str) -> None:
    """Return once the device has carried out what was sent to it (frees included), so a
    step's span ends when the device is done, not when the request left. A remote device
    answers one memory query after every earlier request (one connection, in order); a local
    backend frees synchronously. Unknown names are ignored."""
    try:
        dev, remote = _handle(name)
    except EbbError:
        return
    if remote:
        ggml.device_memory(dev)


def reported_used_bytes(name: str) -> int | None:
    """The device's own reading of its used memory (NVML for CUDA devices, else ggml's).
    Called per pipeline step: it asks only the device in question."""
    if name.startswith("CUDA") and name[4:].isdigit():
        readings = nvml_readings()
        if readings is not None and int(name[4:]) < len(readings):
            return readings[int(name[4:])].used_bytes
    try:
        dev, remote = _handle(name)
    except EbbError:
        return None
    if remote:  # an RPC server reports its host's memory, not what we placed there
        return None
    free, total = ggml.device_memory(dev)
    return total - free if total else None


_TCP_INFO_BYTES_ACKED = 120  # offset of tcpi_bytes_acked in Linux's struct tcp_info


def rpc_bytes_sent() -> int | None:
    """Bytes this process has sent (and had acknowledged) to the RPC servers it connected to,
    from the kernel's statistics of its own TCP sockets; None where they are not available."""
    if not _rpc_endpoints:
        return None
    import socket
    import struct

    peers: set[tuple[str, int]] = set()
    for endpoint in _rpc_endpoints:
        peers |= _peers(endpoint)
    if not peers or not hasattr(socket, "TCP_INFO"):
        return None
    total = 0
    for sock in _our_sockets():
        try:
            if sock.getpeername()[:2] in peers:
                info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
                if len(info) >= _TCP_INFO_BYTES_ACKED + 8:
                    total += struct.unpack_from("Q", info, _TCP_INFO_BYTES_ACKED)[0]
        except OSError:
            pass
        finally:
            sock.close()
    return total


# ---------------------------------------------------------------- NVML


@dataclass(frozen=True)
class NvmlReading:
    index: int
    name: str
    used_bytes: int
    total_bytes: int
    process_used_bytes: int | None  # this process's usage; None when the driver hides it


_nvml_lock = threading.Lock()
_nvml_state: dict[str, Any] = {}  # "module": pynvml once initialised, or None: not available


def _nvml() -> Any:
    """pynvml, initialised once per process (and shut down at exit), or None when there is no
    NVIDIA driver or library. Any thread."""
    with _nvml_lock:
        if "module" not in _nvml_state:
            _nvml_state["module"] = None
            try:
                import pynvml
            except ImportError:
                return None
            try:
                pynvml.nvmlInit()
            except pynvml.NVMLError:  # no driver, no library: "not available"
                return None
            atexit.register(_nvml_shutdown, pynvml)
            _nvml_state["module"] = pynvml
        return _nvml_state["module"]


def _nvml_shutdown(pynvml: Any) -> None:
    try:
        pynvml.nvmlShutdown()
    except pynvml.NVMLError:
        pass


def nvml_readings(pid: int | None = None) -> list[NvmlReading] | None:
    """NVIDIA GPUs as the driver sees them, or None when NVML is not available."""
    import os

    pynvml = _nvml()
    if pynvml is None:
        return None
    pid = pid or os.getpid()
    out = []
    try:
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            name = pynvml.nvmlDeviceGetName(h)
            mine: int | None = None
            try:
                procs = pynvml.nvmlDeviceGetComputeRunningProcesses(h)
                mine = sum(int(p.usedGpuMemory or 0) for p in procs if p.pid == pid)
            except pynvml.NVMLError:  # the driver hides other processes' use
                mine = None
            out.append(NvmlReading(i, name if isinstance(name, str) else name.decode(),
                                   int(mem.used), int(mem.total), mine))
    except pynvml.NVMLError:  # a GPU fell off the bus, a driver reset: not available now
        return None
    return out


SAFETY_MARGIN_BYTES = 256 * 2**20


def session_accelerators(rpc: tuple[str, ...] = ()) -> list[DeviceInfo]:
    """Local accelerators, then these RPC servers' devices (in the order given); servers
    registered in the process earlier for other sessions are not included."""
    for endpoint in rpc:
        connect_rpc(endpoint)
    handles = [(dev, remote) for dev, remote in _usable_handles() if ggml.device_kind(dev) != "cpu"]
    # only these devices' memory is asked: a server another session registered in this
    # process may be gone, and asking a dead server makes ggml abort
    local = [_info(dev, False) for dev, remote in handles if not remote]
    return local + [_info(dev, True) for e in rpc for dev, remote in handles
                    if remote and ggml.device_description(dev) == e]


def pick_accelerator(rpc: tuple[str, ...] = (), name: str | None = None) -> str | None:
    """`name`, else a local accelerator, else the first of these RPC servers' devices; None
    when there is none."""
    if name is not None:
        for endpoint in rpc:
            connect_rpc(endpoint)
        return find_device(name).name
    pick = session_accelerators(rpc)[:1]
    return pick[0].name if pick else None


def default_budget(accel: str) -> int:
    """What Ebb may use on `accel` when no budget is given: its free memory less a margin."""
    free = find_device(accel).free_bytes or 0
    return max(0, free - max(SAFETY_MARGIN_BYTES, free // 20))
