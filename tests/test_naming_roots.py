"""A root whose variable is named like one of its submodules' paths is a layer of its own.

``bert = BertForMaskedLM(...)`` holds a ``BertModel`` at ``.bert``: the root (named after the
variable) and the child (named by its attribute path) were both the layer ``bert``, the
child's parent was itself by name and the Layers tree merged the two levels. The capture is
made by the magic in the test's shell; the expected names, types, parents and depths are
computed in the test from the model's ``named_modules()``.

Two models called in one capture with a submodule at the same path (a GAN's ``gen.fc`` and
``disc.fc``) are two layers: captured by the magic in a real kernel (nbclient), checked
against the module events of the raw Kineto JSON.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pytest
from conftest import run_in_kernel
from IPython.utils.capture import capture_output

import torch  # noqa: E402
from torch import nn  # noqa: E402


class Body(nn.Module):
    """The encoder a task head wraps (``BertModel``)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.layers = nn.ModuleList([nn.Linear(16, 16), nn.Linear(16, 16)])  # a container: no forward
        self.norm = nn.LayerNorm(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = torch.relu(layer(h))
        return self.norm(h)


class ForTask(nn.Module):
    """A task model holding its body at ``.bert`` (``BertForMaskedLM``)."""

    def __init__(self) -> None:
        super().__init__()
        self.bert = Body()
        self.head = nn.Linear(16, 50)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.bert(x))


TRAIN = """\
bert = ForTask()
opt = torch.optim.SGD(bert.parameters(), lr=0.01)
for i in range(4):
    bert(torch.randint(0, 50, (2, 8))).sum().backward()
    opt.step()
    opt.zero_grad()
"""


def expected_layers(var: str, model: nn.Module) -> dict[str, tuple[str, str | None, int]]:
    """layer -> (type, parent layer, depth), from ``named_modules()``: a child by its path, its
    parent the nearest enclosing module that runs a forward (a ModuleList runs none), the root
    by its variable, or ``var (Class)`` where ``var`` is also a child's path."""
    named = dict(model.named_modules())
    called = {path for path, m in named.items() if not isinstance(m, (nn.ModuleList, nn.ModuleDict))}
    root = f"{var} ({type(model).__name__})" if var in named else var
    out: dict[str, tuple[str, str | None, int]] = {root: (type(model).__name__, None, 0)}
    for path in sorted(called - {""}):
        parts = path.split(".")
        enclosing = [".".join(parts[:i]) for i in range(1, len(parts)) if ".".join(parts[:i]) in called]
        out[path] = (type(named[path]).__name__, enclosing[-1] if enclosing else root, len(enclosing) + 1)
    return out


def test_a_root_named_like_its_child_is_its_own_layer(ip: Any) -> None:
    ip.user_ns["ForTask"] = ForTask
    with capture_output() as out:
        result = ip.run_cell(f"%%chakra_trace --no-memory-timeline\n{TRAIN}", store_history=True)
    assert result.success, out.stdout
    capture = ip.user_ns["_chakra_capture"]
    model = ip.user_ns["bert"]
    expected = expected_layers("bert", model)
    assert "bert" in expected and "bert (ForTask)" in expected  # the collision this test is about
    table = capture.trace.layers()
    assert table["layer"].is_unique
    got = {
        str(row.layer): (str(row.type), None if row.parent is None or row.parent != row.parent else str(row.parent),
                         int(row.depth))
        for row in table.itertuples()
    }
    assert got == expected
    # the manifest keeps the variable as the root and the qualified names valid Python
    modules = capture.manifest["modules"]
    root = modules["nn.Module: ForTask_0"]
    assert root == {"path": "bert (ForTask)", "type": "ForTask", "root": "bert", "qualname": "bert"}
    assert modules["nn.Module: Body_0"]["qualname"] == "bert.bert"
    for info in modules.values():
        obj = model
        for part in info["qualname"].split(".")[1:]:
            obj = getattr(obj, part)
        assert type(obj).__name__ == info["type"]


def test_a_root_whose_variable_is_no_path_keeps_its_name(ip: Any) -> None:
    ip.user_ns["ForTask"] = ForTask
    body = TRAIN.replace("bert = ForTask()", "model = ForTask()").replace("bert.parameters", "model.parameters")
    body = body.replace("    bert(", "    model(")
    with capture_output() as out:
        result = ip.run_cell(f"%%chakra_trace --no-memory-timeline\n{body}", store_history=True)
    assert result.success, out.stdout
    table = ip.user_ns["_chakra_capture"].trace.layers()
    expected = expected_layers("model", ip.user_ns["model"])
    assert "model" in expected
    assert set(table["layer"]) == set(expected) and table["layer"].is_unique
    assert dict(zip(table["layer"], table["depth"], strict=True)) == {k: v[2] for k, v in expected.items()}


GAN = """\
gen = nn.Sequential()
gen.add_module("fc", nn.Linear(8, 16))
gen.add_module("act", nn.ReLU())
disc = nn.Sequential()
disc.add_module("fc", nn.Linear(16, 1))
opt = torch.optim.SGD([*gen.parameters(), *disc.parameters()], lr=0.01)
for i in range(4):
    disc(gen(torch.randn(4, 8))).sum().backward()
    opt.step()
    opt.zero_grad()
"""


def _module_events(capture: Path) -> dict[str, tuple[int, float]]:
    """``nn.Module: <Class>_<k>`` -> (calls, summed duration in µs), from the raw Kineto JSON."""
    out: dict[str, tuple[int, float]] = {}
    for path in capture.rglob("kineto_trace_*.json*"):
        raw = path.read_bytes()
        events = json.loads(gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw)["traceEvents"]
        for e in events:
            if e.get("ph") == "X" and str(e.get("name", "")).startswith("nn.Module: "):
                calls, dur = out.get(e["name"], (0, 0.0))
                out[e["name"]] = (calls + 1, dur + float(e["dur"]))
    return out


@pytest.fixture(scope="module")
def gan_capture(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The GAN cell captured by the magic in a real kernel (nbclient, as JupyterLab runs it)."""
    folder = tmp_path_factory.mktemp("gan")
    out = folder / "traces"
    setup = "%load_ext tracemagic\nimport torch\nfrom torch import nn\ntorch.manual_seed(0)"
    run_in_kernel([setup, f"%%chakra_trace -q --no-memory-timeline --out {out} --name gan\n{GAN}"], folder)
    (capture,) = out.iterdir()
    return capture


def test_two_models_with_a_layer_at_one_path_are_two_layers(gan_capture: Path) -> None:
    """A GAN's generator and discriminator both hold an ``fc``: two layers, ``gen.fc`` and
    ``disc.fc``, each with its own calls and time (the events of the first ``Linear`` called
    in each step, ``Linear_0``, are the generator's), not one ``fc`` adding up both."""
    import tracemagic

    table = tracemagic.load(gan_capture, use_cache=False).layers().set_index("layer")
    assert table.index.is_unique
    assert {"gen", "disc", "gen.fc", "gen.act", "disc.fc"} <= set(table.index) and "fc" not in table.index
    raw = _module_events(gan_capture)
    for layer, event in (("gen.fc", "nn.Module: Linear_0"), ("disc.fc", "nn.Module: Linear_1"), ("gen.act", "nn.Module: ReLU_0")):
        calls, dur = raw[event]
        assert int(table.loc[layer, "calls"]) == calls
        assert abs(float(table.loc[layer, "fwd_cpu_us"]) - dur) < 1e-6 * max(dur, 1.0) + 1e-3
    assert table.loc["gen.fc", "parent"] == "gen" and table.loc["disc.fc", "parent"] == "disc"
    modules = json.loads((gan_capture / "capture.json").read_text())["modules"]
    assert modules["nn.Module: Linear_0"] == {"path": "gen.fc", "type": "Linear", "root": "gen", "qualname": "gen.fc"}


def test_a_capture_made_before_clashing_layers_were_qualified_loads_them_apart(gan_capture: Path, tmp_path: Path) -> None:
    """An older capture named both ``fc`` (its manifest's ``path``): loaded now, they are two layers."""
    import shutil

    import tracemagic

    now = tracemagic.load(gan_capture, use_cache=False).layers().set_index("layer")
    old = tmp_path / "old"
    shutil.copytree(gan_capture, old)
    manifest_file = old / "capture.json"
    manifest = json.loads(manifest_file.read_text())
    for entry in manifest["modules"].values():
        if entry["qualname"] != entry["root"]:
            entry["path"] = entry["qualname"].split(".", 1)[1]  # as module_map wrote it then
    assert [e["path"] for e in manifest["modules"].values()].count("fc") == 2
    manifest_file.write_text(json.dumps(manifest))
    loaded = tracemagic.load(old, use_cache=False).layers().set_index("layer")
    assert set(loaded.index) == set(now.index) and loaded.index.is_unique
    assert (loaded.loc[now.index, "calls"] == now["calls"]).all()
