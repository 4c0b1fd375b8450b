"""The report at a glance, in a real browser: nothing covered, nothing cut, nothing blank.

On the quickstart's capture (the notebook's own model and cell, run with the magic), a
BERT-like model trained with AdamW (a small transformer encoder built here from torch.nn,
nothing downloaded) and three GPU traces recorded elsewhere (an A100 rank of 8, DLRM on
8 V100 ranks, an MI300X with layers and memory), every tab of the report is opened in
Debian's chromium (one browser, one page, one report per trace) and its page is measured
with plotly's own DOM and ``getBoundingClientRect``:

- no legend intersects a plot's data area (``.nsewdrag``, one per subplot) or any text
  (title, axis titles, tick labels, annotations); no note (an annotation without an arrow)
  intersects a data area; no annotation intersects another text; no title meets the plot.
  An annotation with an arrow marks a point of the data (the memory peak) and stands in the
  plot by design: it is only held to the text rule;
- every table's first columns (the ones that answer: name, shapes, time, calls, % of roof)
  lie inside the visible width; its headers are words (no ``self_pct``), dtypes are no JSON
  lists, addresses are hex, every table has a filter of its own;
- no annotation runs off the figure's edge; no label (tick, legend entry, table header,
  layer-tree row) is empty; no console error;
- no text, tick label or hover (plotly's own, each trace's first and last points) shows a raw
  value: a float's noise (``0.10000000000000001``), NaN or inf, an HTML entity as it is
  (``&quot;``), a JSON list (``["float"]``) or ``step -1``.

A screenshot of each tab goes to the test's tmp folder and, when ``TRACEMAGIC_SCREENSHOTS``
names a folder, there too.
"""

from __future__ import annotations

import json
import re
import tarfile
from pathlib import Path
from typing import Any, Iterator

import pytest
from conftest import ROOT, TRACES, own_namespace, save_screenshot
import test_report_browser

import tracemagic
from tracemagic.views.report import write_report

pytestmark = [pytest.mark.browser, pytest.mark.filterwarnings("ignore::UserWarning")]

#: the GPU traces: an A100 rank of an 8-GPU job, DLRM on 8 ranks, an MI300X with layers and memory
GPU_TRACES = {"a100": "hta_control.json.gz", "dlrm": "param_dlrm_kineto.tar.gz",
              "mi300x": "tracelens_normalization_layer_test.json.gz"}
#: our own CUDA capture (bench/gpu_check.py on an H200, tests/data/cuda): the magic's folder, with
#: line marks, memory on cuda:0 and its memory timeline
CUDA_CAPTURES = {"cuda_transformer": "cuda_transformer.tar.gz"}
#: the columns of a table that must be in sight (the first ones: they answer its question)
KEY_COLUMNS = 4

BERT_CELLS = [
    '''
import torch
from torch import nn

torch.manual_seed(0)

class TinyBert(nn.Module):
    """Embeddings, a 2-layer post-norm GELU encoder, a pooler and a classifier, as BERT."""
    def __init__(self, vocab=1000, d=64, layers=2, length=32):
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab, d)
        self.position_embeddings = nn.Embedding(length, d)
        self.norm = nn.LayerNorm(d)
        layer = nn.TransformerEncoderLayer(d, nhead=4, dim_feedforward=4 * d, dropout=0.1, activation="gelu",
                                           batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=layers, enable_nested_tensor=False)
        self.pooler = nn.Linear(d, d)
        self.classifier = nn.Linear(d, 2)

    def forward(self, ids):
        positions = torch.arange(ids.shape[1]).unsqueeze(0)
        hidden = self.encoder(self.norm(self.word_embeddings(ids) + self.position_embeddings(positions)))
        return self.classifier(torch.tanh(self.pooler(hidden[:, 0])))

bert = TinyBert()
optimizer = torch.optim.AdamW(bert.parameters(), lr=1e-4)
batches = [(torch.randint(0, 1000, (8, 32)), torch.randint(0, 2, (8,))) for _ in range(5)]
''',
    '''%%chakra_trace -q -v bert_capture --out {out} --name bert --active 2
for ids, labels in batches:
    optimizer.zero_grad()
    loss = nn.functional.cross_entropy(bert(ids), labels)
    loss.backward()
    optimizer.step()
''',
]


def _run(shell: Any, cell: str) -> None:
    result = shell.run_cell(cell)
    assert result.success, result.error_in_exec or result.error_before_exec


@pytest.fixture(scope="module")
def reports(_shell: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One report per trace: the quickstart's first capture, the BERT-like capture, the GPU traces."""
    folder = tmp_path_factory.mktemp("glance")
    notebook = json.loads((ROOT / "notebooks" / "quickstart.ipynb").read_text(encoding="utf-8"))
    code = ["".join(c["source"]) for c in notebook["cells"] if c["cell_type"] == "code"]
    model, loop = code[1], next(c for c in code if c.startswith("%%chakra_trace"))
    first, body = loop.split("\n", 1)
    out: dict[str, Path] = {}
    with own_namespace(_shell) as ns:
        _run(_shell, model)
        _run(_shell, f"{first} -q -v quickstart_capture --out {folder / 'traces'}\n{body}")
        out["quickstart"] = write_report(ns["quickstart_capture"].trace, folder / "quickstart.html")
        _run(_shell, BERT_CELLS[0])
        _run(_shell, BERT_CELLS[1].format(out=folder / "traces"))
        out["bert"] = write_report(ns["bert_capture"].trace, folder / "bert.html")
    for name, file in GPU_TRACES.items():
        out[name] = write_report(tracemagic.load(TRACES / file, cache_dir=folder / "cache"), folder / f"{name}.html")
    for name, file in CUDA_CAPTURES.items():  # the archive holds the capture folder and gpu_check.json
        with tarfile.open(ROOT / "tests" / "data" / "cuda" / file) as tar:
            tar.extractall(folder / name, filter="data")
        (capture,) = [p for p in (folder / name).iterdir() if p.is_dir()]
        out[name] = write_report(tracemagic.load(capture, cache_dir=folder / "cache"), folder / f"{name}.html")
    return out


@pytest.fixture(scope="module")
def page(browser: Any) -> Iterator[Any]:
    """One page for every report, with its console errors in ``page.errors``."""
    tab = browser.new_page(viewport={"width": 1024, "height": 900})
    tab.errors = []
    tab.on("console", lambda m: tab.errors.append(m.text) if m.type == "error" else None)
    tab.on("pageerror", lambda e: tab.errors.append(str(e)))
    yield tab
    tab.close()


#: what overlaps, is cut or is blank in an element (a tab's section, or the report's header)
LAYOUT = """(root) => {
  const problems = [];
  const box = el => { const r = el.getBoundingClientRect(); return {l: r.left, t: r.top, r: r.right, b: r.bottom}; };
  const real = a => a.r - a.l > 0.5 && a.b - a.t > 0.5;
  const meet = (a, b) => real(a) && real(b) && a.l < b.r - 1 && b.l < a.r - 1 && a.t < b.b - 1 && b.t < a.b - 1;
  const text = el => (el.textContent || '').trim();
  root.querySelectorAll('.js-plotly-plot').forEach((gd, i) => {
    const title = gd.querySelector('.gtitle');
    const name = `figure ${i + 1} "${title ? text(title) : ''}"`;
    // a figure without data (its message in the middle: "No memory events: ...") has no data area
    const areas = (gd.data || []).length ? [...gd.querySelectorAll('.draglayer .nsewdrag')].map(box) : [];
    gd.querySelectorAll('.iciclelayer, .sunburstlayer').forEach(l => areas.push(box(l)));
    const labels = [];  // [what, box]
    if (title) labels.push(['title', box(title)]);
    gd.querySelectorAll('.infolayer text').forEach(t => {
      if (/^[xy]\\d*title$/.test(t.getAttribute('class') || '')) labels.push([`axis title "${text(t)}"`, box(t)]);
    });
    gd.querySelectorAll('.xaxislayer-above text, .yaxislayer-above text').forEach(t => {
      labels.push([`tick "${text(t)}"`, box(t)]);
      if (!text(t)) problems.push(`${name}: an empty tick label`);
    });
    const notes = [...gd.querySelectorAll('.annotation')].map(a => {
      const body = a.querySelector('.annotation-text-g') || a;
      return {what: `annotation "${text(body)}"`, box: box(body), arrow: !!a.querySelector('.annotation-arrow-g path')};
    });
    const legend = gd.querySelector('.legend .bg');
    gd.querySelectorAll('.legend .legendtext').forEach(t => { if (!text(t)) problems.push(`${name}: an empty legend entry`); });
    if (legend && gd.querySelector('.legend .traces')) {
      const lb = box(legend);
      areas.forEach(a => { if (meet(lb, a)) problems.push(`${name}: the legend covers the plot`); });
      labels.forEach(([what, b]) => { if (meet(lb, b)) problems.push(`${name}: the legend covers the ${what}`); });
      notes.forEach(n => { if (meet(lb, n.box)) problems.push(`${name}: the legend covers the ${n.what}`); });
    }
    const whole = box(gd);
    notes.forEach((n, j) => {
      if (n.box.l < whole.l - 1 || n.box.r > whole.r + 1) problems.push(`${name}: the ${n.what} is cut at the figure's edge`);
      if (!n.arrow) areas.forEach(a => { if (meet(n.box, a)) problems.push(`${name}: the ${n.what} covers the plot`); });
      labels.forEach(([what, b]) => { if (meet(n.box, b)) problems.push(`${name}: the ${n.what} covers the ${what}`); });
      notes.slice(j + 1).forEach(m => { if (meet(n.box, m.box)) problems.push(`${name}: the ${n.what} covers the ${m.what}`); });
    });
    if (title) areas.forEach(a => { if (meet(box(title), a)) problems.push(`${name}: its title covers the plot`); });
  });
  const width = document.documentElement.clientWidth;
  const tables = [...root.querySelectorAll('table.tm-table')];
  tables.forEach((table, i) => {
    const scroll = table.closest('.tm-scroll');
    const right = Math.min(width, scroll ? box(scroll).r : width);
    const heads = [...table.querySelectorAll('thead th')];
    const name = `table ${i + 1} (${heads.slice(0, 3).map(text).join(', ')})`;
    heads.forEach(th => {
      if (!text(th)) problems.push(`${name}: an empty header`);
      if (/_/.test(text(th))) problems.push(`${name}: a raw header "${text(th)}"`);
    });
    heads.slice(0, ${KEY}).forEach(th => {
      if (box(th).r > right + 1) problems.push(`${name}: its key column "${text(th)}" is outside the visible width (${Math.round(box(th).r)} > ${Math.round(right)})`);
    });
    table.querySelectorAll('tbody td').forEach(td => {
      if (/^\\["/.test(text(td))) problems.push(`${name}: a JSON list in a cell: ${text(td).slice(0, 40)}`);
    });
    const col = heads.findIndex(th => text(th) === 'Address');
    if (col >= 0) table.querySelectorAll(`tbody tr td:nth-child(${col + 1})`).forEach(td => {
      if (text(td) && !/^0x[0-9a-f]+$/.test(text(td))) problems.push(`${name}: an address not in hex: ${text(td)}`);
    });
    if (!table.closest('.tm-tablebox') || !table.closest('.tm-tablebox').querySelector('input.tm-filter'))
      problems.push(`${name}: no filter of its own`);
  });
  root.querySelectorAll('.tm-tree .tm-row .tm-name').forEach(n => { if (!text(n)) problems.push('layer tree: an empty name'); });
  return {problems, tables: tables.length, filters: root.querySelectorAll('input.tm-filter').length,
          figures: root.querySelectorAll('.js-plotly-plot').length,
          headers: tables.map(t => [...t.querySelectorAll('thead th')].map(text))};
}""".replace("${KEY}", str(KEY_COLUMNS))

#: the Source tab's listing: each header's right edge, and the page's width
SOURCE_EDGES = """(table) => ({width: document.documentElement.clientWidth,
  heads: [...table.querySelectorAll('thead th')].map(th => [th.textContent.trim(), th.getBoundingClientRect().right])})"""

#: the hover text of each trace's first and last points in a section (plotly's own hover, drawn
#: and read back from its hover layer: what a user reads under the mouse)
HOVERS = """(root) => {
  const out = [];
  root.querySelectorAll('.js-plotly-plot').forEach(gd => (gd.data || []).forEach((t, c) => {
    if (t.hoverinfo === 'skip' || t.type === 'heatmap' || t.type === 'icicle') return;
    const n = gd.calcdata && gd.calcdata[c] ? gd.calcdata[c].length : 0;
    [0, n - 1].filter((p, i, a) => p >= 0 && a.indexOf(p) === i).forEach(p => {
      try {
        Plotly.Fx.hover(gd, [{curveNumber: c, pointNumber: p}], (t.xaxis || 'x') + (t.yaxis || 'y'));
        const text = [...gd.querySelectorAll('.hoverlayer text')].map(e => e.textContent).join(' ');
        if (text) out.push(text);
      } catch (e) { /* a point plotly cannot hover (an empty trace) */ }
    });
    Plotly.Fx.unhover(gd);
  }));
  return out;
}"""

#: what no text or hover of the report shows: a float's noise (0.10000000000000001), NaN or inf, an
#: HTML entity shown as it is (plotly decodes numeric ones only), a JSON list, or step -1 (the
#: one span of a trace without ProfilerStep)
RAW = re.compile(r"\d\.\d*(?:0{6,}[1-9]|9{6,}\d)|\b0\.0*[1-9]\d{7,}|\b[1-9]\d*\.\d{8,}|\bNaN\b|\bnan\b|\binf\b|Infinity|undefined"
                 r"|&(?:quot|amp|lt|gt|#\d+|#x[0-9a-f]+);|\[\"|step -1\b")


def raw_bits(text: str) -> list[str]:
    """Each raw bit of ``text`` (``RAW``) with a little of its context."""
    return [text[max(0, m.start() - 40):m.end() + 10].replace("\n", " ") for m in RAW.finditer(text)]


DRAWN = ("s => [...document.querySelectorAll(s + ' div.plotly-graph-div')]"
         ".every(g => g.classList.contains('js-plotly-plot') && g.querySelector('.main-svg'))")


@pytest.mark.parametrize("name", ["quickstart", "bert", *GPU_TRACES, *CUDA_CAPTURES])
def test_every_tab_is_readable_at_a_glance(page: Any, reports: dict[str, Path], name: str,
                                           tmp_path: Path) -> None:
    page.errors.clear()
    page.goto(reports[name].as_uri())
    keys = [b.get_attribute("data-tab") for b in page.locator("nav button").all()]
    assert keys[:4] == ["overview", "layers", "timeline", "memory"] and "shapes" in keys, keys
    gpu = name in GPU_TRACES or name in CUDA_CAPTURES
    if name in ("quickstart", "bert", *CUDA_CAPTURES):  # the magic marks the cell's lines
        assert "source" in keys
    if gpu:
        assert {"roofline", "kernels"} <= set(keys)
    if name == "dlrm":
        assert "ranks" in keys
    problems: list[str] = []
    seen: dict[str, Any] = {}
    for key in keys:
        page.locator(f'nav button[data-tab="{key}"]').click()
        page.wait_for_function(DRAWN, arg=f"#tab-{key}", timeout=30_000)
        page.wait_for_timeout(150)  # a redraw, if plotly's automargin widened a margin (checked below)
        found = page.locator(f"#tab-{key}").evaluate(LAYOUT)
        problems += [f"{key}: {p}" for p in found["problems"]]
        section = page.locator(f"#tab-{key}")
        problems += [f"{key}: raw text \"{b}\"" for b in raw_bits(section.inner_text())]
        ticks = section.evaluate("r => [...r.querySelectorAll('.xtick text, .ytick text')].map(t => t.textContent).join(' | ')")
        problems += [f"{key}: a raw tick \"{b}\"" for b in raw_bits(ticks)]
        problems += [f"{key}: raw hover \"{b}\"" for h in section.evaluate(HOVERS) for b in raw_bits(h)]
        assert found["figures"] >= 1 and found["tables"] >= 1, (key, found)
        assert found["filters"] == found["tables"], (key, found)  # one filter per table
        seen[key] = found
        if key == "source":  # the heat listing: all its figure columns in sight, long code lines wrapped
            edges = page.locator("#tab-source .tm-source table").evaluate(SOURCE_EDGES)
            problems += [f"source: the listing's column \"{h}\" ends at {r:.0f} px, past the page's {edges['width']} px"
                         for h, r in edges["heads"] if r > edges["width"] + 1]
            assert edges["heads"] and edges["heads"][-1][0] == "live at peak", edges
        save_screenshot(page, tmp_path, f"{name}-{key}")
    if page.locator(".tm-always .js-plotly-plot").count():  # the iteration strip atop a capture's report
        problems += [f"header: {p}" for p in page.locator(".tm-always").evaluate(LAYOUT)["problems"]]
    assert not problems, "\n".join(problems)
    assert page.errors == []
    # every figure drawn once, in the margins written (none widened by plotly's automargin)
    assert test_report_browser.widened(page.evaluate(test_report_browser.MARGINS)) == []
    # the tables say what they answer, in words with units, and a one-process trace has no rank column
    overview = seen["overview"]["headers"]
    steps = overview[0]
    # the MI300X trace has no ProfilerStep: its one "step" is the whole trace, with no number
    assert steps[:2] == (["Duration (ms)", "Device window (ms)"] if name == "mi300x" else ["Step", "Duration (ms)"]), steps
    assert ("Rank" in steps) == (name == "dlrm")
    top = [h for h in overview if h[0] in ("Name", "Kernel")]
    assert top and all(any(re.search(r"\((ms|µs)\)$", c) for c in h[:KEY_COLUMNS]) for h in top), overview
    if gpu:  # the GPU's time leads: the first top list is kernels by GPU time
        assert overview[1][:3] == ["Kernel", "Total (ms)", "% of GPU time"], overview
        assert page.locator("#tab-overview .gtitle").nth(2).text_content().endswith("kernels by GPU time")
        assert seen["kernels"]["headers"][0][:3] == ["Kernel", "Op", "Total (ms)"], seen["kernels"]["headers"]
        firsts = page.locator("#tab-kernels .tm-tablebox tbody tr td:first-child").all_inner_texts()
        assert firsts and not any(k.startswith("void ") for k in firsts), firsts  # readable names, signature last
        roofline = seen["roofline"]["headers"][0]
        assert roofline[:4] == ["Name", "Input shapes", "% of roof", "GPU (ms)"], roofline
    shapes = seen["shapes"]["headers"][0]  # on a GPU the GPU's time leads here too
    assert shapes[:4] == ["Name", "Input shapes", "Calls", "GPU (ms)" if gpu else "Total (ms)"], shapes
    assert len(list(tmp_path.glob("*.png"))) == len(keys)


def test_each_table_filters_only_its_own_rows(page: Any, reports: dict[str, Path]) -> None:
    """The Overview's three tables (steps, top layers, top ops) each have a filter that
    filters that table alone."""
    page.goto(reports["quickstart"].as_uri())
    boxes = page.locator("#tab-overview .tm-tablebox")
    assert boxes.count() == 3
    rows = [boxes.nth(i).locator("tbody tr").count() for i in range(3)]
    ops = boxes.nth(2)
    ops.locator("input.tm-filter").fill("conv")
    names = ops.locator("tbody tr td:first-child").all_inner_texts()
    assert names and all("conv" in n.lower() for n in names) and len(names) < rows[2]  # case-insensitive
    assert [boxes.nth(i).locator("tbody tr").count() for i in range(2)] == rows[:2]
    cell = ops.locator("tbody tr td.tm-text").first  # long text is cut on screen, whole on hover
    assert cell.get_attribute("title") == cell.inner_text()
