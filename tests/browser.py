"""A real Chromium (Debian's, at /usr/bin/chromium) driven by Playwright, for the chat page's tests.

Playwright's own browser downloads are not used: ``executable_path`` points
at the system Chromium, which ``.ci/run`` installs when it is missing.
Each tab gets a fresh browser context (its own localStorage and
sessionStorage) and records what the page logged as an error.
"""
import os
import re
import shutil
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

CHROMIUM = os.environ.get("TORNCHAT_CHROMIUM", "/usr/bin/chromium")
FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
# With TORNCHAT_SCREENSHOTS=bench/figures the run refreshes the README's screenshot.
SCREENSHOTS = os.environ.get("TORNCHAT_SCREENSHOTS")


def missing() -> str | None:
    """Why the browser tests cannot run here, or None."""
    if not (Path(CHROMIUM).exists() or shutil.which(CHROMIUM)):
        return f"no Chromium at {CHROMIUM} (apt-get install chromium; .ci/run does it)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright is not installed (pip install -e '.[test]')"
    return None


@contextmanager
def launched():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=FLAGS, headless=True)
        try:
            yield browser
        finally:
            browser.close()


@dataclass
class Tab:
    page: object  # playwright.sync_api.Page
    errors: list[str] = field(default_factory=list)  # console errors and uncaught exceptions

    def reply(self, index: int = -1):
        return self.page.locator("#messages .message.assistant").nth(index)

    def send(self, text: str) -> None:
        self.page.fill("#input", text)
        self.page.press("#input", "Enter")

    def wait_idle(self, timeout_s: float = 120) -> None:
        """Until the reply in flight has ended (the Send button is back)."""
        self.page.wait_for_selector("#send:not([hidden])", timeout=timeout_s * 1000)

    def setting(self, name: str, value: str) -> None:
        if self.page.is_hidden("#settings"):
            self.page.click("#settings-button")
        self.page.fill(f"#s-{name}", value)


@contextmanager
def tab(browser, url: str, viewport=(1280, 800)):
    context = browser.new_context(viewport={"width": viewport[0], "height": viewport[1]})
    page = context.new_page()
    page.set_default_timeout(60_000)
    opened = Tab(page)
    page.on("console", lambda message: message.type == "error" and opened.errors.append(message.text))
    page.on("pageerror", lambda error: opened.errors.append(f"uncaught: {error}"))
    try:
        page.goto(url)
        page.wait_for_load_state("load")
        yield opened
    finally:
        context.close()


def screenshot(opened: Tab, directory: Path, name: str) -> Path:
    """A PNG of the page in the test's tmp directory, copied to TORNCHAT_SCREENSHOTS when set."""
    path = directory / name
    opened.page.screenshot(path=str(path))
    if SCREENSHOTS:
        Path(SCREENSHOTS).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(SCREENSHOTS) / name)
    return path


def metric(url: str, name: str, headers: dict | None = None) -> float:
    """One unlabelled sample of the server's /metrics."""
    request = urllib.request.Request(url + "/metrics", headers=headers or {})
    with urllib.request.urlopen(request, timeout=10) as reply:
        text = reply.read().decode()
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert found, f"{name} not in /metrics"
    return float(found.group(1))


def wait_until(condition, timeout_s: float = 60, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := condition():
            return value
        time.sleep(0.05)
    raise AssertionError(f"{what} not met within {timeout_s} s")
