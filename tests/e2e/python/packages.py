#!/usr/bin/env python3
"""Packages on demand through the official Python MCP SDK (`mcp` 2.x).

The Rust end-to-end test `python_sdk::official_python_sdk_installs_packages` starts the real
gateway with its package index pointed at a loopback index the test serves (tiny wheels it built:
`sgdemo` needs `sgdemo-dep`, `sgtool`, an sdist-only `sgsdist`), and runs this script:

    SANDGATE_MCP_URL=... SANDGATE_MCP_TOKEN=... python packages.py --mode 2026-07-28

It installs with the `install_packages` tool (progress notifications must stream pip's output)
and with `pip install` in `run_terminal_command`, imports both in the next cell, and checks that
an sdist-only package is refused with a reason and the sandbox still works.

Exit status 0 when everything held; 1 with a `FAIL:` line saying what did not.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import uuid

import httpx2
import mcp.types as types
from mcp import Client
from mcp.client.streamable_http import streamable_http_client


class Failure(Exception):
    """An expectation about the server's behaviour did not hold."""


def check(condition: bool, message: str) -> None:
    if not condition:
        raise Failure(message)


def text_of(result: types.CallToolResult) -> str:
    return "\n".join(b.text for b in result.content if isinstance(b, types.TextContent))


async def conversation(client: Client) -> None:
    listed = await client.list_tools()
    tool = next((t for t in listed.tools if t.name == "install_packages"), None)
    check(tool is not None, "install_packages is listed")
    assert tool is not None
    check("packages" in tool.input_schema.get("properties", {}), "install_packages takes packages")
    conversation_id = f"sdk-packages-{uuid.uuid4().hex[:8]}"

    progress: list[str] = []

    async def on_progress(done: float, total: float | None, message: str | None) -> None:
        progress.append(message or "")

    installed = await client.call_tool(
        "install_packages",
        {"conversation_id": conversation_id, "packages": ["sgtool"]},
        progress_callback=on_progress,
    )
    check(not installed.is_error, f"install_packages succeeds: {text_of(installed)}")
    structured = installed.structured_content or {}
    check(structured.get("exit_code") == 0, f"pip exited 0: {structured}")
    check("Successfully installed sgtool-2.0" in structured.get("stdout", ""), f"pip installed sgtool: {structured}")
    check(
        any("sgtool" in m for m in progress),
        f"pip's output streamed as progress notifications: {progress!r}",
    )
    sandbox_id = structured["sandbox_id"]

    cell = await client.call_tool("execute_code", {"sandbox_id": sandbox_id, "code": "import sgtool\nsgtool.NAME"})
    check(not cell.is_error, f"the next cell imports sgtool: {text_of(cell)}")
    check(
        ((cell.structured_content or {}).get("result") or {}).get("text/plain") == "'sgtool'",
        f"sgtool.NAME: {cell.structured_content}",
    )

    pip = await client.call_tool(
        "run_terminal_command", {"sandbox_id": sandbox_id, "command": "pip install sgdemo", "timeout_seconds": 120}
    )
    check(not pip.is_error, f"pip install in a terminal command succeeds: {text_of(pip)}")
    cell = await client.call_tool("execute_code", {"sandbox_id": sandbox_id, "code": "import sgdemo\nsgdemo.ANSWER"})
    check(
        ((cell.structured_content or {}).get("result") or {}).get("text/plain") == "42",
        f"sgdemo (with its dependency) imports: {text_of(cell)}",
    )

    refused = await client.call_tool("install_packages", {"sandbox_id": sandbox_id, "packages": ["sgsdist"]})
    check(refused.is_error is True, f"an sdist-only package is refused: {text_of(refused)}")
    check("publishes no binary wheel" in text_of(refused), f"the refusal says why: {text_of(refused)}")
    fine = await client.call_tool("execute_code", {"sandbox_id": sandbox_id, "code": "6 * 7"})
    check(
        ((fine.structured_content or {}).get("result") or {}).get("text/plain") == "42",
        f"the sandbox still works: {text_of(fine)}",
    )


async def run(url: str, token: str, mode: str) -> None:
    http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"}, timeout=httpx2.Timeout(30.0, read=300.0))
    async with http:
        async with Client(streamable_http_client(url, http_client=http), mode=mode) as client:
            await conversation(client)


def leaf(error: BaseException) -> BaseException:
    while isinstance(error, BaseExceptionGroup) and error.exceptions:
        error = error.exceptions[0]
    return error


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default=os.environ.get("SANDGATE_MCP_URL"))
    parser.add_argument("--token", default=os.environ.get("SANDGATE_MCP_TOKEN"))
    parser.add_argument("--mode", choices=["legacy", "2026-07-28", "auto"], default="auto")
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
    print(f"ok ({args.mode}): packages installed through the Python SDK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
