#!/usr/bin/env python3
"""The bot's side of the console test (issue 28), driven by the official Python MCP SDK (`mcp`
2.x): in `--phase work` it works in a conversation (a DataFrame, a chart, output carrying a
`<script>` and an HTML display that tries to load a remote image and stylesheet); in
`--phase check`, after a person took over from the console, it reads the variable and file the
person left and prints the tool result's text, which must say a person acted.

Exit status 0 when the phase did what it should; 1 with a `FAIL:` line saying what did not.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import traceback

import httpx2
import mcp.types as types
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

from support_analyst import Failure, leaf


def text_of(result: types.CallToolResult) -> str:
    return "\n".join(block.text for block in result.content if isinstance(block, types.TextContent))


async def cell(client: Client, conversation: str, code: str) -> types.CallToolResult:
    result = await client.call_tool("execute_code", {"conversation_id": conversation, "code": code})
    if result.is_error:
        raise Failure(f"the cell {code!r} ran: {text_of(result)!r}")
    return result


async def work(client: Client, conversation: str, remote: str) -> None:
    await cell(
        client,
        conversation,
        "import pandas as pd\n"
        "df = pd.DataFrame({'region': ['north', 'south', 'north'], 'amount': [10, 5, 7]})\n"
        "df.groupby('region')['amount'].sum()",
    )
    await cell(
        client,
        conversation,
        "import matplotlib\nmatplotlib.use('Agg')\nimport matplotlib.pyplot as plt\n"
        "df.groupby('region')['amount'].sum().plot(kind='bar')\nplt.show()",
    )
    await cell(
        client,
        conversation,
        "from IPython.display import HTML, display\n"
        f"display(HTML('<img src=\"{remote}/remote.png\"><link rel=\"stylesheet\" href=\"{remote}/remote.css\">"
        "<b id=\"inframe\">rich</b><script>parent.document.title=\"pwned-frame\"</script>'))\n"
        "print('<script>document.title = \"pwned-print\"</script>')",
    )


async def check(client: Client, conversation: str) -> None:
    result = await cell(client, conversation, "print(human_total, open('human.csv').read().strip())")
    print(text_of(result))


async def run(url: str, token: str, phase: str, conversation: str, remote: str) -> None:
    http = httpx2.AsyncClient(
        headers={"Authorization": f"Bearer {token}"}, timeout=httpx2.Timeout(30.0, read=300.0)
    )
    async with http:
        async with Client(streamable_http_client(url, http_client=http)) as client:
            if phase == "work":
                await work(client, conversation, remote)
            else:
                await check(client, conversation)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--phase", choices=["work", "check"], required=True)
    parser.add_argument("--conversation", required=True)
    parser.add_argument("--remote", default="http://127.0.0.1:9", help="where the hostile HTML points")
    parser.add_argument("--timeout", type=float, default=180.0)
    args = parser.parse_args()
    url, token = os.environ.get("SANDGATE_MCP_URL"), os.environ.get("SANDGATE_MCP_TOKEN")
    if not url or not token:
        parser.error("SANDGATE_MCP_URL and SANDGATE_MCP_TOKEN are required")
    try:
        asyncio.run(asyncio.wait_for(run(url, token, args.phase, args.conversation, args.remote), args.timeout))
    except BaseException as wrapped:  # noqa: BLE001 - every failure becomes a clear message and exit 1
        error = leaf(wrapped)
        if isinstance(error, Failure):
            print(f"FAIL ({args.phase}): {error}", file=sys.stderr)
        else:
            traceback.print_exception(error)
            print(f"FAIL ({args.phase}): {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    print(f"ok ({args.phase})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
