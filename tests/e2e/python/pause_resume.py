#!/usr/bin/env python3
"""A conversation that outlives its idle timeout, through the official Python MCP SDK (`mcp` 2.x).

The Rust end-to-end test `python_sdk::official_python_sdk_resumes_a_paused_sandbox` starts the real
gateway on a checkpointing runtime with a 2 s idle timeout and runs this script once per protocol
era:

    SANDGATE_MCP_URL=... SANDGATE_MCP_TOKEN=... python pause_resume.py --mode legacy

A cell sets a variable and writes a file; `list_sandboxes` is polled (with a deadline) until the
conversation's sandbox is `paused`; the next `execute_code` by `conversation_id` sees the variable
and the file under the same `sandbox_id`, and its result says it was resumed; the sandbox's
transcript (read as a resource) marks the pause and the resume. Every structured result is checked
against the tool's outputSchema by the SDK (it raises on a mismatch).

Exit status 0 when everything held; 1 with a `FAIL:` line saying what did not.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
import uuid

import httpx2
import mcp.types as types
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

EXPECTED_VERSION = {"legacy": "2025-11-25", "2026-07-28": "2026-07-28"}

# How long the pause may take to happen, seconds (a deadline, not a wait).
PAUSE_DEADLINE = 240.0
# How often list_sandboxes is asked, seconds.
POLL = 0.2


class Failure(Exception):
    """An expectation about the server's behaviour did not hold."""


def check(condition: bool, message: str) -> None:
    if not condition:
        raise Failure(message)


def text_of(result: types.CallToolResult) -> str:
    return "\n".join(b.text for b in result.content if isinstance(b, types.TextContent))


def plain(result: types.CallToolResult) -> str | None:
    return ((result.structured_content or {}).get("result") or {}).get("text/plain")


async def state_of(client: Client, conversation_id: str, sandbox_id: str) -> str | None:
    listed = await client.call_tool("list_sandboxes", {"conversation_id": conversation_id})
    check(not listed.is_error, f"list_sandboxes succeeds: {text_of(listed)}")
    for entry in (listed.structured_content or {}).get("sandboxes", []):
        if entry.get("sandbox_id") == sandbox_id:
            return entry.get("state")
    return None


async def conversation(client: Client, mode: str) -> None:
    check(
        client.protocol_version == EXPECTED_VERSION[mode],
        f"mode {mode} negotiates {EXPECTED_VERSION[mode]}; got {client.protocol_version}",
    )
    conversation_id = f"sdk-pause-{mode}-{uuid.uuid4().hex[:8]}"
    first = await client.call_tool(
        "execute_code",
        {"conversation_id": conversation_id, "code": "v = 41\nopen('/home/user/kept.txt', 'w').write('kept')\nv"},
    )
    check(not first.is_error, f"the first cell runs: {text_of(first)}")
    structured = first.structured_content or {}
    sandbox_id = structured["sandbox_id"]
    check(structured.get("resumed") is None, f"a fresh sandbox is not resumed: {structured}")

    deadline = time.monotonic() + PAUSE_DEADLINE
    while (state := await state_of(client, conversation_id, sandbox_id)) != "paused":
        check(state in ("running", "pausing"), f"the idle sandbox is running or pausing, not {state!r}")
        check(time.monotonic() < deadline, f"the idle sandbox was paused within {PAUSE_DEADLINE} s")
        await asyncio.sleep(POLL)

    after = await client.call_tool(
        "execute_code",
        {"conversation_id": conversation_id, "code": "v += 1\n(v, open('/home/user/kept.txt').read())"},
    )
    check(not after.is_error, f"the call after the pause runs: {text_of(after)}")
    structured = after.structured_content or {}
    check(structured.get("sandbox_id") == sandbox_id, f"the same sandbox: {structured}")
    check(plain(after) == "(42, 'kept')", f"the variable and the file survived the pause: {structured}")
    resumed = structured.get("resumed") or {}
    check(isinstance(resumed.get("paused_seconds"), (int, float)), f"the result says it was resumed: {structured}")
    check(structured.get("state_lost") in (None, False), f"no state was lost: {structured}")

    read = await client.read_resource(f"sandbox://{sandbox_id}/transcript.html")
    page = "".join(c.text for c in read.contents if isinstance(c, types.TextResourceContents))
    pause, resume = page.find('data-kind="pause"'), page.find('data-kind="resume"')
    check(0 <= pause < resume, f"the transcript marks the pause, then the resume: {page[:2000]}")
    check("Resumed after" in page[resume:], "the resume mark says after how long")


async def run(url: str, token: str, mode: str) -> None:
    http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"}, timeout=httpx2.Timeout(30.0, read=300.0))
    async with http:
        async with Client(streamable_http_client(url, http_client=http), mode=mode) as client:
            await conversation(client, mode)


def leaf(error: BaseException) -> BaseException:
    while isinstance(error, BaseExceptionGroup) and error.exceptions:
        error = error.exceptions[0]
    return error


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default=os.environ.get("SANDGATE_MCP_URL"))
    parser.add_argument("--token", default=os.environ.get("SANDGATE_MCP_TOKEN"))
    parser.add_argument("--mode", choices=["legacy", "2026-07-28"], required=True)
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args()
    if not args.url or not args.token:
        parser.error("the MCP URL and token are required (--url/--token or SANDGATE_MCP_URL/SANDGATE_MCP_TOKEN)")
    try:
        asyncio.run(asyncio.wait_for(run(args.url, args.token, args.mode), args.timeout))
    except BaseException as wrapped:  # noqa: BLE001 - every failure becomes a clear message and exit 1
        error = leaf(wrapped)
        print(f"FAIL ({args.mode}): {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    print(f"ok ({args.mode}): a paused sandbox resumed through the Python SDK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
