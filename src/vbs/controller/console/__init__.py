"""The web console: static files (one HTML page, one JavaScript module, one stylesheet) at ``/console``.

The files are public, as a sign-in page must be; everything the console shows comes from the REST API
``/v1``, called by the browser with the access key the user typed (kept in ``sessionStorage``). The
edge lets ``GET``/``HEAD`` of ``/console`` through without credentials and nothing else
(vbs.controller.rest.edge), and every answer here carries a strict Content-Security-Policy: scripts and
styles from this origin only, no inline script, no frames, API calls to this origin only.
"""

from __future__ import annotations

from importlib import resources

from fastapi import FastAPI
from fastapi.responses import RedirectResponse, Response

from vbs.errors import NotFound

__all__ = ["PREFIX", "install", "is_console_path"]

PREFIX = "/console"
CONTENT_SECURITY_POLICY = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                           "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
SECURITY_HEADERS = {
    "content-security-policy": CONTENT_SECURITY_POLICY,
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "x-frame-options": "DENY",
    "cache-control": "no-cache",
}
MEDIA_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
               ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml"}


def is_console_path(path: str) -> bool:
    return path == PREFIX or path.startswith(PREFIX + "/")


def _static_files() -> dict[str, tuple[bytes, str]]:
    """Every file the console serves, by name, read once: a request can name only one of these."""
    found: dict[str, tuple[bytes, str]] = {}
    for entry in resources.files(__package__).joinpath("static").iterdir():
        suffix = "." + entry.name.rpartition(".")[2]
        if entry.is_file() and suffix in MEDIA_TYPES:
            found[entry.name] = (entry.read_bytes(), MEDIA_TYPES[suffix])
    return found


def install(app: FastAPI) -> None:
    files = _static_files()

    def serve(name: str) -> Response:
        if name not in files:
            raise NotFound(f"The console has no file '{name[:64]}'.")
        body, media_type = files[name]
        return Response(body, media_type=media_type, headers=SECURITY_HEADERS)

    @app.api_route(PREFIX, methods=["GET", "HEAD"], include_in_schema=False)
    def console_root() -> Response:
        # Relative asset URLs in the page resolve against /console/.
        return RedirectResponse(PREFIX + "/", status_code=308, headers=SECURITY_HEADERS)

    @app.api_route(PREFIX + "/", methods=["GET", "HEAD"], include_in_schema=False)
    def console_page() -> Response:
        return serve("index.html")

    @app.api_route(PREFIX + "/{name}", methods=["GET", "HEAD"], include_in_schema=False)
    def console_file(name: str) -> Response:
        return serve(name)
