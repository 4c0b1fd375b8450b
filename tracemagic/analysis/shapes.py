"""``shapes()``: call chains grouped by their top op's name, input shapes and dtypes, with FLOPs
where shapes fix them."""

from __future__ import annotations

import json
import math
from collections.abc import Callable

import numpy as np
import pandas as pd

from tracemagic.analysis._common import (
    activity_rows,
    among,
    call_chains,
    codes_of,
    column_at,
    group_rows,
    group_sums,
    rollup,
    take_codes,
    text,
    text_take,
    values_at,
)
from tracemagic.analysis.schema import computes
from tracemagic.trace.model import TraceTables
from tracemagic.trace.normalize import per_category
from tracemagic.trace.structure import enclosing_of_kind

Dims = list[list[int]]


def _matrix(a: list[int], b: list[int]) -> float | None:
    """2·M·N·K of ``a @ b`` with torch.matmul's broadcasting (1-D operands included)."""
    if not a or not b:
        return None
    a2 = [1, *a] if len(a) == 1 else a
    b2 = [*b, 1] if len(b) == 1 else b
    if a2[-1] != b2[-2]:
        return None
    batch = np.broadcast_shapes(tuple(a2[:-2]), tuple(b2[:-2]))
    return 2.0 * math.prod(batch) * a2[-2] * b2[-1] * a2[-1]


def _mm(dims: Dims) -> float | None:
    return _matrix(dims[0], dims[1]) if len(dims) >= 2 else None


def _addmm(dims: Dims) -> float | None:
    return _matrix(dims[1], dims[2]) if len(dims) >= 3 else None


def _linear(dims: Dims) -> float | None:
    if len(dims) < 2 or not dims[0] or len(dims[1]) != 2 or dims[0][-1] != dims[1][1]:
        return None
    return 2.0 * math.prod(dims[0][:-1]) * dims[1][0] * dims[1][1]


def _convolution(dims: Dims) -> float | None:
    """2 · N · C_out · (C_in / groups) · kernel volume · output positions, estimated.

    Without the op's stride and padding (``Concrete Inputs``) the output size is not known;
    it is taken equal to the input's spatial size ('same' padding, stride 1), which
    overstates strided convolutions. (For a transposed convolution this is its exact count,
    see ``_conv_exact``.)
    """
    if len(dims) < 2 or len(dims[0]) < 3 or len(dims[1]) != len(dims[0]):
        return None
    x, w = dims[0], dims[1]
    return 2.0 * x[0] * w[0] * w[1] * math.prod(w[2:]) * math.prod(x[2:])


def _conv_transpose(dims: Dims, _args: list[str] | None = None) -> float | None:
    """Transposed conv, torch's count: 2 · N · input positions · C_in · (C_out / groups) · kernel.

    The weight is [C_in, C_out / groups, k...]; every input position is multiplied into
    C_out / groups channels by every kernel tap, whatever the stride, padding or output size,
    so the shapes alone fix it (``torch.utils.flop_counter.conv_flop_count``).
    """
    if len(dims) < 2 or len(dims[0]) < 3 or len(dims[1]) != len(dims[0]):
        return None
    x, w = dims[0], dims[1]
    return 2.0 * x[0] * math.prod(x[2:]) * w[0] * w[1] * math.prod(w[2:])


def _arg(args: list[str], i: int) -> object:
    """Argument ``i`` of ``Concrete Inputs`` ('[2, 2]', '1', 'False', 'same') as a value; None if absent."""
    if i >= len(args) or not isinstance(args[i], str) or not args[i].strip():
        return None
    raw = args[i].strip()
    if raw in ("True", "False"):
        return raw == "True"
    try:
        return json.loads(raw)
    except ValueError:
        return raw.strip("'\"")


def _ints(value: object, n: int) -> list[int] | None:
    """An int or int list broadcast to ``n`` spatial dims (torch's ``int[2]`` accepts one value)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return [value] * n
    if isinstance(value, list) and value and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return value * n if len(value) == 1 else value if len(value) == n else None
    return None


#: op -> positions in ``Concrete Inputs`` of (stride, padding, dilation, transposed, groups);
#: transposed None: the op is never transposed
_CONV_ARGS: dict[str, tuple[int, int, int, int | None, int]] = {
    "aten::convolution": (3, 4, 5, 6, 8),
    "aten::_convolution": (3, 4, 5, 6, 8),
    "aten::conv1d": (3, 4, 5, None, 6),
    "aten::conv2d": (3, 4, 5, None, 6),
    "aten::conv3d": (3, 4, 5, None, 6),
}


def _conv_exact(name: str, dims: Dims, args: list[str]) -> float | None:
    """Conv FLOPs from the real output size, torch's ``with_flops``/``FlopCounterMode`` count.

    out = ⌊(in + 2·pad − dil·(k − 1) − 1) / stride⌋ + 1 per spatial dim ('valid' padding is 0,
    'same' keeps the input size); FLOPs = 2 · N · C_out · out positions · (C_in / groups) ·
    kernel volume, with weight [C_out, C_in / groups, k...]. Multiplies and adds only: the
    bias is not counted, as in torch. A transposed convolution counts per input position
    (``_conv_transpose``). None where the arguments are missing or do not fit the shapes.
    """
    if len(dims) < 2 or len(dims[0]) < 3 or len(dims[1]) != len(dims[0]):
        return None
    i_stride, i_pad, i_dil, i_transposed, i_groups = _CONV_ARGS[name]
    if i_transposed is not None:
        transposed = _arg(args, i_transposed)
        if not isinstance(transposed, bool):
            return None
        if transposed:
            return _conv_transpose(dims)
    x, w = dims[0], dims[1]
    n = len(x) - 2
    stride, dilation, groups = _ints(_arg(args, i_stride), n), _ints(_arg(args, i_dil), n), _arg(args, i_groups)
    padding = _arg(args, i_pad)
    if stride is None or dilation is None or not isinstance(groups, int) or isinstance(groups, bool) or groups < 1:
        return None
    if padding == "same":
        out = list(x[2:])
    else:
        pad = [0] * n if padding == "valid" else _ints(padding, n)
        if pad is None or min(stride) < 1:
            return None
        out = [(i + 2 * p - d * (k - 1) - 1) // s + 1 for i, p, d, k, s in zip(x[2:], pad, dilation, w[2:], stride)]
    if min(out) < 1 or w[1] * groups != x[1]:
        return None
    return 2.0 * x[0] * w[0] * math.prod(out) * w[1] * math.prod(w[2:])


def _attention(dims: Dims) -> float | None:
    """QKᵀ and PV: 2·B·L·S·E + 2·B·L·S·Eᵥ for q [.., L, E], k [.., S, E], v [.., S, Eᵥ]."""
    if len(dims) < 3 or min(len(d) for d in dims[:3]) < 2:
        return None
    q, k, v = dims[0], dims[1], dims[2]
    batch = math.prod(q[:-2])
    return 2.0 * batch * q[-2] * k[-2] * (q[-1] + v[-1])


def _flag(args: list[str], i: int) -> bool | None:
    """Boolean argument ``i`` of ``Concrete Inputs`` ('True' / 'False'), None if absent."""
    value = _arg(args, i)
    return value if isinstance(value, bool) else None


def _flags(args: list[str], i: int) -> list[bool] | None:
    """A bool-list argument (``output_mask``: '[True, False, True]'), None if absent."""
    value = _arg(args, i)
    if not isinstance(value, str) or not value.startswith("["):
        return None
    items = [v.strip() for v in value.strip("[]").split(",")]
    return [v == "True" for v in items] if all(v in ("True", "False") for v in items) else None


#: attention op -> (position of q in ``Input Dims``, of ``is_causal`` in ``Concrete Inputs``,
#: FLOPs relative to the forward's): the backward runs five matrix products of the
#: forward's size (QKᵀ again, dV, dP, dQ, dK) to the forward's two, so 2.5×
ATTENTION: dict[str, tuple[int, int, float]] = {
    "aten::scaled_dot_product_attention": (0, 5, 1.0),
    "aten::_scaled_dot_product_flash_attention": (0, 4, 1.0),
    "aten::_scaled_dot_product_efficient_attention": (0, 6, 1.0),
    "aten::_scaled_dot_product_cudnn_attention": (0, 6, 1.0),
    "aten::_scaled_dot_product_flash_attention_for_cpu": (0, 4, 1.0),
    "aten::_scaled_dot_product_flash_attention_backward": (1, 11, 2.5),
    "aten::_scaled_dot_product_efficient_attention_backward": (1, 11, 2.5),
    "aten::_scaled_dot_product_cudnn_attention_backward": (1, 14, 2.5),
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward": (1, 7, 2.5),
}


def _attention_args(name: str, dims: Dims, args: list[str]) -> float | None:
    """Attention FLOPs (``_attention``), halved where ``is_causal`` is recorded True (the
    masked half of QKᵀ and PV is skipped), 2.5× for the backward."""
    at, causal_at, factor = ATTENTION[name]
    value = _attention(dims[at:])
    if value is None:
        return None
    return value * factor * (0.5 if _flag(args, causal_at) else 1.0)


def _convolution_backward(name: str, dims: Dims, args: list[str]) -> float | None:
    """``aten::convolution_backward(grad_output, input, weight, ..., transposed@7, ...,
    output_mask@10)``: each of grad input and grad weight costs the forward's FLOPs,
    2 · N · weight volume · output positions (input positions when transposed); the bias
    gradient is a sum, not counted (as in torch). None without ``output_mask``."""
    if len(dims) < 3 or len(dims[1]) < 3 or len(dims[2]) != len(dims[1]):
        return None
    mask, transposed = _flags(args, 10), _flag(args, 7)
    if mask is None or transposed is None or len(mask) < 2:
        return None
    grad_out, x, w = dims[0], dims[1], dims[2]
    positions = math.prod(x[2:]) if transposed else math.prod(grad_out[2:])
    return 2.0 * x[0] * math.prod(w) * positions * (int(mask[0]) + int(mask[1]))


#: ops whose FLOPs need ``Concrete Inputs`` as well as the dims (None without them)
ARG_RULES: dict[str, Callable[[str, Dims, list[str]], float | None]] = {
    **{name: _attention_args for name in ATTENTION},
    "aten::convolution_backward": _convolution_backward,
}

#: op name -> FLOPs of one call from its input dims
FLOP_RULES: dict[str, Callable[[Dims], float | None]] = {
    "aten::mm": _mm,
    "aten::matmul": _mm,
    "aten::bmm": _mm,
    "aten::addmm": _addmm,
    "aten::baddbmm": _addmm,
    "aten::linear": _linear,
    "aten::convolution": _convolution,
    "aten::_convolution": _convolution,
    "aten::conv1d": _convolution,
    "aten::conv2d": _convolution,
    "aten::conv3d": _convolution,
    "aten::conv_transpose1d": _conv_transpose,
    "aten::conv_transpose2d": _conv_transpose,
    "aten::conv_transpose3d": _conv_transpose,
    "aten::scaled_dot_product_attention": _attention,
    "aten::_scaled_dot_product_flash_attention": _attention,
    "aten::_scaled_dot_product_efficient_attention": _attention,
    "aten::_scaled_dot_product_cudnn_attention": _attention,
    "aten::_scaled_dot_product_flash_attention_for_cpu": _attention,
}
#: rules whose result is an estimate (output size assumed) unless ``Concrete Inputs`` fix it
ESTIMATED = set(_CONV_ARGS)


def flops_with_source(
    name: str, input_dims: str | None, concrete_inputs: str | None = None
) -> tuple[float | None, str | None]:
    """FLOPs of one call and how they were had: ('shapes' exact | 'estimate' | None, None if unknown)."""
    rule = FLOP_RULES.get(name)
    if (rule is None and name not in ARG_RULES) or not input_dims:
        return None, None
    try:
        dims = json.loads(input_dims)
        if name in ARG_RULES:
            args = json.loads(concrete_inputs) if concrete_inputs else []
            exact = ARG_RULES[name](name, dims, args if isinstance(args, list) else [])
            if exact is not None:
                return exact, "shapes"
        if rule is None:
            return None, None
        if name in ESTIMATED and concrete_inputs:
            args = json.loads(concrete_inputs)
            exact = _conv_exact(name, dims, args) if isinstance(args, list) else None
            if exact is not None:
                return exact, "shapes"
        value = rule(dims)
    except (ValueError, TypeError, IndexError):
        return None, None
    if value is None:
        return None, None
    return value, "estimate" if name in ESTIMATED else "shapes"


def flops(name: str, input_dims: str | None, concrete_inputs: str | None = None) -> float | None:
    """FLOPs of one call of op ``name`` with ``Input Dims`` (and ``Concrete Inputs``) text,
    None where they don't fix it."""
    return flops_with_source(name, input_dims, concrete_inputs)[0]


def gpu_time(events: pd.DataFrame, at: np.ndarray | None, activity: np.ndarray) -> np.ndarray:
    """Per events row (or per row of ``at``): duration of the GPU work (kernels, memcpy,
    memset) launched inside it (``activity``: the rows of that work,
    ``_common.activity_rows``)."""
    launch = events["launch"].to_numpy()
    gpu = activity[launch[activity] >= 0]
    if at is not None and gpu.size == 0:  # nothing launched (a CPU trace): no table-long zeros
        return np.zeros(at.size)
    total = rollup(launch[gpu], events["dur"].to_numpy()[gpu], events["parent"].to_numpy())
    return total if at is None else total[at]


#: how a figure of FLOPs was had, most trusted first: a chain's is its least trusted part's
_SOURCES = ("trace", "shapes", "estimate")


def _op_flops(events: pd.DataFrame, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """FLOPs of one call of each of ``rows`` (NaN where unknown) and their source (an index
    of ``_SOURCES``, -1 where unknown): the trace's own ``flops`` arg, else the shapes'."""
    flops = events["flops"]
    if flops.array.isna().all():  # no ``with_flops`` (the usual case)
        value = np.full(rows.size, np.nan)
    else:  # taken at the rows first: the whole column is not converted
        value = pd.Series(column_at(flops, rows)).to_numpy(dtype=np.float64, na_value=np.nan)
    unknown = np.isnan(value)
    source = np.where(unknown, -1, 0)
    names, name_of = _codes_at_rows(events["name"], rows)
    has_rule = among(name_of, [*FLOP_RULES, *ARG_RULES])  # per name, not per row
    # the dims and arguments taken only at the ops a rule knows (a few), not at every op
    # (per category: compared on the small codes, not gathered through an intp index)
    ruled = np.flatnonzero(unknown & per_category(has_rule[:-1], names, bool(has_rule[-1])))
    dims, dims_of = _codes_at_rows(events["input_dims"], rows[ruled])
    shaped = dims >= 0
    ruled, dims = ruled[shaped], dims[shaped]
    args, args_of = _codes_at_rows(events["concrete_inputs"], rows[ruled])
    names = names[ruled]
    if len(name_of) * len(dims_of) * len(args_of) < 2**62:  # one int key (codes + 1: -1 is missing)
        wide = [c.astype(np.int64) + 1 for c in (names, dims, args)]  # (the codes are int8 or int16)
        codes, first = group_rows((wide[0] * len(dims_of) + wide[1]) * len(args_of) + wide[2])
    else:
        codes, first = group_rows(names, dims, args)
    found = [
        flops_with_source(str(name_of[n]), str(dims_of[d]), str(args_of[a]) if a >= 0 and args_of[a] else None)
        for n, d, a in zip(names[first].tolist(), dims[first].tolist(), args[first].tolist())
    ]
    per_key = np.array([np.nan if f is None else f for f, _ in found] + [np.nan])
    per_key_source = np.array([-1 if f is None else _SOURCES.index(str(how)) for f, how in found] + [-1])
    value[ruled] = per_key[codes]
    source[ruled] = per_key_source[codes]
    return value, source


def _codes_at_rows(column: pd.Series, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``codes_of(column)`` with the codes taken at ``rows`` (a categorical's codes are read
    off the array: ``.cat.codes`` copies every row's)."""
    values = column.array
    if isinstance(values, pd.Categorical):
        return np.take(values.codes, rows), np.append(np.asarray(values.categories, dtype=object), [np.nan])
    codes, labels = codes_of(column)
    return codes[rows], labels


def outermost(events: pd.DataFrame, rows: np.ndarray, top: np.ndarray, known: np.ndarray) -> np.ndarray:
    """Mask over ``rows`` (op rows, ``top`` the top of each one's call chain, -1: none) of
    those in a chain with ``known`` True and no known op around them: the ops whose figures
    add up to their chain's (a linear layer's backward: its two ``aten::mm``)."""
    at = np.zeros(len(events), dtype=bool)
    at[rows[known]] = True
    outer = (top >= 0) & known
    candidates = rows[outer]
    parent, depth = events["parent"].to_numpy(), events["depth"].to_numpy()
    levels = int(depth[candidates].max(initial=0)) + 1
    if candidates.size * levels < len(events) // 2:
        # few known ops: climbed from them, one round per nesting level, rather than a
        # pass over every event
        outer[outer] = ~_known_above(parent, at, candidates)
        return outer
    outer[outer] = enclosing_of_kind(parent, depth, at, candidates) < 0
    return outer


def _known_above(parent: np.ndarray, at: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Whether each of ``rows`` has a strict ancestor (along ``parent``) with ``at`` set:
    one round per nesting level, over the rows still climbing."""
    found = np.zeros(rows.size, dtype=bool)
    which = np.arange(rows.size)
    up = parent[rows]
    for _ in range(parent.size):  # (a bound: the nesting has no cycle)
        live = up >= 0
        which, up = which[live], up[live]
        if not up.size:
            break
        hit = at[up]
        found[which[hit]] = True
        which, up = which[~hit], parent[up[~hit]]
    return found


@computes("shapes")
def shapes(trace: TraceTables) -> pd.DataFrame:
    """Call chains grouped by rank and their top op's name, input dims, input types and
    concrete inputs, busiest first.

    Unlike torch's ``key_averages(group_by_input_shape=True)``, which groups by name and
    input dims alone, calls that differ in their scalar or list arguments are rows of their
    own: ``torch.randn(1000, 100)`` and ``torch.randn(500, 100)`` (input dims ``[[], [],
    [], [], []]`` both) are two rows here and one there; and only chain tops are counted, so
    an ``aten::sum`` run inside another op is in that op's row, not a call of its own.

    One row per distinct top op of a call chain (see ``_common.call_chains``: the outermost
    op with recorded shapes, or with none and no op with shapes inside, and the ops it runs
    inside), so one convolution is one row (``aten::conv2d``), never also
    ``aten::convolution``, ``aten::_convolution`` and ``aten::mkldnn_convolution``; chains
    never overlap, so ``total_us`` adds up and ranks them. Columns: ``rank``, ``name``, ``input_dims``, ``input_type``,
    ``concrete_inputs`` (the top op's, JSON text as recorded, NA without
    ``record_shapes``; ``concrete_inputs`` holds the scalar and list arguments, which torch
    writes since 2.x); ``calls``; ``total_us`` (the top op's duration, summed), ``mean_us``,
    ``self_us`` (the self time of every op of the chains, summed: ``total_us`` less the
    runtime calls and other non-op events inside); ``gpu_us`` (kernels, memcpy and memset
    launched inside the chains); ``flops`` (per call: the top op's, the trace's own
    ``flops`` arg when ``with_flops`` wrote it, else computed from the shapes for matmul,
    linear, bmm, conv and attention ops, and from ``Concrete Inputs`` for
    ``aten::convolution_backward`` (by its ``output_mask``) and attention backward (2.5× the
    forward; attention halved where ``is_causal`` is True); where the top op has none, the sum of its
    outermost ops that have some, e.g. the two ``aten::mm`` of a linear layer's backward;
    NA where one call of the row has none: no mean over the known calls, the rule of
    ``efficiency()``); ``tflops_per_s`` (calls × flops / time: GPU time where the chain
    launched GPU work, else host time); ``flops_source`` ('trace' | 'shapes' | 'estimate':
    a conv without ``concrete_inputs``, whose stride and padding are unknown, so its output
    size is assumed equal to the input's; with them the output size is computed exactly
    and the source is 'shapes'; a chain's is its least trusted part's; NA where ``flops`` is). Conv FLOPs count
    as torch's ``with_flops`` does: no bias, transposed convs per input position.
    """
    events = trace.events
    rows, top = call_chains(trace)
    tops = rows[top == rows]
    # each op's chain as the position of its top among ``tops`` (-1: in none): sums per
    # chain are made at the chains alone, not per event (each 2 MB on a 100 MB trace)
    chain = np.full(len(events), -1, dtype=np.int32)
    chain[tops] = np.arange(tops.size, dtype=np.int32)
    chain = take_codes(chain, top)  # (-1 where the op tops no chain)
    inside = chain >= 0
    all_inside = bool(inside.all())
    self_dur = np.take(events["self_dur"].to_numpy(), rows)
    # bincount adds each chain's values in row order, as before: the same sums
    chain_self = np.bincount(
        chain if all_inside else chain[inside],
        weights=self_dur if all_inside else self_dur[inside],
        minlength=tops.size,
    )
    value, source = _op_flops(events, rows)
    outer = outermost(events, rows, top, ~np.isnan(value))
    chain_flops = np.bincount(chain[outer], weights=value[outer], minlength=tops.size)
    chain_source = np.full(tops.size, -1, dtype=np.int64)
    np.maximum.at(chain_source, chain[outer], source[outer])
    keys = ["rank", "name", "input_dims", "input_type", "concrete_inputs"]
    # grouped as ``groupby(keys, sort=False, dropna=False, observed=True)``, on one int key
    # made from the categoricals' codes at the tops (a grouper of 5 categoricals cost more
    # than the sums): the groups are numbered in order of first appearance
    rank = np.take(events["rank"].to_numpy(), tops)
    key_values = {key: events[key].array for key in keys[1:]}
    key_columns = {
        key: values.take(tops) if isinstance(values, pd.Categorical) else events[key].iloc[tops]
        for key, values in key_values.items()
    }
    group, first = group_rows(rank, *key_columns.values())
    # pandas' sums (compensated: they differ from a plain sum in the last bits)
    sums = group_sums(
        group,
        first.size,
        dur=np.take(events["dur"].to_numpy(), tops),
        self_dur=chain_self,
        gpu_us=gpu_time(events, tops, activity_rows(trace)),
        flops=np.where(chain_source >= 0, chain_flops, np.nan),
    )
    totals, gpu = sums["dur"], sums["gpu_us"]
    calls = np.bincount(group, minlength=first.size)
    # per call only where every call's chain is counted: a mean over the known ones would
    # hold the other calls' time to FLOPs they may not have done (as ``efficiency()``)
    every = np.bincount(group[chain_source < 0], minlength=first.size) == 0
    # pandas' mean where every call is known: its compensated sum over the calls
    mean = np.where(every, sums["flops"] / calls, np.nan)
    best = np.full(first.size, -1, dtype=np.int64)
    np.maximum.at(best, group, chain_source)
    source = np.where(every, best, -1)
    named = np.array([*_SOURCES, None], dtype=object)
    seconds = np.where(gpu > 0, gpu, totals) * 1e-6
    # as nullable floats (``Float64``): missing where unknown, and where pandas' arithmetic
    # on them would make NaN (it masks such results), computed on the numbers
    unknown = np.isnan(mean) | ~every
    with np.errstate(all="ignore"):
        rate = mean * calls / seconds / 1e12
    flops = pd.arrays.FloatingArray(mean, unknown)
    tflops = pd.arrays.FloatingArray(rate, unknown | ~(seconds > 0) | np.isnan(rate))
    # busiest first per rank: ordered before the columns are made (``sort_values(["rank",
    # "total_us"], ascending=[True, False], kind="stable")``, which puts NaN last)
    ranks = rank[first]
    if np.isnan(totals).any():
        order = pd.DataFrame({"r": ranks, "t": totals}).sort_values(["r", "t"], ascending=[True, False], kind="stable")
        order = order.index.to_numpy()
    else:
        order = np.lexsort((-totals, ranks))  # (stable)
    at = first[order]
    return pd.DataFrame(
        {
            "rank": ranks[order],
            **{key: _text_at(key_columns[key], at) for key in keys[1:]},
            "calls": calls[order],
            "total_us": totals[order],
            "mean_us": (totals / calls)[order],
            "self_us": sums["self_dur"][order],
            "gpu_us": gpu[order],
            "flops": flops.take(order),
            "tflops_per_s": tflops.take(order),
            "flops_source": text(named[source[order]]),  # -1: the None at the end
        }
    )


def _text_at(values: pd.Categorical | pd.Series, at: np.ndarray) -> pd.api.extensions.ExtensionArray:
    """``text`` of ``values`` at ``at``: a categorical's strings taken by code (one string
    per distinct value made, then Arrow's take)."""
    if isinstance(values, pd.Categorical) and values.categories.inferred_type == "string":
        return text_take(np.asarray(values.categories, dtype=object), np.take(values.codes, at))
    return text(values_at(pd.Series(values), at))
