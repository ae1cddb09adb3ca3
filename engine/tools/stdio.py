"""The SDK's stdio transport (mcp.client.stdio.stdio_client) with one change: a message is put
together from its pieces once, at its end. The SDK's reader adds each 64 KiB piece to all that
came before and splits the whole again, so a long line takes time that grows with its square:
a 16 MB tool result took 4.9 s here and a 50 MB one more than the call's 60 s. Everything else
(the process group, the small environment, the shutdown: stdin closed, then TERM and KILL to
the group, each wait bounded) is the SDK's own code, called as it calls it.
"""
from __future__ import annotations

from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, TextIO


def join_lines(parts: list[str], chunk: str) -> list[str]:
    """The lines `chunk` ends, with what came before it (`parts`, kept for the next piece):
    linear in the lengths, however long a line is."""
    if "\n" not in chunk:
        parts.append(chunk)
        return []
    head, *rest = chunk.split("\n")
    lines = ["".join(parts) + head, *rest[:-1]]
    parts.clear()
    if rest[-1]:
        parts.append(rest[-1])
    return lines


def _message(line: str, errlog: TextIO) -> Any:
    """A JSON-RPC message, or None for a line that is not one (a banner, a print left in the
    server): it goes to the server's stderr file, where a failure shows it, not to the session
    (the SDK logged a traceback for each and handed the session an error)."""
    import mcp_types

    from mcp.shared.message import SessionMessage

    if not line.strip():
        return None
    try:
        return SessionMessage(mcp_types.jsonrpc_message_adapter.validate_json(line, by_name=False))
    except ValueError:
        try:
            errlog.write(f"(not MCP, on stdout) {line[:500]}\n")
        except (OSError, ValueError):
            pass
        return None


@asynccontextmanager
async def stdio_client(server: Any, errlog: TextIO) -> AsyncIterator[Any]:
    import anyio
    import anyio.lowlevel
    from anyio.streams.text import TextReceiveStream
    from mcp.client import stdio as sdk
    from mcp.shared.message import SessionMessage

    command = await sdk._get_executable_command(server.command)
    process = await sdk._create_platform_compatible_process(
        command=command, args=server.args, env=sdk.get_default_environment() | (server.env or {}),
        errlog=errlog, cwd=server.cwd)
    read_stream_writer, read_stream = anyio.create_memory_object_stream[SessionMessage | Exception](0)
    write_stream, write_stream_reader = anyio.create_memory_object_stream[SessionMessage](0)
    writer_done = anyio.Event()

    async def stdout_reader() -> None:
        assert process.stdout
        stdout = TextReceiveStream(process.stdout, encoding=server.encoding,
                                   errors=server.encoding_error_handler)
        try:
            async with read_stream_writer:
                try:
                    parts: list[str] = []
                    async for chunk in stdout:
                        for line in join_lines(parts, chunk):
                            message = _message(line, errlog)
                            if message is None:
                                continue
                            try:
                                await read_stream_writer.send(message)
                            except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                                return
                finally:
                    await sdk._drain_stdout(process)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError, ConnectionError):
            pass

    async def stdin_writer() -> None:
        assert process.stdin
        try:
            async with write_stream_reader:
                async for message in write_stream_reader:
                    json = message.message.model_dump_json(by_alias=True, exclude_unset=True)
                    await process.stdin.send((json + "\n").encode(
                        encoding=server.encoding, errors=server.encoding_error_handler))
        except (anyio.ClosedResourceError, anyio.BrokenResourceError, OSError):
            await read_stream_writer.aclose()
        finally:
            writer_done.set()

    async def shutdown() -> None:
        read_stream.close()
        write_stream.close()
        with anyio.move_on_after(sdk._WRITER_FLUSH_TIMEOUT):
            await writer_done.wait()
        await sdk._stop_server_process(process)
        await sdk._aclose_all(read_stream, write_stream, read_stream_writer, write_stream_reader)
        await anyio.lowlevel.checkpoint()

    async with anyio.create_task_group() as tg:
        tg.start_soon(stdout_reader)
        tg.start_soon(stdin_writer)
        try:
            yield read_stream, write_stream
        finally:
            with anyio.CancelScope(shield=True):
                await shutdown()
            tg.cancel_scope.cancel()
    await anyio.lowlevel.cancel_shielded_checkpoint()
