"""SFT / VL rows (:mod:`ray_ppu.data.sft.view`) in the terminal and on one HTML page.

Terminal: trained text between ``⟦ ⟧`` (green too on a colour terminal), images as
``⟨image 1: 40×30 px, 16 tokens⟩``, padding as ``⟨pad × 37⟩``; the markers stay in a file or a
pipe, where colours would be noise. HTML: the same spans coloured, each image shown beside its
span (its file, embedded), the corpus's figures on top, one self-contained file to send
around (no scripts, no links out).
"""

from __future__ import annotations

import base64
import html
import json

from ray_ppu.data.sft.view import RowView

_GREEN, _BLUE, _DIM, _RESET = "\x1b[32m", "\x1b[34m", "\x1b[2m", "\x1b[0m"


def row_header(view: RowView, where: str) -> str:
    packed = f", {len(view.samples)} samples packed" if len(view.samples) > 1 else ""
    return (f"── row {view.row}{where}: {view.length} positions{packed}, {view.trained} trained, "
            f"{view.pad} padding")


def text_lines(view: RowView, where: str = "", colour: bool = False) -> list[str]:
    """The row as text: a header, then each sample with its spans marked."""
    lines = [row_header(view, where)]
    for n, (sample, length) in enumerate(zip(view.samples, view.lengths), 1):
        if len(view.samples) > 1:
            lines.append(f"── sample {n} of {len(view.samples)} ({length} positions)")
        parts = []
        for seg in sample:
            if seg.kind == "trained":
                parts.append(f"{_GREEN}⟦{seg.text}⟧{_RESET}" if colour else f"⟦{seg.text}⟧")
            elif seg.kind == "image":
                parts.append(f"{_BLUE}⟨{seg.text}⟩{_RESET}" if colour else f"⟨{seg.text}⟩")
            else:
                parts.append(seg.text)
        lines += "".join(parts).splitlines() or [""]
    if view.pad:
        lines.append(f"{_DIM}⟨pad × {view.pad}⟩{_RESET}" if colour else f"⟨pad × {view.pad}⟩")
    return lines


def figure_lines(found: dict, source: str) -> list[str]:
    """The corpus's figures, one line each."""
    lines = [f"corpus ({source}):"]
    lines += [f"  {key}: {json.dumps(value, ensure_ascii=False)}" for key, value in found.items()]
    return lines


_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; }
table { border-collapse: collapse; margin-bottom: 1.5em; }
td { padding: 2px 10px; border-bottom: 1px solid #eee; }
.row { border: 1px solid #ccc; border-radius: 6px; padding: 8px 12px; margin: 12px 0; }
.head { font-weight: 600; margin-bottom: 6px; }
.sample { white-space: pre-wrap; font-family: ui-monospace, monospace; font-size: 13px;
          border-left: 3px solid #bbb; padding-left: 8px; margin: 6px 0; }
.context { color: #555; }
.trained { background: #d9f7d9; color: #063; }
.image { background: #dde8ff; color: #123a8a; display: inline-block; padding: 2px 4px; }
.image img { max-height: 96px; display: block; margin-top: 2px; }
.pad { color: #999; font-style: italic; }
"""


def html_page(title: str, found: dict, source: str, views: list[tuple[RowView, str]]) -> str:
    """One self-contained page: the figures, then each row's samples with their spans."""
    esc = html.escape
    out = [f"<!doctype html><html><head><meta charset='utf-8'><title>{esc(title)}</title>"
           f"<style>{_STYLE}</style></head><body><h1>{esc(title)}</h1>",
           f"<p>Figures from {esc(source)}. <span class='trained'>Trained tokens</span>, "
           f"<span class='context'>template and prompt (no loss)</span>, "
           f"<span class='image'>image positions</span>.</p><table>"]
    out += [f"<tr><td>{esc(key)}</td><td>{esc(json.dumps(value, ensure_ascii=False))}</td></tr>"
            for key, value in found.items()]
    out.append("</table>")
    for view, where in views:
        out.append(f"<div class='row'><div class='head'>{esc(row_header(view, where)[3:])}</div>")
        for n, (sample, length) in enumerate(zip(view.samples, view.lengths), 1):
            label = (f"<div class='pad'>sample {n} of {len(view.samples)}, {length} positions</div>"
                     if len(view.samples) > 1 else "")
            out.append(label + "<div class='sample'>" + "".join(_span(seg) for seg in sample)
                       + "</div>")
        if view.pad:
            out.append(f"<div class='pad'>padding × {view.pad}</div>")
        out.append("</div>")
    out.append("</body></html>")
    return "\n".join(out)


def _span(seg) -> str:
    if seg.kind != "image":
        return f"<span class='{seg.kind}'>{html.escape(seg.text)}</span>"
    picture = ""
    if seg.image and seg.image["bytes"]:
        data = base64.b64encode(seg.image["bytes"]).decode()
        picture = f"<img alt='image {seg.image['index'] + 1}' src='data:image;base64,{data}'>"
    return f"<span class='image'>{html.escape(seg.text)}{picture}</span>"
