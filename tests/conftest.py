"""Shared fixtures: a real IPython shell with tracemagic loaded, small real models, readers.

Everything here is generic so any test module can reuse it:

- ``ip``: the IPython ``InteractiveShell`` with ``%load_ext tracemagic`` done, ``torch``,
  ``nn`` and the models below in its namespace, the working directory a fresh
  ``tmp_path`` (so ``./traces`` lands there), and the namespace cleaned afterwards.
- ``mlp`` / ``cnn`` / ``transformer``: fresh small models (CPU, seconds to run).
- ``read_json``: read a ``.json`` or ``.json.gz`` file.
- ``kineto_events``: the ``traceEvents`` of a Kineto trace file.
- ``traces``: the folder of real GPU traces recorded elsewhere (``tests/data/traces``, read
  only: a test that loads one passes a temporary cache folder or works on a copy).
"""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import torch  # noqa: E402
nn = torch.nn

#: real Kineto traces recorded on GPU machines by other projects (see its README)
TRACES = Path(__file__).resolve().parent / "data" / "traces"


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


@pytest.fixture(scope="session")
def _shell() -> Any:
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "tracemagic")
    return shell


@pytest.fixture
def ip(_shell: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The shell, in a fresh working directory, with torch and small models defined."""
    monkeypatch.chdir(tmp_path)
    before = set(_shell.user_ns)
    _shell.user_ns.update(
        torch=torch,
        nn=nn,
        make_mlp=make_mlp,
        make_cnn=make_cnn,
        make_transformer=make_transformer,
    )
    yield _shell
    for name in set(_shell.user_ns) - before:
        del _shell.user_ns[name]


@pytest.fixture
def read_json() -> Callable[[Path], Any]:
    """Read a JSON file, gzip-compressed or not."""

    def read(path: Path) -> Any:
        path = Path(path)
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt", encoding="utf-8") as fh:
            return json.load(fh)

    return read


@pytest.fixture
def kineto_events(read_json: Callable[[Path], Any]) -> Callable[[Path], list[dict[str, Any]]]:
    """The ``traceEvents`` list of a Kineto trace file."""

    def events(path: Path) -> list[dict[str, Any]]:
        return read_json(path)["traceEvents"]

    return events


#: throwaway venvs for third-party tools (HTA, DFTracer) that cannot share .venv
VENVS = Path(__file__).resolve().parents[1] / "bench" / "out" / "venvs"


def _throwaway_venv(name: str, requirements: list[str]) -> Path:
    """A venv under bench/out/venvs/<name> with ``requirements``, made once and reused.

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
