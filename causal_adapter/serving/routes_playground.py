"""``GET /``: the playground page (static/playground.html), one static page served with headers that keep it to its
own origin; ``--no-ui`` leaves the route out (a 404)."""
from __future__ import annotations

from importlib.resources import files

from fastapi import FastAPI
from fastapi.responses import HTMLResponse

#: The page may talk to its own origin only: its script and style are inline, it loads nothing from elsewhere, and the
#: browser refuses any request it would make to another host (the machine may be offline; nothing leaks).
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
                               "img-src 'self' data:; connect-src 'self'; base-uri 'none'; form-action 'none'; "
                               "frame-ancestors 'none'",
    "Cache-Control": "no-cache",
    "X-Content-Type-Options": "nosniff",
}


def playground_page() -> str:
    """The playground (``GET /``): one static page, no template: it holds nothing of the server's (the API key is
    typed into it, never written into it), and reads the adapters from ``v1/models`` (relative URLs: it works behind
    a reverse proxy's path prefix)."""
    return files(__package__).joinpath("static", "playground.html").read_text(encoding="utf-8")


def register(app: FastAPI) -> None:
    """``GET /`` on `app`: the page, read once."""
    page = playground_page()

    @app.get("/", include_in_schema=False)
    async def playground():
        return HTMLResponse(page, headers=PAGE_HEADERS)
