"""Payload of the dashboard and the HTML report against the size of the trace.

The views aggregate (top-K events per timeline lane plus busy bins, min/max-preserving
memory curves, tables aggregated by name and paginated in Python), so what reaches the
browser should stay at a few MB whatever the trace size. This prints, per trace: trace
bytes and events, load and build times, the widget state a saved notebook would hold
(total and per tab), the Timeline's zoom (time to redraw a window and its figure's size),
and the report's bytes with and without the inlined plotly.js.

Usage: ``.venv/bin/python bench/bench_dashboard_payload.py [TRACE ...]``. Without
arguments: the biggest ``bench/out/*.json`` (from ``bench/make_traces.py``), else
``../shared/traces/hta_control.json.gz``.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import tracemagic  # noqa: E402
from tracemagic.views.dashboard import Dashboard  # noqa: E402
from tracemagic.views.report import write_report  # noqa: E402
from tracemagic.views.text import summary  # noqa: E402

SHARED = HERE.parent.parent / "shared" / "traces"
if not SHARED.is_dir():
    SHARED = Path("/work/shared/traces")


def default_traces() -> list[Path]:
    generated = sorted((HERE / "out").glob("*.json"), key=lambda p: p.stat().st_size)
    return [generated[-1]] if generated else [SHARED / "hta_control.json.gz"]


def mib(n: float) -> str:
    return f"{n / 2**20:8.2f} MiB"


def bench(path: Path) -> dict[str, float]:
    from plotly.offline import get_plotlyjs
    from ipywidgets.embed import dependency_state

    size = sum(p.stat().st_size for p in path.rglob("*")) if path.is_dir() else path.stat().st_size
    print(f"\n{path.name}: {mib(size)} on disk")
    t = time.perf_counter()
    trace = tracemagic.load(path)
    load_s = time.perf_counter() - t
    print(f"  load            {load_s:7.1f} s   {len(trace.events):,} events, {len(trace.rank_ids)} rank(s)")

    t = time.perf_counter()
    dash = Dashboard(trace, force_widget=True)
    dash.render_all()
    build_s = time.perf_counter() - t
    state = dash.widget_state_bytes()
    print(f"  dashboard build {build_s:7.1f} s   (analyses included)")
    print(f"  widget state    {mib(state)}   ({100 * state / size:.3f}% of the trace)")
    for key in dash.keys:
        box = dash._tabs[key]["box"]
        tab_bytes = len(json.dumps(dependency_state(box, drop_defaults=True)).encode())
        print(f"    {key:<12}  {mib(tab_bytes)}")

    zoom = dash.zoomable("timeline")
    if zoom is not None:
        # the Timeline is a FigureWidget: its anywidget ESM (plotly.js) is sent once per
        # dashboard when displayed live; a zoom redraws only the visible window
        esm = len(str(zoom.widget._esm).encode())
        print(f"  timeline widget ESM (live, once) {mib(esm)}")
        lo, hi = zoom.base
        for fraction in (0.5, 0.01, 0.0001):
            end = (lo - zoom.origin + fraction * (hi - lo)) / zoom.div
            t = time.perf_counter()
            zoom.set_range(0.0, end)
            meta = zoom.widget.layout.meta
            spec = len(json.dumps(dash.figures("timeline")[0]).encode())
            print(f"  zoom to {fraction:>7.2%}  {time.perf_counter() - t:6.2f} s   {meta['shown']:,} of "
                  f"{meta['total']:,} events drawn, figure {mib(spec)}")

    t = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        report = write_report(dash.data, Path(tmp) / "report.html")
        report_bytes = report.stat().st_size
    report_s = time.perf_counter() - t
    plotly_js = len(get_plotlyjs().encode())
    print(f"  report          {mib(report_bytes)}   ({mib(report_bytes - plotly_js)} without plotly.js), {report_s:.1f} s")

    t = time.perf_counter()
    text = summary(dash.data)
    print(f"  text summary    {len(text.encode()):8,d} B     {time.perf_counter() - t:.2f} s")
    return {"trace": size, "state": state, "report": report_bytes, "load_s": load_s, "build_s": build_s}


def main(argv: list[str]) -> None:
    warnings.simplefilter("ignore")
    paths = [Path(a) for a in argv] or default_traces()
    for path in paths:
        bench(path)


if __name__ == "__main__":
    main(sys.argv[1:])
