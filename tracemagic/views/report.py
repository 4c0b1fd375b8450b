"""The standalone HTML report: the dashboard's tabs as one self-contained file.

plotly.js is inlined once, tables are embedded as escaped JSON and drawn with
``textContent`` by a few lines of inline script (sort, filter, pages), and a
Content-Security-Policy with a per-file nonce forbids network access and any script the
report did not write itself (an ``onerror=`` smuggled in through a name cannot run even if
escaping were ever missed). The file is written atomically.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd
import plotly.graph_objects as go
import plotly.io as pio

from tracemagic._version import __version__
from tracemagic.views import figures, html, sections
from tracemagic.views._format import esc
from tracemagic.views.data import TraceData

if TYPE_CHECKING:  # pragma: no cover
    from tracemagic.trace import Trace

#: rows of one table embedded in the report (the rest is summarized in a note)
MAX_TABLE_ROWS = 5000
PLOTLY_CONFIG = {"displaylogo": False, "responsive": True}

_PAGE_CSS = """
body{font:14px system-ui,sans-serif;margin:0;color:#222}
header{padding:12px 20px;border-bottom:1px solid #ddd;background:#fafafa}
header h1{font-size:18px;margin:0 0 6px}
header .tm-meta{color:#777;font-size:12px}
nav{display:flex;gap:4px;padding:8px 20px 0;border-bottom:1px solid #ddd;position:sticky;top:0;background:#fff;z-index:10}
nav button{border:1px solid #ccc;border-bottom:none;background:#f3f3f3;padding:6px 14px;cursor:pointer;border-radius:4px 4px 0 0;font:inherit}
nav button.active{background:#fff;font-weight:600}
main{padding:8px 20px 40px}
.tm-section{display:none}.tm-section.active{display:block}
.tm-tablebox{margin-top:8px}
.tm-tools{display:flex;gap:8px;align-items:center;font-size:12px;margin:4px 0}
.tm-tools input{width:220px;padding:2px 6px}
.tm-scroll{max-height:520px;overflow:auto;border:1px solid #eee}
.tm-beside{display:flex;flex-wrap:wrap;gap:12px;align-items:flex-start}
.tm-beside>.tm-main{flex:3 1 520px;min-width:0}.tm-beside>.tm-side{flex:2 1 380px;min-width:0}
"""

_SCRIPT = """
(function(){
  function fmt(v){
    if(v===null||v===undefined)return "";
    if(typeof v==="number"){
      if(Number.isInteger(v))return v.toLocaleString("en-US");
      return v.toLocaleString("en-US",{maximumFractionDigits:Math.abs(v)<100?3:1});
    }
    if(typeof v==="boolean")return v?"yes":"";
    return String(v);
  }
  function initTable(box){
    var spec=JSON.parse(box.querySelector("script.tm-data").textContent);
    var st={filter:"",col:-1,desc:true,page:0,size:25};
    var input=box.querySelector("input.tm-filter"),info=box.querySelector(".tm-info");
    var prev=box.querySelector("button.tm-prev"),next=box.querySelector("button.tm-next");
    var size=box.querySelector("select.tm-size"),wrap=box.querySelector(".tm-scroll");
    function rows(){
      var f=st.filter.toLowerCase(),out=spec.rows;
      if(f){out=out.filter(function(r){return r.some(function(v,i){return spec.text[i]&&v!==null&&String(v).toLowerCase().indexOf(f)>=0;});});}
      if(st.col>=0){var c=st.col,d=st.desc?-1:1;out=out.slice().sort(function(a,b){
        var x=a[c],y=b[c];if(x===y)return 0;if(x===null)return 1;if(y===null)return -1;return (x<y?-1:1)*d;});}
      return out;
    }
    function render(){
      var all=rows(),pages=Math.max(1,Math.ceil(all.length/st.size));
      st.page=Math.min(st.page,pages-1);
      var table=document.createElement("table");table.className="tm-table";
      var tr=document.createElement("tr");
      spec.columns.forEach(function(name,i){
        var th=document.createElement("th");th.textContent=name+(st.col===i?(st.desc?" \\u25bc":" \\u25b2"):"");
        if(spec.text[i])th.className="tm-text";
        th.addEventListener("click",function(){if(st.col===i){st.desc=!st.desc;}else{st.col=i;st.desc=!spec.text[i];}st.page=0;render();});
        tr.appendChild(th);});
      var thead=document.createElement("thead");thead.appendChild(tr);table.appendChild(thead);
      var tbody=document.createElement("tbody");
      all.slice(st.page*st.size,(st.page+1)*st.size).forEach(function(r){
        var row=document.createElement("tr");
        r.forEach(function(v,i){var td=document.createElement("td");td.textContent=fmt(v);
          if(spec.text[i]){td.className="tm-text";td.title=fmt(v);}row.appendChild(td);});
        tbody.appendChild(row);});
      table.appendChild(tbody);wrap.replaceChildren(table);
      info.textContent=all.length.toLocaleString("en-US")+" rows"+(all.length!==spec.rows.length?" (of "+spec.rows.length.toLocaleString("en-US")+")":"")+
        (spec.total>spec.rows.length?", first "+spec.rows.length.toLocaleString("en-US")+" of "+spec.total.toLocaleString("en-US")+" kept":"")+
        " \\u00b7 page "+(st.page+1)+"/"+pages;
      prev.disabled=st.page===0;next.disabled=st.page>=pages-1;
    }
    input.addEventListener("input",function(){st.filter=input.value;st.page=0;render();});
    size.addEventListener("change",function(){st.size=parseInt(size.value,10);st.page=0;render();});
    prev.addEventListener("click",function(){st.page-=1;render();});
    next.addEventListener("click",function(){st.page+=1;render();});
    render();
  }
  function show(key){
    document.querySelectorAll(".tm-section").forEach(function(s){s.classList.toggle("active",s.id==="tab-"+key);});
    document.querySelectorAll("nav button").forEach(function(b){b.classList.toggle("active",b.dataset.tab===key);});
    var sec=document.getElementById("tab-"+key);
    if(window.Plotly&&sec){sec.querySelectorAll(".js-plotly-plot").forEach(function(p){Plotly.Plots.resize(p);});}
  }
  document.querySelectorAll(".tm-tablebox").forEach(initTable);
  document.querySelectorAll("nav button").forEach(function(b){b.addEventListener("click",function(){show(b.dataset.tab);});});
  var first=document.querySelector("nav button");if(first)show(first.dataset.tab);
})();
"""


def _json_value(value: Any) -> Any:
    if value is None or value is pd.NA:
        return None
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return None
    if hasattr(value, "item"):  # numpy scalars
        return _json_value(value.item())
    if isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def script_json(obj: Any) -> str:
    """JSON safe inside a ``<script>`` element: ``<``, ``>``, ``&`` and line separators escaped."""
    text = json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    for raw, safe in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"), ("\u2028", "\\u2028"), ("\u2029", "\\u2029")):
        text = text.replace(raw, safe)
    return text


def table_block(frame: pd.DataFrame, caption: str, nonce: str) -> str:
    """A sortable, filterable, paginated table: escaped JSON rows + toolbar."""
    total = len(frame)
    kept = frame.head(MAX_TABLE_ROWS)
    spec = {
        "columns": [str(c) for c in kept.columns],
        "text": [html.is_text(kept[c]) for c in kept.columns],
        "rows": [[_json_value(v) for v in row] for row in kept.itertuples(index=False, name=None)],
        "total": total,
    }
    sizes = "".join(f'<option value="{n}"{" selected" if n == 25 else ""}>{n}</option>' for n in (10, 25, 50, 100, 500))
    return (
        f'<div class="tm-tablebox"><div class="tm-caption">{esc(caption)}</div>'
        '<div class="tm-tools"><input class="tm-filter" type="search" placeholder="filter rows…">'
        f'<label>rows <select class="tm-size">{sizes}</select></label>'
        '<button class="tm-prev" type="button">◀</button><button class="tm-next" type="button">▶</button>'
        '<span class="tm-info"></span></div><div class="tm-scroll"></div>'
        f'<script class="tm-data" type="application/json" nonce="{nonce}">{script_json(spec)}</script></div>'
    )


def figure_block(fig: go.Figure, div_id: str, nonce: str, *, include_plotlyjs: bool) -> str:
    """One figure as a ``<div>`` + its script (plotly.js inlined when asked), nonce'd."""
    fragment = pio.to_html(
        fig, full_html=False, include_plotlyjs=include_plotlyjs, include_mathjax=False,
        div_id=div_id, config=PLOTLY_CONFIG, validate=False,
    )
    # plotly writes the figure as JSON with < > / escaped, so the only <script tags here are its own
    return fragment.replace("<script", f'<script nonce="{nonce}"')


def render(data: TraceData, *, other: TraceData | None = None, title: str | None = None,
           state: sections.ViewState | None = None) -> str:
    """The report's HTML text (see :func:`write_report`)."""
    state = state or sections.ViewState()
    nonce = secrets.token_urlsafe(16)
    title = title or (f"{data.name} vs {other.name}" if other else data.name)
    keys = sections.available(data, other)
    nav, body = [], []
    plotly_included = False
    strip = ""
    if not data.summaries_only and not data.iterations.empty:  # every iteration of the loop, atop the report
        strip = figure_block(figures.iteration_strip(data.iterations), "fig-strip", nonce, include_plotlyjs=True)
        plotly_included = True
    for key in keys:
        try:
            section = sections.build(key, data, state, other)
        except Exception as exc:  # noqa: BLE001 - one failed view must not lose the report
            section = sections.Section(key, sections.TITLES[key], bullets=[f"This view failed: {type(exc).__name__}: {exc}"])
        parts = [html.facts(section.facts), html.bullets(section.bullets, "Recommendations" if key == "overview" else "")]
        for i, fig in enumerate(section.figures):
            block = figure_block(fig, f"fig-{key}-{i}", nonce, include_plotlyjs=not plotly_included)
            if i == 0 and section.side:  # the side panel (the Layers tab's tree table) beside the first figure
                block = f'<div class="tm-beside"><div class="tm-main">{block}</div><div class="tm-side">{section.side}</div></div>'
            parts.append(block)
            plotly_included = True
        if len(section.table.columns):
            parts.append(table_block(section.table, section.table_title, nonce))
        parts += [html.table(frame, caption=caption, max_rows=50) for caption, frame in section.extra]
        nav.append(f'<button type="button" data-tab="{key}">{esc(section.title)}</button>')
        body.append(f'<section class="tm-section" id="tab-{key}">{"".join(parts)}</section>')
    csp = (
        "default-src 'none'; "
        f"script-src 'nonce-{nonce}' 'unsafe-eval'; "
        "style-src 'unsafe-inline'; img-src data: blob:; font-src data:; connect-src 'none'; "
        "base-uri 'none'; form-action 'none'"
    )
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        f'<meta http-equiv="Content-Security-Policy" content="{csp}">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>tracemagic · {esc(title)}</title>"
        f"<style>{_PAGE_CSS}{html.CSS}</style></head><body>"
        f'<header><h1>tracemagic · {esc(title)}</h1><div class="tm-meta">tracemagic {esc(__version__)} · {stamp}'
        f" · self-contained report (no network)</div>{strip}</header>"
        f"<nav>{''.join(nav)}</nav><main>{''.join(body)}</main>"
        f'<script nonce="{nonce}">{_SCRIPT}</script></body></html>\n'
    )


def write_report(
    trace: Trace | TraceData,
    path: str | os.PathLike[str],
    *,
    other: Trace | TraceData | None = None,
    title: str | None = None,
) -> Path:
    """Write the standalone HTML report of ``trace`` (compared with ``other`` if given).

    Args:
        trace: a loaded ``Trace`` (or a dashboard's ``TraceData``).
        path: the ``.html`` file to write; its folder is created if needed.
        other: a second trace for the Compare tab (``trace`` is A, ``other`` is B).
        title: the heading (default: the file name(s)).

    Returns:
        The path written (absolute).

    Raises:
        OSError: the file cannot be written (the old file, if any, is left intact).
    """
    data = trace if isinstance(trace, TraceData) else TraceData(trace)
    other_data = None if other is None else other if isinstance(other, TraceData) else TraceData(other)
    target = Path(path).expanduser().absolute()
    target.parent.mkdir(parents=True, exist_ok=True)
    text = render(data, other=other_data, title=title)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target
