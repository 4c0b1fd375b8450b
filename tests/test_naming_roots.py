"""A root whose variable is named like one of its submodules' paths is a layer of its own.

``bert = BertForMaskedLM(...)`` holds a ``BertModel`` at ``.bert``: the root (named after the
variable) and the child (named by its attribute path) were both the layer ``bert``, the
child's parent was itself by name and the Layers tree merged the two levels. The capture is
made by the magic in the test's shell; the expected names, types, parents and depths are
computed in the test from the model's ``named_modules()``.
"""

from __future__ import annotations

from typing import Any

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
