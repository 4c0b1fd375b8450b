"""The Flame tab of the HTML report in a real browser (Debian's chromium driven by
Playwright, as ``test_report_browser``): the icicle is drawn with a box per node the figure
holds, clicking a box zooms into it, no console errors, no network; a screenshot is kept in
the test's own temporary folder."""

from __future__ import annotations

import base64
import html
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import TRACES, save_screenshot
from test_report_browser import Page  # the browser fixture: conftest.browser

import tracemagic
from tracemagic.views.report import write_report

pytestmark = [pytest.mark.browser, pytest.mark.filterwarnings("ignore::UserWarning")]


#: every plotly figure of a tab drawn
_DRAWN = "s => [...document.querySelectorAll(s + ' div.plotly-graph-div')].every(g => g.querySelector('.main-svg'))"


def open_flame_tab(page: Page, trace_file: str | Path, folder: Path) -> Any:
    """Write the report of ``trace_file`` (of ``tests/data/traces``, or a path), open it, click its Flame
    tab and wait for its figures; the tab's section (a Playwright locator)."""
    trace = tracemagic.load(TRACES / trace_file, use_cache=False)
    report = write_report(trace, folder / "report.html")
    page.page.goto(report.as_uri())
    page.page.locator('nav button[data-tab="flame"]').click()
    page.page.wait_for_function(_DRAWN, arg="#tab-flame", timeout=20_000)
    return page.page.locator("#tab-flame")


@pytest.mark.parametrize("name", ["tracelens_normalization_layer_test.json.gz", "kineto_worker0.1623143089861.pt.trace.json.gz"])
def test_flame_tab_draws_the_call_tree(browser: Any, tmp_path: Path, name: str) -> None:
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


def test_flame_search_highlights_boxes_and_the_views_name_the_code(browser: Any, tmp_path: Path) -> None:
    """The search box above the flame graph colours the boxes whose label holds the text; the
    Kernels table has its ``where`` column and the roofline's hover names the user code."""
    page = Page(browser)
    try:
        section = open_flame_tab(page, "tracelens_normalization_layer_test.json.gz", tmp_path)
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
        # the count: every box of the graph whose label holds the text (those too narrow to be drawn too)
        spec = json.loads(section.locator("script.tm-fig").first.text_content() or "")
        every = next(t for t in spec["data"] if t["type"] == "icicle")["labels"]
        hits = sum("forward" in html.unescape(label).lower() for label in every)
        assert hits >= len(wanted)
        assert section.locator(".tm-flame-hits").first.inner_text() == f"{hits} boxes match"
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


# -- what each view of a large flame graph draws (hta_control: most boxes narrower than a pixel) --
#: a view draws the boxes at least this many px wide; a label where it fits at this font size or more
BOX_PX, LABEL_PX = 1.0, 4.0
#: the edges of those rules are left alone (rounding, and two ways of measuring a label's width)
BOX_BAND, LABEL_BAND = (0.9, 1.1), (3.5, 4.5)
#: where a box (by its id) lies on the page: its middle, or 3 px from its left edge (the text's side)
AT = """(gd, [id, left]) => {
    const g = [...gd.querySelectorAll('g.slice')].find(g => g.__data__.data.data.id === id);
    const r = g.querySelector('path.surface').getBoundingClientRect();
    return [left ? r.x + 3 : r.x + r.width / 2, r.y + r.height / 2];
}"""
#: what is drawn: each slice's id, its box's width (px) and the text it shows
DRAWN = """gd => [...gd.querySelectorAll('g.slice')].map(g => [
    g.__data__.data.data.id, g.querySelector('path.surface').getBBox().width,
    (g.querySelector('text.slicetext') || {textContent: ''}).textContent.trim()])"""
#: each label's width (px) in the font plotly draws the boxes' text with, measured by an SVG text
LABEL_WIDTHS = """(gd, labels) => {
    const drawn = gd.querySelector('g.slice text.slicetext'), style = getComputedStyle(drawn);
    const svg = document.createElementNS('http://www.w3.org/2000/svg', 'svg'); document.body.appendChild(svg);
    const text = document.createElementNS('http://www.w3.org/2000/svg', 'text'); svg.appendChild(text);
    text.style.fontFamily = style.fontFamily; text.style.fontSize = style.fontSize;
    const out = labels.map(l => { text.textContent = l; return text.getComputedTextLength(); });
    svg.remove();
    return [parseFloat(style.fontSize), out];
}"""


def _array(value: Any) -> np.ndarray:
    """A plotly JSON array: a list, or base64 bytes with a dtype (plotly.py's numpy arrays)."""
    if isinstance(value, dict):
        return np.frombuffer(base64.b64decode(value["bdata"]), dtype=np.dtype(value["dtype"]))
    return np.asarray(value)


def _tree(spec: dict[str, Any]) -> tuple[list[str], dict[str, str], dict[str, float], dict[str, str]]:
    """From the icicle as the report holds it: ids, each id's parent, each box's total (its own
    value plus its children's totals: ``branchvalues='remainder'``) and its label as shown."""
    trace = next(t for t in spec["data"] if t["type"] == "icicle")
    ids, parents = trace["ids"], dict(zip(trace["ids"], trace["parents"]))
    total = dict(zip(ids, _array(trace["values"]).astype(float)))
    depth = {}
    for i in ids:
        d, p = 0, parents[i]
        while p:
            d, p = d + 1, parents[p]
        depth[i] = d
    for i in sorted(ids, key=depth.__getitem__, reverse=True):
        if parents[i]:
            total[parents[i]] += total[i]
    return ids, parents, total, {i: html.unescape(lab) for i, lab in zip(ids, trace["labels"])}


def _check_view(gd: Any, spec: dict[str, Any], entry: str, names: int = 0) -> dict[str, tuple[float, str]]:
    """The view of ``entry`` drawn in ``gd``: the boxes of its subtree at least ``BOX_PX`` wide,
    each as wide as its time, named where its label fits at ``LABEL_PX`` or more (at least
    ``names`` of them); returns what is drawn (id -> width, text)."""
    ids, parents, total, labels = _tree(spec)
    width = gd.evaluate("gd => gd._fullLayout._size.w")
    px = width / total[entry]

    def under(i: str) -> bool:
        while i and i != entry:
            i = parents[i]
        return i == entry

    subtree = [i for i in ids if under(i)]
    drawn = {i: (w, t) for i, w, t in gd.evaluate(DRAWN)}
    for i in subtree:
        box = total[i] * px
        if box >= BOX_BAND[1]:
            assert i in drawn, f"{labels[i]!r}, {box:.1f} px wide, is not drawn"
            assert abs(drawn[i][0] - box) < 0.6, (labels[i], drawn[i][0], box)  # as wide as its time
        elif box < BOX_BAND[0]:
            assert i not in drawn, f"{labels[i]!r}, {box:.2f} px wide, is drawn"
    assert set(drawn) <= set(subtree)
    size, measured = gd.evaluate(LABEL_WIDTHS, [labels[i] for i in drawn])
    named = 0
    for i, text_width in zip(drawn, measured):
        box, text = drawn[i]
        fits = size * min(1.0, (box - 6) / max(text_width, 1e-9))  # plotly's fit: 3 px each side, then shrunk
        if fits >= LABEL_BAND[1]:
            assert text == labels[i], f"{labels[i]!r} would fit at {fits:.1f} px in {box:.0f} px: drawn {text!r}"
            named += 1
        elif fits < LABEL_BAND[0]:
            assert text == "", f"{labels[i]!r} is drawn at {fits:.1f} px"
    assert named >= names
    return drawn


def test_hta_flame_draws_each_views_visible_boxes_and_names_them(browser: Any, tmp_path: Path) -> None:
    """hta_control's call tree (713 boxes, three in four narrower than a pixel): each flame
    graph of the tab draws the boxes at least a pixel wide, each as wide as its time, named
    where the name fits; a narrow box shows its hover; a click on a box draws its subtree the
    same way (names of boxes too narrow before), a click on the box at the top zooms out."""
    page = Page(browser)
    try:
        section = open_flame_tab(page, "hta_control.json.gz", tmp_path)
        figures = section.locator(".tm-figure")
        assert figures.count() == 2  # CPU time, GPU time
        specs = [json.loads(figures.nth(k).locator("script.tm-fig").text_content() or "") for k in range(2)]
        root = "all"
        views = []
        for k, spec in enumerate(specs):
            ids = _tree(spec)[0]
            views.append(_check_view(figures.nth(k).locator("div.plotly-graph-div"), spec, root, names=5))
            assert len(views[-1]) < len(ids) / 2  # hta_control: most boxes are narrower than a pixel
        before = views[0]
        save_screenshot(page.page, tmp_path, "hta-flame")
        cpu = figures.first.locator("div.plotly-graph-div")
        spec = specs[0]
        ids, parents, total, labels = _tree(spec)
        custom = {i: html.unescape(str(row[0])) for i, row in zip(ids, next(t for t in spec["data"])["customdata"])}
        # a narrow box has its hover: its name
        drawn = {i: w for i, (w, _) in before.items()}
        narrow = min((i for i in drawn if drawn[i] >= 3), key=drawn.__getitem__)
        box = cpu.evaluate(AT, [narrow, False])
        page.page.mouse.move(*box)
        page.page.wait_for_function("gd => !!gd.querySelector('g.hovertext')", arg=cpu.element_handle(), timeout=5_000)
        assert custom[narrow] in (cpu.locator("g.hovertext").first.text_content() or "")
        # a click on the box below the root with the most boxes beneath it: its view
        def beneath(i: str) -> int:
            return sum(1 for c in ids if parents[c] == i) + sum(beneath(c) for c in ids if parents[c] == i)

        clicked = max((i for i in ids if parents[i] == root and i in drawn), key=beneath)
        page.page.mouse.move(0, 0)
        box = cpu.evaluate(AT, [clicked, True])
        page.page.mouse.click(*box)
        page.page.wait_for_function("([gd, id]) => gd.data[0].level === id", arg=[cpu.element_handle(), clicked],
                                    timeout=10_000)
        zoomed = _check_view(cpu, spec, clicked)
        assert set(zoomed) - set(drawn), "the zoom drew no box that was too narrow before"
        assert any(t and not before.get(i, (0, ""))[1] for i, (_, t) in zoomed.items()), "the zoom named no box"
        save_screenshot(page.page, tmp_path, "hta-flame-zoomed")
        # the box at the top (the one clicked) zooms out to its parent: the whole tree
        box = cpu.evaluate(AT, [clicked, True])
        page.page.mouse.click(*box)
        page.page.wait_for_function("gd => !gd.data[0].level", arg=cpu.element_handle(), timeout=10_000)
        _check_view(cpu, spec, root)
        # a narrower window: the view of the new width (fewer boxes, fewer names)
        width = cpu.evaluate("gd => gd._fullLayout._size.w")
        page.page.set_viewport_size({"width": 800, "height": 900})
        page.page.wait_for_function(  # plotly's resize, then the view of the new width: no box under 0.9 px
            "([gd, w]) => gd._fullLayout._size.w < w - 100 && [...gd.querySelectorAll('g.slice path.surface')]"
            ".every(p => p.getBBox().width >= 0.9)", arg=[cpu.element_handle(), width], timeout=10_000)
        narrower = _check_view(cpu, spec, root)
        assert len(narrower) < len(before)
        assert page.errors == [] and page.requests == []
    finally:
        page.close()


def test_a_magic_captures_flame_names_the_cell_once_and_the_layers(browser: Any, tmp_path: Path) -> None:
    """The Flame tab of a ``%%chakra_trace`` GPU capture (tests/data/cuda) as drawn: one
    ``<module>`` box per graph (the cell's body, not also the line IPython ran the magic
    from: raw, inside tracemagic's frames), and the ``nn.Module`` boxes drawn with the names
    of the manifest's module map (as the Layers tab), in their text and their hover."""
    import tarfile

    from test_cuda_captures import DATA, expected_layers, magic_cells

    archive = DATA / "cuda_transformer.tar.gz"
    if not archive.is_file():
        pytest.skip(f"no {archive.name} in {DATA}")
    with tarfile.open(archive) as tar:
        tar.extractall(tmp_path / "capture", filter="data")
    (folder,) = [p for p in (tmp_path / "capture").iterdir() if p.is_dir()]
    manifest = json.loads((folder / "capture.json").read_text())
    events = json.loads((folder / "kineto_trace_0.json").read_text())["traceEvents"]
    (body,), lines = magic_cells(events)
    assert len(lines) == 1
    body_file, body_line = body.rsplit("(", 1)[0], int(body.rsplit("(", 1)[1].split(")")[0])
    number = (manifest.get("cells") or {}).get(body_file)  # a capture with the map: Cell In[n]
    place = f"Cell In[{number}]" if number is not None else body_file.rsplit("/", 1)[-1]
    expected = expected_layers(manifest)
    tree = tracemagic.load(folder, use_cache=False).call_tree(user_only=True)
    raw_of = {str(n): str(name) for n, name, kind in zip(tree["node"], tree["name"], tree["kind"]) if kind == "module"}
    page = Page(browser)
    try:
        section = open_flame_tab(page, folder, tmp_path)
        graphs = section.locator("div.plotly-graph-div")
        assert graphs.count() == 2
        for k in range(2):
            gd = graphs.nth(k)
            drawn = gd.evaluate(DRAWN)
            texts = [t for _, _, t in drawn]
            assert [t for t in texts if t.startswith("<module>")] == [f"<module> · {place}:{body_line}"], texts[:5]
            modules = [(i, t) for i, _, t in drawn if i in raw_of]
            assert modules and not any(t.startswith("nn.Module:") for t in texts)
            named = [(i, t) for i, t in modules if t]
            assert len(named) >= 3, modules
            assert all(t == expected[raw_of[i]] for i, t in named), named
            assert any(t == "bert.encoder.layer.0" for _, t in named)
        # the hover of the widest module box names the layer
        gd = graphs.first
        drawn = gd.evaluate(DRAWN)
        widest = max((d for d in drawn if d[0] in raw_of), key=lambda d: d[1])
        page.page.mouse.move(*gd.evaluate(AT, [widest[0], False]))
        page.page.wait_for_function("gd => !!gd.querySelector('g.hovertext')", arg=gd.element_handle(), timeout=5_000)
        hover = gd.locator("g.hovertext").first.text_content() or ""
        assert hover.startswith(expected[raw_of[widest[0]]] + " (module "), hover
        # the search finds a module box by its class too (torch's name, in its hover), not only by its path
        section.locator("input.tm-flame-search").first.fill("BertLayer")
        page.page.wait_for_function("gd => typeof gd.data[0].marker.colors[0] === 'string'", arg=gd.element_handle(),
                                    timeout=10_000)
        ids = gd.evaluate("gd => Array.from(gd.data[0].ids)")
        colors = gd.evaluate("gd => Array.from(gd.data[0].marker.colors)")
        hits = {ids[i] for i, c in enumerate(colors) if c == "#2b7bff"}
        assert hits and hits == {i for i in ids if "BertLayer" in raw_of.get(i, "")}, (hits, len(ids))
        save_screenshot(page.page, tmp_path, "magic-flame")
        assert page.errors == [] and page.requests == []
    finally:
        page.close()
