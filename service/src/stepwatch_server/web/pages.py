"""Serving the dashboard: `/` and `/run/<name>` answer the single page, `/docs` the API docs page, `/assets/`
their built files.

The files are built from the top-level `web/` project (`npm ci && npm run build`, which
scripts/setup.sh and the Dockerfile run) into `static/` next to this module, and shipped inside the
package. When they are missing (a checkout that was never built), `/` answers a page that says how to
build them instead of a bare 404.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, FastAPI
from starlette.responses import FileResponse, HTMLResponse, Response
from starlette.staticfiles import StaticFiles

STATIC_DIR = Path(__file__).with_name("static")
INDEX = STATIC_DIR / "index.html"
DOCS = STATIC_DIR / "docs.html"  # the API docs: Swagger UI from npm, built with the dashboard (no CDN)

NOT_BUILT = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>stepwatch: dashboard not built</title></head>
<body style="font-family: system-ui, sans-serif; max-width: 46rem; margin: 3rem auto; line-height: 1.5">
<h1>The stepwatch dashboard is not built</h1>
<p>The collector is running and its API answers (<a href="/openapi.json">/openapi.json</a>, <a href="/api/v1/runs">/api/v1/runs</a>),
but the dashboard's files are missing from <code>{static}</code>.</p>
<p>Build them from a clone of the repository (needs Node.js 20 and npm), then restart the collector:</p>
<pre>bash scripts/setup.sh
# or only the dashboard:
cd web &amp;&amp; npm ci &amp;&amp; npm run build</pre>
</body></html>
"""

router = APIRouter(include_in_schema=False)


def _page(page: Path | None = None) -> Response:
    page = INDEX if page is None else page  # looked up at each call (tests move it)
    if not page.is_file():
        return HTMLResponse(NOT_BUILT.format(static=STATIC_DIR), status_code=503)
    return FileResponse(page, headers={"Cache-Control": "no-cache"})


@router.get("/docs")
def api_docs() -> Response:
    """The API docs, reading /openapi.json (FastAPI's own /docs loads Swagger UI from a CDN: it is off)."""
    return _page(DOCS)


@router.get("/")
def runs_page() -> Response:
    return _page()


@router.get("/run/{run:path}")
def run_page(run: str) -> Response:
    return _page()


def mount_static(app: FastAPI) -> None:
    """`/assets/`: the built scripts and styles, when they are built (else `/` says how to build them,
    and to restart the collector after)."""
    assets = STATIC_DIR / "assets"
    if assets.is_dir():
        app.mount("/assets", StaticFiles(directory=assets), name="assets")
