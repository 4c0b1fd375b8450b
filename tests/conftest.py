"""Shared fixtures: a real IPython shell with tracemagic loaded, small real models, readers.

Everything here is generic so any test module can reuse it:

- ``ip``: the IPython ``InteractiveShell`` with ``%load_ext tracemagic`` done, ``torch``,
  ``nn`` and the models below in its namespace, the working directory a fresh
  ``tmp_path`` (so ``./traces`` lands there), and the namespace restored afterwards. A
  fixture that runs cells in the shared shell itself (``_shell``) does so inside
  ``own_namespace(_shell)``.
- ``mlp`` / ``cnn`` / ``transformer``: fresh small models (CPU, seconds to run).
- ``read_json``: read a ``.json`` or ``.json.gz`` file.
- ``kineto_events``: the ``traceEvents`` of a Kineto trace file.
- ``exact_events(path)``: the same, ``ts`` counted exactly from the earliest event: the
  reference for figures summed over a live capture's intervals.
- ``traces``: the folder of real GPU traces recorded elsewhere (``tests/data/traces``, read
  only: a test that loads one passes a temporary cache folder or works on a copy).
- ``throwaway_venv``: a reused venv for a third-party tool, kept outside the checkout.

The suite writes only into temporary folders: ``TRACEMAGIC_CACHE_DIR`` is set to one for
the whole session (notebook kernels and subprocesses inherit it), and the session fails
at its end if ``tests/data``, ``../shared`` or the checkout changed (see
``pytest_sessionfinish``).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

try:
    import torch  # noqa: E402
    nn = torch.nn
except ModuleNotFoundError:  # an interpreter torch has no wheel for (tests/test_newer_pythons.py): the
    torch = None  # modules that need no torch still run; the small models below cannot be made
    nn = types.SimpleNamespace(Module=object)

ROOT = Path(__file__).resolve().parents[1]
#: real Kineto traces recorded on GPU machines by other projects (see its README)
TRACES = ROOT / "tests" / "data" / "traces"
#: the browser tests' screenshots: ``$TRACEMAGIC_ARTIFACTS``, else the system temp folder
ARTIFACTS = Path(os.environ.get("TRACEMAGIC_ARTIFACTS") or Path(tempfile.gettempdir()) / "tracemagic-artifacts")
#: Debian's chromium, which the browser tests drive through Playwright (``make browser``)
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """One headless chromium for a browser test module (its tests open their own pages). Not
    one per session: Playwright's sync API keeps an asyncio loop running while it is open,
    which later tests that run a loop of their own (``asyncio.run``) cannot share."""
    import playwright.sync_api as playwright_api

    assert Path(CHROMIUM).exists(), f"Debian's chromium is not installed at {CHROMIUM}: run `make browser`"
    with playwright_api.sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


def save_screenshot(page: Any, folder: Path, name: str) -> Path:
    """A full-page screenshot of ``page`` as ``folder/name.png`` (a test's tmp folder), and a
    copy in ``$TRACEMAGIC_SCREENSHOTS`` when that is set (to look at them after a run)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    keep = os.environ.get("TRACEMAGIC_SCREENSHOTS")
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, Path(keep) / path.name)
    return path


# -- the suite writes nowhere but its temporary folders ------------------------------------

#: what running the suite may leave in the checkout: Python's, pytest's and mypy's caches,
#: and what installing the checkout makes (its C build, its egg-info, the built extensions)
_BYPRODUCTS = {"__pycache__", ".pytest_cache", ".mypy_cache", ".git", ".venv", "build"}
_BUILT = (".so", ".pyd")
_WATCHED = (ROOT, ROOT.parent / "shared")
_SNAPSHOT = pytest.StashKey[dict[str, tuple[int, int, str]]]()
_CACHE = pytest.StashKey[tuple[Path, str | None]]()


def _snapshot() -> dict[str, tuple[int, int, str]]:
    """Every folder and file of the checkout and of ``../shared`` (byproducts aside): a
    file's size and mtime, and for ``tests/data`` and ``../shared`` the SHA-256 of its bytes."""
    found: dict[str, tuple[int, int, str]] = {}
    for top in _WATCHED:
        if not top.is_dir():
            continue
        for folder, dirs, files in os.walk(top):
            here = Path(folder)
            dirs[:] = [d for d in dirs if d not in _BYPRODUCTS and not d.endswith(".egg-info")
                       and not (here == ROOT and d == "shared")]
            found[f"{here}{os.sep}"] = (0, 0, "folder")  # an empty folder made is a change too
            for name in files:
                if name.endswith(_BUILT):
                    continue
                path = here / name
                try:
                    stat = path.stat()
                except OSError:
                    continue
                fixed = top != ROOT or TRACES.parent in path.parents
                digest = hashlib.sha256(path.read_bytes()).hexdigest() if fixed else ""
                found[str(path)] = (stat.st_size, stat.st_mtime_ns, digest)
    return found


def pytest_sessionstart(session: pytest.Session) -> None:
    """Send every trace cache of the session to a temporary folder and note the files."""
    cache = Path(tempfile.mkdtemp(prefix="tracemagic-test-cache-"))
    session.stash[_CACHE] = (cache, os.environ.get("TRACEMAGIC_CACHE_DIR"))
    os.environ["TRACEMAGIC_CACHE_DIR"] = str(cache)
    session.stash[_SNAPSHOT] = _snapshot()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail the session if any test wrote into the checkout, ``tests/data`` or ``../shared``."""
    cache = session.stash.get(_CACHE, None)
    if cache is not None:
        folder, before_session = cache
        shutil.rmtree(folder, ignore_errors=True)
        if before_session is None:
            os.environ.pop("TRACEMAGIC_CACHE_DIR", None)
        else:
            os.environ["TRACEMAGIC_CACHE_DIR"] = before_session
    before = session.stash.get(_SNAPSHOT, None)
    if before is None:
        return
    after = _snapshot()
    changed = sorted(
        [f"added    {p}" for p in after.keys() - before.keys()]
        + [f"removed  {p}" for p in before.keys() - after.keys()]
        + [f"changed  {p}" for p in before.keys() & after.keys() if before[p] != after[p]]
    )
    if changed:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        lines = ["the tests wrote outside their temporary folders:", *changed[:50]]
        if reporter is not None:
            reporter.write("\n")
            reporter.write_sep("=", "files changed by the suite", red=True)
            for line in lines:
                reporter.write_line(line)
        else:
            print("\n".join(lines), file=sys.stderr)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(scope="session")
def traces() -> Path:
    """``tests/data/traces``: the real traces; never write into it."""
    return TRACES


def make_mlp() -> Any:
    """A 3-layer MLP: 32 -> 64 -> 64 -> 10 (repeated Linear/ReLU classes)."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)
    )


class SmallCNN(nn.Module):
    """Two conv blocks and a classifier head, on 1x16x16 images."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 4, 3, padding=1),
            nn.BatchNorm2d(4),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(4, 8, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
        )
        self.head = nn.Linear(8, 10)

    def forward(self, x: Any) -> Any:
        return self.head(torch.flatten(self.features(x), 1))


class SmallTransformer(nn.Module):
    """An embedding, a 2-layer ``nn.TransformerEncoder`` (d_model 32) and a linear head."""

    def __init__(self, vocab: int = 50, d_model: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        layer = nn.TransformerEncoderLayer(
            d_model, nhead=2, dim_feedforward=64, dropout=0.0, batch_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, tokens: Any) -> Any:
        return self.head(self.encoder(self.embed(tokens)))


def make_cnn() -> SmallCNN:
    torch.manual_seed(0)
    return SmallCNN()


def make_transformer() -> SmallTransformer:
    torch.manual_seed(0)
    return SmallTransformer()


@pytest.fixture
def mlp() -> Any:
    return make_mlp()


@pytest.fixture
def cnn() -> SmallCNN:
    return make_cnn()


@pytest.fixture
def transformer() -> SmallTransformer:
    return make_transformer()


#: the shared shell's user namespace right after ``%load_ext tracemagic``
_INITIAL_NS: dict[str, Any] = {}


@pytest.fixture(scope="session")
def _shell() -> Any:
    """The one IPython shell of the session. Whoever runs cells in it restores its namespace
    afterwards (``own_namespace``), so no test sees another's ``model`` or ``obs``."""
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "tracemagic")
    _INITIAL_NS.update(shell.user_ns)
    return shell


@contextmanager
def own_namespace(shell: Any, start: dict[str, Any] | None = None) -> Iterator[dict[str, Any]]:
    """Run cells in ``shell`` and put its user namespace back as it was on the way out: names
    added are removed and names rebound get their old value again (``start``: begin from that
    namespace instead of the current one, and return to it)."""
    ns = shell.user_ns
    before = dict(ns if start is None else start)
    if start is not None:
        ns.clear()
        ns.update(before)
    try:
        yield ns
    finally:
        ns.clear()  # in place: the shell, its module and its display hook keep this dict
        ns.update(before)


@pytest.fixture
def ip(_shell: Any, tmp_path: Path) -> Iterator[Any]:
    """The shell, in a fresh working directory, with torch and small models defined, its
    namespace the session's initial one (whatever ran before) and reset to it afterwards.

    The working directory is changed by a MonkeyPatch of its own: a test's
    ``monkeypatch.undo()`` must not send its next capture into the checkout's ``./traces``.
    """
    with pytest.MonkeyPatch.context() as here, own_namespace(_shell, _INITIAL_NS) as ns:
        here.chdir(tmp_path)
        ns.update(
            torch=torch,
            nn=nn,
            make_mlp=make_mlp,
            make_cnn=make_cnn,
            make_transformer=make_transformer,
        )
        yield _shell


@pytest.fixture
def read_json() -> Callable[[Path], Any]:
    """Read a JSON file, gzip-compressed or not."""

    def read(path: Path) -> Any:
        path = Path(path)
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt", encoding="utf-8") as fh:
            return json.load(fh)

    return read


def exact_events(path: Path) -> list[dict[str, Any]]:
    """The ``traceEvents`` of a Kineto trace file, ``ts`` in us from the earliest event.

    A capture's ``ts`` is about 5e12 us, which a float holds only to 2**-10 us: the ends of
    a few dozen intervals then drift by a hundredth of a us from the recorded decimals. Read
    as decimals and made floats once small, every ``ts`` is exact to the ns; every other
    number is an ordinary float (or int), as ``json.load`` gives it.
    """

    def number(value: Any) -> Any:
        if isinstance(value, list):
            return [number(v) for v in value]
        return float(value) if isinstance(value, Decimal) else value

    def floats(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        return {k: v if k == "ts" else number(v) for k, v in pairs}

    opener: Any = gzip.open if Path(path).suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as fh:
        events = json.load(fh, parse_float=Decimal, object_pairs_hook=floats)["traceEvents"]
    origin = min(Decimal(e["ts"]) for e in events if "ts" in e)
    for e in events:
        if "ts" in e:
            e["ts"] = float(Decimal(e["ts"]) - origin)
    return events


@pytest.fixture
def kineto_events(read_json: Callable[[Path], Any]) -> Callable[[Path], list[dict[str, Any]]]:
    """The ``traceEvents`` list of a Kineto trace file."""

    def events(path: Path) -> list[dict[str, Any]]:
        return read_json(path)["traceEvents"]

    return events


#: throwaway venvs for third-party tools (HTA, DFTracer) that cannot share .venv, kept
#: out of the checkout and reused by later runs and other clones:
#: ``$TRACEMAGIC_TEST_VENVS``, else ``$XDG_CACHE_HOME/tracemagic-tests/venvs``
VENVS = Path(
    os.environ.get("TRACEMAGIC_TEST_VENVS")
    or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tracemagic-tests" / "venvs"
)


def _throwaway_venv(name: str, requirements: list[str]) -> Path:
    """A venv under ``VENVS/<name>`` with ``requirements``, made once and reused.

    torch is pinned (constraint) so nothing can pull a CUDA build. Fails the test, with
    pip's own words, when the packages cannot be installed here.
    """
    venv = VENVS / name
    python = venv / "bin" / "python"
    stamp = venv / ".tracemagic-stamp"
    wanted = "\n".join(requirements)
    if python.exists() and stamp.exists() and stamp.read_text() == wanted:
        return python
    VENVS.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    pin = VENVS / "torch-constraint.txt"
    pin.write_text("torch==2.13.0\n")
    done = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "-c", str(pin), *requirements],
        capture_output=True, text=True, timeout=900,
    )
    if done.returncode != 0:
        pytest.fail(
            f"could not install {requirements} into {venv} for the {name} check "
            f"(deselect with -m 'not slow' on an offline machine):\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
        )
    stamp.write_text(wanted)
    return python


@pytest.fixture(scope="session")
def throwaway_venv() -> Callable[[str, list[str]], Path]:
    """``throwaway_venv(name, requirements)``: the python of a cached tool venv."""
    return _throwaway_venv


def run_in_kernel(
    cells: list[str], folder: Path, env: dict[str, str] | None = None, allow_errors: bool = False
) -> Any:
    """Execute ``cells`` in a real Jupyter kernel (nbclient, ipykernel: as JupyterLab runs
    them) with ``folder`` as its working directory; the executed notebook (``allow_errors``:
    a cell that raises does not stop the others, its error is in its outputs)."""
    import nbclient
    import nbformat

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    client = nbclient.NotebookClient(
        nb, timeout=300, kernel_name="python3", allow_errors=allow_errors, resources={"metadata": {"path": str(folder)}}
    )
    client.execute(**({"env": env} if env is not None else {}))
    return nb


def rank_file(path: Path, rank: int | None, steps: list[int], t0: float = 1000.0, world: int = 4) -> Path:
    """A trace of ``steps`` (each 100 µs from ``t0`` on, one op in it) claiming ``rank``."""
    events = []
    for i, step in enumerate(steps):
        ts = t0 + 100 * i
        events.append({"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{step}", "pid": 1, "tid": 1, "ts": ts, "dur": 90})
        events.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": ts + 10, "dur": 50})
    doc: dict[str, Any] = {"traceEvents": events}
    if rank is not None:
        doc["distributedInfo"] = {"backend": "nccl", "rank": rank, "world_size": world}
    path.write_text(json.dumps(doc))
    return path
