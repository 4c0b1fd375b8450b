"""The CUDA path proved on a real GPU (issue 29): one run, a few minutes, PASS/FAIL per check.

The device command (one line, from the repository root, with ``.whl`` carried)::

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD && (python3 setup.py build_ext --inplace > $OUT/build.log 2>&1 || echo BUILD FAILED: the Python loader route is used) ; set -o pipefail; PYTHONUNBUFFERED=1 timeout 480 python3 bench/gpu_check.py 2>&1 | tee $OUT/gpu_check.log

What it does, through the magic in a real kernel (nbclient + ipykernel, as JupyterLab runs
cells): captures the quickstart model (``notebooks/quickstart.ipynb``) and the BERT-like
transformer of ``notebooks/transformer.ipynb`` with AdamW, each once with ``--et`` and once
with the defaults, a large bf16 matmul, a ``torch.compile``'d tiny model, two whose
forward and backward run as CUDA graphs (``torch.cuda.make_graphed_callables``, and
``torch.compile(mode="reduce-overhead")``), and a large MLP trained under
``torch.autocast(bfloat16)``; then loads each
capture with tracemagic and checks it against its raw JSON, computed here independently:
kernels and their launching ops (correlation and External id), device windows and GPU busy,
the ``cuda:0`` memory peak against ``torch.cuda.max_memory_allocated()`` read inside the cell,
the device and its peaks, the matmul's ``pct_of_roofline``, layer names against
``named_modules()``, the Flame tab's boxes (one ``<module>`` per cell, named ``Cell In[n]`` as
the executed notebook numbers it, modules by their attribute path), the ``loss.backward()``
line's GPU work (launched by autograd's thread, from the raw marks), the ET joined to Kineto
(``chakra.check`` and rf_id), and, for the compiled
model, no re-trace inside the window and Triton kernels attributed to the compiled layer, and
for the graphs, each kernel of a replay (one ``cudaGraphLaunch``) in its step, and for
autocast, its float32 ``aten::linear`` held to the bf16 peak and under its roof. It
prints the step times with no profiler, a bare ``torch.profiler`` and the magic (same run),
writes each capture as ``<name>.tar.gz`` into ``$OUT`` (else ``--out``) with ``gpu_check.json``
(GPU, driver, torch, the peak read in the cell) inside, and runs ``pytest tests/test_magic.py -k
cuda``. Without CUDA every check that needs it prints SKIP (the CPU rehearsal:
``PYTHONPATH=$PWD .venv/bin/python bench/gpu_check.py --out /tmp/gpucheck``). Exit status 1 if
any check fails.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS: list[tuple[str, str, str]] = []  # (status, check, detail)
#: dynamo tracing or compiling a frame (what a re-trace leaves in a trace), as tests/test_compiled.py
RETRACE = re.compile(r"bytecode_tracing|dynamo_timed|compile_id=|convert_frame\.py\(\d+\): _compile\b")
GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
RUNTIME_CATS = {"cuda_runtime", "cuda_driver"}


def record(status: str, check: str, detail: str = "") -> None:
    RESULTS.append((status, check, detail))
    print(f"{status:4} {check}" + (f": {detail}" if detail else ""), flush=True)


def check(name: str, fn: Callable[[], str | None], *, cuda_only: bool = False, cuda: bool = True) -> None:
    """Run ``fn`` (raises AssertionError on failure, returns a detail line); SKIP without CUDA."""
    if cuda_only and not cuda:
        record("SKIP", name, "needs CUDA")
        return
    try:
        detail = fn()
        record("PASS", name, detail or "")
    except Exception as exc:  # noqa: BLE001 - every check reports, none stops the run
        record("FAIL", name, f"{type(exc).__name__}: {exc}")
        traceback.print_exc(limit=3)


# ---------------------------------------------------------------- the environment


def environment() -> dict[str, Any]:
    import torch

    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "machine": platform.machine(),
        "cores": os.cpu_count(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(
            gpu=torch.cuda.get_device_name(0),
            sm_count=props.multi_processor_count,
            gpu_memory_bytes=props.total_memory,
            capability=f"{props.major}.{props.minor}",
        )
    try:
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        env["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
        if smi.returncode == 0 and smi.stdout.strip():
            env["driver"] = smi.stdout.strip().splitlines()[0].split(",")[1].strip()
    except (OSError, subprocess.SubprocessError) as exc:
        env["nvidia_smi"] = f"unavailable ({exc})"
    versions = {}
    for name in (
        "pandas",
        "numpy",
        "pyarrow",
        "plotly",
        "narwhals",
        "ipywidgets",
        "anywidget",
        "IPython",
        "ipykernel",
        "nbclient",
        "jupyter_client",
        "msgspec",
        "orjson",
        "triton",
        "psutil",
        "dateutil",
    ):
        try:
            module = __import__(name)
            versions[name] = getattr(module, "__version__", "?")
        except Exception as exc:  # noqa: BLE001 - report whatever is missing
            versions[name] = f"MISSING ({type(exc).__name__})"
    env["versions"] = versions
    # every installed copy, first on the path first: the machine's own beside the carried wheels
    from importlib import metadata

    env["distributions"] = {
        name: [d.version for d in metadata.distributions(name=name)]
        for name in (
            "pandas",
            "numpy",
            "pyarrow",
            "narwhals",
            "python-dateutil",
            "typing_extensions",
            "psutil",
            "packaging",
            "pygments",
            "setuptools",
            "jinja2",
            "ipykernel",
            "plotly",
        )
    }
    from tracemagic.trace import parse, structure

    env["loader_route"] = ("C scanner" if parse._scan is not None else "msgspec (no C scanner)") + (
        " + C nesting" if structure._nesting is not None else " + numpy nesting"
    )
    return env


# ---------------------------------------------------------------- the cells run in a kernel


def notebook_code(notebook: str, marker: str) -> str:
    """The first code cell of ``notebooks/<notebook>`` that contains ``marker``."""
    nb = json.loads((ROOT / "notebooks" / notebook).read_text())
    for cell in nb["cells"]:
        source = "".join(cell["source"])
        if cell["cell_type"] == "code" and marker in source:
            return source
    raise LookupError(f"no cell with {marker!r} in {notebook}")


def cells(work: Path, cuda: bool) -> list[str]:
    dev = "cuda" if cuda else "cpu"
    mm = 8192 if cuda else 256
    backend = "inductor" if cuda or shutil.which("g++") or shutil.which("c++") else "aot_eager"
    setup = f"""\
%load_ext tracemagic
import json, time, torch
import torch.nn.functional as F
from torch import nn
DEV = {dev!r}
INFO = {{"device": DEV, "captures": {{}}, "timings": {{}}}}
def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()
def peak_reset():
    if DEV == "cuda":
        torch.cuda.reset_peak_memory_stats()
def peak():
    return torch.cuda.max_memory_allocated() if DEV == "cuda" else None
def expected_layers(var, model):  # the root by its variable (`var (Class)` where var is also a path), the rest by their path
    named = dict(model.named_modules())
    root = f"{{var}} ({{type(model).__name__}})" if var in named else var
    return sorted(root if not n else n for n, m in named.items()
                  if not isinstance(m, (nn.ModuleList, nn.ModuleDict)))
def note(key, var, model):
    # what the capture cell left (a cell that raised before its end leaves None: not noted)
    global cap, cell_peak, times
    if cap is not None:
        INFO["captures"][key] = {{"dir": str(cap.dir.resolve()), "status": cap.status, "var": var,
            "named_modules": expected_layers(var, model) if model is not None else None,
            "max_memory_allocated": cell_peak, "iteration_s": times}}
    cap = cell_peak = times = None
cap = cell_peak = times = None
"""
    quick_model = notebook_code("quickstart.ipynb", "class SmallNet").replace(
        "model = SmallNet()", "model = SmallNet().to(DEV)"
    )
    quick_model = quick_model.replace(
        "batches = [(torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,))) for _ in range(6)]",
        "batches = [(torch.randn(16, 3, 32, 32, device=DEV), torch.randint(0, 10, (16,), device=DEV)) for _ in range(6)]",
    )
    assert "device=DEV" in quick_model and ".to(DEV)" in quick_model, "the quickstart cell changed"
    # the loop of notebooks/quickstart.ipynb's first capture, with the peak read over the
    # recorded steps (default schedule: wait 1, warmup 1, active 3 -> iterations 2, 3, 4)
    quick_loop = """\
times = []
for step, (x, y) in enumerate(batches):
    if step == 2:
        peak_reset()
    if step == 5:
        cell_peak = peak()
    t0 = time.perf_counter()
    optimizer.zero_grad()
    loss = loss_fn(model(x), y)
    loss.backward()
    optimizer.step()
    sync()
    times.append(time.perf_counter() - t0)
"""
    bert = notebook_code("transformer.ipynb", "class BertForMaskedLM")
    bert = bert.replace(
        "model = BertForMaskedLM(cfg)", "cfg.num_hidden_layers = 1\nbert = BertForMaskedLM(cfg).to(DEV)"
    )
    bert = bert.replace("model.parameters()", "bert.parameters()").replace(
        "model.named_modules()", "bert.named_modules()"
    )
    bert += """
bert_opt = torch.optim.AdamW(bert.parameters(), lr=1e-4)
def masked_batch(batch_size=8, seq_len=64, mask_id=1):
    tokens = torch.randint(2, cfg.vocab_size, (batch_size, seq_len), device=DEV)
    hidden = torch.rand(tokens.shape, device=DEV) < 0.15
    labels = torch.where(hidden, tokens, torch.full_like(tokens, -100))
    return tokens.masked_fill(hidden, mask_id), labels
bert_batches = [masked_batch() for _ in range(8)]
"""
    bert_loop = """\
times = []
for step in range(6):
    if step == 2:
        peak_reset()
    if step == 5:
        cell_peak = peak()
    t0 = time.perf_counter()
    input_ids, labels = bert_batches[step]
    logits = bert(input_ids)
    loss = F.cross_entropy(logits.view(-1, cfg.vocab_size), labels.view(-1))
    loss.backward()
    bert_opt.step()
    bert_opt.zero_grad(set_to_none=True)
    sync()
    times.append(time.perf_counter() - t0)
"""
    # the same loop with no profiler and under a bare torch.profiler with the magic's default
    # flags and schedule: the step times of the three, in this one kernel
    bare = f"""\
from torch.profiler import ProfilerActivity, profile, schedule
acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEV == "cuda" else [])
for mode in ("none", "bare", "none2"):
    times = []
    prof = profile(activities=acts, schedule=schedule(wait=1, warmup=1, active=3), record_shapes=True,
                   profile_memory=True, with_stack=True,
                   on_trace_ready=lambda p: p.export_chrome_trace({str(work / "bare.json")!r})) if mode == "bare" else None
    if prof: prof.start()
    for step in range(6):
        t0 = time.perf_counter()
        input_ids, labels = bert_batches[step]
        logits = bert(input_ids)
        loss = F.cross_entropy(logits.view(-1, cfg.vocab_size), labels.view(-1))
        loss.backward()
        bert_opt.step()
        bert_opt.zero_grad(set_to_none=True)
        sync()
        times.append(time.perf_counter() - t0)
        if prof: prof.step()
    if prof: prof.stop()
    INFO["timings"][mode] = times
"""
    matmul = f"""\
a = torch.randn({mm}, {mm}, device=DEV, dtype=torch.bfloat16)
b = torch.randn({mm}, {mm}, device=DEV, dtype=torch.bfloat16)
for _ in range(3):
    c = a @ b
sync()
"""
    matmul_loop = """\
for i in range(4):
    c = torch.mm(a, b)
    c = torch.mm(a, b)
    c = torch.mm(a, b)
    sync()
"""
    compiled = f"""\
class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(32, 64)
        self.out = nn.Sequential(nn.ReLU(), nn.Linear(64, 8))

    def forward(self, x):
        return self.out(self.proj(x))

torch.manual_seed(0)
tiny = Tiny().to(DEV)
cm = torch.compile(tiny, backend={backend!r})
xc = torch.randn(16, 32, device=DEV)
for _ in range(3):  # warm: compiled for these shapes, forward and backward
    cm(xc).sum().backward()
sync()
from torch._dynamo.utils import counters
frames_before = sum(counters["frames"].values())
"""
    compiled_loop = """\
for i in range(6):
    cm(xc).sum().backward()
    sync()
"""
    # CUDA graphs, as torch's docs show them for part of a network: the model's forward and
    # backward captured once (``make_graphed_callables``, which warms them up on a side stream)
    # and replayed every iteration, the loss and the optimizer step eager around them; the
    # kernels of a replay are launched by one ``cudaGraphLaunch`` (on a CPU the plain model)
    graphs = """\
torch.manual_seed(0)
gnet = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256)).to(DEV)
gopt = torch.optim.SGD(gnet.parameters(), lr=0.01)
gx = torch.randn(64, 256, device=DEV, requires_grad=True)
if DEV == "cuda":
    gnet = torch.cuda.make_graphed_callables(gnet, (gx,))
sync()
"""
    graphs_loop = """\
for i in range(6):
    gopt.zero_grad(set_to_none=True)
    loss = gnet(gx).square().mean()
    loss.backward()
    gopt.step()
    sync()
"""
    # torch.compile(mode="reduce-overhead"): Inductor's kernels replayed as CUDA graphs
    # (cudagraph trees, recorded in the warm-up here); the gradients are set to None each
    # iteration, as a training loop's zero_grad does (a graph's outputs are overwritten by
    # its next replay: a gradient kept from the last one could not be accumulated into).
    # On a CPU the compiled model above
    reduce_overhead = """\
torch.manual_seed(0)
ro = torch.compile(Tiny().to(DEV), mode="reduce-overhead") if DEV == "cuda" else cm
ro_opt = torch.optim.SGD(ro.parameters(), lr=0.01)
xr = torch.randn(16, 32, device=DEV)
def ro_step():
    torch.compiler.cudagraph_mark_step_begin()
    ro_opt.zero_grad(set_to_none=True)
    ro(xr).sum().backward()
    ro_opt.step()
for _ in range(4):  # warm: compiled, then recorded as graphs, forward and backward
    ro_step()
sync()
"""
    reduce_overhead_loop = """\
for i in range(6):
    torch.compiler.cudagraph_mark_step_begin()
    ro_opt.zero_grad(set_to_none=True)
    ro(xr).sum().backward()
    ro_opt.step()
    sync()
"""
    # mixed precision as most GPU training runs: the forward under torch.autocast(bf16) (each
    # float32 aten::linear casts its inputs and runs its aten::addmm in bf16), large enough
    # for the matrix math to be compute-bound
    d, b = (8192, 8192) if cuda else (256, 64)
    amp = f"""\
torch.manual_seed(0)
amp_net = nn.Sequential(nn.Linear({d}, {d}), nn.GELU(), nn.Linear({d}, {d})).to(DEV)
amp_opt = torch.optim.SGD(amp_net.parameters(), lr=1e-3)
xa = torch.randn({b}, {d}, device=DEV)
for _ in range(2):
    with torch.autocast(DEV, dtype=torch.bfloat16):
        amp_net(xa).float().square().mean().backward()
sync()
"""
    amp_loop = """\
for i in range(6):
    amp_opt.zero_grad(set_to_none=True)
    with torch.autocast(DEV, dtype=torch.bfloat16):
        loss = amp_net(xa).float().square().mean()
    loss.backward()
    amp_opt.step()
    sync()
"""
    flags = "-q --out traces"
    return [
        setup,
        quick_model,
        # shown as a user sees it: the dashboard widget (plotly + ipywidgets) in the output
        f"%%chakra_trace --out traces -v cap --et --name quickstart_et\n{quick_loop}",
        "note('quickstart_et', 'model', model)",
        f"%%chakra_trace {flags} -v cap --name quickstart\n{quick_loop}",
        "note('quickstart', 'model', model)",
        bert,
        f"%%chakra_trace {flags} -v cap --et --name transformer_et\n{bert_loop}",
        "note('transformer_et', 'bert', bert)",
        bare,
        f"%%chakra_trace {flags} -v cap --name transformer\n{bert_loop}",
        "INFO['timings']['magic'] = times\nnote('transformer', 'bert', bert)",
        matmul,
        f"%%chakra_trace {flags} -v cap --name matmul --wait 0 --warmup 1 --active 2 --no-memory-timeline\n"
        f"{matmul_loop}",
        "note('matmul', None, None)",
        compiled,
        f"%%chakra_trace {flags} -v cap --name compiled\n{compiled_loop}",
        "note('compiled', 'cm', None)\n"
        f"INFO['compiled'] = {{'backend': {backend!r}, 'frames_before': frames_before, "
        "'frames_after': sum(counters['frames'].values())}",
        graphs,
        f"%%chakra_trace {flags} -v cap --name graphs\n{graphs_loop}",
        "note('graphs', None, None)",
        reduce_overhead,
        f"%%chakra_trace {flags} -v cap --name reduce_overhead\n{reduce_overhead_loop}",
        "note('reduce_overhead', None, None)",
        amp,
        f"%%chakra_trace {flags} -v cap --name amp\n{amp_loop}",
        "note('amp', None, None)",
        f"INFO['bare'] = {str(work / 'bare.json')!r}\nopen({str(work / 'info.json')!r}, 'w').write(json.dumps(INFO))",
    ]


def run_kernel(work: Path, cuda: bool) -> dict[str, Any]:
    import nbclient
    import nbformat

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells(work, cuda)])
    # "python3" is this interpreter (as ipykernel's own spec), whatever kernel specs the machine has
    spec = work / "jupyter" / "kernels" / "python3"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(
        json.dumps(
            {
                "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                "display_name": "Python 3",
                "language": "python",
            }
        )
    )
    os.environ["JUPYTER_PATH"] = os.pathsep.join(
        [str(work / "jupyter"), *filter(None, [os.environ.get("JUPYTER_PATH")])]
    )
    client = nbclient.NotebookClient(
        nb, timeout=300, kernel_name="python3", allow_errors=True, resources={"metadata": {"path": str(work)}}
    )
    t0 = time.perf_counter()
    try:
        client.execute()
    finally:
        for i, cell in enumerate(nb.cells):
            for out in cell.get("outputs", []):
                if out.get("output_type") == "error":
                    print("\n".join(out.get("traceback", []))[-3000:], flush=True)
                    first = cell.source.splitlines()[0][:60]
                    record("FAIL", f"kernel cell {i} ({first})", f"{out['ename']}: {out['evalue'][:500]}")
    print(f"kernel cells ran in {time.perf_counter() - t0:.1f} s", flush=True)
    info: dict[str, Any] = json.loads((work / "info.json").read_text())
    shown = [o for o in nb.cells[2].get("outputs", []) if o.get("output_type") in ("display_data", "execute_result")]
    info["dashboard"] = [sorted(o.get("data", {})) for o in shown]
    for key, entry in info.get("captures", {}).items():  # the In[n] the notebook shows for its cell
        made = [
            c
            for c in nb.cells
            if c.source.startswith("%%chakra_trace") and f" --name {key} " in c.source.splitlines()[0] + " "
        ]
        entry["cell"] = made[0].execution_count if made else None
    return info


# ---------------------------------------------------------------- the raw JSON, read here


def raw_events(capture: Path) -> dict[str, Any]:
    found = [p for p in (capture / "kineto_trace_0.json", capture / "kineto_trace_0.json.gz") if p.exists()]
    if not found:
        raise FileNotFoundError(f"no Kineto trace in {capture} (the cell raised before a step was recorded?)")
    path = found[0]
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        doc: dict[str, Any] = json.load(f)
    return doc


def _union(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(spans):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def check_capture(key: str, entry: dict[str, Any], cuda: bool, cache: Path) -> None:
    """The checks of one capture against its raw JSON."""
    import tracemagic

    folder = Path(entry["dir"])
    doc = raw_events(folder)
    events = doc["traceEvents"]
    trace = tracemagic.load(folder, cache_dir=cache)
    manifest = json.loads((folder / "capture.json").read_text()) if (folder / "capture.json").exists() else {}
    check(f"{key}: capture complete", lambda: _eq(entry["status"], "complete") or f"{len(events):,} events")
    xs = [e for e in events if e.get("ph") == "X"]
    steps = sorted(
        (e for e in xs if e.get("cat") == "user_annotation" and e.get("name", "").startswith("ProfilerStep#")),
        key=lambda e: e["ts"],
    )
    kernels_raw = [e for e in xs if e.get("cat") in GPU_CATS]
    launches = {
        e["args"]["correlation"]: e for e in xs if e.get("cat") in RUNTIME_CATS and "correlation" in e.get("args", {})
    }
    cpu_ops = {
        e["args"]["External id"]: e for e in xs if e.get("cat") == "cpu_op" and "External id" in e.get("args", {})
    }

    def step_of(ts: float) -> int:
        """The recorded step holding ``ts`` (-1: none)."""
        return next((int(s["name"].split("#")[1]) for s in steps if s["ts"] <= ts <= s["ts"] + s["dur"]), -1)

    def ours_by_correlation() -> dict[int, tuple[str, int]]:
        """Our ``kernels()``: each correlation's (op, step)."""
        table = trace.kernels()
        return {
            int(c): (str(op), int(s))
            for c, op, s in zip(table["correlation"], table["op"], table["step"])
            if c is not None and str(c) != "<NA>"
        }

    def kernels() -> str:
        table = trace.kernels()
        raw = [e for e in kernels_raw if e["cat"] == "kernel"]
        assert len(raw) > 0, "no kernel in the raw JSON"
        assert int((table["kind"] == "kernel").sum()) == len(raw), (int((table["kind"] == "kernel").sum()), len(raw))
        in_steps = unlaunched = 0
        wrong = []
        by_corr = ours_by_correlation()
        for k in raw:
            corr = k["args"].get("correlation")
            launch = launches.get(corr)
            if launch is None:  # in flight when the profiler began (each iteration ends in a sync)
                unlaunched += 1
                continue
            ext = launch["args"].get("External id")
            op = cpu_ops.get(ext)
            step = step_of(launch["ts"])
            in_steps += step >= 0
            ours = by_corr.get(corr)
            if op is not None and ours is not None and (ours[0] != op["name"] or ours[1] != step):
                wrong.append((k["name"][:40], ours, op["name"], step))
        assert not wrong, f"{len(wrong)} kernels with another op/step than the raw External id says: {wrong[:3]}"
        assert in_steps == len(raw) - unlaunched > 0, f"{in_steps}/{len(raw)} kernels launched in the steps"
        assert unlaunched <= 0.01 * len(raw), f"{unlaunched} kernels with no launching call in the trace"
        return f"{len(raw)} kernels, each launched by its External id's op in the cell's steps" + (
            f" ({unlaunched} in flight before the window)" if unlaunched else ""
        )

    check(f"{key}: kernels and their launching ops", kernels, cuda_only=True, cuda=cuda)

    def windows() -> str:
        table = trace.steps()
        assert [int(s) for s in table["step"]] == [int(s["name"].split("#")[1]) for s in steps]
        lines = []
        prev_end = float("-inf")
        for row, s in zip(table.itertuples(), steps):
            start, host_end = s["ts"], s["ts"] + s["dur"]
            ends = [
                k["ts"] + k["dur"]
                for k in kernels_raw
                if k["args"].get("correlation") in launches
                and start <= launches[k["args"]["correlation"]]["ts"]
                and launches[k["args"]["correlation"]]["ts"] + launches[k["args"]["correlation"]]["dur"] <= host_end
            ]
            w_start = max(start, prev_end)
            w_end = max([host_end, *ends])
            prev_end = w_end
            # the window's start against the host step's: both offsets from the same origin
            assert abs((row.window_ts - row.ts) - (w_start - start)) <= 2.0, (row.step, row.window_ts - row.ts)
            assert abs(row.window_dur - (w_end - w_start)) <= max(2.0, 1e-4 * row.window_dur), (
                row.step,
                row.window_dur,
                w_end - w_start,
            )
            busy = _union(
                [
                    (max(k["ts"], w_start), min(k["ts"] + k["dur"], w_end))
                    for k in kernels_raw
                    if k["ts"] < w_end and k["ts"] + k["dur"] > w_start
                ]
            )
            assert abs(row.gpu_busy_us - busy) <= max(2.0, 1e-4 * row.window_dur), (row.step, row.gpu_busy_us, busy)
            assert abs(row.gpu_idle_us - (row.window_dur - busy)) <= max(2.0, 1e-4 * row.window_dur)
            lines.append(
                f"step {row.step}: window {row.window_dur:.0f} µs, busy {busy:.0f} µs "
                f"({100 * busy / row.window_dur:.0f}%)"
            )
        return "; ".join(lines)

    check(f"{key}: device windows and GPU busy/idle", windows, cuda_only=True, cuda=cuda)

    def memory() -> str:
        mem = [
            e
            for e in events
            if e.get("name") == "[memory]"
            and e.get("args", {}).get("Device Type") == 1
            and e["args"].get("Device Id") == 0
        ]
        assert mem, "no CUDA memory event on device 0"
        raw_peak = max(e["args"]["Total Allocated"] for e in mem)
        peaks = trace.memory_peaks()
        whole = peaks[(peaks["device"] == "cuda:0") & peaks["step"].isna()]
        assert len(whole) == 1, peaks
        ours = int(whole["peak_bytes"].iloc[0])
        assert ours == raw_peak, (ours, raw_peak)
        cell = entry.get("max_memory_allocated")
        detail = f"peak on cuda:0 {ours:,} B = raw {raw_peak:,} B"
        if cell is not None:
            # the same allocator statistic over the same iterations: equal up to allocations
            # made between the profiler's step boundary and the reset (none expected)
            assert abs(ours - cell) <= max(2 << 20, 0.01 * cell), (
                f"trace peak {ours:,} vs max_memory_allocated {cell:,}"
            )
            detail += f"; torch.cuda.max_memory_allocated() in the cell {cell:,} B (diff {ours - cell:+,} B)"
        return detail

    if entry.get("max_memory_allocated") is not None or key != "matmul":
        check(f"{key}: memory on cuda:0", memory, cuda_only=True, cuda=cuda)

    def device() -> str:
        from tracemagic.analysis import devices as dev_table

        props = doc.get("deviceProperties") or []
        assert props, "no deviceProperties in the raw JSON"
        ours = trace.devices
        assert ours and ours[0].get("name") == props[0]["name"], (ours[:1], props[0].get("name"))
        peaks = dev_table.match(ours[0])
        assert peaks is not None, f"device {props[0]['name']!r} not recognised"
        assert peaks.bf16 > 0 and peaks.tbytes_per_s > 0
        assert manifest["device"]["type"] == "cuda" and manifest["device"]["activities"] == ["CPU", "CUDA"]
        return f"{props[0]['name']} -> {peaks.name}: bf16 {peaks.bf16} TFLOP/s, {peaks.tbytes_per_s} TB/s"

    check(f"{key}: device recognised with its peaks", device, cuda_only=True, cuda=cuda)

    if entry.get("named_modules"):

        def layer_names() -> str:
            ours = sorted(set(trace.layers()["layer"]))
            expected = entry["named_modules"]
            # other modules the loop calls are roots of their own (the quickstart's loss_fn)
            others = {m["root"] for m in manifest["modules"].values() if m["root"] != entry["var"]}
            missing, extra = sorted(set(expected) - set(ours)), sorted(set(ours) - set(expected) - others)
            assert not missing and not extra, f"missing {missing[:8]}, extra {extra[:8]}"
            return (
                f"{len(expected)} layers = {entry['var']}.named_modules() (the root by its variable; "
                f"ModuleList containers have no forward), other roots {sorted(others)}"
            )

        check(f"{key}: layer names = named_modules()", layer_names)

    if entry.get("cell") is not None:

        def flame() -> str:
            # the Flame tab as drawn: one <module> box for the capture cell, named Cell In[n] (the
            # In[n] the executed notebook shows), no cell's temporary file, modules by layer path
            from html import unescape

            from tracemagic.views import figures

            fig = figures.flame(trace.call_tree(user_only=True), cells=trace.cell_numbers)
            labels = [unescape(str(label)) for label in fig.data[0].labels]
            top = [label for label in labels if label.startswith("<module>")]
            assert len(top) == 1 and f"Cell In[{entry['cell']}]:" in top[0], top
            temp = {os.path.basename(f) for f in manifest.get("cells") or {}}
            assert temp and not [label for label in labels if any(t in label for t in temp)], temp
            detail = f"one {top[0]!r} box"
            if entry.get("named_modules"):
                assert not [label for label in labels if label.startswith("nn.Module: ")], "torch's module names"
                others = {m["root"] for m in manifest["modules"].values() if m["root"] != entry["var"]}
                shown = {label.split(" · ")[0] for label in labels}
                named = shown & (set(entry["named_modules"]) | others)
                assert entry["named_modules"][0] in named or entry["var"] in named, sorted(shown)[:10]
                detail += f", {len(named)} module boxes named by {entry['var']}.named_modules() paths"
            return detail + ", no temporary cell file"

        check(f"{key}: Flame: one box per cell, Cell In[n], modules by path", flame)

    cell_text = dict(enumerate(str(manifest.get("cell", "")).splitlines(), start=2))
    backward_lines = [n for n, text in cell_text.items() if text.strip() == "loss.backward()"]
    if backward_lines:

        def backward_line() -> str:
            # the GPU work launched (any thread: autograd's runs the backward) inside the
            # loss.backward() line's marks, per run, from the raw events; lines() per step
            (number,) = backward_lines
            mark = f"tracemagic.line:{number}"
            marks = [e for e in xs if e.get("name") == mark and e.get("cat") in ("cpu_op", "user_annotation")]
            assert marks, f"no {mark} in the raw JSON"
            raw = sum(
                k["dur"]
                for k in kernels_raw
                if (launch := launches.get(k.get("args", {}).get("correlation"))) is not None
                and any(m["ts"] <= launch["ts"] < m["ts"] + m["dur"] for m in marks)
            ) / len(marks)
            row = trace.lines().set_index("line").loc[number]
            ours = float(row["gpu_us"]) / float(row["calls"])
            assert raw > 0 and abs(ours - raw) <= max(1.0, 1e-3 * raw), (ours, raw)
            return f"line {number} `loss.backward()`: {ours:.1f} µs of GPU work per run (raw {raw:.1f})"

        check(
            f"{key}: lines: loss.backward() holds the GPU work autograd's thread launched",
            backward_line,
            cuda_only=True,
            cuda=cuda,
        )

    if key.endswith("_et"):

        def et() -> str:
            from tracemagic.export.chakra import check as chakra_check

            report = chakra_check(folder)
            assert report.ok and report.timed_share == 1.0, report.summary()
            et_path = next(folder.glob("torch_et_0*.json"))
            nodes = json.loads(et_path.read_text())["nodes"]

            def rf_ids(node: dict[str, Any]) -> list[Any]:
                return [a["value"] for a in node.get("attrs", []) if a.get("name") == "rf_id"]

            et_rf = {v for n in nodes for v in rf_ids(n)}
            launching = {
                cpu_ops[launches[k["args"]["correlation"]]["args"]["External id"]]["args"].get("Record function id")
                for k in kernels_raw
                if k["args"].get("correlation") in launches
                and launches[k["args"]["correlation"]]["args"].get("External id") in cpu_ops
            }
            launching.discard(None)
            joined = launching & et_rf
            assert not cuda or launching, "no launching op with a Record function id"
            assert joined == launching, f"{len(launching - joined)} launching ops not in the ET"
            # and every op of the recorded steps (as tests/test_cuda_captures.py checks)
            in_steps = [e for e in cpu_ops.values() if any(s["ts"] <= e["ts"] <= s["ts"] + s["dur"] for s in steps)]
            recorded = {e["args"].get("Record function id") for e in in_steps} - {None}
            missing = recorded - et_rf
            assert recorded and not missing, f"{len(missing)}/{len(recorded)} ops of the steps not in the ET"
            return (
                f"chakra check OK, {report.timed_share:.0%} of {report.pairs[0].et_ops} ET ops timed; "
                f"{len(joined)}/{len(launching)} kernel-launching ops and {len(recorded)} ops of the steps "
                "joined by rf_id"
            )

        check(f"{key}: ET joined to Kineto", et)

    if key == "matmul":

        def roofline() -> str:
            eff = trace.efficiency()
            rows = eff[
                eff["name"].isin(["aten::mm", "aten::matmul"]) & eff["input_type"].str.contains("BFloat16", na=False)
            ]
            assert len(rows), eff[["name", "input_type"]].head()
            row = rows.sort_values("gpu_us").iloc[-1]
            pct = float(row["pct_of_roofline"])
            assert 0 < pct <= 100, f"pct_of_roofline {pct}"
            # independently: the mm's kernels from the raw JSON, 2*M*N*K FLOPs per call
            mm_ops = [
                e
                for e in xs
                if e.get("cat") == "cpu_op"
                and e["name"] == "aten::mm"
                and any(s["ts"] <= e["ts"] <= s["ts"] + s["dur"] for s in steps)
            ]
            ids = {e["args"]["External id"] for e in mm_ops}
            gpu = sum(
                k["dur"]
                for k in kernels_raw
                if k["cat"] == "kernel"
                and launches.get(k["args"].get("correlation"), {}).get("args", {}).get("External id") in ids
            )
            dims = json.loads(row["input_dims"])
            m, k_ = dims[0]
            n = dims[1][1]
            tflops = 2 * m * n * k_ * len(mm_ops) / gpu / 1e6
            assert abs(tflops - float(row["tflops_per_s"])) <= 0.05 * tflops, (tflops, row["tflops_per_s"])
            return (
                f"{row['name']} {m}x{k_}x{n} bf16: {tflops:.0f} TFLOP/s (raw) vs ours "
                f"{float(row['tflops_per_s']):.0f}, pct_of_roofline {pct:.1f}% of {row['peak_tflops']} on {row['device']}"
            )

        check("matmul: bf16 pct_of_roofline plausible", roofline, cuda_only=True, cuda=cuda)

    if key == "compiled":

        def no_retrace() -> str:
            inside = [e for e in xs if any(s["ts"] <= e["ts"] <= s["ts"] + s["dur"] for s in steps)]
            retraced = [e["name"] for e in inside if RETRACE.search(e["name"])]
            assert not retraced, retraced[:5]
            assert len(steps) == 3
            regions = [e for e in inside if e["name"].startswith("Torch-Compiled Region")]
            assert len(regions) == 3, len(regions)
            return "3 steps, 3 compiled regions, no dynamo tracing event inside"

        check("compiled: no re-trace inside the window", no_retrace)

        def triton() -> str:
            table = trace.kernels()
            trit = table[table["name"].astype(str).str.startswith("triton")]
            assert len(trit), "no Triton kernel"
            fwd_calls = [e for e in xs if e["name"] == "nn.Module: OptimizedModule_0"]
            fwd = {
                k["args"]["correlation"]
                for k in kernels_raw
                if k["name"].startswith("triton")
                and k["args"].get("correlation") in launches
                and any(c["ts"] <= launches[k["args"]["correlation"]]["ts"] <= c["ts"] + c["dur"] for c in fwd_calls)
            }
            assert fwd, "no Triton kernel launched inside the compiled module's forward"
            ours = trit[trit["correlation"].isin(list(fwd))]
            assert len(ours) == len(fwd) and set(ours["layer"].astype(str)) == {"cm"}, set(ours["layer"].astype(str))
            layers = trace.layers()
            cm = layers[layers["layer"] == "cm"]
            assert len(cm) == 1 and float(cm["gpu_us"].iloc[0]) > 0
            return (
                f"{len(trit)} Triton kernels, the {len(fwd)} launched in the forward attributed to 'cm'; "
                f"layer cm gpu_us {float(cm['gpu_us'].iloc[0]):.0f} µs"
            )

        check("compiled: Triton kernels attributed to the compiled layer", triton, cuda_only=True, cuda=cuda)

    if key == "amp":

        def autocast_roofline() -> str:
            # the float32 aten::linear calls that ran an aten::linear in bf16 inside (autocast), in
            # the steps; their GPU work from the raw launches, 2*M*N*K FLOPs a call: the row of
            # efficiency() for them is held to the bf16 peak, and under its roof
            from tracemagic.analysis import devices as dev_table

            ops = sorted((e for e in xs if e.get("cat") == "cpu_op"), key=lambda e: (e["tid"], e["ts"], -e["dur"]))
            outer = [
                e
                for e in ops
                if e["name"] == "aten::linear"
                and e["args"].get("Input type", [None])[0] == "float"
                and any(s["ts"] <= e["ts"] <= s["ts"] + s["dur"] for s in steps)
                and any(
                    i["name"] == "aten::linear"
                    and i["tid"] == e["tid"]
                    and e["ts"] < i["ts"] < e["ts"] + e["dur"]
                    and i["args"].get("Input type", [None])[0] == "c10::BFloat16"
                    for i in ops
                )
            ]
            assert outer, "no float32 aten::linear running a bf16 aten::linear inside"
            dims = outer[0]["args"]["Input Dims"]
            assert all(e["args"]["Input Dims"] == dims for e in outer)
            (m, k), (n, _k) = dims[0], dims[1]
            gpu = sum(
                g["dur"]
                for g in kernels_raw
                if (launch := launches.get(g["args"].get("correlation"))) is not None
                and any(e["tid"] == launch["tid"] and e["ts"] <= launch["ts"] <= e["ts"] + e["dur"] for e in outer)
            )
            raw_tflops = 2 * m * n * k * len(outer) / gpu / 1e6
            eff = trace.efficiency()
            rows = eff[(eff["name"] == "aten::linear") & eff["input_type"].str.startswith('["float"')]
            rows = rows[rows["calls"] == len(outer)]
            assert len(rows) == 1, eff[["name", "input_type", "calls", "peak_tflops"]].head(8)
            row = rows.iloc[0]
            peak = dev_table.match(trace.devices[0]).bf16
            assert float(row["peak_tflops"]) == peak, (row["peak_tflops"], peak)
            assert abs(float(row["tflops_per_s"]) - raw_tflops) <= 0.02 * raw_tflops, (row["tflops_per_s"], raw_tflops)
            pct = float(row["pct_of_roofline"])
            assert 0 < pct <= 100, pct
            return (
                f"{len(outer)} autocast aten::linear calls {m}x{k}x{n}: {raw_tflops:.0f} TFLOP/s (raw), ours "
                f"{float(row['tflops_per_s']):.0f} against the bf16 peak {peak}: {pct:.1f}% of the roof"
            )

        check("amp: an autocast float32 linear held to the bf16 peak", autocast_roofline, cuda_only=True, cuda=cuda)

    if key in ("graphs", "reduce_overhead"):

        def graph_replays() -> str:
            # the kernels a graph replay runs are launched by one cudaGraphLaunch (raw): each is
            # in our kernels() with the step of that launch and the op its External id names
            graph = [
                k
                for k in kernels_raw
                if k["cat"] == "kernel"
                and launches.get(k["args"].get("correlation"), {}).get("name", "").startswith("cudaGraphLaunch")
            ]
            assert graph, "no kernel launched by cudaGraphLaunch"
            ours = ours_by_correlation()
            wrong = []
            for k in graph:
                launch = launches[k["args"]["correlation"]]
                op = cpu_ops.get(launch["args"].get("External id"))
                step = step_of(launch["ts"])
                got = ours.get(int(k["args"]["correlation"]))
                if got is None or got[1] != step or (op is not None and got[0] != op["name"]):
                    wrong.append((k["name"][:40], got, op and op["name"], step))
            assert not wrong, f"{len(wrong)} of {len(graph)} graph kernels: {wrong[:3]}"
            launched = sorted({ours[int(k["args"]["correlation"])][0] for k in graph})
            replays = len({k["args"]["correlation"] for k in graph})
            return f"{len(graph)} kernels in {replays} graph replays, each in its step; launched by {launched}"

        check(f"{key}: the kernels of CUDA graph replays", graph_replays, cuda_only=True, cuda=cuda)


def _eq(a: Any, b: Any) -> None:
    assert a == b, f"{a!r} != {b!r}"


# ---------------------------------------------------------------- outputs


def pack(key: str, entry: dict[str, Any], env: dict[str, Any], out: Path) -> Path:
    """``<out>/cuda_<key>.tar.gz`` (``cpu_`` without CUDA): the capture folder as the magic wrote
    it, and beside it (not in it: the folder stays a capture) ``gpu_check.json``."""
    folder = Path(entry["dir"])
    meta = {"environment": env, "capture": key, **{k: v for k, v in entry.items() if k != "dir"}}
    meta_path = folder.parent / f".{key}.gpu_check.json"
    meta_path.write_text(json.dumps(meta, indent=1))
    prefix = "cuda" if env["cuda_available"] else "cpu"
    path = out / f"{prefix}_{key}.tar.gz"
    with tarfile.open(path, "w:gz", compresslevel=9) as tar:
        tar.add(meta_path, arcname="gpu_check.json")
        for p in sorted(folder.iterdir()):
            if p.is_file() and not p.name.startswith("."):
                tar.add(p, arcname=f"{prefix}_{key}/{p.name}")
    return path


def timings(info: dict[str, Any], work: Path) -> None:
    from statistics import median

    t = info["timings"]
    active = slice(2, 5)  # the recorded iterations of the default schedule
    none = median(t["none"][2:] + t["none2"][2:]) * 1e3
    bare = median(t["bare"][active]) * 1e3
    magic = median(t["magic"][active]) * 1e3
    print(
        f"TIMING transformer step (median of the recorded iterations, ms): no profiler {none:.2f}, "
        f"bare torch.profiler {bare:.2f} ({bare / none:.2f}x), %%chakra_trace {magic:.2f} "
        f"({magic / none:.2f}x; {magic / bare:.2f}x the bare profiler)",
        flush=True,
    )
    bare_doc = json.loads((work / "bare.json").read_text())
    magic_doc = raw_events(Path(info["captures"]["transformer"]["dir"]))

    def steps_ms(doc: dict[str, Any]) -> list[float]:
        return [
            round(e["dur"] / 1e3, 3)
            for e in doc["traceEvents"]
            if e.get("ph") == "X"
            and e.get("cat") == "user_annotation"
            and e.get("name", "").startswith("ProfilerStep#")
        ]

    print(f"TIMING ProfilerStep ms, bare: {steps_ms(bare_doc)}, magic: {steps_ms(magic_doc)}", flush=True)


def pytest_cuda_test(cuda: bool) -> None:
    """``pytest tests/test_magic.py -k cuda``: the CUDA test the suite skips without a GPU."""
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-rs",
        "tests/test_magic.py",
        "-k",
        "cuda",
    ]
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired as exc:
        record("FAIL", "pytest tests/test_magic.py -k cuda", f"timed out after {exc.timeout} s")
        return
    print(done.stdout[-3000:] + done.stderr[-2000:], flush=True)
    last = (done.stdout.strip().splitlines() or ["?"])[-1]
    passed = done.returncode == 0 and "passed" in last
    status = "PASS" if passed else ("SKIP" if done.returncode == 0 and not cuda else "FAIL")
    record(status, "pytest tests/test_magic.py -k cuda", last)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out",
        default=os.environ.get("OUT") or "gpu-check-out",
        help="where the .tar.gz captures go (default $OUT, else ./gpu-check-out)",
    )
    parser.add_argument("--no-pytest", action="store_true", help="skip pytest tests/test_magic.py -k cuda")
    args = parser.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    env = environment()
    print("ENVIRONMENT " + json.dumps(env, indent=1), flush=True)
    cuda = bool(env["cuda_available"])
    print(f"loader route: {env['loader_route']}", flush=True)
    work = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    info: dict[str, Any] = {}
    try:
        info = run_kernel(work, cuda)
        record("PASS", "the magic in a real kernel (nbclient + ipykernel)", f"{len(info['captures'])} captures")
    except Exception as exc:  # noqa: BLE001 - report and go on to pytest
        record("FAIL", "the magic in a real kernel (nbclient + ipykernel)", f"{type(exc).__name__}: {str(exc)[:2000]}")
    cache = work / "cache"
    if info:
        check(
            "the dashboard shows in the kernel (plotly + ipywidgets)",
            lambda: (
                _eq(any("application/vnd.jupyter.widget-view+json" in d for d in info["dashboard"]), True)
                or f"display MIME types {info['dashboard']}"
            ),
        )
    for key, entry in info.get("captures", {}).items():
        try:
            check_capture(key, entry, cuda, cache)
        except Exception as exc:  # noqa: BLE001 - a capture that cannot even load is one failure
            record("FAIL", f"{key}: load", f"{type(exc).__name__}: {exc}")
            traceback.print_exc(limit=5)
    if "compiled" in info:
        c = info["compiled"]
        check(
            "compiled: no dynamo frame compiled during the magic's cell",
            lambda: _eq(c["frames_after"], c["frames_before"]) or f"backend {c['backend']}, frames {c['frames_after']}",
        )
    if info.get("timings"):
        try:
            timings(info, work)
        except Exception as exc:  # noqa: BLE001
            record("FAIL", "timings", f"{type(exc).__name__}: {exc}")
    for key, entry in info.get("captures", {}).items():
        try:
            path = pack(key, entry, env, out)
            print(f"wrote {path} ({path.stat().st_size / 1024:.0f} KiB)", flush=True)
        except Exception as exc:  # noqa: BLE001
            record("FAIL", f"{key}: pack", f"{type(exc).__name__}: {exc}")
    if args.no_pytest:
        record("SKIP", "pytest tests/test_magic.py -k cuda", "--no-pytest")
    else:
        pytest_cuda_test(cuda)
    shutil.rmtree(work, ignore_errors=True)
    counts = {s: sum(1 for r in RESULTS if r[0] == s) for s in ("PASS", "FAIL", "SKIP")}
    print(
        f"\nSUMMARY: {counts['PASS']} PASS, {counts['FAIL']} FAIL, {counts['SKIP']} SKIP in "
        f"{time.perf_counter() - started:.0f} s on {env.get('gpu', 'CPU')} (torch {env['torch']}, "
        f"driver {env.get('driver', '-')}, loader {env['loader_route']})",
        flush=True,
    )
    for status, name, detail in RESULTS:
        if status == "FAIL":
            print(f"  FAIL {name}: {detail[:300]}")
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
