"""Chisel-compatible model profiling: ``@capture_model`` and ``parse_model_trace``.

Chisel (Herdora's ``chisel-cli``) profiles every ``forward`` of a decorated model class,
writes ``{model_name}_forward_{NNN:03d}.json`` Kineto traces and summarises them per layer
as ``{model_name, trace_file, layer_stats: {layer: {total_time_us, call_count, shapes,
operations}}}``. Its summary sums every ``cpu_op``'s duration, so nested ops
(``aten::linear`` around ``aten::addmm``) count twice, and finds layers through a
``Stack`` arg current torch no longer writes (every op lands in ``Unknown_<op>``).

Here the same API and dict shape come from tracemagic's layer attribution: a layer is an
``nn.Module`` instance named by its attribute path (``encoder.layers.0.linear1``, from a
``<trace>.modules.json`` written next to each trace), ``total_time_us`` is the host time
spent in the layer itself (nested layers are not counted in their parents, so the values
add up to the forward time), and ops nested in other ops are listed but not re-counted.
Set ``TRACEMAGIC_DISABLE=1`` to turn the decorator into a no-op in production.

Each forward is a one-step capture on the capture session's pieces (``capture.session``
starts and stops the profiler, ``capture.files`` places the files atomically): the profiler
is stopped whatever the forward raises, and a forward that raises writes no file.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from tracemagic.trace import layout

if TYPE_CHECKING:  # pragma: no cover
    from tracemagic.trace.model import TraceTables

__all__ = ["DISABLE_ENV", "capture_model", "format_layer_summary", "parse_model_trace"]

#: set to 1/true/yes to make ``capture_model`` a no-op
DISABLE_ENV = "TRACEMAGIC_DISABLE"
_DIMS = re.compile(r"\[\d")
_log = logging.getLogger(__name__)
T = TypeVar("T", bound=type)


def _disabled() -> bool:
    return os.environ.get(DISABLE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def capture_model(
    model_name: str | None = None,
    record_shapes: bool = True,
    profile_memory: bool = True,
    **profiler_kwargs: Any,
) -> Callable[[T], T]:
    """Class decorator: profile every ``forward`` of the model and print a per-layer table.

    Each call writes ``<trace_dir>/{model_name}_forward_{NNN:03d}.json`` (NNN counts calls
    per instance from 001) and ``...modules.json`` (trace module names -> attribute paths).

    Args:
        model_name: the trace file prefix (default: the class name).
        record_shapes: record input shapes (``torch.profiler.profile`` argument).
        profile_memory: record allocations.
        **profiler_kwargs: more ``torch.profiler.profile`` arguments, plus ``trace_dir``
            (default ``$TRACEMAGIC_TRACE_DIR`` or ``./traces``) and ``verbose`` (print the
            table, default True).

    Returns:
        The decorator; with ``TRACEMAGIC_DISABLE=1`` it returns the class unchanged, and a
        class decorated while enabled skips profiling while the variable is set.

    Raises:
        TypeError: the decorated object is not an ``nn.Module`` subclass.
    """
    trace_dir = Path(profiler_kwargs.pop("trace_dir", None) or os.environ.get("TRACEMAGIC_TRACE_DIR", "traces"))
    verbose = bool(profiler_kwargs.pop("verbose", True))
    profiler_kwargs.setdefault("with_stack", True)  # nn.Module events come from the python tracer

    def decorate(cls: T) -> T:
        import torch

        from tracemagic.capture.session import profiler_busy

        if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
            raise TypeError(f"@capture_model decorates an nn.Module subclass, not {cls!r}")
        if _disabled():
            return cls
        name = model_name or cls.__name__
        original = cls.forward

        def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
            if _disabled() or profiler_busy():  # the capture session's own test
                if not _disabled() and not getattr(self, "_tracemagic_warned", False):
                    warnings.warn(
                        f"@capture_model({name}): a profiler is already running (e.g. %%chakra_trace); "
                        "this forward pass is not profiled separately.",
                        stacklevel=2,
                    )
                    self._tracemagic_warned = True
                return original(self, *args, **kwargs)
            return _profiled_forward(
                self, original, name, trace_dir, record_shapes, profile_memory, verbose, profiler_kwargs, args, kwargs
            )

        forward.__doc__ = original.__doc__
        forward.__wrapped__ = original  # type: ignore[attr-defined]
        return type(
            cls.__name__,
            (cls,),
            {
                "forward": forward,
                "__module__": cls.__module__,
                "__qualname__": cls.__qualname__,
                "__doc__": cls.__doc__,
            },
        )  # type: ignore[return-value]

    return decorate


def _profiled_forward(
    model: Any,
    original: Callable[..., Any],
    name: str,
    trace_dir: Path,
    record_shapes: bool,
    profile_memory: bool,
    verbose: bool,
    profiler_kwargs: dict[str, Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """One forward as a one-step capture, on the capture session's pieces: the profiler
    started and stopped with torch's notices hushed (``capture.session``), stopped also
    when the forward raises (then nothing is written), the trace and its modules placed
    atomically (``capture.files``), the modules named by ``capture.naming``."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from tracemagic.capture import files
    from tracemagic.capture.naming import module_map
    from tracemagic.capture.session import start_profiler, stop_profiler

    count = getattr(model, "_tracemagic_calls", 0) + 1
    model._tracemagic_calls = count
    trace_dir.mkdir(parents=True, exist_ok=True)
    trace_file = trace_dir / f"{name}_forward_{count:03d}.json"
    options = dict(profiler_kwargs)
    options.setdefault(
        "activities", [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    )
    prof = profile(record_shapes=record_shapes, profile_memory=profile_memory, **options)
    hidden: list[str] = []  # torch's start/stop notices: kept out of the output
    start_profiler(prof, hidden)
    try:
        result = original(model, *args, **kwargs)
    finally:
        # switched off under us (torch.autograd._disable_profiler()): exporting would crash
        switched_off = not torch._C._autograd._profiler_enabled()
        failed = stop_profiler(prof, hidden)
    if switched_off or failed is not None:
        why = "was switched off inside the forward" if switched_off else f"failed to stop ({failed})"
        warnings.warn(f"@capture_model({name}): torch.profiler {why}; no trace written.", stacklevel=3)
        return result
    window: dict[str, Any] = {}

    def export(path: str) -> None:  # the model's modules are named while the results are alive
        nonlocal window
        prof.export_chrome_trace(path)
        window = _window(prof, model, path)

    files.write_with(trace_file, export)
    modules = module_map(window, [model], {name: model})  # the model itself is named `name`
    files.write_json(layout.modules_sidecar(trace_file), modules)
    print(f"[capture_model] {name} forward pass #{count} -> {trace_file}", file=sys.stdout)
    if verbose:
        stats = parse_model_trace(trace_file, name)
        print(format_layer_summary(stats), file=sys.stdout)
    return result


def _window(prof: Any, model: Any, trace: str) -> dict[str, Any]:
    """The trace's module names -> modules (the model's own call is on the stack when the
    tracer starts: torch records it too); empty without ``with_stack`` or on failure."""
    from tracemagic.capture.naming import recorded_modules, resolve

    if not prof.with_stack:
        return {}
    try:
        return resolve(recorded_modules(prof.profiler, trace), [model])
    except Exception:  # noqa: BLE001 - names are a convenience: never lose the forward's result
        _log.debug("naming the model's modules failed", exc_info=True)
        return {}


def _load(trace_file: Path) -> TraceTables:
    from tracemagic.trace.loader import load

    trace = load(trace_file, use_cache=False)
    sidecar = layout.modules_sidecar(trace_file)
    if trace.manifest is None and sidecar.is_file():
        with contextlib.suppress(OSError, json.JSONDecodeError):
            trace.manifest = {"modules": json.loads(sidecar.read_text())}
    return trace


def _shape_tuples(dims_text: Any) -> list[tuple[int, ...]]:
    if not isinstance(dims_text, str) or not _DIMS.search(dims_text):
        return []
    try:
        dims = json.loads(dims_text)
    except json.JSONDecodeError:
        return []
    out = []
    for d in dims if isinstance(dims, list) else []:
        if isinstance(d, list) and d and all(isinstance(x, int) for x in d):
            out.append(tuple(d))
    return out


def _entry(layer_type: str = "") -> dict[str, Any]:
    return {
        "total_time_us": 0,
        "call_count": 0,
        "shapes": set(),
        "operations": set(),
        "inclusive_time_us": 0,
        "gpu_time_us": 0,
        "type": layer_type,
    }


def parse_model_trace(trace_file: str | os.PathLike[str], model_name: str = "Unknown") -> dict[str, Any]:
    """Per-layer statistics of a model trace, in Chisel's dict shape.

    Args:
        trace_file: a Kineto trace (``capture_model`` output, or any ``with_stack`` trace).
        model_name: the model's name, copied into the result.

    Returns:
        ``{"model_name", "trace_file", "layer_stats": {layer: {"total_time_us",
        "call_count", "shapes", "operations", ...}}}``: ``total_time_us`` is the layer's own
        host time (µs, int; nested layers counted only in themselves), ``shapes`` a set of
        input-shape tuples and ``operations`` a set of op names run in the layer (nested
        ops included, each op in its innermost layer). Extra keys: ``inclusive_time_us``,
        ``gpu_time_us``, ``type``. Time of the outermost ops outside every layer is
        reported under ``"(no layer)"`` when there is any.

    Raises:
        TraceError: the file is missing or not a Kineto trace (Chisel returned None; a
            clear error is more useful).
    """
    path = Path(trace_file)
    trace = _load(path)
    ev = trace.events
    stats: dict[str, dict[str, Any]] = {}
    from tracemagic.analysis.layers import layers
    from tracemagic.analysis.ops import ops as ops_table

    for row in trace.table(layers).itertuples(index=False):
        entry = stats[str(row.layer)] = _entry(str(row.type))
        entry["total_time_us"] = int(round(float(row.self_cpu_us)))
        entry["call_count"] = int(row.calls)
        entry["inclusive_time_us"] = int(round(float(row.cpu_us)))
        entry["gpu_time_us"] = int(round(float(row.gpu_us)))
    ops = trace.table(ops_table)
    ops = ops[(ops["kind"] == "cpu_op").to_numpy()]
    found = ops.loc[ops["layer"].notna().to_numpy(), ["layer", "name", "input_dims"]].astype(object)
    for name, op in found[["layer", "name"]].drop_duplicates().itertuples(index=False):  # per distinct pair
        stats.setdefault(name, _entry())["operations"].add(str(op))
    for name, dims in found[["layer", "input_dims"]].dropna().drop_duplicates().itertuples(index=False):
        stats.setdefault(name, _entry())["shapes"].update(_shape_tuples(dims))
    parent = ops["parent"].to_numpy()
    in_op = (parent >= 0) & (ev["kind"].to_numpy()[np.maximum(parent, 0)] == "cpu_op")
    unattributed = float(ops.loc[ops["layer"].isna().to_numpy() & ~in_op, "dur"].sum())
    if unattributed > 0 and stats:
        stats["(no layer)"] = _entry() | {
            "total_time_us": int(round(unattributed)),
            "inclusive_time_us": int(round(unattributed)),
        }
    return {"model_name": model_name, "trace_file": str(trace_file), "layer_stats": stats}


def format_layer_summary(analysis: dict[str, Any]) -> str:
    """Chisel's per-layer table (layer, calls, total and average ms, shapes) as text."""
    stats = analysis.get("layer_stats") or {}
    if not stats:
        return "No layer information found in trace (profile with with_stack=True)."
    rows = sorted(stats.items(), key=lambda kv: kv[1]["total_time_us"], reverse=True)
    width = max(25, max(len(k) for k in stats) + 1)
    lines = [
        f"{'Layer':<{width}} {'Calls':<8} {'Total Time (ms)':<15} {'Avg Time (ms)':<15} {'Shapes':<20}",
        "─" * (width + 60),
    ]
    for layer, s in rows:
        total_ms = s["total_time_us"] / 1000
        avg_ms = total_ms / s["call_count"] if s["call_count"] else 0.0
        shapes = sorted(s["shapes"])
        shape_text = ", ".join(str(x) for x in shapes) if len(shapes) <= 2 else f"{len(shapes)} unique shapes"
        lines.append(f"{layer:<{width}} {s['call_count']:<8} {total_ms:<15.3f} {avg_ms:<15.3f} {shape_text:<20}")
    total = sum(s["total_time_us"] for s in stats.values()) / 1000
    lines += ["─" * (width + 60), f"{'TOTAL':<{width}} {'':<8} {total:<15.3f}"]
    return "\n".join(lines)
