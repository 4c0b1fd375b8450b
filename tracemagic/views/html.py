"""Small HTML fragments (tables, fact lists, bullet lists) with every value escaped.

Used by the dashboard's ``widgets.HTML`` (which sets ``innerHTML``) and the report.
"""

from __future__ import annotations

from typing import Sequence

import pandas as pd

from tracemagic.views._format import esc, fmt_cell

CSS = """
.tm-table{border-collapse:collapse;font:12px/1.35 system-ui,sans-serif;margin:4px 0}
.tm-table th,.tm-table td{padding:2px 8px;border-bottom:1px solid #e5e5e5;text-align:right;white-space:nowrap}
.tm-table th{background:#f5f5f5;position:sticky;top:0;cursor:pointer}
.tm-table td.tm-text,.tm-table th.tm-text{text-align:left;max-width:48em;overflow:hidden;text-overflow:ellipsis}
.tm-facts{display:grid;grid-template-columns:max-content auto;gap:2px 12px;font:13px system-ui,sans-serif;margin:4px 0}
.tm-facts dt{color:#666}.tm-facts dd{margin:0}
.tm-bullets{font:13px system-ui,sans-serif;margin:4px 0;padding-left:1.3em}
.tm-bullets li{margin:2px 0}
.tm-caption{font:600 13px system-ui,sans-serif;margin:8px 0 2px}
"""


def is_text(series: pd.Series) -> bool:
    """Whether a column shows as left-aligned text."""
    return not pd.api.types.is_numeric_dtype(series) or pd.api.types.is_bool_dtype(series)


def table(frame: pd.DataFrame, *, caption: str = "", max_rows: int | None = None) -> str:
    """``frame`` as an escaped HTML table (``max_rows`` first rows)."""
    shown = frame if max_rows is None else frame.head(max_rows)
    text_cols = [is_text(frame[c]) for c in frame.columns]
    head = "".join(f'<th class="{"tm-text" if t else ""}">{esc(c)}</th>' for c, t in zip(frame.columns, text_cols))
    rows = []
    for values in shown.itertuples(index=False, name=None):
        cells = "".join(
            f'<td class="tm-text" title="{esc(fmt_cell(v))}">{esc(fmt_cell(v))}</td>' if t else f"<td>{esc(fmt_cell(v))}</td>"
            for v, t in zip(values, text_cols)
        )
        rows.append(f"<tr>{cells}</tr>")
    cap = f'<div class="tm-caption">{esc(caption)}</div>' if caption else ""
    if not len(frame.columns):
        return cap + "<div><i>no rows</i></div>"
    return f'{cap}<table class="tm-table"><thead><tr>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table>'


def facts(pairs: Sequence[tuple[str, str]]) -> str:
    """(label, value) pairs as an escaped definition list."""
    if not pairs:
        return ""
    items = "".join(f"<dt>{esc(k)}</dt><dd>{esc(v)}</dd>" for k, v in pairs)
    return f'<dl class="tm-facts">{items}</dl>'


def bullets(lines: Sequence[str], caption: str = "") -> str:
    """Lines as an escaped bullet list."""
    if not lines:
        return ""
    cap = f'<div class="tm-caption">{esc(caption)}</div>' if caption else ""
    return cap + '<ul class="tm-bullets">' + "".join(f"<li>{esc(line)}</li>" for line in lines) + "</ul>"


def style() -> str:
    """The ``<style>`` element the fragments rely on."""
    return f"<style>{CSS}</style>"
