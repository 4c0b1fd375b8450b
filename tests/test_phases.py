"""``trace.phases()``: data loading, forward, backward, optimizer and other per step, checked
on a real ``%%chakra_trace`` capture of a training loop with AdamW and a DataLoader against
unions of the annotations' intervals computed here from the raw JSON; the optimizer advice,
the Overview's phases figure and the Timeline's phases lane show the same figures."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from IPython.utils.capture import capture_output
from tb_reference import union

from tracemagic.analysis import advice as rules
from tracemagic.analysis import phases as phases_module

TRAIN = """\
from torch.utils.data import DataLoader, TensorDataset
model = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.ReLU()) for _ in range(40)], nn.Linear(4, 2))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
loader = DataLoader(TensorDataset(torch.randn(96, 4), torch.randint(0, 2, (96,))), batch_size=8)
%%CELL%%
"""
LOOP = """\
for x, y in loader:
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
"""
#: the phases' names as torch writes them (the module docstring's rule, spelled out here)
NAMES = {
    "dataloader": re.compile(r"^enumerate\((?:DataLoader|DataPipe)\)#"),
    "optimizer": re.compile(r"^Optimizer\.(?:step|zero_grad)#"),
    "backward": re.compile(r"^autograd::engine::evaluate_function: |^torch::autograd::AccumulateGrad$|^\w*Backward\d*$"),
    "forward": re.compile(r"^nn\.Module: "),
}
ORDER = ("backward", "dataloader", "optimizer", "forward")


def raw_phases(events: list[dict[str, Any]]) -> dict[int, dict[str, float]]:
    """Per ProfilerStep: each phase's time, the union of its events' intervals less the
    phases above it (``ORDER``), clipped to the step; and ``dur``."""
    timed = [e for e in events if e.get("ph") == "X" and float(e.get("dur", 0)) > 0]
    step_threads = {(e["pid"], e["tid"]) for e in timed if e["name"].startswith("ProfilerStep#")}
    host = [e for e in timed if e.get("cat") in ("cpu_op", "user_annotation")]
    backward_threads = {(e["pid"], e["tid"]) for e in host if NAMES["backward"].search(e["name"])} - step_threads
    spans: dict[str, list[tuple[float, float]]] = {name: [] for name in ORDER}
    for e in timed:
        interval = (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
        category = e.get("cat")
        if category == "python_function" and NAMES["forward"].search(e["name"]):
            spans["forward"].append(interval)
        if category not in ("cpu_op", "user_annotation"):
            continue
        for name in ("dataloader", "optimizer", "backward"):
            if NAMES[name].search(e["name"]) or (name == "backward" and (e["pid"], e["tid"]) in backward_threads):
                spans[name].append(interval)
    out = {}
    for e in timed:
        if not e["name"].startswith("ProfilerStep#"):
            continue
        lo, hi = float(e["ts"]), float(e["ts"]) + float(e["dur"])
        row, above = {"dur": float(e["dur"])}, []
        for name in ORDER:
            row[name] = union(above + spans[name], lo, hi) - union(above, lo, hi)
            above += spans[name]
        row["other"] = float(e["dur"]) - sum(row[name] for name in ORDER)
        out[int(e["name"].split("#")[1])] = row
    return out


@pytest.fixture(scope="module")
def capture(_shell: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    import torch
    from conftest import exact_events, own_namespace

    out = tmp_path_factory.mktemp("phases")
    with own_namespace(_shell) as ns, capture_output() as shown:
        ns.update(torch=torch, nn=torch.nn)
        setup, _ = TRAIN.split("%%CELL%%")
        assert _shell.run_cell(setup).success
        result = _shell.run_cell(f"%%chakra_trace --wait 1 --warmup 1 --active 4 --out {out}\n{LOOP}")
        cap = ns.get("_chakra_capture")
    assert result.success and cap is not None, shown.stdout
    cap.raw = exact_events(cap.dir / "kineto_trace_0.json")
    return cap



def test_each_phase_is_the_union_of_its_annotations(capture: Any) -> None:
    expected = raw_phases(capture.raw)
    table = capture.trace.phases()
    assert list(table.columns) == phases_module.COLUMNS
    assert sorted(table["step"]) == sorted(expected) and len(expected) >= 4
    for _, row in table.iterrows():
        want = expected[int(row["step"])]
        assert row["dur"] == pytest.approx(want["dur"], abs=1e-6)
        for name in ("dataloader", "forward", "backward", "optimizer", "other"):
            assert row[f"{name}_us"] == pytest.approx(want[name], abs=1e-6), (row["step"], name)
        assert np.isnan(row[[f"gpu_{p}_us" for p in phases_module.PHASES]].to_numpy(dtype=float)).all()  # CPU only
    # every phase is there: a loop of DataLoader, forward, backward and AdamW
    complete = table[table["step"].isin([s["step"] for s in capture.manifest["steps"] if s["complete"]])]
    for name in ("dataloader", "forward", "backward", "optimizer"):
        assert (complete[f"{name}_us"] > 0).all(), name
    assert table.attrs["optimizers"] == ["AdamW"]
    foreach = any(e.get("cat") == "cpu_op" and e["name"].startswith("aten::_foreach_") for e in capture.raw)
    assert table.attrs["optimizer_impl"] == ("foreach" if foreach else "for-loop")


def test_the_optimizer_rule_names_the_class_and_its_fix(capture: Any) -> None:
    """AdamW over 82 tiny tensors, one at a time (about ten ops each, against a few per layer
    for the forward and backward): well over the threshold of the loop's steps, measured here
    from the raw JSON; the advice names AdamW and foreach/fused."""
    expected = raw_phases(capture.raw)
    loop = [s["step"] for s in capture.manifest["steps"] if s["complete"]]
    share = sum(expected[s]["optimizer"] for s in loop) / sum(expected[s]["dur"] for s in loop)
    assert share >= rules.OPTIMIZER_SHARE + 0.01
    advice = capture.trace.advice()
    (row,) = [r for _, r in advice.iterrows() if r["rule"] == "optimizer"]
    assert row["value"] == pytest.approx(share, abs=0.005) and row["threshold"] == rules.OPTIMIZER_SHARE
    assert row["evidence"].startswith(f"AdamW's step and zero_grad take {100 * share:.0f}% of the step")
    assert "torch.optim.AdamW(..., foreach=True)" in row["advice"] and "fused=True" in row["advice"]


def test_the_overview_and_the_timeline_draw_the_phases(capture: Any) -> None:
    from tracemagic.views import Dashboard

    expected = raw_phases(capture.raw)
    dash = Dashboard(capture.trace)
    (fig,) = [f for f in dash.figures("overview") if f["layout"]["title"]["text"].startswith("Phases of each step")]
    drawn = {trace["name"]: dict(zip(trace["x"], decode(trace["y"]))) for trace in fig["data"]}  # CPU: "step N"
    names = {"dataloader": "data loading", "forward": "forward", "backward": "backward", "optimizer": "optimizer",
             "other": "other"}
    shown = [s for s in expected if f"step {s}" in drawn["forward"]]
    assert shown and all(s not in (e["step"] for e in capture.manifest["steps"] if not e["complete"]) for s in shown)
    for step in shown:
        for phase, name in names.items():
            assert drawn[name][f"step {step}"] == pytest.approx(expected[step][phase] / 1000, abs=1e-5)
    facts = dict(dash.section("overview").facts)
    assert "backward" in facts["phases"] and facts["phases"].endswith("of the host step")
    # the Timeline: a phases lane under the steps, its bars the phases' runs
    timeline = dash.figures("timeline")[0]
    lanes = list(timeline["layout"]["yaxis"]["categoryarray"])
    assert lanes[:2] == ["steps", "phases"]
    kinds = {t["name"] for t in timeline["data"]}
    assert {"phase dataloader", "phase forward", "phase backward", "phase optimizer"} <= kinds
    for trace in timeline["data"]:
        if trace["name"].startswith("phase "):
            assert set(trace["y"]) == {"phases"} and all(text for text in trace["text"])


def decode(values: Any) -> list[float]:
    import base64

    if isinstance(values, dict) and "bdata" in values:
        return np.frombuffer(base64.b64decode(values["bdata"]), dtype=np.dtype(values["dtype"])).astype(float).tolist()
    return [float(v) for v in values]


def test_phases_of_a_gpu_trace_add_up(tmp_path: Path) -> None:
    """On the A100 trace: the host phases add up to each step, and the GPU time of the
    phases is the GPU work the steps launched (each event once)."""
    import tracemagic
    from conftest import TRACES

    trace = tracemagic.load(TRACES / "hta_control.json.gz", cache_dir=tmp_path)
    table = trace.phases()
    host = table[[f"{p}_us" for p in phases_module.PHASES]].sum(axis=1)
    np.testing.assert_allclose(host, table["dur"], rtol=1e-9)
    assert (table["backward_us"] > 0).all() and (table["gpu_backward_us"] > 0).all()
    assert table.attrs["optimizers"] == ["FusedAdam"]


def test_phases_are_kept_per_rank_for_each_ranks_own_steps() -> None:
    """The views and the advice keep the phases of each rank's own steps (the tail rule can
    drop step 2 on rank 1 alone): a (rank, step) pair, not the step number across ranks."""
    import pandas as pd

    from tracemagic.analysis import aggregate

    phases = pd.DataFrame({"rank": [0, 0, 1, 1], "step": [1, 2, 1, 2], "optimizer_us": [1.0, 2.0, 3.0, 4.0]})
    steps = pd.DataFrame({"rank": [0, 0, 1], "step": [1, 2, 1]})
    kept = aggregate.of_steps(phases, steps)
    assert list(zip(kept["rank"], kept["step"])) == [(0, 1), (0, 2), (1, 1)]
    assert kept["optimizer_us"].tolist() == [1.0, 2.0, 3.0]
    assert aggregate.of_steps(phases, steps.iloc[:0]).empty
