#!/usr/bin/env python3
"""Calls that run longer than the gateway's connection idle timeout, driven by the official Python
MCP SDK (`mcp` 2.x): an `execute_code` cell and a `run_terminal_command` that each sleep, silent,
for `--sleep` seconds, and must both get their answer.

The Rust end-to-end test `hostile::calls_longer_than_the_idle_timeout_…` starts the gateway with
a short `http.idle_timeout_seconds` and runs this once per protocol mode. In `auto` (the SDK's
default, which lands on the stateless 2026-07-28 era) the answer is one JSON body at the end and
nothing moves on the connection meanwhile; the SDK reported such a lost answer as
"RemoteProtocolError: Server disconnected without sending a response".

Exit status 0 when both answers came back; 1 with a `FAIL:` line saying what did not.
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


def text_of(result: types.CallToolResult) -> str:
    return "\n".join(block.text for block in result.content if isinstance(block, types.TextContent))


async def long_calls(client: Client, mode: str, sleep: float) -> None:
    if client.protocol_version != EXPECTED_VERSION[mode]:
        raise Failure(f"mode {mode} negotiates {EXPECTED_VERSION[mode]}; got {client.protocol_version}")
    conversation = f"long-call-{mode}-{uuid.uuid4().hex}"
    cell = await client.call_tool(
        "execute_code",
        {"conversation_id": conversation, "code": f"import time\ntime.sleep({sleep})\n'slept'"},
    )
    result = (cell.structured_content or {}).get("result") or {}
    if cell.is_error or result.get("text/plain") != "'slept'":
        raise Failure(f"the {sleep} s cell answers with its value: {cell.structured_content} {text_of(cell)!r}")
    command = await client.call_tool(
        "run_terminal_command",
        {"conversation_id": conversation, "command": f"sleep {sleep}; echo slept"},
    )
    out = command.structured_content or {}
    if command.is_error or out.get("stdout") != "slept\n" or out.get("exit_code") != 0:
        raise Failure(f"the {sleep} s command answers with its output: {out} {text_of(command)!r}")


async def run(url: str, token: str, mode: str, sleep: float) -> None:
    # As in support_analyst.py: the SDK's defaults (30 s, 300 s to read) on our own client.
    http = httpx2.AsyncClient(
        headers={"Authorization": f"Bearer {token}"}, timeout=httpx2.Timeout(30.0, read=300.0)
    )
    async with http:
        async with Client(streamable_http_client(url, http_client=http), mode=mode) as client:
            await long_calls(client, mode, sleep)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default=os.environ.get("SANDGATE_MCP_URL"), help="MCP endpoint ($SANDGATE_MCP_URL)")
    parser.add_argument("--token", default=os.environ.get("SANDGATE_MCP_TOKEN"), help="bearer token ($SANDGATE_MCP_TOKEN)")
    parser.add_argument("--mode", choices=sorted(EXPECTED_VERSION), default="auto")
    parser.add_argument("--sleep", type=float, required=True, help="how long each call sleeps, seconds")
    parser.add_argument("--timeout", type=float, default=180.0, help="give up after this many seconds")
    args = parser.parse_args()
    if not args.url or not args.token:
        parser.error("the MCP URL and token are required (--url/--token or SANDGATE_MCP_URL/SANDGATE_MCP_TOKEN)")
    try:
        asyncio.run(asyncio.wait_for(run(args.url, args.token, args.mode, args.sleep), args.timeout))
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
    print(f"ok ({args.mode}, protocol {EXPECTED_VERSION[args.mode]}): calls of {args.sleep} s were answered")
    return 0


if __name__ == "__main__":
    sys.exit(main())
