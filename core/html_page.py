"""Self-contained HTML report pages (SFT, GRPO, eval): the KFP UI's HTML view and a browser.

One page frame for every report: a doctype and charset (a browser opening the file renders it
as HTML, in UTF-8), and a style that keeps the content within the page's width (charts scale
down to it instead of being cut off). Images are embedded as ``data:`` URIs, so a page is one
file that can be copied anywhere.
"""

from __future__ import annotations

import base64
import html

STYLE = (
    "body{font-family:sans-serif;margin:1.5em;max-width:1400px}"
    "img{max-width:100%;height:auto}"
    "table{border-collapse:collapse;margin:0.4em 0 1.2em}"
    "td,th{border:1px solid #ccc;padding:3px 7px;font-size:13px;text-align:left}"
    "th{background:#f2f2f2}caption{font-weight:bold;text-align:left;padding:4px 0}"
)


def html_page(title: str, body: str) -> str:
    """A whole HTML document: ``title`` (escaped here) and ``body`` (HTML, as given)."""
    return (
        "<!doctype html><html><head><meta charset='utf-8'>"
        "<meta name='viewport' content='width=device-width, initial-scale=1'>"
        f"<title>{html.escape(title)}</title><style>{STYLE}</style></head>"
        f"<body>\n{body}\n</body></html>"
    )


def png_img(png: bytes, alt: str) -> str:
    """An ``<img>`` element that carries the PNG itself."""
    data = base64.b64encode(png).decode("ascii")
    return f"<img alt='{html.escape(alt, quote=True)}' src='data:image/png;base64,{data}'>"
