"""Open a page in a real browser: headless Chromium (Debian's ``chromium`` package), for tests.

``render(page)`` loads a file as a user's browser does (``file://``, the browser deciding by
the file's name how to show it) and returns what it rendered:

- the DOM after loading (``--dump-dom``): an HTML page has its tables and images as elements;
  a page shown as text is one ``<pre>`` of escaped source;
- a screenshot (``--screenshot``) of the page at ``WINDOW`` pixels;
- the layout, measured by the browser on a copy of the page with a script appended that
  records, once loaded, the viewport and document widths and each image's state and box
  (in a ``data-layout`` attribute of ``<body>``, read back from that copy's DOM).

Chromium runs with a new empty profile each time and without network, sandbox or GPU (flags
that work as root in a container).
"""

from __future__ import annotations

import html.parser
import json
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

WINDOW = (1280, 900)
TIMEOUT_S = 120
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    f"--window-size={WINDOW[0]},{WINDOW[1]}",
)
_LAYOUT_SCRIPT = """
<script>
addEventListener("load", () => {
  const box = (e) => e.getBoundingClientRect();
  document.body.setAttribute("data-layout", JSON.stringify({
    viewport: document.documentElement.clientWidth,
    document: document.documentElement.scrollWidth,
    images: [...document.images].map((i) => ({
      loaded: i.complete && i.naturalWidth > 0,
      natural: i.naturalWidth,
      left: box(i).left,
      right: box(i).right,
    })),
  }));
});
</script>
"""


def chromium() -> str | None:
    """The Chromium executable on PATH, if any."""
    return shutil.which("chromium") or shutil.which("chromium-browser")


@dataclass
class Element:
    tag: str
    attrs: dict[str, str | None]


@dataclass
class Rendered:
    """What the browser made of a page."""

    dom: str
    elements: list[Element] = field(default_factory=list)
    screenshot: Path | None = None
    layout: dict = field(default_factory=dict)

    def all(self, tag: str) -> list[Element]:
        return [e for e in self.elements if e.tag == tag]


class _Elements(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.found: list[Element] = []

    def handle_starttag(self, tag: str, attrs) -> None:
        self.found.append(Element(tag, dict(attrs)))


def _run(exe: str, args: list[str], cwd: Path) -> str:
    with tempfile.TemporaryDirectory(prefix="chromium-profile-") as profile:
        done = subprocess.run(
            [exe, *FLAGS, f"--user-data-dir={profile}", *args],
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
            cwd=cwd,
            check=False,
        )
    if done.returncode != 0:
        raise RuntimeError(f"chromium {args[0]} failed ({done.returncode}): {done.stderr[-2000:]}")
    return done.stdout


def _parse(dom: str) -> list[Element]:
    parser = _Elements()
    parser.feed(dom)
    return parser.found


def render(page: Path, work: Path) -> Rendered:
    """Load ``page`` in headless Chromium: its DOM, a screenshot and its layout.

    Args:
        page: the file, opened by its own name (as ``xdg-open`` would).
        work: a directory for the screenshot and the measured copy.
    """
    exe = chromium()
    if exe is None:
        raise FileNotFoundError("no chromium on PATH: apt-get install -y chromium")
    work.mkdir(parents=True, exist_ok=True)
    url = page.resolve().as_uri()
    dom = _run(exe, ["--dump-dom", url], work)
    shot = work / f"{page.name}.png"
    _run(exe, [f"--screenshot={shot}", url], work)
    measured = work / f"measured-{page.name}"
    measured.write_bytes(page.read_bytes() + _LAYOUT_SCRIPT.encode())
    body = next(
        e for e in _parse(_run(exe, ["--dump-dom", measured.as_uri()], work)) if e.tag == "body"
    )
    layout = json.loads(body.attrs.get("data-layout") or "{}")
    return Rendered(dom, _parse(dom), shot if shot.exists() else None, layout)
