"""``efficiency()``: how close each op runs to its device's roofline.

For every call chain that ran on the GPU (the rows of ``shapes()``, grouped by op, input
dims and dtypes) it models the FLOPs and the bytes one call must at least move from its
recorded shapes, and compares the achieved rates with the device's peaks
(``tracemagic.analysis.devices``): the roofline ``min(peak FLOP/s, intensity × peak
bytes/s)`` says whether the op is compute- or memory-bound at this shape and how far below
its roof it runs.

Cost models (one call; the element size follows ``Input type``; NaN where an op is not
modelled or its shapes do not fix the count — never a guess):

- FLOPs of matrix ops come from ``shapes`` (one place): mm/bmm/matmul/addmm/baddbmm/linear
  2·M·N·K (no bias term), convolution forward (only where ``Concrete Inputs`` fix the
  output size: ``shapes()``' 'estimate' for older traces is left out here) and
  ``aten::convolution_backward`` (per gradient in ``output_mask``), scaled-dot-product /
  flash / efficient / cuDNN attention 2·B·H·L·S·(E + Eᵥ), halved when ``is_causal``,
  2.5× for the backward; or the trace's own ``flops`` arg (``with_flops``).
- Bytes: every tensor input read once and every output written once (the least DRAM
  traffic: caches and re-reads are not counted, so intensity is an upper bound and the
  roof a true ceiling). Matrix products and convolutions write their output (its size
  follows from the FLOPs: ``flops / (2·K)`` elements); attention writes ``out`` (forward,
  L·Eᵥ per head) or dQ, dK, dV (backward); a transposed convolution's output size is not
  modelled (bytes NaN).
- Norms (layer, RMS, batch, group, instance; forward and backward): read the tensor
  inputs, write one tensor the size of the input (per-row statistics and per-channel
  parameter gradients, a few bytes per row or channel, are not counted); 5 FLOPs per
  element forward, 8 backward.
- Softmax / log-softmax: read the input (backward: grad and output), write one tensor of
  its size; 5 FLOPs per element forward, 3 backward.
- Elementwise ops (unary, binary, in-place, activation backward, ``where``): read the
  inputs, write the broadcast output (the first input's dtype; ``where``: the second's),
  1 FLOP per output element; ``fill_``/``zero_`` write only.
- Reductions (sum, mean, amax, ...): read the input, write the reduced output (its size
  from the ``dim`` argument in ``Concrete Inputs``; no dim, as in ``sum(x, dtype=...)``:
  one element; in the input's element size), 1 FLOP per input element.
- Embedding: read the indices and the gathered rows, write them (0 FLOPs).

A call chain's figures are those of its outermost modelled ops added up (as ``shapes()``
adds FLOPs), and only where those ops launched all the chain's GPU work (a linear layer's
backward is its two ``aten::mm`` and the bias ``aten::sum``; without a model for the sum
it stays NaN rather than count the sum's kernel time against the matrix products).

Bytes are DRAM traffic, the peak bandwidth HBM's: a memory-bound op whose data fits in
the device's last-level cache (``devices.PEAKS`` ``cache_mib``), typically an elementwise
op on a tensor the op before it just wrote, can be served from the cache and show more
than 100% (seen on the A100 and V100 traces for tensors of a few MB, with kernels of a
few µs whose 1 µs timestamps add their own noise).

FLOPs are those of the direct algorithm. cuDNN/MIOpen may run a 3×3 convolution as
Winograd or FFT, which executes fewer multiplications: such a convolution could show more
than 100% of the compute roof, the algorithm's saving rather than a wrong peak. No trace
here shows it: the V100 ResNet-50 trace runs Winograd kernels but records no ``Concrete
Inputs``, so its convolutions are NaN here; ``shapes()``' 'estimate' for them (stride 1
assumed) reaches 1.3-3.5× the FP32 peak for 1×1 and 7×7 convolutions as well as 3×3,
which is the overcount of strided convolutions, not Winograd.

Compared with AMD TraceLens' ``perf_model`` (MIT, ``TraceLens/PerfModel/perf_model.py``):
its GEMM counts 2·M·N·K + M·N for a bias (we follow torch's ``with_flops``, which leaves
the bias add out of ``addmm``/``linear``, so ours is lower by M·N); its GEMM bytes are the
same reads and writes (it takes the bias as 1×N, we read the bias tensor's recorded
shape); its GEMM backward (input and weight gradients, 2·M·N·K each, plus M·N for the bias
gradient) is what we get for a linear layer's backward chain, two ``aten::mm`` and the
bias ``aten::sum`` (one FLOP per input element); it reads ``is_causal`` from the same
``Concrete Inputs`` positions of the flash (4), efficient (6) and cuDNN (6) SDPA ops. Its
norm, softmax and elementwise models are not compared here.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import pandas as pd

from tracemagic.analysis import devices
from tracemagic.analysis._common import (
    activity_rows,
    among,
    call_chains,
    codes_of,
    group_rows,
    layer_codes,
    names_where,
    text,
)
from tracemagic.analysis.attribution import attribution
from tracemagic.analysis.schema import TABLES, computes
from tracemagic.analysis.shapes import (
    _SOURCES,
    ARG_RULES,
    ATTENTION,
    FLOP_RULES,
    _arg,
    _flag,
    _flags,
    _op_flops,
    gpu_time,
    outermost,
)
from tracemagic.errors import TraceError
from tracemagic.trace.kineto import GPU_ACTIVITY
from tracemagic.trace.model import TraceTables
from tracemagic.trace.normalize import kind_mask
from tracemagic.trace.shared_keys import Shared

COLUMNS = tuple(TABLES["efficiency"].names)

#: bytes per element of a tensor ``Input type``; other types (Scalar, ScalarList, '') are not tensors
ELEMENT_BYTES: dict[str, int] = {
    "double": 8, "float": 4, "c10::Half": 2, "c10::BFloat16": 2,
    "c10::Float8_e4m3fn": 1, "c10::Float8_e5m2": 1, "c10::Float8_e4m3fnuz": 1, "c10::Float8_e5m2fnuz": 1,
    "long int": 8, "long": 8, "int": 4, "short int": 2, "short": 2, "signed char": 1, "unsigned char": 1,
    "bool": 1, "c10::complex<float>": 8, "c10::complex<double>": 16,
}  # fmt: skip
#: tensor dtype -> the precision of its peak (integer and bool ops have none)
PRECISION: dict[str, str] = {
    "double": "fp64", "float": "fp32", "c10::Half": "fp16", "c10::BFloat16": "bf16",
    "c10::Float8_e4m3fn": "fp8", "c10::Float8_e5m2": "fp8",
    "c10::Float8_e4m3fnuz": "fp8", "c10::Float8_e5m2fnuz": "fp8",
}  # fmt: skip

#: kernel names of float32 matrix math on TF32 tensor cores, as in the A100 traces: cuBLAS
#: and cuDNN ``sm80_xmma_*_tf32f32_tf32f32_*``, CUTLASS ``tensorop_s1688gemm`` (its float
#: m16n8k8 MMA is TF32), cuDNN's mangled CUTLASS ``tfloat32_t``; AMD's XF32 (``xf32``).
#: CUDA-core float32 kernels (``ampere_sgemm_*``, ``volta_sgemm_*``, ``implicit_convolve_sgemm``) match none.
TF32_KERNEL = re.compile(r"tf32|tfloat32|xf32|tensorop_s1688", re.I)

Dims = list[Any]
Cost = tuple[float, float]  # (FLOPs, bytes) of one call; NaN where unknown
NAN = math.nan

_MATMUL_K = {"aten::mm": 0, "aten::matmul": 0, "aten::bmm": 0, "aten::linear": 0, "aten::addmm": 1, "aten::baddbmm": 1}
_CONV = {
    "aten::conv1d", "aten::conv2d", "aten::conv3d", "aten::convolution", "aten::_convolution",
}  # fmt: skip
_NORM_FWD = {
    "aten::layer_norm", "aten::native_layer_norm", "aten::rms_norm", "aten::_fused_rms_norm", "aten::batch_norm",
    "aten::native_batch_norm", "aten::_batch_norm_impl_index", "aten::cudnn_batch_norm", "aten::miopen_batch_norm",
    "aten::group_norm", "aten::native_group_norm", "aten::instance_norm",
    "aten::_native_batch_norm_legit", "aten::_native_batch_norm_legit_no_training",
}  # fmt: skip
_NORM_BWD = {
    "aten::native_layer_norm_backward", "aten::_fused_rms_norm_backward", "aten::native_batch_norm_backward",
    "aten::cudnn_batch_norm_backward", "aten::miopen_batch_norm_backward", "aten::native_group_norm_backward",
}  # fmt: skip
_SOFTMAX_FWD = {"aten::softmax", "aten::_softmax", "aten::log_softmax", "aten::_log_softmax"}
_SOFTMAX_BWD = {"aten::_softmax_backward_data", "aten::_log_softmax_backward_data"}
_ELEMENTWISE = {
    f"aten::{op}{suffix}"
    for op in (
        "add", "sub", "rsub", "mul", "div", "relu", "gelu", "silu", "sigmoid", "tanh", "exp", "log", "neg", "abs",
        "sqrt", "rsqrt", "pow", "clamp", "clamp_min", "clamp_max", "hardtanh", "leaky_relu", "nan_to_num",
        "threshold_backward", "gelu_backward", "silu_backward", "sigmoid_backward", "tanh_backward",
        "where", "masked_fill", "addcmul", "addcdiv", "lerp", "reciprocal", "sin", "cos", "erf",
        "maximum", "minimum",
    )
    for suffix in ("", "_")
}  # fmt: skip
_WRITE_ONLY = {"aten::fill_", "aten::zero_"}
#: reductions whose ``dim`` is their second argument
_REDUCTION = {f"aten::{op}" for op in ("sum", "mean", "amax", "amin", "prod", "var", "std", "logsumexp")}
_EMBEDDING = {"aten::embedding"}


def _tensors(dims: Dims, types: list[str]) -> list[tuple[list[int], int]]:
    """(shape, bytes per element) of each tensor input (a flat int list with a tensor dtype)."""
    out = []
    for d, t in zip(dims, types):
        if t in ELEMENT_BYTES and isinstance(d, list) and all(isinstance(v, int) for v in d):
            out.append((d, ELEMENT_BYTES[t]))
    return out


def _read(tensors: list[tuple[list[int], int]]) -> float:
    return float(sum(math.prod(d) * size for d, size in tensors))


def _matmul(name: str, dims: Dims, types: list[str], flops: float) -> Cost:
    """Inputs read, the output (flops / 2K elements) written in the first operand's dtype."""
    at = _MATMUL_K[name]
    tensors = _tensors(dims, types)
    if at >= len(dims) or not dims[at] or types[at] not in ELEMENT_BYTES:
        return flops, NAN
    k = dims[at][-1]
    return flops, _read(tensors) + flops / (2.0 * k) * ELEMENT_BYTES[types[at]] if k else NAN


def _conv(name: str, dims: Dims, types: list[str], args: list[str], flops: float) -> Cost:
    """Inputs read, output written: N·C_out·positions = flops / (2 · C_in/groups · kernel)."""
    transposed = _flag(args, 6) if name in ("aten::convolution", "aten::_convolution") else False
    if transposed is not False or len(dims) < 2 or len(dims[1]) < 3 or types[0] not in ELEMENT_BYTES:
        return flops, NAN
    per_output = math.prod(dims[1][1:])
    return flops, _read(_tensors(dims, types)) + flops / (2.0 * per_output) * ELEMENT_BYTES[types[0]]


def _conv_backward(dims: Dims, types: list[str], args: list[str], flops: float) -> Cost:
    """grad_output, input and weight read; grad input and grad weight written per ``output_mask``."""
    wants = _flags(args, 10)
    tensors = _tensors(dims[:3], types[:3])
    if len(tensors) < 3 or wants is None or len(wants) < 2:
        return flops, NAN
    (_, _), (x, size), (w, _) = tensors
    written = (math.prod(x) if wants[0] else 0) + (math.prod(w) if wants[1] else 0)
    return flops, _read(tensors) + written * size


def _attention(name: str, dims: Dims, types: list[str], flops: float) -> Cost:
    """Forward: q, k, v (and a mask) read, out [.., L, Eᵥ] written; backward: every tensor
    input read (grad, q, k, v, out, ...), dQ, dK, dV written."""
    at = ATTENTION[name][0]
    tensors = _tensors(dims, types)
    if len(dims) < at + 3 or len(tensors) < 3:
        return flops, NAN
    q, k, v = dims[at : at + 3]
    size = ELEMENT_BYTES.get(types[at], 0)
    if not size or len(q) < 2 or len(v) < 2:
        return flops, NAN
    written = math.prod(q) + math.prod(k) + math.prod(v) if at else math.prod(q[:-1]) * v[-1]
    return flops, _read(tensors) + written * size


def _like_input(dims: Dims, types: list[str], x: int, per_element: float) -> Cost:
    """Tensor inputs read, one tensor the size of input ``x`` written; ``per_element`` FLOPs."""
    tensors = _tensors(dims, types)
    if x >= len(dims) or types[x] not in ELEMENT_BYTES or not isinstance(dims[x], list):
        return NAN, NAN
    n = math.prod(dims[x])
    return per_element * n, _read(tensors) + n * ELEMENT_BYTES[types[x]]


def _elementwise(name: str, dims: Dims, types: list[str]) -> Cost:
    """Inputs read, the broadcast output written in the first input's dtype (``where``'s:
    its second, after the condition); 1 FLOP per element."""
    tensors = _tensors(dims, types)
    out_type = types[1] if name.startswith("aten::where") and len(types) > 1 else types[0]
    if not tensors or out_type not in ELEMENT_BYTES:
        return NAN, NAN
    try:
        out = math.prod(np.broadcast_shapes(*(tuple(d) for d, _ in tensors)))
    except ValueError:
        return NAN, NAN
    return float(out), _read(tensors) + out * ELEMENT_BYTES[out_type]


def _reduction(dims: Dims, types: list[str], args: list[str]) -> Cost:
    """Input read, the reduced output written; 1 FLOP per input element. The output size
    needs the ``dim`` argument (``Concrete Inputs``), or no dim at all (a full reduction).
    An op of two arguments has no dim: the second is ``sum``/``mean``/``prod``'s ``dtype``
    (recorded as a number: '7' is float64, not dim 7) or ``var``/``std``'s ``unbiased``."""
    if not dims or types[0] not in ELEMENT_BYTES or not isinstance(dims[0], list):
        return NAN, NAN
    x = dims[0]
    n = math.prod(x)
    has_dim = len(dims) > 2
    dim = _arg(args, 1) if has_dim else None
    if dim is None and has_dim and types[1] != "":
        return NAN, NAN  # a dim argument the trace did not record (no ``Concrete Inputs``)
    if isinstance(dim, int) and not isinstance(dim, bool):
        dim = [dim]
    if dim is None:
        dim = []
    if not isinstance(dim, list) or not all(isinstance(v, int) for v in dim):
        return NAN, NAN
    reduced = {v % len(x) for v in dim} if x and dim else set(range(len(x)))
    out = math.prod(s for i, s in enumerate(x) if i not in reduced)
    size = ELEMENT_BYTES[types[0]]
    return float(n), n * size + out * size


def _write_only(dims: Dims, types: list[str]) -> Cost:
    """``fill_``/``zero_``: the tensor written once, no FLOPs."""
    if not dims or types[0] not in ELEMENT_BYTES or not isinstance(dims[0], list):
        return NAN, NAN
    return 0.0, float(math.prod(dims[0]) * ELEMENT_BYTES[types[0]])


def _embedding(dims: Dims, types: list[str]) -> Cost:
    """``aten::embedding(weight, indices, ...)``: indices read, rows gathered and written."""
    tensors = _tensors(dims[:2], types[:2])
    if len(tensors) < 2 or len(tensors[0][0]) != 2:
        return NAN, NAN
    (weight, size), (indices, index_size) = tensors
    rows = math.prod(indices) * weight[1]
    return 0.0, math.prod(indices) * index_size + 2.0 * rows * size


def op_cost(
    name: str, input_dims: str | None, input_type: str | None, concrete_inputs: str | None, flops: float
) -> Cost:
    """(FLOPs, bytes) of one call of op ``name`` (see the module docstring); NaN where not modelled.

    ``flops`` is what ``shapes`` found for the op (NaN where it has no rule), used for the
    matrix ops so that their FLOPs are counted in one place.
    """
    if not input_dims or not input_type:
        return NAN, NAN
    try:
        dims, types = json.loads(input_dims), json.loads(input_type)
        args = json.loads(concrete_inputs) if concrete_inputs else []
        if not isinstance(dims, list) or not isinstance(types, list) or not isinstance(args, list):
            return NAN, NAN
        return _cost(name, dims, types, args, flops)
    except (ValueError, TypeError, IndexError, ZeroDivisionError):
        return NAN, NAN


_RULES: dict[str, Callable[[str, Dims, list[str], list[str], float], Cost]] = {
    **{n: lambda name, d, t, a, f: _matmul(name, d, t, f) for n in _MATMUL_K},
    **{n: lambda name, d, t, a, f: _conv(name, d, t, a, f) for n in _CONV},
    **{n: lambda name, d, t, a, f: _attention(name, d, t, f) for n in ATTENTION},
    "aten::convolution_backward": lambda name, d, t, a, f: _conv_backward(d, t, a, f),
    **{n: lambda name, d, t, a, f: _like_input(d, t, 0, 5.0) for n in _NORM_FWD},
    **{n: lambda name, d, t, a, f: _like_input(d, t, 0, 8.0) for n in _NORM_BWD},
    **{n: lambda name, d, t, a, f: _like_input(d, t, 0, 5.0) for n in _SOFTMAX_FWD},
    **{n: lambda name, d, t, a, f: _like_input(d, t, 0, 3.0) for n in _SOFTMAX_BWD},
    **{n: lambda name, d, t, a, f: _elementwise(name, d, t) for n in _ELEMENTWISE},
    **{n: lambda name, d, t, a, f: _write_only(d, t) for n in _WRITE_ONLY},
    **{n: lambda name, d, t, a, f: _reduction(d, t, a) for n in _REDUCTION},
    **{n: lambda name, d, t, a, f: _embedding(d, t) for n in _EMBEDDING},
}  # fmt: skip
#: ops whose FLOPs ``shapes`` counts: matrix products, convolutions, attention
MATRIX_OPS = frozenset([*FLOP_RULES, *ARG_RULES])


def _cost(name: str, dims: Dims, types: list[str], args: list[str], flops: float) -> Cost:
    rule = _RULES.get(name)
    if rule is None:
        return (flops, NAN) if name in MATRIX_OPS else (NAN, NAN)
    if name in MATRIX_OPS and math.isnan(flops):
        return NAN, NAN
    return rule(name, dims, types, args, flops)


def gpu_chains(trace: TraceTables) -> tuple[np.ndarray, np.ndarray]:
    """The rows of the GPU events launched by an op, and for each the top of the launching
    op's call chain (-1: in none); computed once per trace."""

    def compute() -> tuple[np.ndarray, np.ndarray]:
        events = trace.events
        call_rows, top = call_chains(trace)
        top_of = np.full(len(events), -1, dtype=np.int64)
        top_of[call_rows] = top
        gpu = np.flatnonzero(kind_mask(events, *GPU_ACTIVITY) & (events["launch"].to_numpy() >= 0))
        op = events["op"].to_numpy()[gpu]
        return gpu, np.where(op >= 0, top_of[np.maximum(op, 0)], -1)

    return trace.shared(Shared.EFFICIENCY_GPU_CHAINS, compute)


def chain_costs(trace: TraceTables) -> pd.DataFrame:
    """Per call chain that launched GPU work (or every chain on a trace without a GPU):
    ``row`` (its top op), ``flops``, ``bytes`` (one call; each the sum over the chain's
    outermost ops for which it is known, NaN unless those ops launched all of the chain's
    GPU work: a kernel of an op no model covers leaves the chain unknown), ``matrix`` (a
    matrix op among them), ``tf32`` (one of its kernels is a TF32 tensor-core kernel by
    name, ``TF32_KERNEL``), ``time_us`` (the GPU time it launched; host time without a GPU); computed once per trace."""

    def compute() -> pd.DataFrame:
        events = trace.events
        rows, top = call_chains(trace)
        shaped, source = _op_flops(events, rows)
        shaped[source == _SOURCES.index("estimate")] = NAN  # a conv's assumed output size is a guess
        (names, name_of), (dims, dims_of), (types, types_of), (args, args_of) = (
            codes_of(events[c]) for c in ("name", "input_dims", "input_type", "concrete_inputs")
        )
        names, dims, types, args = names[rows], dims[rows], types[rows], args[rows]
        known = among(name_of, [*_RULES, *MATRIX_OPS])[names] & (dims >= 0)  # decided per name
        at = np.flatnonzero(known)
        key = (names[at], dims[at], types[at], args[at], np.nan_to_num(shaped[at], nan=-1.0))
        codes, first = group_rows(*key)

        def given(values: np.ndarray, code: int) -> str | None:
            return str(values[code]) if code >= 0 and values[code] else None

        found = np.array(
            [
                op_cost(
                    str(name_of[n]), str(dims_of[d]), given(types_of, t), given(args_of, a), NAN if f < 0 else float(f)
                )
                for n, d, t, a, f in zip(*(column[first] for column in key))
            ]
            + [(NAN, NAN)]
        ).reshape(-1, 2)
        flops, nbytes = np.full(rows.size, NAN), np.full(rows.size, NAN)
        flops[at], nbytes[at] = found[codes, 0], found[codes, 1]
        # where the trace's own ``flops`` arg counts an op we do not model, take it (as shapes)
        flops = np.where(np.isnan(flops) & ~known, shaped, flops)
        n = len(events)
        launched = gpu_time(events, None, activity_rows(trace))
        tops = rows[top == rows]
        time_us = launched[tops] if trace.has_gpu else events["dur"].to_numpy()[tops]
        keep = time_us > 0
        tops = tops[keep]
        # summed per event (a chain's top), kept at the tops alone: per-event arrays are
        # 2 MB each on a 100 MB trace, and this ran at the session's peak memory
        chain: dict[str, np.ndarray] = {}
        for field, value in (("flops", flops), ("bytes", nbytes)):
            outer = outermost(events, rows, top, ~np.isnan(value))
            total = np.bincount(top[outer], weights=value[outer], minlength=n)[tops]
            # a chain's figure counts only where its modelled ops launched all its GPU work
            covered = np.bincount(top[outer], weights=launched[rows[outer]], minlength=n)[tops]
            complete = (np.bincount(top[outer], minlength=n)[tops] > 0) & (covered >= launched[tops] * (1 - 1e-9))
            chain[field] = np.where(complete, total, NAN)
            if field == "flops":
                matrix = np.zeros(n, dtype=bool)
                matrix[top[outer & among(name_of, MATRIX_OPS)[names]]] = True
                matrix = matrix[tops]
            del outer, total, covered, complete
        del launched
        gpu, chain_top = gpu_chains(trace)
        tf32 = np.zeros(n, dtype=bool)
        tf32[chain_top[names_where(events["name"], TF32_KERNEL)[gpu] & (chain_top >= 0)]] = True
        return pd.DataFrame(
            {
                "row": tops,
                "flops": chain["flops"],
                "bytes": chain["bytes"],
                "matrix": matrix,
                "tf32": tf32[tops],
                "computed_in": _computed_in(top, names, types, among(name_of, MATRIX_OPS), tops),
                "time_us": time_us[keep],
            }
        )

    return trace.shared(Shared.EFFICIENCY_CHAINS, compute)


def _computed_in(
    top: np.ndarray, names: np.ndarray, types: np.ndarray, matrix_name: np.ndarray, tops: np.ndarray
) -> np.ndarray:
    """For each chain top in ``tops``: the ``input_type`` code of the chain's last matrix op
    (-1: none), the dtype its matrix math ran in. Under autocast the top is called with
    float32 tensors, casts them and calls itself again in bf16 or fp16 (``aten::linear``
    [float] -> ``aten::_to_copy`` ... -> ``aten::linear`` [BFloat16] -> ``aten::addmm``
    [BFloat16]): the top's own dtype is not the one its kernels ran in. ``top``, ``names``
    and ``types``: per op row of ``call_chains``, in event order (the last is the innermost);
    ``tops`` ascending."""
    at = np.flatnonzero((types >= 0) & (top >= 0))
    at = at[matrix_name[names[at]]]
    out = np.full(tops.size, -1, dtype=np.int64)
    if not at.size or not tops.size:
        return out
    chain = top[at]
    order = np.argsort(chain, kind="stable")  # each chain's matrix ops together, in event order
    ends = np.flatnonzero(np.append(chain[order][1:] != chain[order][:-1], True))  # the last of each
    keys, last = chain[order][ends], at[order][ends]
    j = np.minimum(np.searchsorted(tops, keys), tops.size - 1)  # (``tops`` ascending: the few looked up)
    found = tops[j] == keys
    out[j[found]] = types[last[found]]
    return out


Peaks = Mapping[str, float] | devices.DevicePeaks


def _rank_peaks(trace: TraceTables, peaks: Peaks | None) -> dict[int, tuple[str | None, dict[str, float]]]:
    """Per rank: the device's name and its peaks ({precision: TFLOP/s, 'tbytes_per_s': TB/s})."""
    if peaks is not None:
        if isinstance(peaks, devices.DevicePeaks):
            given, label = dict(peaks._asdict()), peaks.name
        elif isinstance(peaks, Mapping):
            given, label = dict(peaks), str(peaks.get("name", "given peaks"))
        else:
            raise TraceError(
                f"peaks must be a dict like {{'bf16': 989.5, 'tbytes_per_s': 3.35}} or a devices.DevicePeaks, "
                f"not {type(peaks).__name__}"
            )
        allowed = {*devices.PRECISIONS, "tbytes_per_s", *devices.DevicePeaks._fields}
        wrong = sorted(set(given) - allowed)
        if wrong:
            raise TraceError(
                f"peaks has unknown keys {wrong}: use {', '.join(devices.PRECISIONS)} (TFLOP/s) and tbytes_per_s (TB/s)"
            )
        try:
            values = {k: float(given.get(k, NAN)) for k in (*devices.PRECISIONS, "tbytes_per_s")}
        except (TypeError, ValueError) as error:
            raise TraceError(f"peaks must be numbers (TFLOP/s, TB/s): {error}") from None
        return {r: (label, values) for r in trace.rank_ids}
    out: dict[int, tuple[str | None, dict[str, float]]] = {}
    for r, listed in _devices_of(trace).items():
        found = next((m for m in map(devices.match, listed) if m is not None), None)
        if found is None:
            out[r] = (None, dict.fromkeys((*devices.PRECISIONS, "tbytes_per_s"), NAN))
        else:
            out[r] = (found.name, {k: float(getattr(found, k)) for k in (*devices.PRECISIONS, "tbytes_per_s")})
    return out


def _devices_of(trace: TraceTables) -> dict[int, list[dict[str, Any]]]:
    """Per rank, its ``deviceProperties`` entries (none on a trace without GPU activity)."""
    if not trace.has_gpu:
        return {r: [] for r in trace.rank_ids}
    return {r: trace.meta.get("ranks", {}).get(r, {}).get("devices") or trace.devices for r in trace.rank_ids}


def _precision(input_type: str | None) -> str | None:
    """The precision of an op: its first floating-point tensor input's."""
    try:
        types = json.loads(input_type) if isinstance(input_type, str) else []
    except ValueError:
        return None
    if not isinstance(types, list):
        return None
    return next((PRECISION[t] for t in types if isinstance(t, str) and t in PRECISION), None)  # [["x"]]: none


#: the precisions of ``PRECISION``, in order: ``_precisions`` numbers them from 0
PRECISION_NAMES = tuple(dict.fromkeys(PRECISION.values()))


def _precisions(types: tuple[np.ndarray, np.ndarray], rows: np.ndarray, computed_in: np.ndarray) -> np.ndarray:
    """Per chain (its top at ``rows``), the number in ``PRECISION_NAMES`` of the dtype its
    math ran in (-1: none): its last matrix op's (``computed_in``, an ``input_type`` code)
    where that has a floating-point input, else its top's first floating-point input's."""
    codes, values = types
    number: dict[str | None, int] = {p: i for i, p in enumerate(PRECISION_NAMES)}
    of_code = np.array([number.get(_precision(v), -1) for v in values], dtype=np.int64)  # (NaN last: -1)
    inner = of_code[computed_in]  # computed_in -1: the appended NaN's, -1
    return np.where(inner >= 0, inner, of_code[codes[rows]])


def op_shapes(trace: TraceTables) -> tuple[pd.DataFrame, np.ndarray]:
    """The call chains of ``chain_costs`` grouped by (rank, op, input dims, input type,
    precision), in order of first call, and each chain's group (its row in the table); computed once per
    trace. Columns: those keys (values as ``to_numpy`` gives them), ``calls``, ``gpu_us``,
    ``flops`` and ``bytes`` per call (NaN unless known for every call), ``matrix``,
    ``tf32``, ``precision`` (the dtype its math ran in: its top's first floating-point
    input's, or its last matrix op's where that differs, as under autocast; None for
    integer ops; also a key); ``efficiency()`` adds the roofline.
    Grouped on the categorical codes: no string is touched per call."""

    def compute() -> tuple[pd.DataFrame, np.ndarray]:
        events = trace.events
        chains = chain_costs(trace)
        rows = chains["row"].to_numpy()
        keys = ["rank", "name", "input_dims", "input_type"]
        rank = events["rank"].to_numpy()[rows]
        coded = {k: codes_of(events[k]) for k in keys[1:]}
        # and by the precision the chain computed in (autocast's and a plain call's apart)
        precision = _precisions(coded["input_type"], rows, chains["computed_in"].to_numpy())
        group_of, first = group_rows(rank, *(codes[rows] for codes, _ in coded.values()), precision)
        flops, nbytes = chains["flops"].to_numpy(), chains["bytes"].to_numpy()
        frame = pd.DataFrame(
            {
                "group": group_of,
                "time_us": chains["time_us"].to_numpy(),
                "flops": flops,
                "bytes": nbytes,
                "flops_unknown": np.isnan(flops),
                "bytes_unknown": np.isnan(nbytes),
                "matrix": chains["matrix"].to_numpy(),
                "tf32": chains["tf32"].to_numpy(),
            }
        )
        # the groups in order of first call, as a groupby on the values with sort=False
        summed = frame.groupby("group", sort=False).agg(
            calls=("time_us", "size"),
            gpu_us=("time_us", "sum"),
            flops_total=("flops", "sum"),
            bytes_total=("bytes", "sum"),
            flops_unknown=("flops_unknown", "max"),
            bytes_unknown=("bytes_unknown", "max"),
            matrix=("matrix", "max"),
            tf32=("tf32", "max"),
        )
        table = pd.DataFrame(
            {"rank": rank[first], **{k: values[codes[rows[first]]] for k, (codes, values) in coded.items()}}
        )
        table["precision"] = np.array([None, *PRECISION_NAMES], dtype=object)[precision[first] + 1]
        for column in summed.columns:
            table[column] = summed[column].to_numpy()
        # per call; NaN where some calls of the group could not be modelled
        table["flops"] = np.where(table["flops_unknown"], NAN, table["flops_total"] / table["calls"])
        table["bytes"] = np.where(table["bytes_unknown"], NAN, table["bytes_total"] / table["calls"])
        return table, group_of

    return trace.shared(Shared.EFFICIENCY_OP_SHAPES, compute)


def chain_precisions(trace: TraceTables) -> tuple[np.ndarray, np.ndarray]:
    """The top rows of ``op_shapes``' call chains and the ``precision`` each counts under
    (None: none). With its top's rank, name, input dims and input type this is the row of
    ``efficiency()`` the chain is counted in: autocast's calls and plain ones of the same op,
    dims and dtypes are rows apart, and their sites must be too (the views' ``where``)."""
    table, group_of = op_shapes(trace)
    return chain_costs(trace)["row"].to_numpy(), table["precision"].to_numpy(dtype=object)[group_of]


def roofline(trace: TraceTables) -> pd.DataFrame:
    """``op_shapes`` with the rates, peaks, bound and % of the roof at the device's own
    peaks; computed once per trace (``efficiency()`` and ``layers()`` share it)."""

    def compute() -> pd.DataFrame:
        table = op_shapes(trace)[0].copy()
        _roofline(trace, table, None)
        return table

    return trace.shared(Shared.EFFICIENCY_ROOFLINE, compute)


@computes("efficiency")
def efficiency(trace: TraceTables, peaks: Peaks | None = None) -> pd.DataFrame:
    """Op × input shapes × dtypes with their FLOPs, bytes, achieved rates and roofline, per rank.

    One row per (rank, op, ``input_dims``, ``input_type``, ``precision``) of the call chains
    that launched GPU work (``shapes()``' rows, with different ``concrete_inputs`` merged),
    most GPU time first. Columns: ``precision`` (the dtype its math ran in, fp64, fp32,
    bf16, fp16 or fp8: its first floating-point input's, or its inner matrix op's where that
    differs, as under autocast; NA without one); ``calls``; ``gpu_us`` (kernels, memcpy and memset the calls launched,
    summed; on a trace without GPU activity, the ops' host time); ``flops`` and ``bytes``
    per call (the cost models of this module; NaN unless known for every call of the
    row, the rule of ``shapes()``' ``flops``); ``intensity`` =
    flops / bytes (FLOP/byte); ``tflops_per_s`` = calls × flops / gpu_us and
    ``tbytes_per_s`` = calls × bytes / gpu_us (10¹² per second); ``peak_tflops`` (the
    device's peak at the op's precision: its first floating-point input's dtype, or, where
    a matrix op inside it ran in another, that op's (under autocast a float32
    ``aten::linear`` runs its ``aten::addmm`` in bf16 or fp16: the row is held to that
    peak, and is a row apart from the same call made without autocast); a float32
    matrix op is held to the TF32 tensor-core peak only where its kernels' names say they
    ran on TF32 tensor cores (``TF32_KERNEL``: ``allow_tf32`` is off by default for
    matmuls and on for cuDNN convolutions), else, as on a CPU trace or with kernels of
    unknown names, to the FP32 peak; NaN for integer ops);
    ``peak_tbytes_per_s``; ``bound`` ('compute' where intensity reaches the ridge
    peak_tflops / peak_tbytes_per_s, else 'memory'; 'memory' also for ops without
    FLOPs or a compute peak; NA where unknown); ``pct_of_roofline`` (achieved over the
    roof at this intensity, min(peak_tflops, intensity × peak_tbytes_per_s), × 100;
    for memory-bound ops without FLOPs, achieved TB/s over peak TB/s); ``device`` (the
    ``devices.PEAKS`` row matched from ``deviceProperties``, NA: unknown device or no GPU,
    whose peaks are NaN unless given).

    Args:
        peaks: the device's peaks instead of the matched ones, for every rank: a
            ``devices.DevicePeaks`` or a dict with any of fp64, fp32, tf32, bf16, fp16, fp8
            (TFLOP/s) and tbytes_per_s (TB/s), e.g. ``{'bf16': 989.5, 'tbytes_per_s': 3.35}``.

    ``df.attrs['layers']``: per row, the layers its calls ran in (most GPU time first, as
    text: ``encoder.0, encoder.1 (+4)``; '' where none). ``df.attrs['note']``, where a
    GPU is not one ``devices.match`` knows: which, and that its peaks are NaN.
    """
    groups, group_of = op_shapes(trace)
    if peaks is None:  # the device's own peaks: the roofline ``layers()`` shares
        table = roofline(trace).copy()
    else:
        table = groups.copy()
        _roofline(trace, table, peaks)
    chains = chain_costs(trace)
    table["_layers"] = _layer_text(trace, chains, group_of, len(table))
    for column in ("name", "input_dims", "input_type", "precision", "device"):
        table[column] = text(table[column])
    table = table.sort_values(["rank", "gpu_us"], ascending=[True, False], kind="stable").reset_index(drop=True)
    out = table[list(COLUMNS)].copy()
    out.attrs["layers"] = [str(v) for v in table["_layers"]]
    listed = [d for ds in _devices_of(trace).values() for d in ds] if peaks is None else []
    unknown = sorted({repr(str(d.get("name") or "")) for d in listed if devices.match(d) is None})
    if unknown:
        out.attrs["note"] = (
            f"no peaks for {', '.join(unknown)}: not in tracemagic.analysis.devices.PEAKS, so peaks, "
            "bound and pct_of_roofline are NaN; pass peaks={'bf16': ..., 'tbytes_per_s': ...}"
        )
    return out


def _roofline(trace: TraceTables, table: pd.DataFrame, peaks: Peaks | None) -> None:
    """Fill the rate, peak, bound and roofline columns of ``table`` in place."""
    per_rank = _rank_peaks(trace, peaks)
    seconds_e12 = table["gpu_us"].to_numpy() * 1e6  # µs × 10⁶: flops / this = TFLOP/s
    flops, nbytes = table["flops"].to_numpy(), table["bytes"].to_numpy()
    calls = table["calls"].to_numpy()
    with np.errstate(divide="ignore", invalid="ignore"):
        table["intensity"] = np.where(nbytes > 0, flops / nbytes, NAN)
        table["tflops_per_s"] = calls * flops / seconds_e12
        table["tbytes_per_s"] = calls * nbytes / seconds_e12
    peak, bandwidth, device = [], [], []
    for rank, precision, matrix, tf32 in zip(table["rank"], table["precision"], table["matrix"], table["tf32"]):
        name, values = per_rank.get(int(rank), (None, {}))
        value = values.get(precision, NAN) if precision else NAN
        if precision == "fp32" and matrix and tf32 and not math.isnan(values.get("tf32", NAN)):
            value = values["tf32"]
        peak.append(value)
        bandwidth.append(values.get("tbytes_per_s", NAN))
        device.append(name)
    table["peak_tflops"] = np.array(peak, dtype=float)
    table["peak_tbytes_per_s"] = np.array(bandwidth, dtype=float)
    table["device"] = np.array(device, dtype=object)
    intensity = table["intensity"].to_numpy()
    peak_flops, peak_bytes = table["peak_tflops"].to_numpy(), table["peak_tbytes_per_s"].to_numpy()
    with np.errstate(divide="ignore", invalid="ignore"):
        ridge = peak_flops / peak_bytes
        compute = (flops > 0) & (intensity >= ridge)  # False wherever something is NaN
        memory = (
            ~compute
            & ~np.isnan(nbytes)
            & ~np.isnan(peak_bytes)
            & ((flops == 0) | np.isnan(peak_flops) | (intensity < ridge))
        )
        # below the roof's slope achieved FLOP/s over intensity × bandwidth is achieved bytes/s over bandwidth
        pct = (
            np.where(
                compute, table["tflops_per_s"].to_numpy() / peak_flops, table["tbytes_per_s"].to_numpy() / peak_bytes
            )
            * 100.0
        )
    bound = np.full(len(table), None, dtype=object)
    bound[memory], bound[compute] = "memory", "compute"
    table["bound"] = text(bound)
    table["pct_of_roofline"] = np.where(compute | memory, pct, NAN)


def _layer_text(trace: TraceTables, chains: pd.DataFrame, group_of: np.ndarray, groups: int) -> list[str]:
    """Per group of ``op_shapes``, the layers its calls ran in (forward by nesting, backward
    by the forward op), most time first (ties: first met first): ``a, b (+3)``."""
    rows = chains["row"].to_numpy()
    module = attribution(trace).module[rows] if rows.size else np.zeros(0, dtype=np.int64)
    layer, names = layer_codes(trace, module)
    named = layer >= 0
    group, layer = group_of[named], layer[named]
    pair, first = group_rows(group, layer)
    # summed as pandas sums (compensated, in row order) per (group, layer), first met first
    time = pd.Series(chains["time_us"].to_numpy()[named]).groupby(pair, sort=False).sum().to_numpy()
    order = np.argsort(-time, kind="stable")  # most time first, ties as met
    order = order[np.argsort(group[first][order], kind="stable")]  # then by group, keeping that order
    by_group = group[first][order]
    found = [""] * groups
    for start, end in zip(*_runs(by_group)):
        listed = [str(v) for v in names[layer[first][order[start:end]]]]
        found[int(by_group[start])] = ", ".join(listed[:2]) + (f" (+{len(listed) - 2})" if len(listed) > 2 else "")
    return found


def _runs(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Start and end (exclusive) of each run of equal values."""
    if not values.size:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    starts = np.flatnonzero(np.r_[True, values[1:] != values[:-1]])
    return starts, np.r_[starts[1:], values.size]


def gpu_shares(trace: TraceTables) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per events row: the FLOPs a GPU event did (its call chain's, shared among the chain's
    GPU events by duration; 0 where the chain's FLOPs are unknown), whether its chain's
    op × shape is memory-bound in ``efficiency()``, and whether that bound is known at all
    (not on an unknown device, nor for an op without a cost model); 0, False and False for
    other rows. For ``layers()``, which sums them per layer."""

    def compute() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        events = trace.events
        n = len(events)
        chains = chain_costs(trace)
        rows = chains["row"].to_numpy()
        bound = roofline(trace)["bound"]
        group_of = op_shapes(trace)[1]
        rate = np.zeros(n)  # FLOPs per µs of GPU time, per chain top
        rate[rows] = np.nan_to_num(chains["flops"].to_numpy() / chains["time_us"].to_numpy())
        memory, known = np.zeros(n, dtype=bool), np.zeros(n, dtype=bool)
        memory[rows] = bound.eq("memory").fillna(False).to_numpy(dtype=bool)[group_of]
        known[rows] = bound.notna().to_numpy()[group_of]
        gpu, chain = gpu_chains(trace)
        flops, is_memory, has_bound = np.zeros(n), np.zeros(n, dtype=bool), np.zeros(n, dtype=bool)
        held = chain >= 0
        flops[gpu[held]] = rate[chain[held]] * events["dur"].to_numpy()[gpu[held]]
        is_memory[gpu[held]] = memory[chain[held]]
        has_bound[gpu[held]] = known[chain[held]]
        return flops, is_memory, has_bound

    return trace.shared(Shared.EFFICIENCY_GPU_SHARES, compute)
