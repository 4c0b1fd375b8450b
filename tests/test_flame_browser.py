"""The Flame tab of the HTML report in a real browser (Debian's chromium driven by
Playwright, as ``test_report_browser``): the icicle is drawn with a box per node the figure
holds, clicking a box zooms into it, no console errors, no network; a screenshot is kept in
the test's own temporary folder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import TRACES
from test_report_browser import Page  # the browser fixture: conftest.browser

import tracemagic
from tracemagic.views.report import write_report

pytestmark = [pytest.mark.browser, pytest.mark.filterwarnings("ignore::UserWarning")]


@pytest.mark.parametrize("name", ["tracelens_normalization_layer_test.json.gz", "kineto_worker0.1623143089861.pt.trace.json.gz"])
def test_flame_tab_draws_the_call_tree(browser: Any, tmp_path: Path, name: str) -> None:  # noqa: F811
    trace = tracemagic.load(TRACES / name, use_cache=False)
    report = write_report(trace, tmp_path / "report.html")
    page = Page(browser)
    try:
        page.page.goto(report.as_uri())
        page.page.locator('nav button[data-tab="flame"]').click()
        section = page.page.locator("#tab-flame")
        assert section.is_visible()
        section.locator(".js-plotly-plot .main-svg").first.wait_for(timeout=20_000)
        page.page.wait_for_function(
            "s => [...document.querySelectorAll(s + ' div.plotly-graph-div')].every(g => g.querySelector('.main-svg'))",
            arg="#tab-flame", timeout=20_000)
        graphs = section.locator("div.plotly-graph-div")
        assert graphs.count() == 2  # CPU time, and GPU time by launching stack
        cpu = graphs.first
        written = cpu.evaluate("gd => gd.data[0].ids.length")
        assert cpu.evaluate("gd => gd.data[0].type") == "icicle"
        slices = cpu.locator("g.slice")
        assert 1 <= slices.count() <= written + 1  # plotly adds a common root above several top boxes
        # the user's own code is at the top: the figure is "user code only"
        labels = cpu.evaluate("gd => gd.data[0].labels")
        assert any("test_perf_model.py" in label or "resnet50_profiler_api.py" in label for label in labels)
        assert "user code only" in (section.inner_text() or "")
        assert section.locator("table.tm-table").count() >= 1
        # a click on a box below the top zooms: the clicked box becomes the widest
        assert cpu.evaluate("gd => gd.data[0].level || ''") == ""
        slices.nth(2).click(force=True)
        page.page.wait_for_function("gd => !!gd.data[0].level", arg=cpu.element_handle(), timeout=10_000)
        zoomed = cpu.evaluate("gd => gd.data[0].level")
        assert zoomed in cpu.evaluate("gd => gd.data[0].ids")
        page.page.screenshot(path=str(tmp_path / "report-flame.png"), full_page=True)
        assert (tmp_path / "report-flame.png").stat().st_size > 10_000
        assert page.errors == [] and page.requests == []
    finally:
        page.close()


def test_flame_search_highlights_boxes_and_the_views_name_the_code(browser: Any, tmp_path: Path) -> None:  # noqa: F811
    """The search box above the flame graph colours the boxes whose label holds the text; the
    Kernels table has its ``where`` column and the roofline's hover names the user code."""
    trace = tracemagic.load(TRACES / "tracelens_normalization_layer_test.json.gz", use_cache=False)
    report = write_report(trace, tmp_path / "report.html")
    page = Page(browser)
    try:
        page.page.goto(report.as_uri())
        page.page.locator('nav button[data-tab="flame"]').click()
        section = page.page.locator("#tab-flame")
        page.page.wait_for_function(
            "s => [...document.querySelectorAll(s + ' div.plotly-graph-div')].every(g => g.querySelector('.main-svg'))",
            arg="#tab-flame", timeout=20_000)
        cpu = section.locator("div.plotly-graph-div").first
        before = cpu.evaluate("gd => Array.from(gd.data[0].marker.colors)")
        labels = cpu.evaluate("gd => gd.data[0].labels.map(l => { const e = document.createElement('textarea'); "
                              "e.innerHTML = l; return e.value.toLowerCase(); })")
        wanted = [i for i, label in enumerate(labels) if "forward" in label]
        assert wanted and len(wanted) < len(labels)
        section.locator("input.tm-flame-search").first.fill("Forward")
        page.page.wait_for_function("gd => typeof gd.data[0].marker.colors[0] === 'string'", arg=cpu.element_handle(),
                                    timeout=10_000)
        colors = cpu.evaluate("gd => Array.from(gd.data[0].marker.colors)")
        assert [i for i, c in enumerate(colors) if c == "#2b7bff"] == wanted
        assert all(c == "#e6e6e6" for i, c in enumerate(colors) if i not in wanted)
        assert section.locator(".tm-flame-hits").first.inner_text() == f"{len(wanted)} boxes match"
        # the slices drawn take the colours (the fill of a matching box)
        fills = cpu.evaluate("gd => [...gd.querySelectorAll('g.slice path.surface')].map(p => p.style.fill)")
        assert "rgb(43, 123, 255)" in fills
        section.locator("input.tm-flame-search").first.fill("")
        page.page.wait_for_function("gd => typeof gd.data[0].marker.colors[0] !== 'string'", arg=cpu.element_handle(),
                                    timeout=10_000)
        assert cpu.evaluate("gd => Array.from(gd.data[0].marker.colors)") == before
        # the Kernels table: a where column naming the user function
        page.page.locator('nav button[data-tab="kernels"]').click()
        kernels = page.page.locator("#tab-kernels")
        kernels.locator("table.tm-table").first.wait_for(timeout=20_000)
        headers = kernels.locator("table.tm-table th").all_inner_texts()
        assert any(h.startswith("Where") for h in headers)  # the header in words: "Where (your code)"
        assert "forward · test_perf_model.py:35" in kernels.locator("table.tm-table").first.inner_text()
        # the roofline: hovering a point names the code that called the op
        page.page.locator('nav button[data-tab="roofline"]').click()
        page.page.wait_for_function(
            "s => [...document.querySelectorAll(s + ' div.plotly-graph-div')].every(g => g.querySelector('.main-svg'))",
            arg="#tab-roofline", timeout=20_000)
        roof = page.page.locator("#tab-roofline div.plotly-graph-div").first
        found = roof.evaluate("""gd => {
            for (let c = 0; c < gd.data.length; c++) {
                const t = gd.data[c];
                if (t.mode !== 'markers') continue;
                for (let p = 0; p < t.customdata.length; p++) {
                    if (String(t.customdata[p][7]).includes('test_perf_model.py')) {
                        Plotly.Fx.hover(gd, [{curveNumber: c, pointNumber: p}]);
                        return gd.querySelector('g.hovertext') ? gd.querySelector('g.hovertext').textContent : '';
                    }
                }
            }
            return null;
        }""")
        assert found and "code " in found and "test_perf_model.py:" in found
        assert page.errors == [] and page.requests == []
    finally:
        page.close()
