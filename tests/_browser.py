"""Debian's Chromium for the end-to-end tests: where it is and how it is started."""

from __future__ import annotations

from typing import Any

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def launch_chromium(playwright: Any) -> Any:
    """A headless Chromium browser from a ``sync_playwright()`` context (close it when done)."""
    return playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
