"""The built site, served on localhost and loaded page by page in headless Chromium (Debian's package).

A page fails when it does not render (no heading or no content, or a blank body), when the browser logs a
console error or an uncaught exception, or when a request fails, answers an HTTP error or leaves localhost
(the site must work offline). ``nox -s docs`` builds the site and sets ``ALIGNLIT_DOCS_SITE``; with
``ALIGNLIT_DOCS_SCREENSHOTS=DIR`` the home page and a concept page are also saved as PNGs there (the ones
committed under ``docs/screenshots/`` come from this test).
"""

from __future__ import annotations

import functools
import http.server
import os
import threading
from pathlib import Path

import pytest

SITE = os.environ.get("ALIGNLIT_DOCS_SITE")
CHROMIUM = os.environ.get("ALIGNLIT_CHROMIUM", "/usr/bin/chromium")
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
SCREENSHOTS = {"home.png": "", "concept-online-step.png": "concepts/online-step/"}

pytestmark = [
    pytest.mark.docs,
    pytest.mark.skipif(not SITE, reason="needs a built site: `nox -s docs` (ALIGNLIT_DOCS_SITE)"),
]


@pytest.fixture(scope="module")
def server():
    site = Path(SITE).resolve()
    assert (site / "index.html").is_file(), f"{site}: no index.html (mkdocs build first)"

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    handler = functools.partial(Quiet, directory=str(site))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield site, f"http://127.0.0.1:{httpd.server_address[1]}/"
    httpd.shutdown()


def site_pages(site: Path) -> list[str]:
    return sorted(
        str(p.parent.relative_to(site)).replace(".", "", 1) + ("/" if p.parent != site else "")
        for p in site.rglob("index.html")
        if "assets" not in p.parts
    )


def test_every_page_renders_without_errors(server):
    from playwright.sync_api import sync_playwright

    assert Path(CHROMIUM).is_file(), f"no Chromium at {CHROMIUM}: apt-get install -y chromium"
    site, base = server
    pages = site_pages(site)
    assert len(pages) > 40, pages
    problems: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        context = browser.new_context(viewport={"width": 1280, "height": 900})
        page = context.new_page()
        current = {"url": ""}
        page.on(
            "console", lambda m: m.type == "error" and problems.append(f"{current['url']}: console: {m.text}")
        )
        page.on("pageerror", lambda e: problems.append(f"{current['url']}: exception: {e}"))
        # a request the next navigation cancels (net::ERR_ABORTED) is not a failure; a missing file is a 404
        page.on(
            "requestfailed",
            lambda r: (
                "ERR_ABORTED" not in (r.failure or "")
                and problems.append(f"{current['url']}: request failed ({r.failure}): {r.url}")
            ),
        )
        page.on(
            "response",
            lambda r: r.status >= 400 and problems.append(f"{current['url']}: HTTP {r.status}: {r.url}"),
        )

        def local_only(route):
            if route.request.url.startswith(base):
                route.continue_()
            else:
                problems.append(f"{current['url']}: request leaves localhost: {route.request.url}")
                route.abort()

        page.route("**/*", local_only)
        for path in pages:
            current["url"] = base + path
            response = page.goto(base + path, wait_until="load")
            assert response is not None and response.ok, f"{path}: {response and response.status}"
            heading = page.locator("article h1").first
            if not heading.count() or not heading.inner_text().strip():
                problems.append(f"{path}: no h1 in the article")
            box = page.locator("article").first.bounding_box()
            if not box or box["height"] < 100 or box["width"] < 300:
                problems.append(f"{path}: the article is not laid out ({box})")
            if len(page.locator("article").first.inner_text().strip()) < 40:
                problems.append(f"{path}: the article is (almost) empty")
        out = os.environ.get("ALIGNLIT_DOCS_SCREENSHOTS")
        if out:
            Path(out).mkdir(parents=True, exist_ok=True)
            for name, path in SCREENSHOTS.items():
                current["url"] = base + path
                page.goto(base + path, wait_until="load")
                page.screenshot(path=str(Path(out) / name))
        browser.close()
    assert not problems, "\n".join(problems[:50])
    print(f"\n{len(pages)} pages rendered in Chromium without errors")
