"""Execution Trace reading and its join to Kineto (``tracemagic.et``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import TRACES

import tracemagic
from tracemagic import et
from tracemagic.errors import TraceError

import torch  # noqa: E402
HTA_ET = TRACES / "hta_benchmark_simple_add_et.json.gz"
HTA_KINETO = TRACES / "hta_benchmark_simple_add_trace.json.gz"


def capture_pair(folder: Path, steps: int = 3) -> Path:
    """Record an MLP train step with the ET observer and the profiler over the same steps."""
    from torch.profiler import ExecutionTraceObserver, ProfilerActivity, profile, schedule

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    observer = ExecutionTraceObserver().register_callback(str(folder / "torch_et_0.json"))
    try:
        with profile(
            activities=[ProfilerActivity.CPU],
            schedule=schedule(wait=0, warmup=1, active=steps - 1),
            on_trace_ready=lambda p: p.export_chrome_trace(str(folder / "kineto_trace_0.json")),
            record_shapes=True,
            execution_trace_observer=observer,
        ) as prof:
            for _ in range(steps):
                model(torch.randn(8, 16)).sum().backward()
                prof.step()
    finally:
        observer.unregister_callback()
    return folder


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return capture_pair(tmp_path_factory.mktemp("etpair"))


def test_read_real_hta_et_schema_1_0_1() -> None:
    trace = et.read_et(HTA_ET)
    assert trace.schema == "1.0.1"
    nodes = trace.nodes
    assert len(nodes) == 38 and nodes["id"].is_monotonic_increasing
    add = nodes[nodes["name"] == "aten::add"].iloc[0]
    assert add["op_schema"].startswith("aten::add.Tensor(")
    assert json.loads(add["input_shapes"])[:2] == [[256, 256], [256, 256]]
    assert json.loads(add["input_types"])[0] == "Tensor(float)"
    assert len(add["input_tensors"]) == 2 and len(add["output_tensors"]) == 1
    assert not nodes.loc[nodes["name"].str.startswith("[pytorch"), "is_op"].any()


def test_hta_pair_joins_by_external_id_with_names_agreeing() -> None:
    trace = tracemagic.load(HTA_KINETO, use_cache=False)
    ops = et.et_ops(trace)
    assert ops.attrs["join_key"] == {0: "external_id"}  # torch < 2.1: no Record function id
    hit = ops[ops["row"] >= 0]
    assert len(hit) == 36  # every node but the two roots
    names = trace.events["name"].astype(str).to_numpy()[hit["row"].to_numpy()]
    assert (names == hit["name"].to_numpy()).all()
    assert (hit["dur"] >= hit["self_dur"]).all()


def test_hta_graph_links_producers_to_consumers() -> None:
    nodes, edges = et.et_graph(HTA_KINETO)
    assert list(nodes["name"]).count("aten::add") == 2
    assert set(nodes["depth"]) == {0}
    by_id = dict(zip(nodes["id"], nodes["name"]))
    add_inputs = edges[edges["dst"].map(by_id) == "aten::add"]
    assert set(add_inputs["src"].map(by_id)) == {"aten::rand"}  # c = a + b, a and b from rand
    assert (add_inputs["bytes"] == 256 * 256 * 4).all()


def test_captured_pair_schema_and_full_join(pair: Path) -> None:
    trace = tracemagic.load(pair / "kineto_trace_0.json", use_cache=False)
    ops = et.et_ops(trace)
    assert ops.attrs["schemas"] == {0: "1.1.1-chakra.0.0.4"}
    assert ops.attrs["join_key"] == {0: "rf_id"}
    real = ops[~ops["name"].str.startswith("[pytorch")]
    assert (real["row"] >= 0).all()
    assert set(real["step"]) == {1, 2}
    assert (real["step"] == real["kineto_step"]).all()
    linear = real[real["name"] == "aten::linear"].iloc[0]
    assert json.loads(linear["input_shapes"]) == [[8, 16], [32, 16], [32]]
    assert json.loads(linear["output_types"]) == ["Tensor(float)"]


def test_captured_graph_per_step_and_level(pair: Path) -> None:
    top, edges = et.et_graph(pair, step=1)
    names = list(top["name"])
    assert names[:5] == ["aten::randn", "aten::linear", "aten::relu", "aten::linear", "aten::sum"]
    assert "aten::addmm" not in names  # inside aten::linear
    ids = dict(zip(top["name"][::-1], top["id"][::-1]))  # first occurrence of each name
    assert ((edges["src"] == ids["aten::randn"]) & (edges["dst"] == ids["aten::linear"])).any()
    assert set(edges["src"]) | set(edges["dst"]) <= set(top["id"])
    assert top["dur"].notna().all()
    leaf, _ = et.et_graph(pair, step=1, level="leaf")
    assert "aten::clamp_min" in set(leaf["name"]) and not {"aten::linear", "aten::relu"} & set(leaf["name"])
    everything, _ = et.et_graph(pair / "torch_et_0.json", step=2, level="all")
    assert len(everything) > len(leaf) > len(top) - 5


def test_errors_are_clear(tmp_path: Path, pair: Path) -> None:
    with pytest.raises(TraceError, match="ProfilerStep#9"):
        et.et_graph(pair, step=9)
    with pytest.raises(ValueError, match="level"):
        et.et_graph(pair, level="middle")  # type: ignore[arg-type]
    cut = tmp_path / "torch_et_0.json"
    cut.write_text((pair / "torch_et_0.json").read_text()[:5000])
    with pytest.raises(TraceError, match="unregister"):
        et.read_et(cut)
    (tmp_path / "k.json").write_text('{"traceEvents": []}')
    with pytest.raises(TraceError, match="not a PyTorch Execution Trace"):
        et.read_et(tmp_path / "k.json")
    lonely = tmp_path / "alone"
    lonely.mkdir()
    (lonely / "kineto_trace_0.json").write_text((pair / "kineto_trace_0.json").read_text())
    with pytest.raises(TraceError, match="no Execution Trace"):
        et.et_ops(lonely / "kineto_trace_0.json")


def test_find_et_names(tmp_path: Path) -> None:
    for name in ("kineto_trace_3.json", "torch_et_3.json", "x_trace.json.gz", "x_et.json.gz"):
        (tmp_path / name).write_text("{}")
    assert et.find_et(tmp_path / "kineto_trace_3.json") == tmp_path / "torch_et_3.json"
    assert et.find_et(tmp_path / "x_trace.json.gz") == tmp_path / "x_et.json.gz"


def test_cut_off_gzip_et_is_a_trace_error_in_reader_and_check(tmp_path: Path) -> None:
    from tracemagic.export import chakra

    whole = HTA_ET.read_bytes()
    cut = tmp_path / "torch_et_0.json.gz"
    cut.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(TraceError, match="cut off or corrupt"):
        et.read_et(cut)
    pair = chakra.check(cut, HTA_KINETO).pairs[0]
    assert len(pair.problems) == 1 and "cut off or corrupt" in pair.problems[0] and str(cut) in pair.problems[0]


def test_one_et_per_cycle_gives_each_step_its_own_cycles_graph(tmp_path: Path) -> None:
    """``--repeat 2 --et``: node ids restart in each cycle's ET; a step's graph (export and the
    dashboard's) holds that cycle's nodes, as the raw ET names them, and edges among them."""
    from tracemagic.views.data import TraceData

    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    with tracemagic.capture(wait=0, warmup=1, active=2, repeat=2, et=True, out=tmp_path,
                            no_memory_timeline=True) as cap:
        for _ in cap.steps(range(7)):
            model(torch.randn(8, 16)).sum().backward()
    raw = {}
    for k in (1, 2):
        nodes = json.loads((cap.dir / f"torch_et_0_cycle{k}.json").read_text())["nodes"]
        raw[k] = {n["id"]: (n["name"], next(a["value"] for a in n["attrs"] if a["name"] == "rf_id")) for n in nodes}
        steps = {int(n["name"].split("#")[1]) for n in nodes if n["name"].startswith("ProfilerStep#")}
        assert len(steps) == 2
        raw[k]["steps"] = steps
    assert raw[1]["steps"].isdisjoint(raw[2]["steps"]) and set(raw[1]) & set(raw[2])  # ids repeat
    trace = tracemagic.load(cap.dir, use_cache=False)
    view = TraceData(trace)
    for k in (1, 2):
        for step in raw[k]["steps"]:
            for nodes, edges in (et.et_graph(cap.dir, step=step), view.et_graph(step)):
                assert len(nodes) and (nodes["step"] == step).all()
                for i, name, rf in zip(nodes["id"], nodes["name"], nodes["rf_id"]):
                    assert raw[k][int(i)] == (name, rf)
                ids = set(nodes["id"])
                assert len(edges) and set(edges["src"]) <= ids and set(edges["dst"]) <= ids
    # the whole capture's graph is the cycles' graphs side by side, as each ET file alone gives it
    alone = [et.et_graph(cap.dir / f"torch_et_0_cycle{k}.json") for k in (1, 2)]
    everything, edges = et.et_graph(cap.dir)
    assert sorted(set(everything["step"])) == sorted(raw[1]["steps"] | raw[2]["steps"])
    assert list(everything["id"]) == [i for n, _ in alone for i in n["id"]]
    assert list(everything["depth"]) == [d for n, _ in alone for d in n["depth"]]
    assert sorted(map(tuple, edges[["src", "dst", "tensor"]].to_numpy().tolist())) == sorted(
        tuple(r) for _, e in alone for r in e[["src", "dst", "tensor"]].to_numpy().tolist())
    for k, (nodes, edges) in zip((1, 2), alone):
        step = min(raw[k]["steps"])
        cut = nodes[nodes["step"] == step]
        shown, shown_edges = view.et_graph(step)
        assert list(shown["id"]) == list(cut["id"])
        assert len(shown_edges) == len(edges[edges["src"].isin(cut["id"]) & edges["dst"].isin(cut["id"])])


def test_the_old_module_path_still_works_and_warns() -> None:
    """``tracemagic.export.et`` (documented before it moved to ``tracemagic.et``) imports with a
    DeprecationWarning and gives the same functions."""
    import importlib
    import sys

    sys.modules.pop("tracemagic.export.et", None)
    with pytest.warns(DeprecationWarning, match="tracemagic.et"):
        old = importlib.import_module("tracemagic.export.et")
    assert old.et_ops is et.et_ops and old.et_graph is et.et_graph and old.read_et is et.read_et
    assert old.et_ops(HTA_KINETO).equals(et.et_ops(HTA_KINETO))
