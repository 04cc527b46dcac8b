"""A real browser for the tests: Debian's ``chromium``, headless (``.ci/run`` installs it when
it can). ``chromium()`` skips the calling test, saying why, where there is none or it cannot
start; ``dump_dom`` returns a page's DOM after its scripts ran (``--virtual-time-budget``), and
``Dom`` reads the elements and attributes out of it."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import tempfile
from html.parser import HTMLParser

import pytest

NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
TIMEOUT_S = 60


@functools.cache
def _find() -> tuple[str | None, str]:
    """(the browser's path, None with the reason it cannot be used)."""
    path = next((p for p in map(shutil.which, NAMES) if p), None)
    if path is None:
        return None, ("no chromium on this machine: Debian's `apt-get install chromium` "
                      "(about 290 MB; .ci/run installs it when it can)")
    try:
        out = _run(path, ["--dump-dom", "data:text/html,<p id=probe>browser-ok</p>"], 5000)
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"{path} cannot start here: {e}"
    if "browser-ok" not in out:
        return None, f"{path} cannot load a page here"
    return path, ""


def chromium() -> str:
    """The browser's path, or skip the calling test with the reason."""
    path, why = _find()
    if path is None:
        pytest.skip(why)
    return path


def _run(path: str, args: list[str], budget_ms: int, window: str = "1280,1800") -> str:
    with tempfile.TemporaryDirectory(prefix="hicached-chromium-") as profile:
        cmd = [path, "--headless", "--disable-gpu", "--no-first-run", "--no-default-browser-check",
               "--disable-extensions", "--hide-scrollbars", f"--user-data-dir={profile}",
               f"--window-size={window}", f"--virtual-time-budget={budget_ms}", *args]
        if os.geteuid() == 0:  # chromium's sandbox refuses to run as root
            cmd.insert(1, "--no-sandbox")
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S,
                              check=False)
    if proc.returncode != 0:
        raise subprocess.SubprocessError(f"exit {proc.returncode}: {proc.stderr[-2000:]}")
    return proc.stdout


def dump_dom(url: str, budget_ms: int = 4000) -> str:
    """The page's DOM after ``budget_ms`` of (virtual) time: its scripts, fetches and timers
    ran."""
    return _run(chromium(), ["--dump-dom", url], budget_ms)


def screenshot(url: str, path: str, window: str = "1280,1800", budget_ms: int = 4000) -> None:
    _run(chromium(), [f"--screenshot={path}", url], budget_ms, window)


class Dom(HTMLParser):
    """Every element of a page as (tag, attributes, the id of the ``<section>`` it is in)."""

    def __init__(self, html: str):
        super().__init__()
        self.elements: list[tuple[str, dict, str | None]] = []
        self.body: dict = {}  # the attributes of <body>
        self._section: str | None = None
        self.feed(html)

    def handle_starttag(self, tag, attrs):
        a = {k: v or "" for k, v in attrs}
        if tag == "section":
            self._section = a.get("id")
        elif tag == "body":
            self.body = a
        self.elements.append((tag, a, self._section))

    def handle_endtag(self, tag):
        if tag == "section":
            self._section = None

    def by_id(self, id_: str) -> dict:
        found = [a for _, a, _ in self.elements if a.get("id") == id_]
        assert len(found) == 1, f"{len(found)} elements with id {id_!r}"
        return found[0]

    def find(self, tag: str, cls: str, section: str | None = None) -> list[dict]:
        """Elements ``<tag class="cls">`` (in ``<section id=section>``)."""
        return [a for t, a, s in self.elements if t == tag and cls in a.get("class", "").split()
                and (section is None or s == section)]
