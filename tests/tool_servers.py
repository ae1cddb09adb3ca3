"""MCP servers for the tests, written with the official SDK (`python tests/tool_servers.py MODE`):
a real server over stdio, or over Streamable HTTP (`http PORT`), and the faults users meet.

Modes: tools (the normal one: echo, add, picture (a red one), fail (an error), slow (waits on
a file), wait (the same, with no arguments), big (N MB of text), tone (a clip)), garbage (prints lines that are not JSON-RPC first),
crash (its `crash` tool ends the process mid-call), hang (never answers the handshake),
exit (says why on stderr and exits before the handshake), badschema (one tool with an invalid
schema beside a good one), same (a second server with `echo` too), old (a hand-written server
that speaks only the 2024-11-05 protocol), new (one that answers with a version from the future).
"""
import io
import json
import os
import sys
import time
from pathlib import Path

from mcp.server.mcpserver import Audio, Image, MCPServer  # the tools' return types are read by name


def _red_png(side: int = 64) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (side, side), (255, 0, 0)).save(buf, "PNG")
    return buf.getvalue()


def tools_server(mode: str) -> object:
    m = MCPServer(f"ebb-test-{mode}")

    @m.tool()
    def echo(text: str) -> str:
        """Say the text back."""
        return f"echo: {text}"

    if mode == "same":
        return m

    @m.tool()
    def add(a: int, b: int) -> str:
        """Add two whole numbers."""
        return str(a + b)

    @m.tool()
    def picture() -> Image:
        """A picture (of one colour: red; its name says nothing of it, so a reply that names
        the colour saw it)."""
        return Image(data=_red_png(), format="png")

    @m.tool()
    def fail() -> str:
        """Always fails."""
        raise ValueError("the tool broke on purpose")

    @m.tool()
    def slow(flag: str) -> str:
        """Writes FLAG.started (its pid), then waits until the file `flag` exists (the test
        makes it) and answers."""
        Path(flag + ".started").write_text(str(os.getpid()))
        while not Path(flag).exists():
            time.sleep(0.02)
        return "slow done"

    @m.tool()
    def whoami() -> str:
        """Its environment's names, and whether it leads a process group of its own."""
        import json

        return json.dumps({"env": sorted(os.environ), "own_group": os.getpgid(0) == os.getpid()})

    @m.tool()
    def wait() -> str:
        """Writes wait.started (its pid) in its folder, then waits for wait.go there."""
        Path("wait.started").write_text(str(os.getpid()))
        while not Path("wait.go").exists():
            time.sleep(0.02)
        return "waited"

    @m.tool()
    def big(megabytes: int) -> str:
        """A text result of this many megabytes."""
        return "x" * (megabytes << 20)

    @m.tool()
    def tone() -> Audio:
        """One second of a 440 Hz tone (WAV)."""
        import math
        import struct
        import wave


        buf = io.BytesIO()
        with wave.open(buf, "wb") as w:
            w.setnchannels(1)
            w.setsampwidth(2)
            w.setframerate(16000)
            w.writeframes(b"".join(struct.pack("<h", int(8000 * math.sin(2 * math.pi * 440 * i / 16000)))
                                   for i in range(16000)))
        return Audio(data=buf.getvalue(), format="wav")

    if mode == "crash":
        @m.tool()
        def crash() -> str:
            """Ends the server mid-call."""
            print("about to crash: on purpose", file=sys.stderr, flush=True)
            os._exit(3)

    if mode == "badschema":
        @m.tool()
        def broken(x: int) -> str:
            """A tool whose schema the server spoils below."""
            return str(x)

    return m


def hand_written(version: str) -> None:
    """A minimal server over stdio that answers `initialize` with `version` only (no discover)."""
    for line in sys.stdin:
        msg = json.loads(line)
        method, mid = msg.get("method"), msg.get("id")
        if mid is None:
            continue
        if method == "initialize":
            result: object = {"protocolVersion": version, "capabilities": {"tools": {}},
                              "serverInfo": {"name": "hand", "version": "1"}}
        elif method == "tools/list":
            result = {"tools": [{"name": "echo", "description": "Say it back.",
                                 "inputSchema": {"type": "object",
                                                 "properties": {"text": {"type": "string"}}}}]}
        elif method == "tools/call":
            text = msg["params"]["arguments"].get("text", "")
            result = {"content": [{"type": "text", "text": f"echo: {text}"}]}
        else:
            print(json.dumps({"jsonrpc": "2.0", "id": mid,
                              "error": {"code": -32601, "message": f"no method {method}"}}), flush=True)
            continue
        print(json.dumps({"jsonrpc": "2.0", "id": mid, "result": result}), flush=True)


def main() -> None:
    mode = sys.argv[1]
    print(f"test server {mode} starting", file=sys.stderr, flush=True)
    if mode == "hang":
        time.sleep(3600)
    if mode == "exit":
        print("cannot start: no API key given", file=sys.stderr, flush=True)
        sys.exit(1)
    if mode == "old":
        return hand_written("2024-11-05")
    if mode == "new":
        return hand_written("2099-01-01")
    if mode == "garbage":
        print("Welcome to my server! (this line is not JSON-RPC)", flush=True)
        print("{not json either", flush=True)
    if mode == "http":
        m = tools_server("tools")
        m.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))  # type: ignore[call-overload]
        return
    m = tools_server(mode)
    if mode == "badschema":
        tool = m._tool_manager._tools["broken"]  # type: ignore[attr-defined]
        tool.parameters = {"type": "object", "properties": {"x": {"type": 12}}}
    m.run()  # type: ignore[attr-defined]


if __name__ == "__main__":
    main()
