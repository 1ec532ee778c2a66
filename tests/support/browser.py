"""The viewer's pages in a real headless Chromium, reaching the gateway alone."""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from typing import Any

from playwright.sync_api import Browser, Page, sync_playwright


@contextlib.contextmanager
def chromium() -> Iterator[Browser]:
    """Debian's headless Chromium, driven by Playwright."""
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=shutil.which("chromium"), args=["--no-sandbox"])
        yield launched
        launched.close()


def page_for(browser: Browser, gateway_url: str) -> tuple[Page, list[str]]:
    """A page that may reach only the gateway; the URLs it tried elsewhere."""
    context = browser.new_context(viewport={"width": 1300, "height": 1000})
    blocked: list[str] = []

    def only_the_gateway(route: Any) -> None:
        if route.request.url.startswith(gateway_url):
            route.continue_()
        else:
            blocked.append(route.request.url)
            route.abort()

    context.route("**/*", only_the_gateway)
    return context.new_page(), blocked


def draw_every_token(page: Page, section: str) -> None:
    """Scroll each token view of `section` into view (they are drawn as they come near the screen), then
    unfold every prefix a turn shares with its parent."""
    for box in page.locator(f"{section} .tokens").all():
        box.scroll_into_view_if_needed()
    page.wait_for_function(
        f"[...document.querySelectorAll('{section} .tokens')].every((box) => box.childElementCount > 0)"
    )
    for summary in page.locator(f"{section} details.prefix > summary").all():
        summary.click()
    folds = f"[...document.querySelectorAll('{section} details.prefix')]"
    page.wait_for_function(f"{folds}.every((fold) => fold.childElementCount > 1)")
