"""Connects the official MCP Python SDK to sandgate with OAuth, the way an MCP client does it.

The SDK's OAuthClientProvider does discovery (401 -> protected-resource metadata ->
authorization-server metadata), dynamic client registration, PKCE, the token exchange and
refresh. Its redirect handler stands in for the person at the browser: it fetches the
authorization URL, signs in on sandgate's login form and approves the consent form, over plain
HTTP (httpx2), reading the forms' hidden fields like a browser would.

Usage: python oauth_connect.py <mcp-url>   (env SANDGATE_TEST_EMAIL, SANDGATE_TEST_PASSWORD)
Prints one JSON line with what happened; exits non-zero on any failure.
"""

import asyncio
import json
import os
import sys
from html.parser import HTMLParser
from urllib.parse import parse_qs, urljoin, urlparse

import httpx2
from mcp import Client
from mcp.client.auth import AuthorizationCodeResult, OAuthClientProvider, TokenStorage
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.auth import OAuthClientInformationFull, OAuthClientMetadata, OAuthToken

REDIRECT_URI = "http://127.0.0.1:1/oauth/callback"


class MemoryStorage(TokenStorage):
    def __init__(self) -> None:
        self.tokens: OAuthToken | None = None
        self.client_info: OAuthClientInformationFull | None = None

    async def get_tokens(self) -> OAuthToken | None:
        return self.tokens

    async def set_tokens(self, tokens: OAuthToken) -> None:
        self.tokens = tokens

    async def get_client_info(self) -> OAuthClientInformationFull | None:
        return self.client_info

    async def set_client_info(self, client_info: OAuthClientInformationFull) -> None:
        self.client_info = client_info


class FormParser(HTMLParser):
    """Collects the first form's action and its input fields (and which page it was)."""

    def __init__(self) -> None:
        super().__init__()
        self.forms: list[dict] = []
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "form":
            self.forms.append({"action": a.get("action"), "fields": {}})
        elif tag == "input" and self.forms and a.get("name"):
            self.forms[-1]["fields"][a["name"]] = a.get("value", "")

    def handle_data(self, data):
        self.text.append(data)


def parse(html: str) -> FormParser:
    p = FormParser()
    p.feed(html)
    return p


class Person:
    """Signs in and approves, keeping cookies by hand (the session cookie is `__Host-`/Secure,
    which a cookie jar would not send over http even on loopback; a browser does)."""

    def __init__(self, email: str, password: str) -> None:
        self.email = email
        self.password = password
        self.cookies: dict[str, str] = {}
        self.result: AuthorizationCodeResult | None = None
        self.consent_text = ""

    def _absorb(self, response: httpx2.Response) -> None:
        for value in response.headers.get_list("set-cookie"):
            pair = value.split(";", 1)[0]
            name, _, val = pair.partition("=")
            if val and "Max-Age=0" not in value:
                self.cookies[name] = val
            else:
                self.cookies.pop(name, None)

    def _headers(self) -> dict[str, str]:
        return {"cookie": "; ".join(f"{k}={v}" for k, v in self.cookies.items())}

    async def redirect_handler(self, authorization_url: str) -> None:
        async with httpx2.AsyncClient(follow_redirects=False, timeout=30) as http:
            url = authorization_url
            for _ in range(10):
                response = await http.get(url, headers=self._headers())
                self._absorb(response)
                if response.status_code in (302, 303):
                    url = urljoin(url, response.headers["location"])
                    if url.startswith(REDIRECT_URI):
                        return self._capture(url)
                    continue
                if response.status_code != 200:
                    raise RuntimeError(f"GET {url} answered {response.status_code}: {response.text[:300]}")
                page = parse(response.text)
                form = page.forms[0]
                fields = dict(form["fields"])
                if "password" in fields or "email" in fields:
                    fields["email"] = self.email
                    fields["password"] = self.password
                else:
                    self.consent_text = " ".join(t.strip() for t in page.text if t.strip())
                    fields["decision"] = "approve"
                post = await http.post(urljoin(url, form["action"]), data=fields, headers=self._headers())
                self._absorb(post)
                if post.status_code != 303:
                    raise RuntimeError(f"POST {form['action']} answered {post.status_code}: {post.text[:300]}")
                url = urljoin(url, post.headers["location"])
                if url.startswith(REDIRECT_URI):
                    return self._capture(url)
            raise RuntimeError("too many steps before the redirect back to the client")

    def _capture(self, url: str) -> None:
        q = {k: v[0] for k, v in parse_qs(urlparse(url).query).items()}
        if "error" in q:
            raise RuntimeError(f"authorization failed: {q}")
        self.result = AuthorizationCodeResult(code=q["code"], state=q.get("state"), iss=q.get("iss"))

    async def callback_handler(self) -> AuthorizationCodeResult:
        assert self.result is not None, "the redirect handler captured the redirect"
        return self.result


async def main() -> None:
    server = sys.argv[1]
    person = Person(os.environ["SANDGATE_TEST_EMAIL"], os.environ["SANDGATE_TEST_PASSWORD"])
    storage = MemoryStorage()
    provider = OAuthClientProvider(
        server_url=server,
        client_metadata=OAuthClientMetadata(
            client_name="Python SDK e2e",
            redirect_uris=[REDIRECT_URI],
            grant_types=["authorization_code", "refresh_token"],
            response_types=["code"],
            scope="sandbox execute",
        ),
        storage=storage,
        redirect_handler=person.redirect_handler,
        callback_handler=person.callback_handler,
    )
    async with httpx2.AsyncClient(auth=provider, timeout=httpx2.Timeout(30, read=120)) as http:
        async with Client(streamable_http_client(server, http_client=http), mode="auto") as client:
            tools = sorted(t.name for t in (await client.list_tools()).tools)
            created = await client.call_tool("create_sandbox", {"conversation_id": "python-sdk"})
            ran = await client.call_tool(
                "execute_code", {"conversation_id": "python-sdk", "code": "sum(range(10))"}
            )
    print(
        json.dumps(
            {
                "client_id": storage.client_info.client_id if storage.client_info else None,
                "has_refresh_token": bool(storage.tokens and storage.tokens.refresh_token),
                "tools": tools,
                "consent_mentions_client": "Python SDK e2e" in person.consent_text,
                "create_error": bool(created.is_error),
                "sandbox_id": (created.structured_content or {}).get("sandbox_id"),
                "result": ((ran.structured_content or {}).get("result") or {}).get("text/plain"),
            }
        )
    )


if __name__ == "__main__":
    asyncio.run(main())
