"""The dashboard where users meet it: JupyterLab, in a real browser.

A JupyterLab server from this venv starts on a free loopback port with a token, in a
temporary root holding a copy of ``notebooks/quickstart.ipynb``; Playwright drives Debian's
Chromium (``/usr/bin/chromium``, the module's: ``conftest.browser``) to open the notebook and
run it with the menu (Run > Run All Cells), as a user would. Then:

- every cell ran and the saved notebook holds no error output (the kernel's side);
- the dashboard is there; each of its tabs can be selected and shows its plotly figure,
  drawn (an SVG of non-zero height, not just a ``.js-plotly-plot`` element);
- changing the step selector changes the figure of a step-dependent tab;
- the browser console shows no errors.

Each tab is also measured as the report's are (``test_browser_layout.LAYOUT``: no legend or note
over the data or a text, key columns in sight, no empty label), with every table's own filter, the
report name box and the "Save HTML report" button showing their whole text and the layer tree
beside the icicle at least 400 px wide.

Screenshots of each tab go to the module's tmp folder (and ``$TRACEMAGIC_SCREENSHOTS`` when set);
a failure's to ``jupyterlab/`` in ``conftest.ARTIFACTS`` (a temporary folder). The server (and its
kernel) is always stopped, by its process group, whatever happens.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest
import conftest
from test_browser_layout import LAYOUT

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = conftest.ARTIFACTS / "jupyterlab"
NOTEBOOK = "quickstart.ipynb"

pytestmark = [pytest.mark.browser, pytest.mark.slow]

import playwright.sync_api as sync_api  # noqa: E402


# ------------------------------------------------------------------------------------------
# the server
# ------------------------------------------------------------------------------------------
class Lab:
    def __init__(self, url: str, token: str, root: Path, log: Path) -> None:
        self.url, self.token, self.root, self.log = url, token, root, log

    def notebook_url(self, name: str) -> str:
        return f"{self.url}/lab/tree/{name}?token={self.token}"

    def log_tail(self, chars: int = 4000) -> str:
        return self.log.read_text(encoding="utf-8", errors="replace")[-chars:]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _user_settings(home: Path) -> dict[str, str]:
    """A private Jupyter home: settings, config, runtime and workspaces of its own."""
    settings = home / "settings"
    tracker = settings / "@jupyterlab" / "notebook-extension" / "tracker.jupyterlab-settings"
    tracker.parent.mkdir(parents=True)
    # every cell in the DOM (the default virtualises cells out of view)
    tracker.write_text(json.dumps({"windowingMode": "none"}), encoding="utf-8")
    labconfig = home / "config" / "labconfig"
    labconfig.mkdir(parents=True)
    # no "get notified about Jupyter news?" toast over the notebook, no network fetch
    (labconfig / "page_config.json").write_text(
        json.dumps({"disabledExtensions": {"@jupyterlab/apputils-extension:announcements": True}}),
        encoding="utf-8",
    )
    return {
        "JUPYTERLAB_SETTINGS_DIR": str(settings),
        "JUPYTER_CONFIG_DIR": str(home / "config"),
        "JUPYTER_RUNTIME_DIR": str(home / "runtime"),
        "JUPYTERLAB_WORKSPACES_DIR": str(home / "workspaces"),
    }


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    base = tmp_path_factory.mktemp("jupyterlab")
    root = base / "root"
    root.mkdir()
    shutil.copy(ROOT / "notebooks" / NOTEBOOK, root / NOTEBOOK)
    port, token = _free_port(), secrets.token_hex(16)
    env = {
        **os.environ,
        **_user_settings(base / "home"),
        # 2 shared cores: OpenMP threads spinning for busy cores make torch crawl
        "OMP_NUM_THREADS": "1",
    }
    cmd = [
        sys.executable, "-m", "jupyter", "lab", "--no-browser",
        "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}", "--ServerApp.port_retries=0",
        f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
        "--ServerApp.terminals_enabled=False",
        "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
        "--LabApp.extension_manager=readonly",
    ]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-root")
    log = base / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    server = Lab(f"http://127.0.0.1:{port}", token, root, log)
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                with urllib.request.urlopen(f"{server.url}/api/status?token={token}", timeout=2):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"JupyterLab did not start (exit {proc.poll()}):\n{server.log_tail()}")
                time.sleep(0.3)
        yield server
    finally:
        _stop(proc)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """Stop the server and everything it started (its kernel): its own process group."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        except ProcessLookupError:
            pass
    try:  # the kernel may outlive a server killed mid-shutdown: same group
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


# ------------------------------------------------------------------------------------------
# the browser session: open the notebook, Run All, keep the page for the tests
# ------------------------------------------------------------------------------------------
ALL_RAN = """() => {
  const prompts = [...document.querySelectorAll('.jp-Notebook .jp-CodeCell .jp-InputArea-prompt')]
      .map(e => e.textContent.trim());
  return prompts.length > 0 && prompts.every(p => /^\\[\\d+\\]:$/.test(p));
}"""

#: the visible tab panel of the dashboard, and what its plotly figures look like
VISIBLE_FIGURES = """(dash) => {
  const panel = [...dash.querySelectorAll(':scope > .widget-tab-contents > .lm-Widget')]
      .find(p => !p.classList.contains('lm-mod-hidden'));
  if (!panel) return null;
  return [...panel.querySelectorAll('.js-plotly-plot')].map(gd => {
    const box = gd.getBoundingClientRect();
    const svg = gd.querySelector('.main-svg');
    return {height: box.height, width: box.width, svg: !!svg && svg.getBoundingClientRect().height,
            traces: (gd.data || []).length,
            title: ((gd.layout || {}).title || {}).text || '',
            signature: JSON.stringify([(gd.data || []).map(t => [t.name, t.x, t.y, t.base]),
                                       (gd.layout || {}).shapes, ((gd.layout || {}).xaxis || {}).range])};
  });
}"""


class Session:
    def __init__(self, page: Any, console: list[tuple[str, str]]) -> None:
        self.page = page
        #: where the screenshots go
        self.folder = Path(".")
        self.console = console
        #: the dashboard's ipywidgets Tab, and the box holding it with the controls
        self.dashboard = page.locator(".jp-OutputArea-output .widget-tab").first
        self.root = self.dashboard.locator("xpath=..")

    def figures(self) -> list[dict[str, Any]] | None:
        return self.dashboard.evaluate(VISIBLE_FIGURES)

    def wait_for_drawn_figure(self, timeout: float = 30) -> list[dict[str, Any]]:
        """The visible tab's figures once one is drawn (an SVG of non-zero height)."""
        deadline = time.monotonic() + timeout
        figures: list[dict[str, Any]] | None = None
        while time.monotonic() < deadline:
            figures = self.figures()
            if figures and any(f["svg"] and f["height"] > 50 for f in figures):
                return figures
            self.page.wait_for_timeout(250)
        _save_failure(self.page, "no-figure")
        shown = [{k: v for k, v in f.items() if k != "signature"} for f in figures or []]
        hint = ""
        if figures and any(f["svg"] and not f["height"] for f in figures):
            hint = (
                "\nThe SVG is drawn but its container is 0 px high, so nothing shows: plotly's "
                "config responsive=True sizes the plot to its parent, which an ipywidgets Output "
                "in JupyterLab leaves without a height (jupyterlab-plotly's resize then drops "
                "layout.height). Send the figure with responsive=False (the plot still takes the "
                "output's width)."
            )
        raise AssertionError(f"no plotly figure drawn (an SVG of non-zero height) in the visible tab: {shown}{hint}")

    def show_dashboard(self) -> None:
        """Scroll the dashboard (controls, tab bar, first figure) to the top of the view."""
        self.root.evaluate("(box) => box.scrollIntoView({block: 'start'})")
        self.page.wait_for_timeout(300)

    def screenshot(self, name: str) -> Path:
        return conftest.save_screenshot(self.page, self.folder, f"jupyterlab-{name}")


@pytest.fixture(scope="module")
def session(lab: Lab, browser: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Session]:
    """The notebook opened in a page of the module's chromium (``conftest.browser``), run with Run All."""
    console: list[tuple[str, str]] = []
    page = browser.new_page(viewport={"width": 1400, "height": 1400})
    try:
        page.set_default_timeout(60_000)
        page.on("console", lambda m: console.append((m.type, m.text)))
        page.on("pageerror", lambda e: console.append(("pageerror", str(e))))
        page.goto(lab.notebook_url(NOTEBOOK))
        page.wait_for_selector(".jp-NotebookPanel .jp-Notebook .jp-CodeCell")
        _wait_for_kernel(lab, page)
        page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).click()
        page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Run All Cells$")).click()
        _accept_kernel_dialog(page)
        try:
            page.wait_for_function(ALL_RAN, timeout=150_000)
            page.wait_for_selector(".jp-NotebookPanel .jp-Notebook-ExecutionIndicator[data-status='idle']")
        except sync_api.Error:
            _save_failure(page, "run-all")
            raise AssertionError(f"Run All did not finish:\n{_errors_on_page(page)}\n{lab.log_tail()}") from None
        session = Session(page, console)
        session.folder = tmp_path_factory.mktemp("jupyterlab-shots")
        yield session
    finally:
        page.close()


def _wait_for_kernel(lab: Lab, page: Any, timeout: float = 90) -> None:
    """Until the notebook's kernel runs (server side) and the page shows it idle."""
    deadline = time.monotonic() + timeout
    while True:
        with urllib.request.urlopen(f"{lab.url}/api/sessions?token={lab.token}", timeout=5) as resp:
            sessions = json.load(resp)
        states = [s["kernel"]["execution_state"] for s in sessions if s.get("path", "").endswith(NOTEBOOK)]
        if "idle" in states:
            break
        if time.monotonic() > deadline:
            _save_failure(page, "kernel")
            raise AssertionError(f"the notebook's kernel did not start: {sessions}\n{lab.log_tail()}")
        page.wait_for_timeout(300)
    page.wait_for_selector(".jp-NotebookPanel .jp-Notebook-ExecutionIndicator[data-status='idle']")


def _accept_kernel_dialog(page: Any) -> None:
    """JupyterLab asks for a kernel when Run All races the session's start: take python3."""
    dialog = page.locator(".jp-Dialog", has_text="Select Kernel")
    try:
        dialog.wait_for(timeout=2_000)
    except sync_api.Error:
        return
    dialog.locator(".jp-Dialog-button.jp-mod-accept").click()


def _save_failure(page: Any, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"failed-{name}.png"))


def _errors_on_page(page: Any) -> str:
    return "\n".join(page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']").all_inner_texts())


# ------------------------------------------------------------------------------------------
# the tests (in file order; they share one browser session)
# ------------------------------------------------------------------------------------------
def test_every_cell_ran_without_a_kernel_error(session: Session, lab: Lab) -> None:
    import nbformat

    page = session.page
    page.locator(".jp-NotebookPanel .jp-Notebook").first.click(position={"x": 5, "y": 5})
    page.keyboard.press("Control+s")
    page.wait_for_selector(".jp-NotebookPanel-toolbar, .jp-Toolbar")
    deadline = time.monotonic() + 30
    while True:  # saved when the document tab loses its dirty mark
        dirty = page.locator(".lm-DockPanel-tabBar .lm-TabBar-tab.jp-mod-dirty").count()
        if not dirty or time.monotonic() > deadline:
            break
        page.wait_for_timeout(250)
    assert not dirty, "the notebook could not be saved"
    nb = nbformat.read(lab.root / NOTEBOOK, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.execution_count for c in code), "not every cell ran"
    errors = [(c.source[:80], o.ename, o.evalue) for c in code for o in c.outputs if o.output_type == "error"]
    assert not errors, errors
    # the dashboard went out as a widget view, with the text summary beside it
    views = [o for c in code for o in c.outputs if "application/vnd.jupyter.widget-view+json" in o.get("data", {})]
    assert views and "text/plain" in views[0].data


def test_the_dashboard_renders_with_a_drawn_figure(session: Session) -> None:
    assert session.dashboard.count() == 1, "no dashboard (ipywidgets Tab) in the notebook's outputs"
    session.dashboard.scroll_into_view_if_needed()
    figures = session.wait_for_drawn_figure()
    assert all(f["traces"] for f in figures), figures


def test_every_tab_can_be_selected_and_shows_its_figure(session: Session) -> None:
    tabs = session.dashboard.locator(":scope > .widget-tab-bar .lm-TabBar-tab")
    titles = [t.strip() for t in tabs.all_inner_texts()]
    assert titles[:2] == ["Overview", "Layers"], titles
    shots = []
    problems: list[str] = []
    # the report name box and the Save button show all their text
    shown, cut = session.root.evaluate("""(box) => {
        const all = [...box.querySelectorAll(':scope > .widget-hbox .widget-button, :scope > .widget-hbox .widget-text input')];
        return [all.map(e => e.textContent.trim() || e.value),
                all.filter(e => e.scrollWidth > e.clientWidth + 1).map(e => e.textContent.trim() || e.value)]; }""")
    assert "Save HTML report" in shown and any(v.endswith(".report.html") for v in shown), shown
    assert not cut, f"cut off: {cut}"
    for index, title in enumerate(titles):
        tab = tabs.nth(index)
        tab.click()
        assert "lm-mod-current" in (tab.get_attribute("class") or ""), f"tab {title} was not selected"
        figures = session.wait_for_drawn_figure()
        assert all(f["traces"] for f in figures if f["svg"]), f"{title}: a figure without data: {figures}"
        session.page.wait_for_timeout(300)  # plotly's automargin redraw
        found = session.dashboard.evaluate(f"(dash) => ({LAYOUT})([...dash.querySelectorAll(':scope > .widget-tab-contents > .lm-Widget')].find(p => !p.classList.contains('lm-mod-hidden')))")
        # the widget's tables have their filter in a Text widget above them, not in a .tm-tablebox
        problems += [f"{title}: {p}" for p in found["problems"] if not p.endswith("no filter of its own")]
        panel = session.dashboard.locator(":scope > .widget-tab-contents > .lm-Widget:not(.lm-mod-hidden)")
        filters = panel.locator("input[placeholder='filter rows…']").count()
        assert filters == found["tables"], f"{title}: {filters} filters for {found['tables']} tables"
        if panel.locator(".tm-tree").count():  # the layer tree is readable beside (or under) the icicle
            width = panel.locator(".tm-tree").first.evaluate("t => t.getBoundingClientRect().width")
            assert width >= 400, f"the layer tree is {width:.0f} px wide"
        session.show_dashboard()
        shots.append(session.screenshot(f"{index + 1:02d}-{title.lower()}"))
    assert all(p.stat().st_size > 10_000 for p in shots)
    assert not problems, "\n".join(problems)


def test_the_step_selector_changes_what_is_shown(session: Session) -> None:
    dash = session.dashboard
    tabs = dash.locator(":scope > .widget-tab-bar .lm-TabBar-tab")
    timeline = tabs.filter(has_text=re.compile(r"^Timeline$"))
    assert timeline.count() == 1, "no Timeline tab"
    timeline.click()
    before = session.wait_for_drawn_figure()
    label = session.page.locator("label", has_text=re.compile(r"^step$"))
    select = session.root.locator(".widget-dropdown", has=label).locator("select")
    assert select.count() == 1, "no step selector above the dashboard's tabs"
    options = select.locator("option").all_inner_texts()
    assert options[0].replace("\xa0", " ") == "all steps" and len(options) >= 3, options
    shown = select.evaluate("(s) => s.selectedIndex")
    assert shown == 0, (
        f"the step selector shows option {shown} at first, not 'all steps' (-1: nothing, a blank box). "
        "ipywidgets 8 treats a Dropdown value of None as 'no selection': give 'all steps' a value "
        "other than None"
    )
    select.select_option(index=2)  # the second recorded step
    deadline = time.monotonic() + 30
    after = before
    while time.monotonic() < deadline:
        after = session.figures() or []
        if after and [f["signature"] for f in after] != [f["signature"] for f in before] and any(f["svg"] for f in after):
            break
        session.page.wait_for_timeout(250)
    assert [f["signature"] for f in after] != [f["signature"] for f in before], "the figure did not change with the step"
    session.wait_for_drawn_figure()
    session.show_dashboard()
    session.screenshot(f"timeline-{options[2].replace(chr(160), ' ').replace(' ', '-')}")


#: the visible tab panel's plotly outputs: a live graph, or the still PNG JupyterLab's plotly
#: renderer shows for an output whose data holds one (its snapshot, taken after each draw)
LIVE_OR_STILL = """(dash) => {
  const panel = [...dash.querySelectorAll(':scope > .widget-tab-contents > .lm-Widget')]
      .find(p => !p.classList.contains('lm-mod-hidden'));
  return [...panel.querySelectorAll('.jp-RenderedPlotly')].map(o => {
    const img = o.querySelector('.plot-img'), graph = o.querySelector('.plot-container');
    return {still: !!img && img.style.display !== 'none' && !!img.getAttribute('src'),
            live: !!graph && graph.style.display !== 'none'};
  });
}"""


def test_a_redrawn_tab_keeps_its_figures_live(session: Session) -> None:
    """The step selector redraws the selected tab (at once, or when it is next selected); where
    its figure does not change (Source and Flame show all steps) the figure stays a live plotly
    graph, not a still image of it."""
    dash = session.dashboard
    page = session.page
    tabs = dash.locator(":scope > .widget-tab-bar .lm-TabBar-tab")
    select = session.root.locator(".widget-dropdown", has=page.locator("label", has_text=re.compile(r"^step$"))).locator("select")
    options = [o.replace("\xa0", " ") for o in select.locator("option").all_inner_texts()]
    panel = dash.locator(":scope > .widget-tab-contents > .lm-Widget:not(.lm-mod-hidden)")

    def shown_after(change: str, title: str, step: str) -> None:
        page.mouse.move(1, 1)  # not over a figure: the pointer entering a still image draws it
        panel.get_by_text(f"does not follow the step selector ({step})").wait_for(timeout=30_000)
        page.wait_for_timeout(1000)
        shown = dash.evaluate(LIVE_OR_STILL)
        assert shown and all(f["live"] and not f["still"] for f in shown), (
            f"{title}, {change}: its figures are {shown}: a still PNG where the box holding a figure "
            "was made anew (the page draws it again from its copy, which holds the renderer's snapshot); "
            "keep the same box across redraws"
        )

    if select.evaluate("(s) => s.selectedIndex") == 0:  # run alone: a step chosen before the tabs are selected
        select.select_option(index=2)
    for title, index in (("Source", 1), ("Flame", len(options) - 1)):
        tab = tabs.filter(has_text=re.compile(f"^{title}$"))
        if not tab.count():
            continue
        current = options[select.evaluate("(s) => s.selectedIndex")]
        tab.click()  # redrawn for the step chosen since it was drawn
        shown_after("selected", title, current)
        select.select_option(index=index)
        shown_after(f"{options[index]} selected", title, options[index])


def test_the_flame_search_draws_once_per_search_not_per_keystroke(session: Session) -> None:
    """Each search draws the flame graphs again (hundreds of boxes, seconds on a big trace): typing
    a word must not redraw them at every key, only when the search is given (Enter)."""
    dash, page = session.dashboard, session.page
    tab = dash.locator(":scope > .widget-tab-bar .lm-TabBar-tab").filter(has_text=re.compile(r"^Flame$"))
    if not tab.count():
        pytest.skip("no Flame tab")
    tab.click()
    session.wait_for_drawn_figure()
    panel = dash.locator(":scope > .widget-tab-contents > .lm-Widget:not(.lm-mod-hidden)")
    box = panel.locator("input[placeholder='search boxes…']")
    # count the plotly outputs drawn anew in the tab from now on
    panel.evaluate("""(p) => { window.__tmDrawn = 0; new MutationObserver(ms => ms.forEach(m => m.addedNodes.forEach(n => {
        if (n.nodeType === 1 && (n.matches('.jp-RenderedPlotly') || n.querySelector('.jp-RenderedPlotly'))) window.__tmDrawn++; })))
        .observe(p, {childList: true, subtree: true}); }""")
    box.click()
    box.press_sequentially("aten", delay=150)
    page.wait_for_timeout(2000)
    while_typing = page.evaluate("() => window.__tmDrawn")
    box.press("Enter")
    panel.get_by_text(re.compile(r"boxes match")).wait_for(timeout=30_000)
    assert while_typing == 0, f"the flame graphs were drawn again {while_typing} times while 'aten' was typed"
    box.fill("")
    box.press("Enter")


#: each fact of the visible tab: where its label (dt) and its value (dd) are drawn
FACT_ROWS = """(dash) => {
  const panel = [...dash.querySelectorAll(':scope > .widget-tab-contents > .lm-Widget')]
      .find(p => !p.classList.contains('lm-mod-hidden'));
  return [...panel.querySelectorAll('dl.tm-facts > dt')].map(dt => {
    const a = dt.getBoundingClientRect(), b = dt.nextElementSibling.getBoundingClientRect();
    return {label: dt.textContent, top: a.top, right: a.right, value_top: b.top, value_left: b.left};
  });
}"""


def test_the_facts_keep_their_labels_in_a_narrow_notebook(session: Session) -> None:
    """JupyterLab styles every ``dl`` in an output (``dt`` floated at 20% of the width): in a narrow
    notebook a long label wrapped and the values slid beside the wrong labels. Each value stays on
    its label's row, right of it."""
    page = session.page
    session.dashboard.locator(":scope > .widget-tab-bar .lm-TabBar-tab").filter(has_text=re.compile(r"^Overview$")).click()
    session.wait_for_drawn_figure()
    page.set_viewport_size({"width": 800, "height": 1400})
    try:
        page.wait_for_timeout(800)
        rows = session.dashboard.evaluate(FACT_ROWS)
        session.show_dashboard()
        session.screenshot("overview-narrow")
    finally:
        page.set_viewport_size({"width": 1400, "height": 1400})
    wrong = [r["label"] for r in rows if abs(r["top"] - r["value_top"]) > 2 or r["right"] > r["value_left"]]
    assert len(rows) >= 5 and not wrong, f"values not beside their labels: {wrong}"


def test_no_errors_in_the_browser_console(session: Session) -> None:
    errors = [(kind, text) for kind, text in session.console if kind in ("error", "pageerror")]
    assert not errors, "\n".join(f"{k}: {t[:500]}" for k, t in errors)
