"""Each table computes only what it needs, checked by instrumentation, not by timing.

Every function of ``tracemagic.analysis.efficiency`` (the cost models, the call-chain
costs, the roofline, the GPU shares ``layers()`` takes from it) is wrapped wherever a
module of tracemagic holds it, and its calls are counted:

- a CPU trace (captured here from a real model, with ``nn.Module`` events) has no GPU
  work to share out, so its ``layers()`` calls none of them;
- on a GPU trace the roofline of ``layers()``, ``efficiency()`` and ``advice()`` is
  computed once and shared.
"""

from __future__ import annotations

import importlib
import json
import pkgutil
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import TRACES

import tracemagic
import tracemagic.analysis
from tracemagic.analysis import efficiency as efficiency_module

GPU_TRACE = "tracelens_normalization_layer_test.json.gz"  # nn.Module events and kernels


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[Counter[str]]:
    """Counts the calls of every function defined in ``analysis.efficiency``, wrapped in
    that module and in every tracemagic module that imported it by name."""
    counted: Counter[str] = Counter()
    for module in pkgutil.iter_modules(tracemagic.analysis.__path__):  # every holder loaded first
        importlib.import_module(f"tracemagic.analysis.{module.name}")
    importlib.import_module("tracemagic.facade")
    originals = {
        name: value
        for name, value in vars(efficiency_module).items()
        if callable(value) and getattr(value, "__module__", None) == efficiency_module.__name__ and not isinstance(value, type)
    }
    assert {"efficiency", "gpu_shares", "chain_costs", "_roofline", "op_cost"} <= originals.keys()

    def counting(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            counted[name] += 1
            return function(*args, **kwargs)

        wrapper.__name__, wrapper.__module__, wrapper.__qualname__ = function.__name__, function.__module__, function.__qualname__
        return wrapper

    wrappers = {name: counting(name, function) for name, function in originals.items()}
    patched = 0
    for module_name, module in list(sys.modules.items()):
        if not module_name.startswith("tracemagic") or module is None:
            continue
        for attr, value in list(vars(module).items()):
            for name, function in originals.items():
                if value is function:
                    monkeypatch.setattr(module, attr, wrappers[name])
                    patched += 1
    assert patched > len(originals)  # layers (gpu_shares) and the facade (efficiency) hold some too
    yield counted


@pytest.fixture(scope="module")
def cpu_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three profiled training steps of a small MLP on the CPU, with module events."""
    import torch
    from torch.profiler import ProfilerActivity, profile, schedule

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    path = tmp_path_factory.mktemp("cpu") / "kineto_trace_0.json"
    with profile(
        activities=[ProfilerActivity.CPU],
        schedule=schedule(wait=0, warmup=1, active=3),
        on_trace_ready=lambda p: p.export_chrome_trace(str(path)),
        record_shapes=True,
        profile_memory=True,
        with_stack=True,
    ) as prof:
        for _ in range(4):
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(torch.randn(8, 16)), torch.randint(0, 4, (8,))).backward()
            optimizer.step()
            prof.step()
    return path


def test_layers_of_a_cpu_trace_never_touch_the_roofline(cpu_trace: Path, tmp_path: Path, calls: Counter[str]) -> None:
    events = json.loads(cpu_trace.read_text())["traceEvents"]
    modules = {e["name"] for e in events if e.get("cat") == "python_function" and str(e.get("name", "")).startswith("nn.Module: ")}
    assert {"nn.Module: Linear_0", "nn.Module: Linear_1", "nn.Module: ReLU_0"} <= modules
    assert not [e for e in events if str(e.get("cat", "")).lower() in ("kernel", "gpu_memcpy", "gpu_memset")]

    trace = tracemagic.load(cpu_trace, cache_dir=tmp_path)
    layers = trace.layers()
    assert {"Linear_0", "ReLU_0", "Linear_1"} <= set(layers["layer"])
    assert (layers["calls"] == 3).all()  # one forward call per active step
    assert layers["tflops_per_s"].isna().all() and layers["memory_bound_pct"].isna().all()
    assert calls == Counter(), f"layers() of a CPU trace ran the roofline code: {dict(calls)}"

    trace.layers(step=int(trace.steps()["step"].iloc[0]))
    trace.steps(), trace.ops(), trace.memory(), trace.shapes(), trace.diff(trace)
    assert calls == Counter(), f"a table other than efficiency() ran the roofline code: {dict(calls)}"

    # the instrumentation sees the roofline where it is asked for
    assert len(trace.efficiency()) and calls["_roofline"] == 1 and calls["chain_costs"] >= 1


def test_the_roofline_of_a_gpu_trace_is_computed_once(tmp_path: Path, calls: Counter[str]) -> None:
    trace = tracemagic.load(TRACES / GPU_TRACE, cache_dir=tmp_path)
    assert trace.has_gpu
    layers = trace.layers()
    assert calls["gpu_shares"] == 1 and calls["_roofline"] == 1
    assert layers["tflops_per_s"].notna().any()  # the layers did get FLOPs from the roofline
    first = Counter(calls)
    trace.efficiency()
    trace.advice()
    trace.layers(step=int(trace.steps()["step"].iloc[-1]))
    assert calls["_roofline"] == 1, f"the roofline was computed again: {dict(calls - first)}"
    assert calls["op_cost"] == first["op_cost"], "the cost models ran again for the same call chains"


@pytest.fixture
def peaks_calls(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Counts the calls of ``memory.peaks`` (``advice`` reads it from its module)."""
    from tracemagic.analysis import memory as memory_module

    counted: Counter[str] = Counter()
    real = memory_module.peaks

    def peaks(*args: Any, **kwargs: Any) -> Any:
        counted["peaks"] += 1
        return real(*args, **kwargs)

    peaks.__name__, peaks.__module__, peaks.__qualname__ = real.__name__, real.__module__, real.__qualname__
    monkeypatch.setattr(memory_module, "peaks", peaks)
    return counted


def test_advice_makes_no_memory_peaks_where_every_allocation_is_on_the_cpu(
    cpu_trace: Path, tmp_path: Path, peaks_calls: Counter[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The memory rules look at GPU peaks alone: a CPU trace's ``advice()`` does not compute
    ``memory_peaks()``; a trace with GPU allocations does, once."""
    monkeypatch.setenv("TRACEMAGIC_TABLE_CACHE", "0")  # computed, not read from an earlier test's cache
    events = json.loads(cpu_trace.read_text())["traceEvents"]
    memory = [e for e in events if e.get("name") == "[memory]"]
    assert memory and {e["args"]["Device Type"] for e in memory} == {0}
    tracemagic.load(cpu_trace, cache_dir=tmp_path).advice()
    assert peaks_calls["peaks"] == 0
    gpu = tracemagic.load(TRACES / GPU_TRACE, cache_dir=tmp_path)
    gpu.advice()
    assert peaks_calls["peaks"] == 1
    assert gpu.memory_peaks()["device"].astype(str).str.startswith("cuda").any()
