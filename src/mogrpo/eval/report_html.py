"""`mogrpo report --html`: the Markdown report as one self-contained HTML page.

The report uses a small, known subset of Markdown (headings, paragraphs, `- ` lists, pipe
tables, `code`, **bold**, images), so it is converted here rather than with a dependency.
Images are inlined as base64 data URIs: the page can be mailed or attached as one file.
"""

from __future__ import annotations

import base64
import html
import re
from pathlib import Path

_IMAGE = re.compile(r"^!\[(?P<alt>[^\]]*)\]\((?P<src>[^)]+)\)$")
_STYLE = """
body { font-family: system-ui, sans-serif; max-width: 60rem; margin: 2rem auto; padding: 0 1rem;
       color: #222; line-height: 1.45; }
table { border-collapse: collapse; margin: 0.5rem 0; }
th, td { border: 1px solid #ccc; padding: 0.2rem 0.6rem; text-align: left; }
th { background: #f3f3f3; }
code { background: #f3f3f3; padding: 0 0.2rem; }
img { max-width: 100%; display: block; margin: 0.5rem 0 1.5rem; }
"""


def _inline(text: str) -> str:
    """Escape, then `code` and **bold**."""
    out = html.escape(text, quote=False)
    out = re.sub(r"`([^`]+)`", r"<code>\1</code>", out)
    return re.sub(r"\*\*([^*]+)\*\*", r"<strong>\1</strong>", out)


def _image(alt: str, src: str, base: Path) -> str:
    path = (base / src).resolve()
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    return (f'<figure><img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'
            f"<figcaption>{html.escape(alt)}</figcaption></figure>")


def _table(rows: list[str]) -> str:
    cells = [[c.strip() for c in row.strip().strip("|").split("|")] for row in rows]
    body = [r for r in cells[1:] if not all(set(c) <= set("-: ") for c in r)]
    head = "".join(f"<th>{_inline(c)}</th>" for c in cells[0])
    lines = "".join("<tr>" + "".join(f"<td>{_inline(c)}</td>" for c in r) + "</tr>"
                    for r in body)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{lines}</tbody></table>"


def markdown_to_html(text: str, base: Path) -> str:
    """The report's Markdown as HTML body elements; image paths are relative to `base`."""
    out: list[str] = []
    blocks = re.split(r"\n\s*\n", text.strip())
    for block in blocks:
        lines = block.splitlines()
        first = lines[0]
        if first.startswith("#"):
            level = len(first) - len(first.lstrip("#"))
            out.append(f"<h{level}>{_inline(first[level:].strip())}</h{level}>")
            lines = lines[1:]
            if not lines:
                continue
            first = lines[0]
        if all(line.startswith("|") for line in lines):
            out.append(_table(lines))
        elif all(line.startswith("- ") for line in lines):
            out.append("<ul>" + "".join(f"<li>{_inline(line[2:])}</li>" for line in lines)
                       + "</ul>")
        elif all(_IMAGE.match(line) for line in lines):
            out += [_image(m["alt"], m["src"], base) for m in map(_IMAGE.match, lines) if m]
        else:
            out.append("<p>" + "<br>".join(_inline(line) for line in lines) + "</p>")
    return "\n".join(out)


def write_html(markdown: str, base: Path, path: Path, title: str) -> Path:
    """Write the report as one HTML file with every chart inlined; returns its path."""
    page = (f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{html.escape(title)}</title><style>{_STYLE}</style></head>\n<body>\n"
            f"{markdown_to_html(markdown, base)}\n</body></html>\n")
    path.write_text(page, encoding="utf-8")
    return path
