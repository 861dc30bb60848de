#!/usr/bin/env python3
"""A support analyst's conversation with sandgate, driven by the official Python MCP SDK (`mcp` 2.x).

The Rust end-to-end test `python_sdk` starts the real gateway and runs this script once per
protocol mode; it can also be pointed at any running sandgate by hand:

    SANDGATE_MCP_URL=http://127.0.0.1:8080/mcp SANDGATE_MCP_TOKEN=... \
        python support_analyst.py --mode legacy

Modes: `legacy` (the 2025-11-25 initialize handshake with an Mcp-Session-Id session),
`2026-07-28` (the stateless era, pinned without a probe) and `auto` (the SDK's default: it probes
`server/discover` and must land on 2026-07-28).

The conversation: list the tools, create a sandbox, upload a CSV of support tickets, group it with
pandas, plot a chart with `plt.show()` (the chart comes back inline), fetch the saved PNG with
get_file, run `ls -la`, run a failing cell and read its traceback, close the sandbox. Every
structured result is checked against the tool's outputSchema by the SDK (it raises on a mismatch;
nothing here catches that), error results are checked the same way explicitly because the SDK
skips them, and any warning the SDK logs fails the run.

Exit status 0 when everything held; 1 with a `FAIL:` line saying what did not.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import hashlib
import logging
import os
import posixpath
import sys
import traceback
import uuid
from dataclasses import dataclass, field
from typing import Any

import httpx2
import jsonschema
import mcp.types as types
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError

TOOLS = {
    "close_sandbox",
    "create_sandbox",
    "execute_code",
    "export_transcript",
    "fork_sandbox",
    "get_file",
    "install_packages",
    "kill_job",
    "list_files",
    "list_jobs",
    "list_sandboxes",
    "pause_sandbox",
    "run_terminal_command",
    "upload_file",
}

EXPECTED_VERSION = {"legacy": "2025-11-25", "2026-07-28": "2026-07-28", "auto": "2026-07-28"}

TICKETS_CSV = (
    "ticket,category,priority,resolution_hours\n"
    "T-1001,billing,high,4.5\n"
    "T-1002,login,low,1.0\n"
    "T-1003,billing,low,2.5\n"
    "T-1004,shipping,high,30.0\n"
    "T-1005,login,high,0.5\n"
    "T-1006,billing,medium,3.0\n"
    "T-1007,shipping,low,12.0\n"
)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


class Failure(Exception):
    """An expectation about the server's behaviour did not hold."""


def check(condition: bool, message: str) -> None:
    if not condition:
        raise Failure(message)


@dataclass
class Reply:
    """A tools/call result, taken apart."""

    result: types.CallToolResult
    texts: list[str] = field(default_factory=list)
    images: list[tuple[str, bytes]] = field(default_factory=list)
    blobs: list[tuple[str, bytes]] = field(default_factory=list)

    @property
    def structured(self) -> dict[str, Any]:
        return self.result.structured_content or {}

    @property
    def text(self) -> str:
        return "\n".join(self.texts)


class WarningLog(logging.Handler):
    """Collects what the SDK logs at WARNING or above (e.g. "cannot validate structured content")."""

    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(f"{record.name}: {record.getMessage()}")


class Analyst:
    """One MCP client session and the checks made on every reply."""

    def __init__(self, client: Client, output_schemas: dict[str, dict[str, Any]]) -> None:
        self.client = client
        self.output_schemas = output_schemas
        # Successful calls made, and those the SDK validated against their outputSchema: the SDK
        # does it in `ClientSession.validate_tool_result`, which is wrapped to count (and which
        # raises on a mismatch: that propagates, nothing here catches it).
        self.succeeded: list[str] = []
        self.sdk_validated: list[str] = []
        session = client.session
        validate = session.validate_tool_result

        async def counted(name: str, result: types.CallToolResult) -> None:
            await validate(name, result)
            self.sdk_validated.append(name)

        session.validate_tool_result = counted  # type: ignore[method-assign]

    async def call(self, name: str, arguments: dict[str, Any]) -> Reply:
        """Calls a tool. A result that is not an error has already been validated by the SDK
        against the tool's outputSchema (`ClientSession.call_tool` raises otherwise); an error
        result that carries structured content is validated here, because the SDK skips those."""
        result = await self.client.call_tool(name, arguments)
        reply = Reply(result)
        for block in result.content:
            if isinstance(block, types.TextContent):
                reply.texts.append(block.text)
            elif isinstance(block, types.ImageContent):
                reply.images.append((block.mime_type, base64.b64decode(block.data, validate=True)))
            elif isinstance(block, types.EmbeddedResource) and isinstance(
                block.resource, types.BlobResourceContents
            ):
                reply.blobs.append(
                    (block.resource.mime_type or "", base64.b64decode(block.resource.blob, validate=True))
                )
            elif isinstance(block, types.EmbeddedResource) and isinstance(
                block.resource, types.TextResourceContents
            ):
                reply.texts.append(block.resource.text)
        if result.is_error and result.structured_content is not None:
            try:
                jsonschema.validate(result.structured_content, self.output_schemas[name])
            except jsonschema.ValidationError as e:
                raise Failure(f"{name}'s error result does not match its outputSchema: {e.message}") from e
        return reply

    async def ok(self, name: str, arguments: dict[str, Any]) -> Reply:
        """Calls a tool that must succeed with structured content and a readable text block."""
        reply = await self.call(name, arguments)
        check(not reply.result.is_error, f"{name} {arguments} failed: {reply.text}")
        check(reply.result.structured_content is not None, f"{name} returned structuredContent")
        check(bool(reply.text.strip()), f"{name} returned a readable text block")
        self.succeeded.append(name)
        return reply

    def check_sdk_validated_everything(self) -> None:
        check(
            self.sdk_validated == self.succeeded,
            f"the SDK validated every successful result against its outputSchema: "
            f"called {self.succeeded}, validated {self.sdk_validated}",
        )


async def list_tools(client: Client) -> dict[str, dict[str, Any]]:
    """tools/list: the fourteen tools, each described, with an object input and output schema."""
    listed = await client.list_tools()
    names = {tool.name for tool in listed.tools}
    check(names == TOOLS, f"tools/list names the fourteen tools; got {sorted(names)}")
    check(listed.next_cursor is None, "tools/list fits on one page")
    schemas: dict[str, dict[str, Any]] = {}
    for tool in listed.tools:
        check(len(tool.description or "") > 40, f"{tool.name} has a useful description")
        check(tool.input_schema.get("type") == "object", f"{tool.name}'s inputSchema is an object schema")
        check(
            tool.output_schema is not None and tool.output_schema.get("type") == "object",
            f"{tool.name} declares an object outputSchema; got {tool.output_schema!r}",
        )
        assert tool.output_schema is not None
        try:
            jsonschema.validators.validator_for(tool.output_schema).check_schema(tool.output_schema)
        except jsonschema.SchemaError as e:
            raise Failure(f"{tool.name}'s outputSchema is not a valid JSON Schema: {e.message}") from e
        check("sandbox_id" in tool.output_schema.get("properties", {}), f"{tool.name}'s result names the sandbox_id")
        schemas[tool.name] = tool.output_schema
    properties = {tool.name: set(tool.input_schema.get("properties", {})) for tool in listed.tools}
    check({"code", "sandbox_id", "timeout_seconds"} <= properties["execute_code"],
          f"execute_code takes code, sandbox_id, timeout_seconds; got {properties['execute_code']}")
    check({"path", "content_base64", "content_text", "overwrite"} <= properties["upload_file"],
          f"upload_file's arguments; got {properties['upload_file']}")
    check({"command", "cwd", "timeout_seconds"} <= properties["run_terminal_command"],
          f"run_terminal_command's arguments; got {properties['run_terminal_command']}")
    return schemas


async def conversation(client: Client, mode: str) -> None:
    check(
        client.protocol_version == EXPECTED_VERSION[mode],
        f"mode {mode} negotiates {EXPECTED_VERSION[mode]}; got {client.protocol_version}",
    )
    analyst = Analyst(client, await list_tools(client))
    conversation_id = f"support-{mode}-{uuid.uuid4().hex}"

    # The agent opens a sandbox for this conversation; asking again returns the same one.
    created = await analyst.ok("create_sandbox", {"conversation_id": conversation_id})
    sandbox_id = created.structured.get("sandbox_id")
    check(isinstance(sandbox_id, str) and sandbox_id != "", f"create_sandbox gives a sandbox_id: {created.structured}")
    check(created.structured.get("created") is True, f"a new sandbox is created: {created.structured}")
    check(bool(created.structured.get("expires_at")), "create_sandbox says when the sandbox expires")
    check(
        isinstance(created.structured.get("idle_timeout_seconds"), int)
        and created.structured["idle_timeout_seconds"] > 0,
        f"create_sandbox gives the idle timeout: {created.structured}",
    )
    check(sandbox_id in created.text, "the text block names the sandbox id")
    again = await analyst.ok("create_sandbox", {"conversation_id": conversation_id})
    check(again.structured.get("sandbox_id") == sandbox_id, "the same conversation gets the same sandbox")
    check(again.structured.get("created") is False, f"…with created: false: {again.structured}")

    # The customer's export goes in.
    uploaded = await analyst.ok(
        "upload_file", {"sandbox_id": sandbox_id, "path": "data/tickets.csv", "content_text": TICKETS_CSV}
    )
    check(uploaded.structured.get("path") == "/home/user/data/tickets.csv",
          f"the upload lands under /home/user: {uploaded.structured}")
    check(uploaded.structured.get("size") == len(TICKETS_CSV.encode()), f"upload size: {uploaded.structured}")
    check(
        uploaded.structured.get("sha256") == hashlib.sha256(TICKETS_CSV.encode()).hexdigest(),
        f"upload sha256: {uploaded.structured}",
    )

    # Group it with pandas; the value of the last expression comes back too.
    grouped = await analyst.ok(
        "execute_code",
        {
            "sandbox_id": sandbox_id,
            "code": (
                "import pandas as pd\n"
                "df = pd.read_csv('data/tickets.csv')\n"
                "hours = df.groupby('category')['resolution_hours'].mean().round(2)\n"
                "print(hours.to_dict())\n"
                "df.groupby('category').size()"
            ),
        },
    )
    s = grouped.structured
    check(
        s.get("stdout") == "{'billing': 3.33, 'login': 0.75, 'shipping': 21.0}\n",
        f"the cell's stdout: {s.get('stdout')!r} (stderr {s.get('stderr')!r}, error {s.get('error')!r})",
    )
    check(s.get("error") is None, f"no error: {s.get('error')}")
    plain = (s.get("result") or {}).get("text/plain", "")
    check("billing" in plain and "3" in plain and "shipping" in plain,
          f"the last expression's value comes back as text/plain: {plain!r}")
    check(isinstance(s.get("execution_count"), int), f"an execution count: {s.get('execution_count')!r}")
    check(s.get("sandbox_id") == sandbox_id, "execute_code names its sandbox")
    check("billing" in grouped.text, f"the text block shows the output: {grouped.text!r}")

    # A chart with plt.show(): inline as image content, and saved under /home/user.
    chart = await analyst.ok(
        "execute_code",
        {
            "sandbox_id": sandbox_id,
            "code": (
                "import matplotlib.pyplot as plt\n"
                "hours.plot.bar(title='Mean resolution time by category')\n"
                "plt.ylabel('hours')\n"
                "plt.show()"
            ),
        },
    )
    check(len(chart.images) == 1, f"one chart comes back inline; got {len(chart.images)}: {chart.text!r}")
    mime, png = chart.images[0]
    check(mime == "image/png", f"the chart is image/png; got {mime}")
    check(png.startswith(PNG_SIGNATURE), "the inline image decodes to a PNG")
    images = chart.structured.get("images") or []
    check(len(images) == 1, f"structured images lists the chart: {images}")
    chart_path = images[0].get("path")
    check(isinstance(chart_path, str) and chart_path.startswith("/home/user/") and chart_path.endswith(".png"),
          f"the chart was saved under /home/user: {images[0]}")
    check(images[0].get("size") == len(png), f"structured size {images[0].get('size')} = the PNG's {len(png)}")

    # The saved chart, fetched again, is the one that was shown.
    fetched = await analyst.ok("get_file", {"sandbox_id": sandbox_id, "path": chart_path})
    check(fetched.structured.get("mime_type") == "image/png", f"get_file's mime type: {fetched.structured}")
    check(fetched.structured.get("size") == len(png), f"get_file's size: {fetched.structured}")
    check(fetched.structured.get("sha256") == hashlib.sha256(png).hexdigest(), "get_file's sha256 is the PNG's")
    check(len(fetched.images) == 1, f"get_file returns the PNG as image content: {fetched.text!r}")
    check(fetched.images[0] == ("image/png", png), "the fetched PNG is byte for byte the inline chart")

    # The CSV comes back as text.
    csv = await analyst.ok("get_file", {"sandbox_id": sandbox_id, "path": "data/tickets.csv"})
    check(csv.structured.get("mime_type", "").startswith("text/"), f"a CSV is text: {csv.structured}")
    check(TICKETS_CSV in csv.texts, "get_file returns the CSV's text unchanged")

    # ls -la shows both files with their sizes (a long listing: under gVisor too).
    chart_dir, chart_name = posixpath.split(chart_path)
    listing = await analyst.ok(
        "run_terminal_command",
        {"sandbox_id": sandbox_id, "command": f"ls -la /home/user data {chart_dir}"},
    )
    out = listing.structured.get("stdout", "")
    check(listing.structured.get("exit_code") == 0, f"ls exits 0: {listing.structured}")
    check(listing.structured.get("timed_out") is False, "ls did not time out")
    sizes = {line.split()[-1]: line.split()[4] for line in out.splitlines() if len(line.split()) >= 9}
    check(sizes.get("tickets.csv") == str(len(TICKETS_CSV)), f"ls -la shows tickets.csv and its size:\n{out}")
    check(sizes.get(chart_name) == str(len(png)), f"ls -la shows {chart_name} and its size:\n{out}")
    check("tickets.csv" in listing.text, "the text block shows the listing")

    files = await analyst.ok("list_files", {"sandbox_id": sandbox_id, "path": "data"})
    entries = {e.get("name"): e for e in files.structured.get("entries", [])}
    check(entries.get("tickets.csv", {}).get("type") == "file", f"list_files shows the CSV: {entries}")

    # A failing cell: isError, and the model can read what went wrong.
    failing = await analyst.call(
        "execute_code", {"sandbox_id": sandbox_id, "code": "df.groupby('category')['satisfaction'].mean()"}
    )
    check(failing.result.is_error is True, f"a failing cell is isError: {failing.text!r}")
    error = failing.structured.get("error") or {}
    check(error.get("name") == "KeyError", f"the error's name is KeyError: {error}")
    check("satisfaction" in error.get("value", ""), f"the error's value names the column: {error}")
    tb = error.get("traceback")
    check(isinstance(tb, list) and len(tb) > 0, f"a traceback comes back: {tb!r}")
    check("KeyError" in "\n".join(tb), f"the traceback shows the KeyError: {tb!r}")
    check("KeyError" in failing.text, f"the text block shows the error: {failing.text!r}")

    # State survived the failure.
    still = await analyst.ok("execute_code", {"sandbox_id": sandbox_id, "code": "len(df)"})
    check((still.structured.get("result") or {}).get("text/plain") == "7", f"state survives: {still.structured}")

    # A call the server cannot accept is a JSON-RPC error, not a tool result.
    try:
        await client.call_tool("execute_code", {"sandbox_id": sandbox_id})
    except MCPError as e:
        check(e.code == types.INVALID_PARAMS, f"a call without `code` is -32602; got {e.code}: {e.message}")
    else:
        raise Failure("a call without `code` is a JSON-RPC error")

    # Close, and the sandbox is gone.
    closed = await analyst.ok("close_sandbox", {"sandbox_id": sandbox_id})
    check(closed.structured.get("closed") is True, f"close_sandbox says closed: {closed.structured}")
    after = await analyst.call("execute_code", {"sandbox_id": sandbox_id, "code": "1"})
    check(after.result.is_error is True, f"a call on a closed sandbox is an error: {after.text!r}")
    check("closed" in after.text, f"…that says the sandbox is closed: {after.text!r}")

    analyst.check_sdk_validated_everything()


async def run(url: str, token: str, mode: str) -> None:
    # The SDK's documented way to add headers: bring your own HTTP client (its default timeouts:
    # 30 s, and 300 s to read, as a response stream may stay open).
    http = httpx2.AsyncClient(
        headers={"Authorization": f"Bearer {token}"}, timeout=httpx2.Timeout(30.0, read=300.0)
    )
    async with http:
        async with Client(streamable_http_client(url, http_client=http), mode=mode) as client:
            await conversation(client, mode)


def leaf(error: BaseException) -> BaseException:
    """The first non-group exception inside anyio's task-group wrapping."""
    while isinstance(error, BaseExceptionGroup) and error.exceptions:
        error = error.exceptions[0]
    return error


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default=os.environ.get("SANDGATE_MCP_URL"), help="MCP endpoint ($SANDGATE_MCP_URL)")
    parser.add_argument("--token", default=os.environ.get("SANDGATE_MCP_TOKEN"), help="bearer token ($SANDGATE_MCP_TOKEN)")
    parser.add_argument("--mode", choices=sorted(EXPECTED_VERSION), default="auto")
    parser.add_argument("--timeout", type=float, default=300.0, help="give up after this many seconds")
    args = parser.parse_args()
    if not args.url or not args.token:
        parser.error("the MCP URL and token are required (--url/--token or SANDGATE_MCP_URL/SANDGATE_MCP_TOKEN)")

    warnings = WarningLog()
    logging.getLogger("mcp").addHandler(warnings)
    try:
        asyncio.run(asyncio.wait_for(run(args.url, args.token, args.mode), args.timeout))
    except BaseException as wrapped:  # noqa: BLE001 - every failure becomes a clear message and exit 1
        error = leaf(wrapped)
        if isinstance(error, Failure):
            print(f"FAIL ({args.mode}): {error}", file=sys.stderr)
        elif isinstance(error, (TimeoutError, asyncio.TimeoutError)):
            print(f"FAIL ({args.mode}): the conversation did not finish within {args.timeout} s", file=sys.stderr)
        else:
            # Includes the SDK's RuntimeError for structured content that does not match an outputSchema.
            traceback.print_exception(error)
            print(f"FAIL ({args.mode}): {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    if warnings.records:
        print(f"FAIL ({args.mode}): the SDK logged warnings:", *warnings.records, sep="\n  ", file=sys.stderr)
        return 1
    print(f"ok ({args.mode}, protocol {EXPECTED_VERSION[args.mode]}): the support-analyst conversation passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
