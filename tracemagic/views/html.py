"""Small HTML fragments (tables, fact lists, bullet lists) with every value escaped.

Used by the dashboard's ``widgets.HTML`` (which sets ``innerHTML``) and the report.
"""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd

from tracemagic.views import tables
from tracemagic.views._format import PLAIN_COLUMNS, esc, fmt_cell, header, shorten, unit_divisor

#: ``dl.tm-facts.tm-facts``: JupyterLab styles every ``dl``/``dt`` in an output (``display: block``,
#: ``dt`` floated at 20% of the width), which would outrank a plain ``.tm-facts`` and put values
#: beside the wrong labels in a narrow notebook
CSS = """
.tm-table{border-collapse:collapse;font:12px/1.35 system-ui,sans-serif;margin:4px 0}
.tm-table th,.tm-table td{padding:2px 8px;border-bottom:1px solid #e5e5e5;text-align:right;white-space:nowrap}
.tm-table th{background:#f5f5f5;position:sticky;top:0;white-space:normal;vertical-align:bottom;
  min-width:3.5em}
.tm-table td.tm-text,.tm-table th.tm-text{text-align:left;max-width:26em;overflow:hidden;text-overflow:ellipsis}
dl.tm-facts.tm-facts{display:grid;grid-template-columns:max-content auto;gap:2px 12px;font:13px system-ui,sans-serif;
  margin:4px 0}
dl.tm-facts.tm-facts>dt{color:#666;float:none;width:auto;padding:0;margin:0}
dl.tm-facts.tm-facts>dd{float:none;width:auto;padding:0;margin:0}
.tm-bullets{font:13px system-ui,sans-serif;margin:4px 0;padding-left:1.3em}
.tm-bullets li{margin:2px 0}
.tm-caption{font:600 13px system-ui,sans-serif;margin:8px 0 2px}
"""


def is_text(series: pd.Series) -> bool:
    """Whether a column shows as left-aligned text."""
    return not pd.api.types.is_numeric_dtype(series) or pd.api.types.is_bool_dtype(series)


def table(frame: pd.DataFrame, *, caption: str = "", max_rows: int | None = None) -> str:
    """``frame`` as an escaped HTML table (``max_rows`` first rows), its headers
    ``_format.header`` of the columns (the column's own name on hover), long text cut
    with the whole value on hover."""
    shown = frame if max_rows is None else frame.head(max_rows)
    text_cols = [is_text(frame[c]) for c in frame.columns]
    head = "".join(
        f'<th class="{"tm-text" if t else ""}" title="{esc(c)}">{esc(header(c))}</th>'
        for c, t in zip(frame.columns, text_cols)
    )
    plain = [str(c) in PLAIN_COLUMNS for c in frame.columns]
    rows = []
    for values in shown.itertuples(index=False, name=None):
        cells = "".join(
            f'<td class="tm-text" title="{esc(fmt_cell(v))}">{esc(fmt_cell(v))}</td>'
            if t
            else f"<td>{esc(fmt_cell(v, p))}</td>"
            for v, t, p in zip(values, text_cols, plain)
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


TREE_CSS = """
.tm-tree{font:12px/1.4 system-ui,sans-serif;border:1px solid #eee;max-height:520px;overflow:auto;min-width:420px}
.tm-tree details>summary{list-style:none;cursor:pointer}
.tm-tree details>summary::-webkit-details-marker{display:none}
.tm-tree .tm-row{display:grid;grid-template-columns:minmax(14em,1fr) repeat(4,5em) 3.5em;gap:0 6px;padding:1px 6px;
  border-bottom:1px solid #f0f0f0;white-space:nowrap}
.tm-tree .tm-row>span{overflow:hidden;text-overflow:ellipsis;text-align:right}
.tm-tree .tm-row>span.tm-name{text-align:left}
.tm-tree .tm-head{font-weight:600;background:#f5f5f5;position:sticky;top:0}
.tm-tree summary .tm-name::before{content:"\\25b8\\00a0";color:#888}
.tm-tree details[open]>summary .tm-name::before{content:"\\25be\\00a0"}
.tm-tree .tm-leaf .tm-name::before{content:"\\00a0\\00a0\\00a0"}
.tm-tree .tm-type{color:#888}
"""


def layer_tree(
    layers: pd.DataFrame,
    *,
    metric: str = "cpu",
    unit: str = "ms",
    rank: int | None = None,
    max_nodes: int = 500,
    open_depth: int = 1,
) -> str:
    """The module hierarchy as an expand/collapse tree table (nested ``<details>``, no script).

    Each row: layer (attribute name, class), total and self time, forward and backward
    time, calls. Children are ordered by total time; the ``max_nodes`` heaviest layers are
    kept with their ancestors. Every name is escaped.

    Args:
        layers: ``trace.layers()``.
        metric: ``cpu`` or ``gpu`` time.
        unit: time unit of the columns.
        rank: the rank shown (default: the lowest).
        max_nodes: the most layers listed.
        open_depth: levels open at first (0: all collapsed).
    """
    if layers is None or layers.empty:
        return '<div class="tm-tree"><i>no layers: record with with_stack=True to see nn.Module names</i></div>'
    total_col, self_col = f"{metric}_us", f"self_{metric}_us"
    fwd_col, bwd_col = f"fwd_{metric}_us", f"bwd_{metric}_us"
    frame, dropped = tables.layer_hierarchy(layers, by=total_col, rank=rank, max_nodes=max_nodes)
    div = unit_divisor(unit)
    children: dict[str, list[dict]] = {}
    for record in frame.sort_values(total_col, ascending=False, kind="stable").to_dict("records"):
        children.setdefault(record["parent"], []).append(record)

    def num(value: object) -> str:
        try:
            v = float(value)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            return ""
        return "" if v != v else f"{v / div:,.3f}"

    def row(record: dict, depth: int) -> str:
        name = record["layer"]
        short = name.rsplit(".", 1)[-1] if record["parent"] and name.startswith(record["parent"] + ".") else name
        kind = record.get("type")
        cells = (
            f'<span class="tm-name" style="padding-left:{1.1 * depth:.1f}em" title="{esc(name)}">'
            f"{esc(shorten(short, 60))}"
            + (
                f' <span class="tm-type" title="{esc(kind)}">{esc(kind)}</span>'
                if isinstance(kind, str) and kind
                else ""
            )
            + "</span>"
            + "".join(f"<span>{num(record.get(c))}</span>" for c in (total_col, self_col, fwd_col, bwd_col))
            + f"<span>{esc(fmt_cell(record.get('calls')))}</span>"
        )
        return f'<div class="tm-row">{cells}</div>'

    def node(record: dict, depth: int) -> str:
        kids = children.get(record["layer"], [])
        if not kids:
            return f'<div class="tm-leaf">{row(record, depth)}</div>'
        inner = "".join(node(k, depth + 1) for k in kids)
        opened = " open" if depth < open_depth else ""
        return f"<details{opened}><summary>{row(record, depth)}</summary>{inner}</details>"

    head = (
        f'<div class="tm-row tm-head"><span class="tm-name">layer</span><span>total {esc(unit)}</span>'
        f"<span>self {esc(unit)}</span><span>fwd {esc(unit)}</span><span>bwd {esc(unit)}</span><span>calls</span></div>"
    )
    body = "".join(node(r, 0) for r in children.get("", []))
    note = f'<div class="tm-caption">{dropped:,} lighter layers not listed</div>' if dropped else ""
    return (
        f"<style>{TREE_CSS}</style>"
        f'<div class="tm-caption">Layer tree ({esc(metric.upper())} time; click a row to expand or collapse)</div>'
        f'<div class="tm-tree">{head}{body}</div>{note}'
    )
