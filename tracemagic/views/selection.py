"""What the timeline draws: the events of a time window, in lanes, reduced to a drawable size.

A pure selection (tables in, a DataFrame out, no plotly) so that what the timeline shows is
testable on its own; ``figures.timeline`` only draws it. It lives with the views because it
exists for drawing: lanes, a bound on the events drawn and busy-time bins for the rest.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pandas as pd

#: how the phases lane names each phase
PHASE_LABELS = {"dataloader": "data loading", "forward": "forward", "backward": "backward", "optimizer": "optimizer"}
#: the columns of ``timeline_events``
COLUMNS = ("lane", "kind", "name", "ts", "dur", "depth", "info", "count", "busy")


def _window(steps: pd.DataFrame | None, step: int | None, frames: list[pd.DataFrame]) -> tuple[float, float]:
    if step is not None and steps is not None and not steps.empty:
        rows = steps[steps["step"] == step]
        if not rows.empty:
            return float(rows["ts"].min()), float((rows["ts"] + rows["dur"]).max())
    starts = [float(f["ts"].min()) for f in frames if not f.empty]
    ends = [float((f["ts"] + f["dur"]).max()) for f in frames if not f.empty]
    return (min(starts), max(ends)) if starts else (0.0, 1.0)


def _overlaps(frame: pd.DataFrame, lo: float, hi: float) -> np.ndarray:
    """Positions of the rows of ``frame`` that overlap ``[lo, hi)``."""
    if frame.empty:
        return np.empty(0, dtype=np.int64)
    ts = frame["ts"].to_numpy(dtype=float)
    end = ts + frame["dur"].to_numpy(dtype=float)
    return np.flatnonzero((end > lo) & (ts < hi))


def _codes(values: pd.Series, rows: np.ndarray) -> tuple[np.ndarray, list[str]]:
    """Integer codes of ``values`` at ``rows`` and the text of each code (no per-row strings)."""
    if isinstance(values.dtype, pd.CategoricalDtype):
        codes = values.cat.codes.to_numpy()[rows].astype(np.int64)
        cats = ["" if pd.isna(c) else str(c) for c in values.cat.categories]
        return np.where(codes < 0, len(cats), codes), [*cats, "?"]
    codes, uniques = pd.factorize(values.to_numpy()[rows], use_na_sentinel=True)
    cats = ["" if pd.isna(c) else str(c) for c in uniques]
    return np.where(codes < 0, len(cats), codes).astype(np.int64), [*cats, "?"]


def _text_at(values: pd.Series, rows: np.ndarray) -> list[str]:
    """``values`` at ``rows`` as text ('' where missing): only the drawn rows are converted."""
    return [
        "" if v is None or v is pd.NA or (isinstance(v, float) and np.isnan(v)) else str(v)
        for v in values.iloc[rows].tolist()
    ]


def _busy_bins(lane: np.ndarray, ts: np.ndarray, dur: np.ndarray, lo: float, hi: float, bins: int) -> pd.DataFrame:
    """Per lane and bin: events not drawn and the fraction of the bin they keep busy.

    Each event's duration is split over the bins it covers (the caller leaves out nested
    CPU events so time is not counted twice).
    """
    if not len(lane):
        return pd.DataFrame(columns=["lane", "start", "busy", "count"])
    width = (hi - lo) / bins
    edges = lo + width * np.arange(bins + 1)
    out = []
    order = np.argsort(lane, kind="stable")
    lane, ts, dur = lane[order], ts[order], dur[order]
    bounds = np.flatnonzero(np.diff(lane)) + 1
    for s, e in zip(np.r_[0, bounds], np.r_[bounds, len(lane)]):
        start = np.clip(ts[s:e], lo, hi)
        end = np.clip(ts[s:e] + dur[s:e], lo, hi)
        # busy time per bin = integral of the coverage
        busy = np.zeros(bins)
        cs = np.clip(np.searchsorted(edges, start, side="right") - 1, 0, bins - 1)
        ce = np.clip(np.searchsorted(edges, end, side="right") - 1, 0, bins - 1)
        same = cs == ce
        np.add.at(busy, cs[same], (end - start)[same])
        d = ~same
        np.add.at(busy, cs[d], edges[cs[d] + 1] - start[d])
        np.add.at(busy, ce[d], end[d] - edges[ce[d]])
        full = np.zeros(bins + 1)  # whole bins between
        np.add.at(full, cs[d] + 1, 1)
        np.add.at(full, ce[d], -1)
        busy += np.cumsum(full)[:bins] * width
        counts = np.bincount(cs, minlength=bins)
        nz = np.nonzero(counts)[0]
        out.append(
            pd.DataFrame(
                {"lane": lane[s], "start": edges[nz], "busy": np.minimum(busy[nz] / width, 1.0), "count": counts[nz]}
            )
        )
    return pd.concat(out, ignore_index=True)


def timeline_events(
    ops: pd.DataFrame,
    kernels: pd.DataFrame | None = None,
    steps: pd.DataFrame | None = None,
    *,
    step: int | None = None,
    window: tuple[float, float] | None = None,
    max_events: int = 3000,
    bins: int = 200,
    thread_names: Mapping[tuple[int, str], str] | None = None,
    spans: pd.DataFrame | None = None,
    phase_spans: pd.DataFrame | None = None,
) -> pd.DataFrame:
    """The events the timeline draws: steps, layers, CPU ops (per rank and thread) and GPU
    work (per rank and stream) in a time window, at most about ``max_events`` of them.

    To stay responsive on millions of events, each lane keeps only its longest events in
    the window (``max_events`` over all lanes, at least 10 per lane) and the rest become
    busy-time bins. Lanes, selection and bins are computed on integer codes; text is made
    only for the events kept.

    Args:
        ops: ``trace.ops()``.
        kernels: ``trace.kernels()`` (None or empty for a CPU-only trace).
        steps: ``trace.steps()``: a ``steps`` lane per rank (its ProfilerStep ops are then
            left out of the thread lanes), and ``step``'s window.
        step: only this step's time window.
        window: (start, end) in µs since the trace start; overrides ``step``.
        max_events: the most individual events kept.
        bins: busy-time bins per lane over the window, for the events not kept.
        thread_names: (rank, thread id) -> lane name (default ``thread <id>``).
        spans: ``layer_spans()``: a ``layers`` lane per rank with its forward and backward
            spans; None or empty: no lane.
        phase_spans: ``phase_spans()``: a ``phases`` lane per rank, under its steps, with a
            bar per run of data loading, forward, backward or optimizer; None or empty: no lane.

    Returns:
        One row per event kept: ``lane`` (its label: ``steps``, ``layers``, ``thread <id>``,
        ``GPU <device> stream <id>``, prefixed ``rank <r> · `` when there are several ranks),
        ``kind`` (step | phase <phase> | layer forward | layer backward | an ops or kernels ``kind``),
        ``name``, ``ts``, ``dur`` (µs), ``depth`` (CPU nesting depth; -1 for steps, 0 for the
        rest), ``info`` (layer, launching op or phase); then one row per busy-time bin of
        the events not kept, nested CPU events left out (``kind`` 'aggregated', ``ts`` and
        ``dur`` the bin, ``count`` events starting in it, ``busy`` the fraction of it they
        cover). ``attrs``: ``lanes`` (labels in drawing order: per rank steps, phases, layers,
        threads, streams), ``window`` ([start, end]), ``total`` (events in the window).
        Empty, with ``lanes`` [], when nothing lies in the window.
    """
    kernels = kernels if kernels is not None else pd.DataFrame(columns=["rank", "ts", "dur"])
    steps_df = steps if steps is not None else pd.DataFrame(columns=["rank", "step", "ts", "dur"])
    lo, hi = window if window is not None else _window(steps_df, step, [ops, kernels])
    lo, hi = float(lo), float(hi)
    if not hi > lo:
        hi = lo + 1e-3
    ranks_seen = set(pd.unique(ops["rank"])) if "rank" in ops and len(ops) else {0}
    if "rank" in kernels and len(kernels):
        ranks_seen |= set(pd.unique(kernels["rank"]))
    several = len(ranks_seen) > 1
    names = thread_names or {}

    # lanes: (rank, order, name) -> id; order 0 steps, 0.5 phases, 1 layers, 2 CPU threads, 3 GPU streams
    lane_ids: dict[tuple[int, float, str], int] = {}

    def lane_of(rank: int, order: float, name: str) -> int:
        return lane_ids.setdefault((int(rank), order, name), len(lane_ids))

    # per source: positions in its frame and their lane, as arrays
    sources: list[tuple[str, pd.DataFrame, np.ndarray, np.ndarray]] = []
    cpu_rows = _overlaps(ops, lo, hi)
    if steps is not None and len(cpu_rows):
        cpu_rows = cpu_rows[(ops["kind"].to_numpy()[cpu_rows] != "step")]  # drawn in the steps lane
    if len(cpu_rows):
        rank = ops["rank"].to_numpy()[cpu_rows].astype(np.int64)
        code, cats = _codes(ops["thread"], cpu_rows)
        key = rank * (len(cats) + 1) + code
        uniq, inverse = np.unique(key, return_inverse=True)
        lane_map = np.array(
            [
                lane_of(
                    k // (len(cats) + 1),
                    2,
                    names.get(
                        (int(k // (len(cats) + 1)), cats[k % (len(cats) + 1)]), f"thread {cats[k % (len(cats) + 1)]}"
                    ),
                )
                for k in uniq
            ],
            dtype=np.int64,
        )
        sources.append(("cpu", ops, cpu_rows, lane_map[inverse.reshape(-1)]))
    gpu_rows = _overlaps(kernels, lo, hi)
    if len(gpu_rows):
        rank = kernels["rank"].to_numpy()[gpu_rows].astype(np.int64)
        dcode, dcats = _codes(kernels["device"], gpu_rows)
        scode, scats = _codes(kernels["stream"], gpu_rows)
        nd, ns = len(dcats) + 1, len(scats) + 1
        key = (rank * nd + dcode) * ns + scode
        uniq, inverse = np.unique(key, return_inverse=True)
        lane_map = np.array(
            [
                lane_of(k // (nd * ns), 3, f"GPU {dcats[(k // ns) % nd] or '?'} stream {scats[k % ns] or '?'}")
                for k in uniq
            ],
            dtype=np.int64,
        )
        sources.append(("gpu", kernels, gpu_rows, lane_map[inverse.reshape(-1)]))
    step_rows = _overlaps(steps_df, lo, hi)
    if len(step_rows):
        lane_map = np.array([lane_of(r, 0, "steps") for r in steps_df["rank"].to_numpy()[step_rows]], dtype=np.int64)
        sources.append(("step", steps_df, step_rows, lane_map))
    spans_df = spans if spans is not None else pd.DataFrame(columns=["rank", "layer", "phase", "ts", "dur"])
    span_rows = _overlaps(spans_df, lo, hi)
    if len(span_rows):
        lane_map = np.array([lane_of(r, 1, "layers") for r in spans_df["rank"].to_numpy()[span_rows]], dtype=np.int64)
        sources.append(("layer", spans_df, span_rows, lane_map))
    phases_df = phase_spans if phase_spans is not None else pd.DataFrame(columns=["rank", "phase", "ts", "dur"])
    phase_rows = _overlaps(phases_df, lo, hi)
    if len(phase_rows):
        lane_map = np.array(
            [lane_of(r, 0.5, "phases") for r in phases_df["rank"].to_numpy()[phase_rows]], dtype=np.int64
        )
        sources.append(("phase", phases_df, phase_rows, lane_map))
    if not sources:
        empty = pd.DataFrame(columns=list(COLUMNS))
        empty.attrs.update(lanes=[], window=[lo, hi], total=0)
        return empty

    lane = np.concatenate([s[3] for s in sources])
    ts = np.concatenate([s[1]["ts"].to_numpy(dtype=float)[s[2]] for s in sources])
    dur = np.concatenate([s[1]["dur"].to_numpy(dtype=float)[s[2]] for s in sources])
    depth = np.concatenate(
        [
            s[1]["depth"].to_numpy(dtype=float)[s[2]]
            if s[0] == "cpu"
            else np.full(len(s[2]), -1.0 if s[0] == "step" else 0.0)
            for s in sources
        ]
    )
    total = len(lane)
    # lane order: per rank, steps, then layers, then CPU threads, then GPU streams
    keys = sorted(lane_ids, key=lambda k: (k[0], k[1], k[2]))
    label = {lane_ids[k]: (f"rank {k[0]} · {k[2]}" if several else k[2]) for k in keys}
    per_lane = max(10, max_events // max(len(keys), 1))
    # the longest ``per_lane`` events of each lane, by one sort over all lanes
    order = np.lexsort((-dur, lane))
    sorted_lane = lane[order]
    first = np.searchsorted(sorted_lane, sorted_lane, side="left")
    keep = np.zeros(total, dtype=bool)
    keep[order[(np.arange(total) - first) < per_lane]] = True

    # text only for the events kept
    offsets = np.cumsum([0] + [len(s[2]) for s in sources])
    pieces = []
    for (kind, frame, rows, _), start in zip(sources, offsets[:-1]):
        mine = np.flatnonzero(keep[start : start + len(rows)])
        if not len(mine):
            continue
        at = rows[mine]
        if kind == "cpu":
            kinds = _text_at(frame["kind"], at)
            names_at = _text_at(frame["name"], at)
            info = _text_at(frame["layer"], at) if "layer" in frame else [""] * len(at)
        elif kind == "gpu":
            kinds = _text_at(frame["kind"], at)
            names_at = _text_at(frame["name"], at)
            info = [
                "launched by " + (o or "?") for o in (_text_at(frame["op"], at) if "op" in frame else [""] * len(at))
            ]
        elif kind == "phase":
            phases = _text_at(frame["phase"], at)
            kinds = [f"phase {p}" for p in phases]
            names_at = [PHASE_LABELS.get(p, p) for p in phases]
            steps_at = frame["step"].to_numpy()[at] if "step" in frame else np.full(len(at), -1)
            busy_at = frame["busy_us"].to_numpy(dtype=float)[at] if "busy_us" in frame else np.full(len(at), np.nan)
            info = [
                (f"step {int(s)}" if int(s) >= 0 else "outside steps")
                + (f" · {b / 1000:.3f} ms of its own" if b == b else "")
                for s, b in zip(steps_at, busy_at)
            ]
        elif kind == "layer":
            phases = _text_at(frame["phase"], at)
            kinds = [f"layer {p}" for p in phases]
            names_at = _text_at(frame["layer"], at)
            types = _text_at(frame["type"], at) if "type" in frame else [""] * len(at)
            info = [f"{p} · {t}" if t else p for p, t in zip(phases, types)]
        else:
            kinds = ["step"] * len(at)
            names_at = [f"ProfilerStep#{int(s)}" for s in frame["step"].to_numpy()[at]]
            info = [""] * len(at)
        idx = start + mine
        pieces.append(
            pd.DataFrame(
                {
                    "lane": [label[int(i)] for i in lane[idx]],
                    "kind": kinds,
                    "name": names_at,
                    "ts": ts[idx],
                    "dur": dur[idx],
                    "depth": depth[idx],
                    "info": info,
                }
            )
        )
    rest = ~keep & (depth <= 0)  # nested CPU events are inside their parents' time
    if (~keep).any():
        agg = _busy_bins(lane[rest], ts[rest], dur[rest], lo, hi, bins)
        if not agg.empty:
            pieces.append(
                pd.DataFrame(
                    {
                        "lane": [label[int(i)] for i in agg["lane"]],
                        "kind": "aggregated",
                        "ts": agg["start"].to_numpy(dtype=float),
                        "dur": (hi - lo) / bins,
                        "count": agg["count"].to_numpy(),
                        "busy": agg["busy"].to_numpy(dtype=float),
                    }
                )
            )
    out = pd.concat(pieces, ignore_index=True).reindex(columns=list(COLUMNS))
    out.attrs.update(lanes=[label[lane_ids[k]] for k in keys], window=[lo, hi], total=int(total))
    return out
