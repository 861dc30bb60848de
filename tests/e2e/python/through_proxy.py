#!/usr/bin/env python3
"""Calls through a reverse proxy that must not buffer and must not cut a long call, driven by the
official Python MCP SDK (`mcp` 2.x).

The Rust end-to-end test `front` puts nginx with TLS (deploy/nginx/sandgate.conf) in front of two
gateway replicas, with a proxy read timeout shorter than `--sleep`, and runs this once per mode:

- a cell that prints, sleeps `--sleep` seconds, prints again: its output must arrive as progress
  notifications, and its answer must come back although the call outlasts the proxy's read
  timeout (the stream's keep-alives, mcp.sse_keep_alive_seconds, reset it);
- in `legacy` (2025-11-25) also a silent cell of `--sleep` seconds: its SSE stream carries only
  keep-alives until the answer.

The HTTP client's own read timeout is `--read-timeout` (the proxy's, in the test): a proxy that
buffered the stream would hold the keep-alives back and the client would give up first.

Exit status 0 when everything held; 1 with a `FAIL:` line saying what did not.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import traceback
import uuid

import httpx2
import mcp.types as types
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

# The script's own directory is on sys.path: the conversation script's failure type and helper.
from support_analyst import Failure, leaf

EXPECTED_VERSION = {"legacy": "2025-11-25", "2026-07-28": "2026-07-28", "auto": "2026-07-28"}


def value_of(result: types.CallToolResult) -> str | None:
    return ((result.structured_content or {}).get("result") or {}).get("text/plain")


async def calls(client: Client, mode: str, sleep: float) -> None:
    if client.protocol_version != EXPECTED_VERSION[mode]:
        raise Failure(f"mode {mode} negotiates {EXPECTED_VERSION[mode]}; got {client.protocol_version}")
    conversation = f"proxy-{mode}-{uuid.uuid4().hex}"
    progress: list[str] = []

    async def on_progress(done: float, total: float | None, message: str | None) -> None:
        progress.append(message or "")

    cell = await client.call_tool(
        "execute_code",
        {
            "conversation_id": conversation,
            "code": f"import time\nprint('tick 0', flush=True)\ntime.sleep({sleep})\nprint('tick 1')\n'done'",
        },
        progress_callback=on_progress,
    )
    if cell.is_error or value_of(cell) != "'done'":
        raise Failure(f"the {sleep} s cell answers with its value: {cell.structured_content}")
    if not any("tick 0" in m for m in progress):
        raise Failure(f"the cell's output streamed as progress notifications: {progress!r}")
    if mode == "legacy":
        silent = await client.call_tool(
            "execute_code",
            {"conversation_id": conversation, "code": f"import time\ntime.sleep({sleep})\n'slept'"},
        )
        if silent.is_error or value_of(silent) != "'slept'":
            raise Failure(f"the silent {sleep} s cell answers with its value: {silent.structured_content}")
    await client.call_tool("close_sandbox", {"conversation_id": conversation})


async def run(url: str, token: str, mode: str, sleep: float, read_timeout: float) -> None:
    http = httpx2.AsyncClient(
        headers={"Authorization": f"Bearer {token}"}, timeout=httpx2.Timeout(30.0, read=read_timeout)
    )
    async with http:
        async with Client(streamable_http_client(url, http_client=http), mode=mode) as client:
            await calls(client, mode, sleep)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default=os.environ.get("SANDGATE_MCP_URL"), help="MCP endpoint ($SANDGATE_MCP_URL)")
    parser.add_argument("--token", default=os.environ.get("SANDGATE_MCP_TOKEN"), help="bearer token ($SANDGATE_MCP_TOKEN)")
    parser.add_argument("--mode", choices=sorted(EXPECTED_VERSION), default="auto")
    parser.add_argument("--sleep", type=float, required=True, help="how long each cell sleeps, seconds")
    parser.add_argument("--read-timeout", type=float, required=True, help="the HTTP client's read timeout, seconds")
    parser.add_argument("--timeout", type=float, default=180.0, help="give up after this many seconds")
    args = parser.parse_args()
    if not args.url or not args.token:
        parser.error("the MCP URL and token are required (--url/--token or SANDGATE_MCP_URL/SANDGATE_MCP_TOKEN)")
    try:
        asyncio.run(
            asyncio.wait_for(run(args.url, args.token, args.mode, args.sleep, args.read_timeout), args.timeout)
        )
    except BaseException as wrapped:  # noqa: BLE001 - every failure becomes a clear message and exit 1
        error = leaf(wrapped)
        if isinstance(error, Failure):
            print(f"FAIL ({args.mode}): {error}", file=sys.stderr)
        elif isinstance(error, (TimeoutError, asyncio.TimeoutError)):
            print(f"FAIL ({args.mode}): the calls did not finish within {args.timeout} s", file=sys.stderr)
        else:
            traceback.print_exception(error)
            print(f"FAIL ({args.mode}): {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    print(f"ok ({args.mode}, protocol {EXPECTED_VERSION[args.mode]}): calls of {args.sleep} s came through the proxy")
    return 0


if __name__ == "__main__":
    sys.exit(main())
