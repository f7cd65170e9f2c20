"""Link previews: the page's Open Graph and Twitter tags say what the app is.

Gradio's page template carries two sets of preview tags of its own (``og:title`` "Gradio",
``og:url`` "{url}" and "https://gradio.app/", pictures on a remote host). ``PageMeta``
replaces all of them, in the HTML of the page only, with one set naming this app and the
address the page was asked for (a shared ``/?sample=5`` link previews as that link).
"""

from __future__ import annotations

import html
import re

from starlette.types import ASGIApp, Message, Receive, Scope, Send

TITLE = "RST-CNN: prediction stability"
DESCRIPTION = (
    "Classify a picture with a rotation- and scale-equivariant CNN and a plain CNN, and see "
    "whether each answer survives turning, resizing and bending the picture."
)
# one <meta property="og:..." content="..."> or <meta name="twitter:..." ...>, over lines
_PREVIEW_TAG = re.compile(
    rb'[ \t]*<meta\s+(?:property|name)="(?:og|twitter):[^"]*"\s+content="[^"]*"\s*/?>[ \t]*\r?\n?'
)


def preview_tags(url: str, title: str = TITLE, description: str = DESCRIPTION) -> str:
    """The preview tags for a page at ``url``."""
    pairs = [
        ("property", "og:type", "website"),
        ("property", "og:title", title),
        ("property", "og:description", description),
        ("property", "og:url", url),
        ("name", "twitter:card", "summary"),
        ("name", "twitter:title", title),
        ("name", "twitter:description", description),
    ]
    return "".join(
        f'<meta {kind}="{key}" content="{html.escape(value, quote=True)}" />\n'
        for kind, key, value in pairs
    )


def rewrite(page: bytes, url: str) -> bytes:
    """``page`` with every preview tag removed and ours put after its charset tag (or
    ``<head>``)."""
    stripped = _PREVIEW_TAG.sub(b"", page)
    anchor = re.search(rb"<meta charset=[^>]*>", stripped) or re.search(rb"<head[^>]*>", stripped)
    if anchor is None:
        return stripped
    at = anchor.end()
    return stripped[:at] + b"\n" + preview_tags(url).encode() + stripped[at:]


class PageMeta:
    """ASGI middleware: HTML answers to GET ``path`` get ``rewrite``'s preview tags."""

    def __init__(self, app: ASGIApp, *, path: str = "/"):
        self.app = app
        self.path = path

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "GET" or scope["path"] != self.path:
            await self.app(scope, receive, send)
            return
        start: Message | None = None
        body: list[bytes] = []

        async def buffered(message: Message) -> None:
            nonlocal start
            if message["type"] == "http.response.start":
                headers = dict(message.get("headers", []))
                if not headers.get(b"content-type", b"").startswith(b"text/html"):
                    await send(message)  # not the page: passed through untouched
                    return
                start = message
                return
            if start is None or message["type"] != "http.response.body":
                await send(message)
                return
            body.append(message.get("body", b""))
            if message.get("more_body", False):
                return
            page = rewrite(b"".join(body), _url(scope))
            headers = [(k, v) for k, v in start.get("headers", []) if k != b"content-length"]
            headers.append((b"content-length", str(len(page)).encode()))
            await send({**start, "headers": headers})
            await send({"type": "http.response.body", "body": page})

        await self.app(scope, receive, buffered)


def _url(scope: Scope) -> str:
    """The address the page was asked for (its Host header passed the host check)."""
    host = dict(scope["headers"]).get(b"host", b"").decode("latin-1")
    query = scope.get("query_string", b"").decode("latin-1")
    return f"{scope.get('scheme', 'http')}://{host}{scope['path']}" + (f"?{query}" if query else "")
