"""The HTML report and the dashboard's HTML in a real browser (Debian's chromium driven by
Playwright, one for the module: ``conftest.browser``): every tab's figure renders, no console
errors, no network, screenshots kept in ``conftest.ARTIFACTS`` (a temporary folder), and
trace strings carrying ``<script>``/``onerror=`` run nothing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import conftest
from conftest import TRACES

import tracemagic
from tracemagic.views.dashboard import Dashboard
from tracemagic.views.report import write_report

pytestmark = [pytest.mark.browser, pytest.mark.filterwarnings("ignore::UserWarning")]

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = conftest.ARTIFACTS
#: screenshots of every tab after it was opened
SHOTS = ARTIFACTS / "report-tabs"

class Page:
    """A page that records console errors, page errors and every non-file request."""

    def __init__(self, browser: Any) -> None:
        self.page = browser.new_page(viewport={"width": 1280, "height": 900})
        self.errors: list[str] = []
        self.requests: list[str] = []
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))

        def route(r: Any) -> None:
            if r.request.url.startswith(("file:", "data:", "blob:", "about:")):
                r.continue_()
            else:
                self.requests.append(r.request.url)
                r.abort()

        self.page.route("**/*", route)

    def close(self) -> None:
        self.page.close()


def cpu_capture(folder: Path) -> Path:
    import torch

    from torch.profiler import ProfilerActivity, profile, schedule

    path = folder / "cpu_trace.json"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True, profile_memory=True, with_stack=True,
                 schedule=schedule(wait=0, warmup=1, active=2),
                 on_trace_ready=lambda p: p.export_chrome_trace(str(path))) as prof:
        for _ in range(3):
            model(torch.randn(16, 32)).sum().backward()
            prof.step()
    return path


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("reports")
    gpu = tracemagic.load(TRACES / "hta_nccl_data.json.gz", use_cache=False)
    cpu = tracemagic.load(cpu_capture(folder), use_cache=False)
    return {"gpu": write_report(gpu, folder / "gpu.html"), "cpu": write_report(cpu, folder / "cpu.html")}


@pytest.mark.parametrize("name", ["gpu", "cpu"])
def test_every_tab_renders_its_figures(browser: Any, reports: dict[str, Path], name: str) -> None:
    page = Page(browser)
    try:
        page.page.goto(reports[name].as_uri())
        buttons = page.page.locator("nav button")
        keys = [buttons.nth(i).get_attribute("data-tab") for i in range(buttons.count())]
        expected = ["overview", "layers", "timeline", "memory", "shapes"] + (["roofline", "kernels"] if name == "gpu" else []) + ["flame"]
        assert keys == expected
        ARTIFACTS.mkdir(exist_ok=True)
        for i, key in enumerate(keys):
            buttons.nth(i).click()
            section = page.page.locator(f"#tab-{key}")
            assert section.is_visible()
            figures = section.locator("div.plotly-graph-div")
            plots = section.locator(".js-plotly-plot")
            plots.first.locator(".main-svg").first.wait_for(timeout=10_000)
            assert plots.count() == figures.count() >= 1, key
            assert section.locator(".js-plotly-plot .main-svg").count() >= plots.count()
            assert section.locator("table.tm-table").count() >= 1, key
            page.page.screenshot(path=str(ARTIFACTS / f"report-{name}-{key}.png"))
        assert page.errors == []
        assert page.requests == []
    finally:
        page.close()


#: per figure placeholder of a section: drawn (a plotly graph with data and the template applied)?
FIGURE_STATE = """section => [...section.querySelectorAll('div.plotly-graph-div')].map(gd => ({
    drawn: gd.classList.contains('js-plotly-plot') && !!gd.querySelector('.main-svg'),
    traces: (gd.data || []).length,
    written: JSON.parse(gd.parentElement.querySelector('script.tm-fig').textContent).data.length,
    marks: gd.querySelectorAll('.main-svg .trace, .main-svg .hm, .main-svg .point').length,
    background: (((gd._fullLayout || {}).template || {}).layout || {}).plot_bgcolor || null}))"""


@pytest.mark.parametrize("name", ["gpu", "cpu"])
def test_hidden_tabs_are_drawn_only_when_opened(browser: Any, reports: dict[str, Path], name: str) -> None:
    """The first tab's figures are drawn at load; every other tab's figures (and tables)
    stay undrawn placeholders until its button is clicked, then each is a plotly graph with
    the traces the file holds (every tab of the CPU capture has some), drawn
    with the report's one copy of the plotly template (white plot area)."""
    text = reports[name].read_text(encoding="utf-8")
    assert text.count('id="tm-template-') == 1 and text.count('"plot_bgcolor":"white"') == 1  # the template once
    page = Page(browser)
    try:
        page.page.goto(reports[name].as_uri())
        keys = [b.get_attribute("data-tab") for b in page.page.locator("nav button").all()]
        first = page.page.locator(f"#tab-{keys[0]}")
        first.locator(".js-plotly-plot .main-svg").first.wait_for(timeout=20_000)
        page.page.wait_for_function(
            "s => [...document.querySelectorAll(s + ' div.plotly-graph-div')].every(g => g.classList.contains('js-plotly-plot'))",
            arg=f"#tab-{keys[0]}", timeout=20_000)
        opened = {keys[0]}
        for key in keys[1:] + keys[:1]:
            for other in keys:
                section = page.page.locator(f"#tab-{other}")
                state = section.evaluate(FIGURE_STATE)
                assert state, f"{other}: no figure placeholder"
                if other in opened:
                    assert all(f["drawn"] for f in state), (other, state)
                else:  # never shown: nothing of plotly's in it, its tables not built
                    assert not any(f["drawn"] for f in state), (other, state)
                    assert section.locator(".js-plotly-plot, .main-svg, .tm-scroll table").count() == 0, other
            page.page.locator(f'nav button[data-tab="{key}"]').click()
            opened.add(key)
            section = page.page.locator(f"#tab-{key}")
            assert section.is_visible()
            page.page.wait_for_function(
                "s => [...document.querySelectorAll(s + ' div.plotly-graph-div')].every(g => g.classList.contains('js-plotly-plot') && g.querySelector('.main-svg'))",
                arg=f"#tab-{key}", timeout=20_000)
            state = section.evaluate(FIGURE_STATE)
            # each figure drawn with the traces the file holds, marks on the plot where it has any
            assert all(f["drawn"] and f["traces"] == f["written"] and (f["marks"] >= 1) == (f["written"] >= 1)
                       for f in state), (key, state)
            if name == "cpu":  # recorded with stacks and memory: every tab has data (the GPU trace has neither)
                assert sum(f["traces"] for f in state) >= 1, (key, state)
            assert all(f["background"] == "white" for f in state), (key, state)  # plotly_white applied, from the one copy
            assert section.locator("table.tm-table").count() >= 1, key
            SHOTS.mkdir(parents=True, exist_ok=True)
            page.page.screenshot(path=str(SHOTS / f"report-{name}-{key}.png"))
        assert page.errors == [] and page.requests == []
    finally:
        page.close()


#: every drawn figure's margins as written and as plotly drew the plot area (plotly's automargin
#: widens a margin too narrow for the tick labels or colour bar it measured, then draws the whole
#: figure again); x tick labels turned by plotly (their angle depends on the window's width)
MARGINS = """() => [...document.querySelectorAll('.js-plotly-plot')].map(gd => {
  const m = gd._fullLayout.margin, s = gd._fullLayout._size;
  const turned = [...gd.querySelectorAll('.xaxislayer-above text')]
      .some(t => /rotate\\((?!0[,)])/.test(t.getAttribute('transform') || ''));
  return {id: gd.id, written: [m.l, m.r, m.t, m.b], drawn: [s.l, s.r, s.t, s.b].map(Math.round), turned};
})"""


def widened(figures: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The figures of :data:`MARGINS` that plotly drew in wider margins than written (the
    bottom and right ones may grow for x labels plotly turned, which depends on the window)."""
    return [f for f in figures if [f["drawn"][0], f["drawn"][2]] != [f["written"][0], f["written"][2]]
            or any(f["drawn"][i] != f["written"][i] and not (f["turned"] and f["drawn"][i] > f["written"][i])
                   for i in (1, 3))]


@pytest.mark.parametrize("name", ["gpu", "cpu"])
def test_every_figure_is_drawn_in_the_margins_it_was_written_with(
    browser: Any, reports: dict[str, Path], name: str
) -> None:
    """The views write margins wide enough for the axes' labels (horizontal bars' names,
    ``figures.tick_margin``), the x axis' title and the flame graph's colour bar, so plotly
    draws each figure once: before, its automargin widened nearly every figure's margins by
    a few pixels and drew it a second time. Every figure of every tab, as drawn in the page:
    its plot area sits in the margins written (the bottom and right ones may grow only for x
    labels plotly turned, which depends on the window's width)."""
    page = Page(browser)
    try:
        page.page.goto(reports[name].as_uri())
        for key in [b.get_attribute("data-tab") for b in page.page.locator("nav button").all()]:
            page.page.locator(f'nav button[data-tab="{key}"]').click()
            page.page.wait_for_function(
                "s => [...document.querySelectorAll(s + ' div.plotly-graph-div')].every(g => g.classList.contains('js-plotly-plot') && g.querySelector('.main-svg'))",
                arg=f"#tab-{key}", timeout=20_000)
        figures = page.page.evaluate(MARGINS)
        assert len(figures) >= 8, figures
        assert widened(figures) == [], widened(figures)
        assert page.errors == []
    finally:
        page.close()


def test_partial_plotlyjs_draws_every_trace_type_it_claims(browser: Any) -> None:
    """The report's partial plotly.js bundle draws a figure of each of its trace types with
    no error; a report with another trace type gets plotly's full bundle."""
    import plotly.graph_objects as go
    from plotly.offline import get_plotlyjs

    from tracemagic.views import report

    partial = report.plotly_js(set(report.PARTIAL_TRACES))
    assert partial != get_plotlyjs() and len(partial) < len(get_plotlyjs()) / 2
    assert report.plotly_js({"bar", "pie"}) == get_plotlyjs()
    figs = {
        "scatter": go.Figure(go.Scatter(x=[1, 2, 3], y=[3, 1, 2])),
        "bar": go.Figure(go.Bar(x=[1, 2], y=["a", "b"], orientation="h", base=[0, 1])),
        "heatmap": go.Figure(go.Heatmap(z=[[1, 2], [3, 4]])),
        "icicle": go.Figure(go.Icicle(labels=["root", "a", "b"], parents=["", "root", "root"], values=[3, 1, 2])),
        "sunburst": go.Figure(go.Sunburst(labels=["root", "a", "b"], parents=["", "root", "root"], values=[3, 1, 2])),
    }
    assert set(figs) == report.PARTIAL_TRACES
    page = Page(browser)
    try:
        page.page.set_content("<html><body></body></html>")
        page.page.add_script_tag(content=partial)
        for kind, fig in figs.items():
            marks = page.page.evaluate(
                """async ([kind, spec]) => { const d = document.createElement('div'); d.style.width = '600px';
                     d.style.height = '300px'; document.body.append(d);
                     await Plotly.newPlot(d, spec.data, spec.layout);
                     return d.querySelectorAll('.main-svg .trace, .main-svg .hm, .main-svg .point, .main-svg .slice').length; }""",
                [kind, json.loads(fig.to_json())],
            )
            assert marks >= 1, kind
        assert page.errors == []
    finally:
        page.close()


def test_report_roofline_tab_draws_the_roof_and_a_point_per_op_shape(browser: Any, tmp_path: Path) -> None:
    trace = tracemagic.load(TRACES / "tracelens_normalization_layer_test.json.gz", use_cache=False)
    efficiency = trace.efficiency()
    drawn = efficiency[(efficiency["intensity"] > 0) & (efficiency["tflops_per_s"] > 0)]
    assert len(drawn) >= 10
    page = Page(browser)
    try:
        page.page.goto(write_report(trace, tmp_path / "roofline.html").as_uri())
        page.page.locator('nav button[data-tab="roofline"]').click()
        section = page.page.locator("#tab-roofline")
        section.locator(".js-plotly-plot .main-svg").first.wait_for(timeout=10_000)
        # log-log axes, the MI300X roof as a line, one marker per op × shape with both figures
        assert (section.locator(".xtitle").first.text_content() or "").startswith("arithmetic intensity")
        assert section.locator(".scatterlayer .trace .js-line").count() >= 1
        assert section.locator(".scatterlayer .point").count() == len(drawn)
        assert "MI300X" in section.inner_text()
        assert section.locator("table.tm-table").count() >= 1
        ARTIFACTS.mkdir(exist_ok=True)
        page.page.screenshot(path=str(ARTIFACTS / "report-roofline.png"))
        assert page.errors == [] and page.requests == []
    finally:
        page.close()


def test_report_table_filters_sorts_and_pages(browser: Any, reports: dict[str, Path]) -> None:
    page = Page(browser)
    try:
        page.page.goto(reports["gpu"].as_uri())
        page.page.locator('nav button[data-tab="timeline"]').click()
        box = page.page.locator("#tab-timeline .tm-tablebox").first  # the ops (the wrappers have a table of their own)
        rows = box.locator("tbody tr")
        assert rows.count() == 25
        info = box.locator(".tm-info")
        assert "page 1/" in info.inner_text()
        box.locator("button.tm-next").click()
        assert "page 2/" in info.inner_text()
        box.locator("input.tm-filter").fill("aten::copy_")
        assert rows.count() == 1 and rows.first.locator("td").first.inner_text() == "aten::copy_"
        box.locator("input.tm-filter").fill("")
        calls_header = box.locator("th", has_text="Calls")
        assert calls_header.get_attribute("title") == "calls"  # the frame's own column name on hover
        calls_header.click()  # numbers sort descending first
        col = [h.inner_text().split(" ")[0] for h in box.locator("th").all()].index("Calls")
        values = [int(r.locator("td").nth(col).inner_text().replace(",", "")) for r in rows.all()]
        assert values == sorted(values, reverse=True)
        assert page.errors == []
    finally:
        page.close()


# -- XSS: names that are markup must not run -----------------------------------------------------
@pytest.fixture(scope="module")
def evil(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from test_views import evil_trace_file

    return tracemagic.load(evil_trace_file(tmp_path_factory.mktemp("evil")), use_cache=False)


def _hover_everything(page: Any) -> None:
    """Move the mouse over every plot so hover labels (which render HTML) are drawn."""
    for plot in page.locator(".js-plotly-plot:visible").all():
        box = plot.bounding_box()
        if not box:
            continue
        for fx in (0.2, 0.35, 0.5, 0.65, 0.8):
            for fy in (0.3, 0.5, 0.7):
                page.mouse.move(box["x"] + fx * box["width"], box["y"] + fy * box["height"])


def test_report_runs_nothing_from_trace_strings(browser: Any, evil: Any, tmp_path: Path) -> None:
    path = write_report(evil, tmp_path / "evil.html", other=evil)
    page = Page(browser)
    try:
        page.page.goto(path.as_uri())
        for button in page.page.locator("nav button").all():
            button.click()
            _hover_everything(page.page)
            page.page.locator(".tm-filter:visible").first.fill("script") if page.page.locator(".tm-filter:visible").count() else None
        assert page.page.evaluate("typeof window.__pwned") == "undefined"
        # the names are displayed as text
        assert "<script>window.__pwned=1</script>" in page.page.locator("body").inner_text()
        assert page.errors == []
    finally:
        page.close()


def test_dashboard_html_runs_nothing_from_trace_strings(browser: Any, evil: Any) -> None:
    """The dashboard's HTML widgets (set as innerHTML by ipywidgets) and its plotly figures."""
    from plotly.offline import get_plotlyjs

    dash = Dashboard(evil, other=evil)
    dash.render_all()
    fragments = [w.value for w in _walk(dash.widget) if type(w).__name__ == "HTML"]
    specs = [fig for key in dash.keys for fig in dash.figures(key)]
    page = Page(browser)
    try:
        page.page.set_content("<html><body><div id='root'></div></body></html>")
        page.page.add_script_tag(content=get_plotlyjs())
        # control: the same payload unescaped does run, so the check below can see it
        page.page.evaluate("s => { const d = document.createElement('div'); d.innerHTML = s; document.body.append(d); }",
                           '<img src=x onerror="window.__control=1">')
        page.page.wait_for_function("window.__control === 1", timeout=5_000)
        page.page.evaluate(
            """fragments => { for (const f of fragments) { const d = document.createElement('div');
                 d.innerHTML = f; document.getElementById('root').append(d); } }""",
            fragments,
        )
        for i, spec in enumerate(specs):
            page.page.evaluate(
                """([i, spec]) => { const d = document.createElement('div'); d.id = 'fig' + i;
                     d.style.width = '900px'; d.style.height = '450px'; document.body.append(d);
                     return Plotly.newPlot(d, spec.data, spec.layout, spec.config || {}); }""",
                [i, json.loads(json.dumps(spec))],
            )
        _hover_everything(page.page)
        page.page.wait_for_timeout(300)
        assert page.page.evaluate("typeof window.__pwned") == "undefined"
        assert "<script>window.__pwned=1</script>" in page.page.locator("#root").inner_text()
    finally:
        page.close()


def _walk(widget: Any) -> list[Any]:
    out = [widget]
    for child in getattr(widget, "children", ()) or ():
        out += _walk(child)
    return out


def test_report_graph_tab_and_layer_tree(browser: Any, reports: dict[str, Path], tmp_path: Path) -> None:
    """The ET op graph of the real HTA pair renders; the layer tree expands and collapses."""
    for source, name in (("hta_benchmark_simple_add_trace.json.gz", "add_trace.json.gz"),
                         ("hta_benchmark_simple_add_et.json.gz", "add_et.json.gz")):
        (tmp_path / name).write_bytes((TRACES / source).read_bytes())
    path = write_report(tracemagic.load(tmp_path / "add_trace.json.gz", use_cache=False), tmp_path / "et.html")
    page = Page(browser)
    try:
        page.page.goto(path.as_uri())
        page.page.locator('nav button[data-tab="graph"]').click()
        section = page.page.locator("#tab-graph")
        section.locator(".js-plotly-plot .main-svg").first.wait_for(timeout=10_000)
        assert section.locator(".js-plotly-plot .scatterlayer .point").count() == 10  # the ten ET ops
        ARTIFACTS.mkdir(exist_ok=True)
        page.page.screenshot(path=str(ARTIFACTS / "report-et-graph.png"))
        assert page.errors == []
    finally:
        page.close()
    page = Page(browser)
    try:
        page.page.goto(reports["cpu"].as_uri())
        page.page.locator('nav button[data-tab="layers"]').click()
        tree = page.page.locator("#tab-layers .tm-side .tm-tree")
        root = tree.locator("details").first
        assert root.get_attribute("open") is not None
        leaf = tree.locator(".tm-leaf").first
        assert leaf.is_visible()
        root.locator("summary").first.click()  # collapse
        assert root.get_attribute("open") is None and not leaf.is_visible()
        root.locator("summary").first.click()  # expand again
        assert leaf.is_visible()
        page.page.screenshot(path=str(ARTIFACTS / "report-cpu-layer-tree.png"))
        assert page.errors == []
    finally:
        page.close()
