#!/usr/bin/env python3
"""The compose deployment's conversation through its TLS reverse proxy, driven by the official
Python MCP SDK (`mcp` 2.x).

The Rust end-to-end test `deploy::compose` brings `deploy/compose.yaml` up (nginx with TLS in
front of the gateway, a node on this host's engine) and runs this once per mode, with
SSL_CERT_FILE naming the deployment's CA (`deploy/pki.sh add-proxy` made the proxy's
certificate): a sandbox whose cell runs a child process and keeps its variables, with
`--pip PROJECT` also `pip install PROJECT` in the sandbox and an import of it in the next cell
(the wheel comes from the compose network's package index, through the gateway), then closed.

Exit status 0 when everything held; 1 with a `FAIL:` line saying what did not.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import traceback
import uuid
from typing import Any

import httpx2
import mcp.types as types
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

# The script's own directory is on sys.path: the conversation script's failure type and helper.
from support_analyst import Failure, leaf

EXPECTED_VERSION = {"legacy": "2025-11-25", "auto": "2026-07-28"}


def structured(result: types.CallToolResult) -> dict[str, Any]:
    return result.structured_content or {}


def value_of(result: types.CallToolResult) -> str | None:
    return (structured(result).get("result") or {}).get("text/plain")


async def ok(client: Client, tool: str, arguments: dict[str, Any]) -> types.CallToolResult:
    result = await client.call_tool(tool, arguments)
    if result.is_error:
        raise Failure(f"{tool} {arguments} answered isError: {result.content}")
    return result


async def conversation(client: Client, mode: str, pip: str | None) -> None:
    if client.protocol_version != EXPECTED_VERSION[mode]:
        raise Failure(f"mode {mode} negotiates {EXPECTED_VERSION[mode]}; got {client.protocol_version}")
    created = await ok(client, "create_sandbox", {"conversation_id": f"compose-{mode}-{uuid.uuid4().hex}"})
    sandbox = structured(created).get("sandbox_id")
    if not sandbox:
        raise Failure(f"create_sandbox names a sandbox: {structured(created)}")
    cell = await ok(
        client,
        "execute_code",
        {
            "sandbox_id": sandbox,
            "code": "import subprocess\nsubprocess.run(['echo', 'from a child'])\nx = 40\nx + 2",
        },
    )
    if structured(cell).get("stdout") != "from a child\n" or value_of(cell) != "42":
        raise Failure(f"the cell's child output and value: {structured(cell)}")
    again = await ok(client, "execute_code", {"sandbox_id": sandbox, "code": "x"})
    if value_of(again) != "40":
        raise Failure(f"the sandbox keeps its variables: {structured(again)}")
    if pip:
        installed = await ok(
            client,
            "run_terminal_command",
            {"sandbox_id": sandbox, "command": f"pip install {pip}", "timeout_seconds": 120},
        )
        stdout = structured(installed).get("stdout") or ""
        if f"Successfully installed {pip}-" not in stdout:
            raise Failure(f"pip installs {pip} through the gateway: {structured(installed)}")
        imported = await ok(client, "execute_code", {"sandbox_id": sandbox, "code": f"import {pip}\n{pip}.ANSWER"})
        print(f"{pip}.ANSWER = {value_of(imported)}")
    closed = await ok(client, "close_sandbox", {"sandbox_id": sandbox})
    if structured(closed).get("closed") is not True:
        raise Failure(f"close_sandbox closes it: {structured(closed)}")


async def run(url: str, token: str, mode: str, pip: str | None) -> None:
    http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"}, timeout=httpx2.Timeout(30.0, read=180.0))
    async with http:
        async with Client(streamable_http_client(url, http_client=http), mode=mode) as client:
            await conversation(client, mode, pip)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default=os.environ.get("SANDGATE_MCP_URL"), help="MCP endpoint ($SANDGATE_MCP_URL)")
    parser.add_argument("--token", default=os.environ.get("SANDGATE_MCP_TOKEN"), help="bearer token ($SANDGATE_MCP_TOKEN)")
    parser.add_argument("--mode", choices=sorted(EXPECTED_VERSION), default="auto")
    parser.add_argument("--pip", help="a project to pip install in the sandbox and import")
    parser.add_argument("--timeout", type=float, default=240.0, help="give up after this many seconds")
    args = parser.parse_args()
    if not args.url or not args.token:
        parser.error("the MCP URL and token are required (--url/--token or SANDGATE_MCP_URL/SANDGATE_MCP_TOKEN)")
    try:
        asyncio.run(asyncio.wait_for(run(args.url, args.token, args.mode, args.pip), args.timeout))
    except BaseException as wrapped:  # noqa: BLE001 - every failure becomes a clear message and exit 1
        error = leaf(wrapped)
        if isinstance(error, Failure):
            print(f"FAIL ({args.mode}): {error}", file=sys.stderr)
        elif isinstance(error, (TimeoutError, asyncio.TimeoutError)):
            print(f"FAIL ({args.mode}): the conversation did not finish within {args.timeout} s", file=sys.stderr)
        else:
            traceback.print_exception(error)
            print(f"FAIL ({args.mode}): {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    print(f"ok ({args.mode}, protocol {EXPECTED_VERSION[args.mode]}): the conversation came through the proxy")
    return 0


if __name__ == "__main__":
    sys.exit(main())
