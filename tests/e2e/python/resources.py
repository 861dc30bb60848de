#!/usr/bin/env python3
"""A sandbox's files and transcript as MCP resources, read with the official Python SDK (`mcp` 2.x).

The Rust end-to-end test `python_sdk` runs it against the real gateway with two tenants' tokens:

    SANDGATE_MCP_URL=... SANDGATE_MCP_TOKEN=... SANDGATE_OTHER_TOKEN=... python resources.py

In the 2025-11-25 era (a session is the conversation) it writes a text file and a PNG, then:
resources/templates/list names the file and transcript templates; resources/list (followed page
by page) shows the session's files and transcript and nothing of another session's sandbox;
resources/read returns text as text, the PNG as a blob, and the transcript as a notebook. The
other tenant reads the same URIs and gets "not found", exactly like for a sandbox that does not
exist. Exit status 0 when everything held; 1 with a `FAIL:` line saying what did not.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import sys

import httpx2
import mcp.types as types
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError


class Failure(Exception):
    """An expectation about the server's behaviour did not hold."""


def check(condition: bool, message: str) -> None:
    if not condition:
        raise Failure(message)


def client(url: str, token: str, mode: str):
    http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"}, timeout=httpx2.Timeout(30.0, read=120.0))
    return http, Client(streamable_http_client(url, http_client=http), mode=mode)


async def list_all(c: Client) -> list[types.Resource]:
    resources, cursor, pages = [], None, 0
    while True:
        page = await c.list_resources(cursor=cursor)
        pages += 1
        resources.extend(page.resources)
        cursor = page.next_cursor
        if not cursor:
            return resources


async def read_error(c: Client, uri: str) -> str:
    try:
        await c.read_resource(uri)
    except MCPError as e:
        return str(e)
    raise Failure(f"reading {uri} should fail")


async def run(url: str, token: str, other_token: str) -> None:
    http, c = client(url, token, "legacy")
    async with http, c:
        made = await c.call_tool(
            "execute_code",
            {
                "code": "import matplotlib.pyplot as plt\n"
                "open('notes.txt', 'w').write('hello from the sandbox')\n"
                "plt.plot([1, 3, 2]); plt.savefig('chart.png'); plt.close()\n"
                "print('ready')"
            },
        )
        check(not made.is_error, f"the cell ran: {made.content}")
        sandbox = made.structured_content["sandbox_id"]

        templates = await c.list_resource_templates()
        uris = {t.uri_template for t in templates.resource_templates}
        for want in ("sandbox://{sandbox_id}/files/{path}", "sandbox://{sandbox_id}/transcript.ipynb"):
            check(want in uris, f"resources/templates/list names {want}; got {sorted(uris)}")

        listed = await list_all(c)
        by_uri = {r.uri: r for r in listed}
        for want in (f"sandbox://{sandbox}/files/notes.txt", f"sandbox://{sandbox}/files/chart.png",
                     f"sandbox://{sandbox}/transcript.ipynb"):
            check(want in by_uri, f"resources/list shows {want}; got {sorted(by_uri)}")

        text = await c.read_resource(f"sandbox://{sandbox}/files/notes.txt")
        first = text.contents[0]
        check(isinstance(first, types.TextResourceContents) and first.text == "hello from the sandbox",
              f"a text file reads as text; got {first!r}")
        png = await c.read_resource(f"sandbox://{sandbox}/files/chart.png")
        first = png.contents[0]
        check(isinstance(first, types.BlobResourceContents), f"a PNG reads as a blob; got {type(first)}")
        check(base64.b64decode(first.blob).startswith(b"\x89PNG"), "the blob is the PNG")
        notebook = await c.read_resource(f"sandbox://{sandbox}/transcript.ipynb")
        first = notebook.contents[0]
        check(isinstance(first, types.TextResourceContents), "the transcript reads as text")
        nb = json.loads(first.text)
        check(nb["nbformat"] == 4, "the transcript is a notebook")
        check(any("savefig('chart.png')" in cell.get("source", "") for cell in nb["cells"]),
              "the transcript holds the cell")

        # Another session (another conversation) of the same tenant sees nothing of this one.
        http2, c2 = client(url, token, "legacy")
        async with http2, c2:
            await c2.call_tool("execute_code", {"code": "1"})
            theirs = await list_all(c2)
            check(all(sandbox not in r.uri for r in theirs),
                  f"another session's list shows nothing of {sandbox}: {[r.uri for r in theirs]}")

    # Another tenant: the real URIs read exactly like ones that do not exist.
    http3, other = client(url, other_token, "2026-07-28")
    async with http3, other:
        for path in ("files/notes.txt", "transcript.ipynb"):
            theirs = await read_error(other, f"sandbox://{sandbox}/{path}")
            missing = await read_error(other, f"sandbox://sbx_doesnotexist/{path}")
            check(theirs.replace(sandbox, "ID") == missing.replace("sbx_doesnotexist", "ID"),
                  f"another tenant's {path} reads like a missing one: {theirs!r} vs {missing!r}")
            check("hello" not in theirs, "nothing of the content leaks")


def main() -> int:
    url, token, other = (os.environ.get(k) for k in ("SANDGATE_MCP_URL", "SANDGATE_MCP_TOKEN", "SANDGATE_OTHER_TOKEN"))
    if not (url and token and other):
        print("FAIL: set SANDGATE_MCP_URL, SANDGATE_MCP_TOKEN and SANDGATE_OTHER_TOKEN", file=sys.stderr)
        return 1
    try:
        asyncio.run(asyncio.wait_for(run(url, token, other), 180))
    except BaseException as wrapped:  # noqa: BLE001 - every failure becomes a clear message and exit 1
        error = wrapped
        while isinstance(error, BaseExceptionGroup) and error.exceptions:
            error = error.exceptions[0]
        print(f"FAIL: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    print("ok: files and transcript as resources")
    return 0


if __name__ == "__main__":
    sys.exit(main())
