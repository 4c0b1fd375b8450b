"""The standalone HTML report: the dashboard's tabs as one self-contained file.

plotly.js is inlined once, at the end of the page: a partial bundle of the trace types the
views draw (``plotly-report.min.js``) where it can draw every figure of the report. Figures
and tables are embedded as escaped JSON, with the plotly template once, and drawn by a few
lines of inline script only when their tab shows: the first tab at once (its text before
plotly.js has loaded), a hidden tab's figures and tables when the tab is opened, so the
first figure waits only for plotly.js and the first tab. A flame graph (the Flame tab's
icicles) is drawn one view at a time: the boxes at least a pixel wide, named where the name
fits, a click drawing the clicked box's view (plotly measures every label it draws). Tables are drawn with
``textContent`` (sort, filter, pages), and a
Content-Security-Policy with a per-file nonce forbids network access and any script the
report did not write itself (an ``onerror=`` smuggled in through a name cannot run even if
escaping were ever missed). The file is written atomically.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import secrets
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd
import plotly.graph_objects as go
from plotly.io.json import to_json_plotly
from plotly.offline import get_plotlyjs, get_plotlyjs_version

from tracemagic._version import __version__
from tracemagic.views import figures, html, sections
from tracemagic.views._format import PLAIN_COLUMNS, esc, header
from tracemagic.views.data import TraceData
from tracemagic.views.flame_search import MATCH_COLOR, OTHER_COLOR

if TYPE_CHECKING:  # pragma: no cover
    from tracemagic.trace import TraceTables

#: rows of one table embedded in the report (the rest is summarized in a note)
MAX_TABLE_ROWS = 5000
PLOTLY_CONFIG = {"displaylogo": False, "responsive": True}
#: plotly.js with only the trace types the views draw (``scripts/build_plotly_bundle.sh``):
#: a fifth of the full bundle's code for the browser to evaluate before the first figure
PARTIAL_PLOTLYJS = Path(__file__).with_name("plotly-report.min.js")
#: the trace types in ``PARTIAL_PLOTLYJS``
PARTIAL_TRACES = frozenset({"scatter", "bar", "heatmap", "icicle", "sunburst"})

_PAGE_CSS = """
body{font:14px system-ui,sans-serif;margin:0;color:#222}
.tm-table th{cursor:pointer}
header{padding:12px 20px;border-bottom:1px solid #ddd;background:#fafafa}
header h1{font-size:18px;margin:0 0 6px}
header .tm-meta{color:#777;font-size:12px}
nav{display:flex;gap:4px;padding:8px 20px 0;border-bottom:1px solid #ddd;position:sticky;top:0;background:#fff;
  z-index:10}
nav button{border:1px solid #ccc;border-bottom:none;background:#f3f3f3;padding:6px 14px;cursor:pointer;
  border-radius:4px 4px 0 0;font:inherit}
nav button.active{background:#fff;font-weight:600}
main{padding:8px 20px 40px}
.tm-section{display:none}.tm-section.active{display:block}
.tm-tablebox{margin-top:8px}
.tm-tools{display:flex;gap:8px;align-items:center;font-size:12px;margin:4px 0}
.tm-tools input{width:220px;padding:2px 6px}
.tm-scroll{max-height:520px;overflow:auto;border:1px solid #eee}
.tm-beside{display:flex;flex-wrap:wrap;gap:12px;align-items:flex-start}
.tm-beside>.tm-main{flex:1 1 480px;min-width:0}.tm-beside>.tm-side{flex:1 1 520px;min-width:460px}
"""

_SCRIPT = """
(function(){
  var CONFIG=__CONFIG__,SEARCH=__SEARCH__;
  function fmt(v,plain){
    if(v===null||v===undefined)return "";
    if(typeof v==="number"){
      if(Number.isInteger(v))return plain?String(v):v.toLocaleString("en-US");
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
      if(f){out=out.filter(function(r){return r.some(function(v,i){
        return spec.text[i]&&v!==null&&String(v).toLowerCase().indexOf(f)>=0;});});}
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
        var th=document.createElement("th");th.title=spec.names[i];
        th.textContent=name+(st.col===i?(st.desc?" \\u25bc":" \\u25b2"):"");
        if(spec.text[i])th.className="tm-text";
        th.addEventListener("click",function(){if(st.col===i){st.desc=!st.desc;}else{st.col=i;st.desc=!spec.text[i];}st.page=0;render();});
        tr.appendChild(th);});
      var thead=document.createElement("thead");thead.appendChild(tr);table.appendChild(thead);
      var tbody=document.createElement("tbody");
      all.slice(st.page*st.size,(st.page+1)*st.size).forEach(function(r){
        var row=document.createElement("tr");
        r.forEach(function(v,i){var td=document.createElement("td");td.textContent=fmt(v,spec.plain[i]);
          if(spec.text[i]){td.className="tm-text";td.title=fmt(v);}row.appendChild(td);});
        tbody.appendChild(row);});
      table.appendChild(tbody);wrap.replaceChildren(table);
      info.textContent=all.length.toLocaleString("en-US")+" rows"+
        (all.length!==spec.rows.length?" (of "+spec.rows.length.toLocaleString("en-US")+")":"")+
        (spec.total>spec.rows.length?", first "+spec.rows.length.toLocaleString("en-US")+
          " of "+spec.total.toLocaleString("en-US")+" kept":"")+
        " \\u00b7 page "+(st.page+1)+"/"+pages;
      prev.disabled=st.page===0;next.disabled=st.page>=pages-1;
    }
    input.addEventListener("input",function(){st.filter=input.value;st.page=0;render();});
    size.addEventListener("change",function(){st.size=parseInt(size.value,10);st.page=0;render();});
    prev.addEventListener("click",function(){st.page-=1;render();});
    next.addEventListener("click",function(){st.page+=1;render();});
    render();
  }
  function initTables(sec){
    sec.querySelectorAll(".tm-tablebox:not(.tm-ready)").forEach(function(box){box.classList.add("tm-ready");initTable(box);});
  }
  // figures are drawn when their tab shows, one at a time (a frame painted between two);
  // then=what to draw after this section's figures (the open tab after the header's strip)
  function drawNext(sec,then){
    if(!window.Plotly||!(sec.classList.contains("active")||sec.classList.contains("tm-always"))){if(then)then();return;}
    var box=sec.querySelector(".tm-figure:not(.tm-drawn)");
    if(!box){if(then)then();return;}
    box.classList.add("tm-drawn");
    var div=box.querySelector(".plotly-graph-div"),
      next=function(){requestAnimationFrame(function(){setTimeout(function(){drawNext(sec,then);},0);});};
    try{
      var spec=JSON.parse(box.querySelector("script.tm-fig").textContent);
      if(spec.template!==null)spec.layout.template=JSON.parse(document.getElementById("tm-template-"+spec.template).textContent);
      Promise.resolve(div.id.indexOf("fig-flame-")===0?flamePlot(div,spec):Plotly.newPlot(div,spec.data,spec.layout,CONFIG))
        .then(function(){initSearch(box,div);next();},function(e){fail(div,e);next();});
    }catch(e){fail(div,e);next();}
  }
  // the flame graph (views.figures.flame): plotly's icicle draws every box it is given and
  // measures every label it draws (a forced layout each, about a millisecond), so each view gives
  // it the boxes at least FLAME.box px wide (a narrower box's time stays in its parent's width, as
  // its parent's remainder) and names the boxes whose label fits at FLAME.font px or more; a click
  // on a box (or on the bar above) draws that box's view, as plotly's own zoom would
  var FLAME={box:1,font:4,pad:3};
  var ESC={"&amp;":"&","&lt;":"<","&gt;":">","&quot;":'"',"&#34;":'"',"&#x27;":"'","&#39;":"'"};
  function unescape(t){
    t=String(t);return t.indexOf("&")<0?t:t.replace(/&(amp|lt|gt|quot|#34|#x27|#39);/g,function(m){return ESC[m];});
  }
  function decoded(v){  // plotly.py writes numeric arrays as base64 (bdata)
    if(!v||!v.bdata)return v||[];
    var T={f8:Float64Array,f4:Float32Array,i4:Int32Array,u4:Uint32Array,i2:Int16Array,u2:Uint16Array,
      i1:Int8Array,u1:Uint8Array}[v.dtype];
    var b=atob(v.bdata),u=new Uint8Array(b.length);for(var i=0;i<b.length;i++)u[i]=b.charCodeAt(i);
    var a=Array.prototype.slice.call(new T(u.buffer)),shape=String(v.shape||"").split(",").map(Number);
    if(shape.length<2)return a;
    var rows=[];for(i=0;i<shape[0];i++)rows.push(a.slice(i*shape[1],(i+1)*shape[1]));return rows;
  }
  function Flame(div,spec,ti){
    var t=spec.data[ti],n=t.ids.length,custom=decoded(t.customdata),at={},up=[],kids=[],roots=[],i,k;
    var own=decoded(t.values),colors=decoded(t.marker&&t.marker.colors),tot=own.slice();
    // what the search looks in (views.flame_search.searched_text): the label, and the full name and
    // the kind the hover shows (a frame's file, a module box's torch name: module BertLayer_0)
    var labels=(t.labels||[]).map(unescape),lower=labels.map(function(l,j){
      var c=custom[j]||[],more=[c[0],c[1]].filter(function(v){return v!=null;});
      return [l].concat(more.map(function(v){return unescape(String(v));})).join("\\n").toLowerCase();});
    for(i=0;i<n;i++){at[t.ids[i]]=i;kids.push([]);}
    for(i=0;i<n;i++){k=t.parents[i] in at?at[t.parents[i]]:-1;up.push(k);(k<0?roots:kids[k]).push(i);}
    var order=[],stack=roots.slice();  // parents before children; totals summed children first
    while(stack.length){k=stack.pop();order.push(k);for(i=0;i<kids[k].length;i++)stack.push(kids[k][i]);}
    for(i=order.length-1;i>=0;i--){k=order[i];if(up[k]>=0)tot[up[k]]+=tot[k];}
    var font=((spec.layout||{}).font)||{},size=font.size||12,width={};
    var ctx=document.createElement("canvas").getContext("2d");
    ctx.font=size+"px "+(font.family||'"Open Sans", verdana, arial, sans-serif');
    var st={level:-1,query:""};
    function textWidth(i){if(!(i in width))width[i]=ctx.measureText(labels[i]).width;return width[i];}
    // the arrays plotly draws for the view of box e (-1: the whole tree), w px wide
    function view(e,w){
      var all=e<0?roots.reduce(function(a,r){return a+tot[r];},0):tot[e],px=all>0?w/all:0;
      var keep=new Uint8Array(n),q=st.query;
      for(k=e<0?-1:up[e];k>=0;k=up[k])keep[k]=2;  // ancestors: the bar above
      var todo=e<0?roots.slice():[e];
      while(todo.length){k=todo.pop();if(k!==e&&tot[k]*px<FLAME.box)continue;keep[k]=1;for(i=0;i<kids[k].length;i++)todo.push(kids[k][i]);}
      var idx=[];for(i=0;i<n;i++)if(keep[i])idx.push(i);
      var out={ids:[],parents:[],labels:[],values:[],customdata:[],text:[],colors:[]};
      idx.forEach(function(i){
        var v=own[i];kids[i].forEach(function(c){if(!keep[c])v+=tot[c];});
        var room=tot[i]*px-2*FLAME.pad,fits=keep[i]===1&&room>0&&size*Math.min(1,room/textWidth(i))>=FLAME.font;
        out.ids.push(t.ids[i]);out.parents.push(t.parents[i]);out.labels.push(t.labels[i]);out.values.push(v);
        out.customdata.push(custom[i]);out.text.push(fits?t.labels[i]:"");
        out.colors.push(q?(lower[i].indexOf(q)>=0?SEARCH[0]:SEARCH[1]):colors[i]);
      });
      var marker=Object.assign({},t.marker,{colors:out.colors});if(q)marker.showscale=false;
      return {trace:Object.assign({},t,{ids:out.ids,parents:out.parents,labels:out.labels,values:out.values,
        customdata:out.customdata,text:out.text,textinfo:"text",marker:marker,level:e<0?"":t.ids[e]}),idx:idx};
    }
    var shown=[],drawnWidth=0;
    function data(){
      var L=div._fullLayout,m=(spec.layout||{}).margin||{};
      var w=L&&L._size?L._size.w:div.getBoundingClientRect().width-(m.l==null?80:m.l)-(m.r==null?80:m.r);
      var v=view(st.level,Math.max(w,1));shown=v.idx;drawnWidth=w;
      return spec.data.map(function(x,j){return j===ti?v.trace:x;});
    }
    this.plot=function(){return Plotly.newPlot(div,data(),spec.layout,CONFIG);};
    this.draw=function(){return Plotly.react(div,data(),div.layout);};
    // the page resized the figure (plotly's responsive config): the view of the new width
    this.resized=function(){var L=div._fullLayout;if(L&&L._size&&Math.abs(L._size.w-drawnWidth)>0.5)this.draw();};
    // the box clicked: its view; the box at the top of the view: its parent's
    this.click=function(ev){
      var p=ev&&ev.points&&ev.points[0];if(!p||p.curveNumber!==ti)return;
      var i=p.pointNumber==null?-1:shown[p.pointNumber];if(i===undefined)return false;
      st.level=i===st.level?up[i]:i;
      if(st.level>=0&&up[st.level]<0&&roots.length===1)st.level=-1;  // the root: the whole tree
      this.draw();return false;
    };
    // the search box's text: every box holding it coloured; how many boxes of the whole tree hold it
    this.search=function(q){
      st.query=q;this.draw();return q?lower.filter(function(l){return l.indexOf(q)>=0;}).length:0;
    };
  }
  function flamePlot(div,spec){
    var ti=-1;spec.data.forEach(function(t,j){if(t.type==="icicle"&&ti<0)ti=j;});
    if(ti<0||!spec.data[ti].ids)return Plotly.newPlot(div,spec.data,spec.layout,CONFIG);
    var f=div.tmFlame=new Flame(div,spec,ti);
    return Promise.resolve(f.plot()).then(function(){
      div.on("plotly_icicleclick",function(ev){return f.click(ev);});
      div.on("plotly_relayout",function(){f.resized();});
    });
  }
  // the flame graph's search box (views.flame_search): matching boxes highlighted, the others greyed
  function initSearch(box,div){
    var input=box.querySelector("input.tm-flame-search");if(!input||!div.tmFlame)return;
    var hits=box.querySelector(".tm-flame-hits");
    input.addEventListener("input",function(){
      var q=input.value.trim().toLowerCase(),n=div.tmFlame.search(q);
      hits.textContent=q?n.toLocaleString("en-US")+" boxes match":"";
    });
  }
  function fail(div,e){div.textContent="This figure could not be drawn: "+e;div.style.height="auto";}
  function show(key){
    document.querySelectorAll(".tm-section").forEach(function(s){s.classList.toggle("active",s.id==="tab-"+key);});
    document.querySelectorAll("nav button").forEach(function(b){b.classList.toggle("active",b.dataset.tab===key);});
    var sec=document.getElementById("tab-"+key);
    if(!sec)return;
    initTables(sec);
    if(window.Plotly){sec.querySelectorAll(".js-plotly-plot").forEach(function(p){Plotly.Plots.resize(p);});}
    drawNext(sec);
  }
  // the figures always shown (the header's iteration strip), then the open tab's: one figure per frame
  window.tmDrawActive=function(){
    var active=function(){var sec=document.querySelector(".tm-section.active");if(sec)drawNext(sec);},
      strip=document.querySelector(".tm-always");
    if(strip)drawNext(strip,active);else active();
  };
  document.querySelectorAll("nav button").forEach(function(b){
    b.addEventListener("click",function(){show(b.dataset.tab);});});
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
    return _script_safe(json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":")))


def table_block(frame: pd.DataFrame, caption: str, nonce: str) -> str:
    """A sortable, filterable, paginated table: escaped JSON rows + toolbar."""
    total = len(frame)
    kept = frame.head(MAX_TABLE_ROWS)
    spec = {
        "columns": [header(c) for c in kept.columns],
        "names": [str(c) for c in kept.columns],
        "plain": [str(c) in PLAIN_COLUMNS for c in kept.columns],
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


class Figures:
    """The report's figures as JSON data for the page's script, drawn when their tab shows.

    Each figure is a ``<div>`` sized to the figure's height (so the page does not move when
    it is drawn) beside its ``{"data", "layout", "template"}`` as escaped JSON; the plotly
    template (``figures.TEMPLATE``, ~10 KB; figures do not carry it) is written once, not once
    per figure.
    """

    def __init__(self, nonce: str) -> None:
        self.nonce = nonce
        self.templates: dict[str, int] = {}  # JSON text -> index (one: figures.TEMPLATE)
        #: the trace types of the figures written so far
        self.types: set[str] = set()

    def block(self, fig: go.Figure, div_id: str) -> str:
        """One figure: its placeholder ``<div>`` and its JSON (drawn when its tab shows)."""
        spec = fig.to_plotly_json()
        layout = spec.get("layout") or {}
        layout.pop("template", None)  # plotly's default, added when serializing a figure that has none
        index = self.templates.setdefault(_script_safe(figures.template_json()), len(self.templates))
        self.types.update(str(trace.get("type") or "scatter") for trace in spec.get("data") or ())
        height = layout.get("height") or 450
        data = _script_safe(to_json_plotly({"data": spec.get("data") or [], "layout": layout, "template": index}))
        search = (
            (
                '<div class="tm-tools"><input class="tm-flame-search" type="search" placeholder="search boxes…">'
                '<span class="tm-flame-hits"></span></div>'
            )
            if any((t.get("type") == "icicle") for t in spec.get("data") or ()) and div_id.startswith("fig-flame-")
            else ""
        )
        return (
            f'<div class="tm-figure">{search}<div id="{esc(div_id)}" class="plotly-graph-div" '
            f'style="height:{float(height):g}px;width:100%"></div>'
            f'<script type="application/json" class="tm-fig" nonce="{self.nonce}">{data}</script></div>'
        )

    def template_blocks(self) -> str:
        """The templates the figures refer to, once each."""
        return "".join(
            f'<script type="application/json" id="tm-template-{i}" nonce="{self.nonce}">{text}</script>'
            for text, i in self.templates.items()
        )


def plotly_js(types: set[str]) -> str:
    """The plotly.js to inline for figures of these trace types: the partial bundle where it
    draws them all and is the plotly.js version the installed plotly writes figures for,
    else plotly's full bundle."""
    partial = _partial_plotlyjs()
    return partial if partial and types <= PARTIAL_TRACES else get_plotlyjs()


@functools.lru_cache(maxsize=1)
def _partial_plotlyjs() -> str | None:
    try:
        text = PARTIAL_PLOTLYJS.read_text(encoding="utf-8")
    except OSError:
        return None
    version = re.match(r"/\*! plotly\.js v(\S+) ", text)
    return text if version and version.group(1) == get_plotlyjs_version() else None


def _script_safe(json_text: str) -> str:
    """JSON text safe inside a ``<script>`` element (``<``, ``>``, ``&`` occur only in strings)."""
    for raw, safe in (
        ("<", "\\u003c"),
        (">", "\\u003e"),
        ("&", "\\u0026"),
        ("\u2028", "\\u2028"),
        ("\u2029", "\\u2029"),
    ):
        json_text = json_text.replace(raw, safe)
    return json_text


def render(
    data: TraceData,
    *,
    other: TraceData | None = None,
    title: str | None = None,
    state: sections.ViewState | None = None,
    other_before: bool = False,
) -> str:
    """The report's HTML text (see :func:`write_report`)."""
    state = state or sections.ViewState()
    nonce = secrets.token_urlsafe(16)
    title = title or (f"{data.name} vs {other.name}" if other else data.name)
    keys = sections.available(data, other)
    nav, body = [], []
    blocks = Figures(nonce)
    strip = ""
    if not data.summaries_only and not data.iterations.empty:  # every iteration of the loop, atop the report
        strip = f'<div class="tm-always">{blocks.block(figures.iteration_strip(data.iterations), "fig-strip")}</div>'
    for key in keys:
        try:
            section = sections.build(key, data, state, other, other_before=other_before)
        except Exception as exc:  # noqa: BLE001 - one failed view must not lose the report
            section = sections.Section(
                key, sections.TITLES[key], bullets=[f"This view failed: {type(exc).__name__}: {exc}"]
            )
        parts = [
            html.facts(section.facts),
            html.bullets(section.bullets, "Recommendations" if key == "overview" else ""),
        ]
        for i, fig in enumerate(section.figures):
            block = blocks.block(fig, f"fig-{key}-{i}")
            if i == 0 and section.side:  # the side panel (the Layers tab's tree table) beside the first figure
                block = (
                    f'<div class="tm-beside"><div class="tm-main">{block}</div>'
                    f'<div class="tm-side">{section.side}</div></div>'
                )
            parts.append(block)
        if len(section.table.columns):
            parts.append(table_block(section.table, section.table_title, nonce))
        parts += [table_block(frame, caption, nonce) for caption, frame in section.extra]  # each with its own filter
        nav.append(f'<button type="button" data-tab="{key}">{esc(section.title)}</button>')
        body.append(f'<section class="tm-section" id="tab-{key}">{"".join(parts)}</section>')
    csp = (
        "default-src 'none'; "
        f"script-src 'nonce-{nonce}' 'unsafe-eval'; "
        "style-src 'unsafe-inline'; img-src data: blob:; font-src data:; connect-src 'none'; "
        "base-uri 'none'; form-action 'none'"
    )
    stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    script = _SCRIPT.replace("__CONFIG__", script_json(PLOTLY_CONFIG)).replace(
        "__SEARCH__", script_json([MATCH_COLOR, OTHER_COLOR])
    )
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f'<meta http-equiv="Content-Security-Policy" content="{csp}">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>tracemagic · {esc(title)}</title>"
        f"<style>{_PAGE_CSS}{html.CSS}</style></head><body>"
        f'<header><h1>tracemagic · {esc(title)}</h1><div class="tm-meta">tracemagic {esc(__version__)} · {stamp}'
        f" · self-contained report (no network)</div>{strip}</header>"
        f"<nav>{''.join(nav)}</nav><main>{''.join(body)}</main>{blocks.template_blocks()}"
        # the first tab's text and tables show before plotly.js (the largest part of the file) runs
        f'<script nonce="{nonce}">{script}</script>'
        f'<script nonce="{nonce}">window.PlotlyConfig={{MathJaxConfig:"local"}};</script>'
        f'<script nonce="{nonce}" charset="utf-8">{plotly_js(blocks.types)}</script>'
        f'<script nonce="{nonce}">window.tmDrawActive();</script></body></html>\n'
    )


def write_report(
    trace: TraceTables | TraceData,
    path: str | os.PathLike[str],
    *,
    other: TraceTables | TraceData | None = None,
    title: str | None = None,
    other_before: bool = False,
) -> Path:
    """Write the standalone HTML report of ``trace`` (compared with ``other`` if given).

    Args:
        trace: a loaded ``Trace`` (or a dashboard's ``TraceData``).
        path: the ``.html`` file to write; its folder is created if needed.
        other: a second trace for the Compare tab (``trace`` is A, ``other`` is B).
        title: the heading (default: the file name(s)).
        other_before: ``other`` is the earlier run (a capture's ``--vs``): the Compare tab
            takes it as A and ``trace`` as B (``sections.build``).

    Returns:
        The path written (absolute).

    Raises:
        OSError: the file cannot be written (the old file, if any, is left intact).
    """
    data = trace if isinstance(trace, TraceData) else TraceData(trace)
    other_data = None if other is None else other if isinstance(other, TraceData) else TraceData(other)
    target = Path(path).expanduser().absolute()
    if target.is_dir():  # an empty name in the dashboard's box is the current folder
        raise IsADirectoryError(f"{target} is a folder: give the report a file name, such as {target / 'report.html'}")
    target.parent.mkdir(parents=True, exist_ok=True)
    text = render(data, other=other_data, title=title, other_before=other_before)
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
