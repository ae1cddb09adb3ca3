"""A small MCP server of Ebb's own (`ebb-engine mcp-demo`, stdio), written with
the official SDK: tools to try the window's cards and to measure the loop (`ebb-engine bench
tools`) without anything from the network. `echo` says its text back, `lines` returns N lines
of text (a result of many tokens), `colour` returns a picture of one colour (the demo projector
names it)."""
import io

from mcp.server.mcpserver import Image, MCPServer  # the tools' types are read by name: no
# `from __future__ import annotations` here

COLOURS = {"red": (255, 0, 0), "green": (0, 160, 0), "blue": (0, 0, 255), "yellow": (255, 230, 0),
           "black": (0, 0, 0), "white": (255, 255, 255)}


def build() -> "MCPServer[object]":
    m: MCPServer[object] = MCPServer("ebb-demo")

    def echo(text: str) -> str:
        """Say the text back."""
        return text

    def lines(n: int) -> str:
        """N numbered lines of text."""
        return "\n".join(f"line {i}: the quick brown fox jumps over the lazy dog" for i in range(1, n + 1))

    def colour(name: str) -> Image:
        """A picture of one colour: red, green, blue, yellow, black or white."""
        from PIL import Image as Pil

        buf = io.BytesIO()
        Pil.new("RGB", (64, 64), COLOURS.get(name.lower(), (128, 128, 128))).save(buf, "PNG")
        return Image(data=buf.getvalue(), format="png")

    for fn in (echo, lines, colour):
        m.add_tool(fn)
    return m


if __name__ == "__main__":
    build().run()
