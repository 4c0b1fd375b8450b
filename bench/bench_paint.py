"""How fast the standalone HTML report paints in a real browser, against ``main``'s report.

For the quickstart capture (``notebooks/quickstart.ipynb`` run headless with the magic, as
``make demo`` does; or ``--quickstart DIR``) and ``tests/data/traces/hta_control.json.gz``,
this writes two reports per trace, each in a fresh process: one by this checkout's code and
one by the baseline's (``--baseline``, default ``/work/main``, run with
``PYTHONPATH=<baseline>``). Then, round by round and interleaved (baseline, candidate,
baseline, ...; a fresh headless Chromium for every page: Debian's ``/usr/bin/chromium``
driven by Playwright, as the browser tests do), it opens each report from disk and measures
with ``performance.now()`` (milliseconds since navigation start):

- ``first figure``: the first frame at which a plotly figure is drawn and visible. A page
  script installed before the report's own wraps ``Plotly.newPlot``/``Plotly.react``; a
  figure counts as drawn once its promise has resolved and its ``<div>`` has a non-zero
  size (a figure drawn inside a hidden tab counts only once its tab shows), and the time
  is that of the next animation frame;
- ``tab <key>``: for every tab in turn, from the click on its button to the frame at which
  every figure of the tab is drawn and visible.

Then (``--lab-rounds``, default 1; 0 skips it) the dashboard where users meet it: for the
baseline and the candidate in turn, a JupyterLab server whose kernel imports that checkout
opens ``notebooks/quickstart.ipynb`` in the same Chromium, runs it with Run > Run All Cells
as a user would, and clicks each tab of the dashboard once: seconds from the click to the
tab's plotly figure drawn (an SVG of non-zero height with data), the first opening of each
tab, so the kernel builds it.

It prints the medians, the goals of issue 23 with ``pass`` / ``falls short`` (first figure
at most 1 s after the page starts loading, every tab at most 0.3 s, the Timeline tab in
JupyterLab under 1 s) and each figure's ratio candidate / baseline, then one line per goal:
its verdict, with what falls short (else the slowest figure) and its ratio to the baseline. Absolute times depend on
the machine and how busy it is; the ratios are of the same measurement in the same run.

Usage: ``.venv/bin/python bench/bench_paint.py [--rounds 3] [--lab-rounds 1]
[--baseline /work/main] [--quickstart DIR] [--keep DIR]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
HTA = ROOT / "tests" / "data" / "traces" / "hta_control.json.gz"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]
#: goals (issue 23), milliseconds
FIRST_FIGURE_GOAL_MS = 1000.0
TAB_GOAL_MS = 300.0
#: the dashboard's Timeline tab in JupyterLab, seconds
LAB_TIMELINE_GOAL_S = 1.0

#: installed before the report's scripts: records when figures are drawn and visible
INIT_SCRIPT = """
(() => {
  const st = window.__tmPaint = {first: null, done: new WeakSet()};
  const visible = gd => { const r = gd.getBoundingClientRect(); return r.width > 0 && r.height > 0; };
  const drawn = gd => st.done.has(gd) && gd.isConnected && visible(gd);
  st.drawn = drawn;
  function check() {
    if (st.first !== null || st.pending) return;
    for (const gd of document.querySelectorAll('.js-plotly-plot')) {
      if (drawn(gd)) { st.pending = true; requestAnimationFrame(() => { st.first = performance.now(); }); return; }
    }
  }
  st.check = check;
  function wrap(P) {
    for (const name of ['newPlot', 'react']) {
      const original = P[name];
      if (typeof original !== 'function' || original.__tmWrapped) continue;
      const wrapped = function(gd) {
        const el = typeof gd === 'string' ? document.getElementById(gd) : gd;
        const result = original.apply(this, arguments);
        Promise.resolve(result).then(() => { if (el) st.done.add(el); check(); });
        return result;
      };
      wrapped.__tmWrapped = true;
      P[name] = wrapped;
    }
  }
  let plotly;
  Object.defineProperty(window, 'Plotly', {configurable: true, enumerable: true,
    get() { return plotly; }, set(v) { plotly = v; if (v) wrap(v); }});
  new MutationObserver(check).observe(document, {subtree: true, childList: true, attributes: true,
                                                  attributeFilter: ['class', 'style']});
})();
"""

#: click tab ``key``'s button; resolve with the ms until every figure of the tab is drawn
CLICK_TAB = """
(key) => new Promise((resolve, reject) => {
  const st = window.__tmPaint;
  const section = document.getElementById('tab-' + key);
  const button = document.querySelector('nav button[data-tab="' + key + '"]');
  const t0 = performance.now();
  button.click();
  const expected = section.querySelectorAll('.plotly-graph-div').length;
  function poll() {
    const plots = [...section.querySelectorAll('.js-plotly-plot')];
    if (plots.length >= expected && plots.every(st.drawn)) { resolve(performance.now() - t0); return; }
    if (performance.now() - t0 > 30000) { reject(new Error('tab ' + key + ' not drawn in 30 s')); return; }
    requestAnimationFrame(poll);
  }
  requestAnimationFrame(poll);
})
"""

WRITE_REPORT = """
import sys, warnings
warnings.simplefilter("ignore")
import tracemagic
tracemagic.load(sys.argv[1], use_cache=False).report(sys.argv[2])
"""


def quickstart_capture(folder: Path) -> Path:
    """Run the quickstart notebook headless with the magic (``make demo``) into ``folder``;
    the directory of its first capture."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-c", "import sys; from tracemagic.demo import run; run(sys.argv[1])", str(folder)],
                   check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL)
    captures = sorted((folder / "traces").glob("capture-*"))
    if not captures:
        raise SystemExit(f"the quickstart wrote no capture under {folder / 'traces'}")
    return captures[0]


def write_report(code: Path, trace: Path, out: Path) -> Path:
    """The report of ``trace`` written by the tracemagic in ``code`` (a fresh process)."""
    env = {**os.environ, "PYTHONPATH": str(code), "TRACEMAGIC_CACHE_DIR": str(out.parent / "cache")}
    subprocess.run([sys.executable, "-c", WRITE_REPORT, str(trace), str(out)], check=True, env=env, cwd=out.parent)
    return out


def measure(playwright: Any, report: Path) -> dict[str, float]:
    """Open ``report`` in a fresh Chromium: the first figure, then each tab's draw time (ms)."""
    browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
    try:
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.add_init_script(INIT_SCRIPT)
        page.goto(report.as_uri(), wait_until="load")
        page.wait_for_function("window.__tmPaint.first !== null", timeout=60_000)
        out = {"first figure": float(page.evaluate("window.__tmPaint.first"))}
        keys = page.eval_on_selector_all("nav button", "bs => bs.map(b => b.dataset.tab)")
        for key in keys[1:] + keys[:1]:  # every other tab, then back to the first
            out[f"tab {key}"] = float(page.evaluate(CLICK_TAB, key))
        if errors:
            raise SystemExit(f"{report}: errors in the browser: {errors}")
        return out
    finally:
        browser.close()


# -- the dashboard in JupyterLab ---------------------------------------------------------------
#: the visible tab panel's plotly figures of the dashboard: drawn (an SVG of non-zero height, with data)?
LAB_DRAWN = """(dash) => {
  const panel = [...dash.querySelectorAll(':scope > .widget-tab-contents > .lm-Widget')]
      .find(p => !p.classList.contains('lm-mod-hidden'));
  if (!panel) return false;
  return [...panel.querySelectorAll('.js-plotly-plot')].some(gd => {
    const svg = gd.querySelector('.main-svg');
    return !!svg && svg.getBoundingClientRect().height > 50 && (gd.data || []).length > 0;
  });
}"""
LAB_ALL_RAN = """() => {
  const prompts = [...document.querySelectorAll('.jp-Notebook .jp-CodeCell .jp-InputArea-prompt')]
      .map(e => e.textContent.trim());
  return prompts.length > 0 && prompts.every(p => /^\\[\\d+\\]:$/.test(p));
}"""


def lab_tabs(playwright: Any, code: Path, folder: Path) -> dict[str, float]:
    """Run the quickstart notebook in JupyterLab (kernel importing tracemagic from ``code``)
    with Run All, then click each dashboard tab once: seconds from the click to its figure drawn."""
    import re
    import secrets

    import playwright.sync_api as playwright_api
    import shutil
    import signal
    import socket
    import time
    import urllib.request

    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    root = folder / "root"
    root.mkdir()
    shutil.copy(ROOT / "notebooks" / "quickstart.ipynb", root / "quickstart.ipynb")
    settings = folder / "home" / "settings" / "@jupyterlab" / "notebook-extension" / "tracker.jupyterlab-settings"
    settings.parent.mkdir(parents=True)
    settings.write_text('{"windowingMode": "none"}', encoding="utf-8")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    token = secrets.token_hex(16)
    env = {**os.environ, "PYTHONPATH": str(code), "OMP_NUM_THREADS": "1", "TRACEMAGIC_CACHE_DIR": str(folder / "cache"),
           "JUPYTERLAB_SETTINGS_DIR": str(folder / "home" / "settings"), "JUPYTER_CONFIG_DIR": str(folder / "home" / "config"),
           "JUPYTER_RUNTIME_DIR": str(folder / "home" / "runtime"), "JUPYTERLAB_WORKSPACES_DIR": str(folder / "home" / "ws")}
    cmd = [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}",
           "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
           "--ServerApp.terminals_enabled=False", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
           "--LabApp.extension_manager=readonly"] + (["--allow-root"] if os.geteuid() == 0 else [])
    with open(folder / "server.log", "wb") as log:
        proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"JupyterLab did not start: see {folder / 'server.log'}") from None
                time.sleep(0.3)
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1400})
            page.set_default_timeout(120_000)
            page.goto(f"{url}/lab/tree/quickstart.ipynb?token={token}")
            while True:  # the notebook's kernel started (server side), then idle on the page
                with urllib.request.urlopen(f"{url}/api/sessions?token={token}", timeout=5) as resp:
                    if any(x["kernel"]["execution_state"] == "idle" for x in json.load(resp)):
                        break
                if time.monotonic() > deadline + 90:
                    raise SystemExit(f"the notebook's kernel did not start: see {folder / 'server.log'}")
                time.sleep(0.3)
            page.wait_for_selector(".jp-NotebookPanel .jp-Notebook-ExecutionIndicator[data-status='idle']")
            page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).click()
            page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Run All Cells$")).click()
            dialog = page.locator(".jp-Dialog", has_text="Select Kernel")
            try:
                dialog.wait_for(timeout=2_000)
                dialog.locator(".jp-Dialog-button.jp-mod-accept").click()
            except playwright_api.Error:  # no dialog: the kernel was ready
                pass
            try:
                page.wait_for_function(LAB_ALL_RAN, timeout=240_000)
            except playwright_api.Error:
                page.screenshot(path=str(folder / "run-all.png"))
                raise SystemExit(f"Run All did not finish: see {folder / 'run-all.png'}, {folder / 'server.log'}") from None
            dash = page.locator(".jp-OutputArea-output .widget-tab").first
            dash.scroll_into_view_if_needed()
            page.wait_for_function(LAB_DRAWN, arg=dash.element_handle(), timeout=60_000)
            tabs = dash.locator(":scope > .widget-tab-bar .lm-TabBar-tab")
            out = {}
            for i, title in enumerate(t.strip() for t in tabs.all_inner_texts()):
                if i == 0:
                    continue
                t0 = time.monotonic()
                tabs.nth(i).click()
                page.wait_for_function(LAB_DRAWN, arg=dash.element_handle(), timeout=60_000, polling=20)
                out[f"lab {title}"] = time.monotonic() - t0
            return out
        finally:
            browser.close()
    finally:  # the server and its kernel: their own process group
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
                proc.wait(timeout=15)
            except (ProcessLookupError, PermissionError):
                break
            except subprocess.TimeoutExpired:
                continue

def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--baseline", type=Path, default=Path("/work/main"),
                        help="a tracemagic checkout whose report is the baseline (default /work/main)")
    parser.add_argument("--quickstart", type=Path, help="a quickstart capture directory (default: run the quickstart)")
    parser.add_argument("--keep", type=Path, help="write the reports here (default: a temporary folder)")
    parser.add_argument("--lab-rounds", type=int, default=1,
                        help="rounds of the quickstart in JupyterLab, dashboard tabs timed (0: skip)")
    args = parser.parse_args(argv)
    if not Path(CHROMIUM).exists():
        raise SystemExit(f"Debian's chromium is not installed at {CHROMIUM}: run scripts/install_chromium.sh")
    import playwright.sync_api as playwright_api

    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.keep or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        quickstart = args.quickstart or quickstart_capture(Path(tmp) / "demo")
        traces = {"quickstart": quickstart, "hta_control": HTA}
        variants = {"baseline": args.baseline.resolve(), "candidate": ROOT}
        reports = {(t, v): write_report(code, path, folder / f"{t}-{v}.html")
                   for t, path in traces.items() for v, code in variants.items()}
        times: dict[tuple[str, str], list[dict[str, float]]] = {key: [] for key in reports}
        with playwright_api.sync_playwright() as p:
            for r in range(args.rounds):
                for t in traces:
                    order = ("baseline", "candidate") if r % 2 == 0 else ("candidate", "baseline")
                    for v in order:
                        times[t, v].append(measure(p, reports[t, v]))
        print(f"report paint in headless Chromium, medians of {args.rounds} rounds (ms since navigation start; "
              f"tab: click to drawn); baseline {variants['baseline']}, candidate {ROOT}")
        verdicts = []
        #: goal -> [(what, candidate, baseline, within the goal)], for the summary at the end
        goals: dict[str, list[tuple[str, float, float, bool]]] = {
            f"first figure <= {FIRST_FIGURE_GOAL_MS / 1000:g} s": [],
            f"every tab <= {TAB_GOAL_MS / 1000:g} s": [],
        }
        for t in traces if args.rounds > 0 else ():
            base, cand = times[t, "baseline"], times[t, "candidate"]
            size_b, size_c = (reports[t, v].stat().st_size for v in ("baseline", "candidate"))
            print(f"\n{t}: report {size_c / 2**20:.2f} MiB (baseline {size_b / 2**20:.2f} MiB)")
            print(f"  {'measure':<18} {'baseline':>9} {'candidate':>9} {'ratio':>7}  goal")
            for name in cand[0]:
                c = statistics.median(m[name] for m in cand)
                b = statistics.median(m[name] for m in base) if name in base[0] else float("nan")
                goal = FIRST_FIGURE_GOAL_MS if name == "first figure" else TAB_GOAL_MS
                word = "pass" if c <= goal else "falls short"
                verdicts.append(word)
                which = list(goals)[0 if name == "first figure" else 1]
                goals[which].append((f"{t} {name}", c / 1000, b / 1000, c <= goal))
                print(f"  {name:<18} {b:9.0f} {c:9.0f} {c / b:7.2f}  <= {goal:.0f} ms: {word}")
        if args.lab_rounds > 0:
            lab: dict[str, list[dict[str, float]]] = {"baseline": [], "candidate": []}
            with playwright_api.sync_playwright() as p:
                for r in range(args.lab_rounds):
                    for v in (("baseline", "candidate") if r % 2 == 0 else ("candidate", "baseline")):
                        lab[v].append(lab_tabs(p, variants[v], folder / f"lab-{v}-{r}"))
            print(f"\nthe quickstart's dashboard in JupyterLab after Run All, medians of {args.lab_rounds} round(s): "
                  "s from a tab's first click to its figure drawn")
            print(f"  {'tab':<18} {'baseline':>9} {'candidate':>9} {'ratio':>7}  goal")
            for name in lab["candidate"][0]:
                c = statistics.median(m[name] for m in lab["candidate"])
                b = statistics.median(m[name] for m in lab["baseline"] if name in m)
                goal = f"< {LAB_TIMELINE_GOAL_S:.0f} s: " + ("pass" if c < LAB_TIMELINE_GOAL_S else "falls short") \
                    if name == "lab Timeline" else ""
                if goal:
                    verdicts.append("pass" if c < LAB_TIMELINE_GOAL_S else "falls short")
                    goals[f"JupyterLab Timeline < {LAB_TIMELINE_GOAL_S:g} s"] = [
                        ("quickstart lab Timeline", c, b, c < LAB_TIMELINE_GOAL_S)]
                print(f"  {name:<18} {b:9.2f} {c:9.2f} {c / b:7.2f}  {goal}")
        print("\nthe goals of issue 23 (candidate; ratio: candidate / baseline, the same measure in this run)")
        for goal, rows in goals.items():
            if not rows:
                continue
            short = [r for r in rows if not r[3]]
            worst = max(rows, key=lambda r: r[1])
            shown = short or [worst]  # what falls short, else the slowest
            print(f"  {goal:<28} {'pass' if not short else 'falls short':<11} "
                  + "; ".join(f"{w} {c:.2f} s ({c / b:.2f}x main's {b:.2f} s)" for w, c, b, _ in shown)
                  + ("" if short else " (the slowest)"))
        print(f"\ngoals: first figure <= {FIRST_FIGURE_GOAL_MS:.0f} ms, every tab <= {TAB_GOAL_MS:.0f} ms"
              + (f", the Timeline in JupyterLab < {LAB_TIMELINE_GOAL_S:.0f} s" if args.lab_rounds > 0 else "") + ": "
              + ("nothing measured" if not verdicts
                 else "pass" if all(w == "pass" for w in verdicts) else "falls short"))
        print(f"machine: {os.cpu_count()} CPUs, load average {load_before[0]:.1f} at the start, "
              f"{os.getloadavg()[0]:.1f} at the end (absolute times move with it; the ratios much less)")


if __name__ == "__main__":
    main()
