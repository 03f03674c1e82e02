"""Browser fixtures (tests/conftest.py exposes browser, dialogs and page): Playwright driving
Debian's Chromium (never a downloaded one), an app served by uvicorn on a thread (`serving`), and a
page that fails its test on any page error or dialog (a dialog would be XSS). A failed test's page is
screenshot whole into FFMEM_ARTIFACTS (default test-artifacts/); every test's with FFMEM_SCREENSHOTS=all.

Skipped when Chromium is not installed, except on CI (env CI set), where that is a failure.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest
import uvicorn

CHROMIUM = os.environ.get("FFMEM_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
ARTIFACTS = Path(os.environ.get("FFMEM_ARTIFACTS", "test-artifacts"))
CALL_FAILED = pytest.StashKey[bool]()  # a test's outcome, for its fixtures' teardown


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.when == "call":
        item.stash[CALL_FAILED] = report.failed
    return report


def screenshot(page, request) -> None:
    """The whole page into ARTIFACTS, named after the test, where the test failed (or did not run its body)
    or FFMEM_SCREENSHOTS=all: a full-page PNG of a tall page costs ~0.3 s."""
    if not request.node.stash.get(CALL_FAILED, True) and os.environ.get("FFMEM_SCREENSHOTS") != "all":
        return
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    name = request.node.name.replace("[", "-").replace("]", "").replace("/", "_")
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


@contextmanager
def serving(app):
    """`app` on a free local port, in a thread; yields the port."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def run_coroutine(coroutine):
    """`asyncio.run(coroutine)` on a thread of its own: the session's Playwright keeps an event loop
    running on the test process's main thread, where a second one cannot start."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


@pytest.fixture(scope="session")
def browser():
    """One Chromium for the test process (each test gets its own context: its own cookies and storage)."""
    if CHROMIUM is None:
        message = "Debian's chromium is not installed (apt-get install chromium)"
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the browser tests: {message}", pytrace=False)
        pytest.skip(message)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield browser
        browser.close()


@pytest.fixture
def dialogs() -> list[str]:
    """Messages of every alert/confirm/prompt the page opened: any would be XSS."""
    return []


@pytest.fixture
def page(browser, request, dialogs):
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))

    def on_dialog(dialog) -> None:
        dialogs.append(dialog.message)
        dialog.dismiss()

    page.on("dialog", on_dialog)
    yield page
    screenshot(page, request)
    context.close()
    assert errors == [], errors
    assert dialogs == [], dialogs


# Each CSP violation is reported to the test through an exposed function (the init script and the
# binding come from the driver, so the page's CSP does not apply to them).
REPORT_VIOLATIONS = """
document.addEventListener("securitypolicyviolation", (event) => {
  const where = `${event.sourceFile}:${event.lineNumber}`;
  window.cspViolation(`${event.violatedDirective} blocked ${event.blockedURI} at ${where}: ${event.sample}`);
});
"""


@pytest.fixture
def watched(page):
    """The page, with every CSP violation and console error it reports collected; none may happen."""
    violations: list[str] = []
    console: list[str] = []
    page.expose_function("cspViolation", lambda text: violations.append(text))
    page.add_init_script(REPORT_VIOLATIONS)

    def on_console(message) -> None:
        if message.type == "error" and not message.location.get("url", "").endswith("/favicon.ico"):
            console.append(f"{message.text} ({message.location.get('url')})")  # we serve no favicon

    page.on("console", on_console)
    yield page
    assert violations == []
    assert console == []
