"""Open an HTML report in headless Chromium and say what a reader would see wrong with it.

Playwright's Python package drives the system's Chromium (Debian's `chromium` package): Playwright's own browser
download needs its CDN, which neither CI nor an offline laptop can count on. Used by tests/pipelines/
test_reports_in_browser.py and by docs/make_screenshots.py (`make screenshots`), so the pictures in the README come
from pages that pass the same checks.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

VIEWPORT = {"width": 1280, "height": 900}  # a common laptop screen: a report must fit its width

# Every <img> waits for its decode (a corrupt data URI rejects) and reports its natural size; 0 means not shown.
_IMAGES_JS = """async () => Promise.all([...document.images].map(async (img) => {
  let error = null;
  try { await img.decode(); } catch (e) { error = String(e); }
  return {alt: img.alt, src: img.src.slice(0, 40), width: img.naturalWidth, height: img.naturalHeight, error};
}))"""


def chromium_path() -> str:
    """$RANGEFINDER_CHROMIUM, else `chromium` (or `chromium-browser`) on PATH; one clear error when there is none."""
    explicit = os.environ.get("RANGEFINDER_CHROMIUM")
    if explicit:
        return explicit
    for name in ("chromium", "chromium-browser"):
        found = shutil.which(name)
        if found:
            return found
    raise RuntimeError(
        "no Chromium found to check the HTML reports in: install it (Debian/Ubuntu: `apt-get install -y chromium`, "
        "as .ci/run does) or point RANGEFINDER_CHROMIUM at a Chromium or Chrome binary"
    )


@dataclass
class PageCheck:
    """What headless Chromium saw on one page."""

    path: Path
    console_errors: list[str] = field(default_factory=list)  # console.error and uncaught exceptions
    failed_requests: list[str] = field(default_factory=list)
    images: list[dict[str, Any]] = field(default_factory=list)  # alt, src, width, height, error
    scroll_width: int = 0  # the document's width
    client_width: int = 0  # the viewport's width inside any scrollbar
    text: str = ""  # the page's visible text

    @property
    def broken_images(self) -> list[dict[str, Any]]:
        return [i for i in self.images if i["width"] == 0 or i["height"] == 0 or i["error"]]

    def problems(self) -> list[str]:
        """One line per thing wrong; empty when the page is fine."""
        out = [f"console error: {e}" for e in self.console_errors]
        out += [f"request failed: {r}" for r in self.failed_requests]
        out += [f"image not decoded: alt={i['alt']!r} src={i['src']}... ({i['error'] or 'no size'})"
                for i in self.broken_images]
        if self.scroll_width > self.client_width:
            out.append(f"scrolls sideways: {self.scroll_width} px wide in a {self.client_width} px viewport")
        return out


@contextmanager
def chromium() -> Iterator[Any]:
    """A headless Chromium browser (playwright.sync_api.Browser), closed on exit."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium_path(), args=["--no-sandbox"])
        try:
            yield browser
        finally:
            browser.close()


def check_page(browser: Any, path: Path, screenshot: Optional[Path] = None) -> PageCheck:
    """Load `path` (file://) in a 1280 px wide viewport; what it saw, and a full-page PNG at `screenshot`."""
    check = PageCheck(path=path)
    page = browser.new_page(viewport=VIEWPORT)
    try:
        page.on("console", lambda m: check.console_errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: check.console_errors.append(f"uncaught: {e}"))
        page.on("requestfailed", lambda r: check.failed_requests.append(f"{r.url[:80]} {r.failure}"))
        page.goto(Path(path).resolve().as_uri(), wait_until="load")
        check.images = page.evaluate(_IMAGES_JS)
        check.scroll_width = page.evaluate("document.documentElement.scrollWidth")
        check.client_width = page.evaluate("document.documentElement.clientWidth")
        check.text = page.inner_text("body")
        if screenshot is not None:
            screenshot.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(screenshot), full_page=True)
    finally:
        page.close()
    return check
