"""Does ``%%chakra_trace`` cost more than torch.profiler itself? Bare ``profile()`` vs the magic.

Same model, same data, same flags (record_shapes, profile_memory, with_stack; CPU; schedule
wait=1 warmup=1 active=3) and both write the Kineto trace, each run to a new file (as
``tensorboard_trace_handler`` does: overwriting one file would make the bare side pay for
freeing the old one's blocks). The magic runs with ``--cpu-only --no-memory-timeline -q``
because the bare loop records no device activity, computes no allocation categories and
displays nothing. Both run as IPython cells, in one process; runs alternate (bare, magic,
magic, bare, ...) so drift hits both alike.

"The whole profiled loop" is the whole cell, timed around ``run_cell``: everything the user
waits for before the cell returns. For the magic that is parsing its line, rewriting and
compiling the cell (or taking both from its cache), making the capture directory and its
``running`` manifest, starting the notices filter and the profiler, the loop with its line
marks and per-iteration timing, stopping, exporting the trace, naming the ``nn.Module``
events, and writing the final manifest. For the bare side it is the ``with profile(...)``
block around the same loop, its ``on_trace_ready`` exporting the trace. Nothing the magic
does inside the cell is left out; only the display is (``-q``; the bare side shows nothing).

Two cases, as the goals of issue 23 ask, and a third:

- ``variable``: the model is a notebook variable (``model = ...`` in a cell);
- ``function``: the model is made inside a function and held only by the closure of
  ``train_step`` and its optimizer: the magic finds it by walking every live object the
  first time (the "cold" capture, shown for information), then from its cache;
- ``tensors``: the loop calls no ``nn.Module`` (tensor ops on the same data: three matrix
  products and a ReLU a step), and the namespace also holds a dataset of 40,000 small
  objects: a window without module calls must not search the namespace for models;
- ``temporary``: the ``variable`` case's MLP, but its forward makes its two ``nn.ReLU``
  each call (``nn.ReLU()(x)``), beside the same dataset: those modules are dead once a
  window is written, and must not be searched for in every capture.

Printed per case: the median wall time of the whole profiled cell (trace export and the
magic's own work included) and of an active step (the ``ProfilerStep#N`` spans of each
trace, from one ``step()`` to the next, so the magic's own per-step work counts), for
each, and the ratios magic / bare against the goals (whole loop at most 1.02x, active step
at most 1.05x) with a pass / falls-short word. A ratio is the median, over the
repetitions, of each magic run over the bare run next to it: on a shared machine the load
changes from one second to the next, and a pair run back to back sees the same load. The
whole loop is judged on CPU time (``time.process_time``) too: on a shared machine it moves
less than the wall time. ``--threads`` (default 1) pins torch's intra-op threads, for the
same reason.

``--phases`` prints instead where the magic's own time goes: the CPU time and the wall
time of each of its phases (and of torch's calls inside them) in ``--reps`` captures of the
``variable`` case, timed by wrapping the functions (a few µs of wrapping each; a function
an older ref lacks is left out, so the same bench runs against it with ``PYTHONPATH``).

``--kernel`` runs all of it in a real ipykernel (through nbclient), as a notebook runs the
magic: there ``sys.stdout``/``sys.stderr`` are ipykernel's streams, whose ``flush()`` waits
for the kernel's IO thread, and descriptors 1 and 2 are the kernel's pipes; a plain
``InteractiveShell`` (the default) has none of that.

``--device cuda`` runs the same model and data on the GPU: both sides then record CUDA
activity too (the bare profiler with ``ProfilerActivity.CUDA``, the magic without
``--cpu-only``, as a user runs it there), and both cells end with
``torch.cuda.synchronize()`` so that the GPU's work counts on both sides.

    .venv/bin/python bench/bench_magic_overhead.py [--reps 9] [--steps 20] [--threads 1] [--phases] [--device cuda] [--kernel]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from IPython.core.interactiveshell import InteractiveShell
from torch import nn
from torch.profiler import ProfilerActivity, profile, schedule

#: the goals of issue 23: magic / bare
LOOP_GOAL = 1.02
STEP_GOAL = 1.05

CELL = """\
for x in data:
    train_step(x)
"""

#: the device the model and data live on (``--device``), and what both sides record
DEVICE = "cpu"
ACTIVITIES = [ProfilerActivity.CPU]
#: what ends both cells: nothing on CPU; on CUDA, waiting for the GPU's queued work
CELL_END = ""

#: the ``variable`` case: the model, its optimizer and the step are notebook variables
DEFINE_HELD = """\
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)).to(DEVICE)
opt = torch.optim.SGD(model.parameters(), lr=0.01)

def train_step(x):
    model(x).sum().backward()
    opt.step()
    opt.zero_grad()
"""


#: the ``tensors`` case: the loop's work without an ``nn.Module``, beside a dataset of
#: 40,000 small objects (what a notebook holds besides its model)
DEFINE_TENSORS = """\
torch.manual_seed(0)
w1, w2, w3 = (torch.randn(n, m, device=DEVICE) for n, m in ((256, 512), (512, 512), (512, 10)))

class Row:
    def __init__(self, i):
        self.i = i
        self.tags = [i, str(i)]

rows = {k: [Row(200 * k + i) for i in range(200)] for k in range(200)}

def train_step(x):
    (x @ w1).relu().matmul(w2).relu().matmul(w3).sum()
"""


#: the ``temporary`` case: an MLP whose forward makes and drops its ReLU modules, beside the
#: ``tensors`` case's dataset
DEFINE_TEMPORARY = DEFINE_TENSORS.split("def train_step")[0] + """\
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(256, 512), nn.Linear(512, 512), nn.Linear(512, 10)

    def forward(self, x):
        return self.fc3(nn.ReLU()(self.fc2(nn.ReLU()(self.fc1(x)))))

model = Net().to(DEVICE)
opt = torch.optim.SGD(model.parameters(), lr=0.01)

def train_step(x):
    model(x).sum().backward()
    opt.step()
    opt.zero_grad()
"""


def make_workload() -> Any:
    """The ``function`` case: a 4-layer MLP training step whose model no variable holds."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)
    ).to(DEVICE)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def train_step(x: torch.Tensor) -> None:
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()

    return train_step


def bare_loop(train_step: Any, data: list[torch.Tensor], out: str) -> None:
    """What a user writes by hand; the trace goes to ``out`` (a new file each run)."""
    with profile(
        activities=ACTIVITIES,
        schedule=schedule(wait=1, warmup=1, active=3, repeat=1),
        on_trace_ready=lambda p: p.export_chrome_trace(out),
        record_shapes=True,
        profile_memory=True,
        with_stack=True,
    ) as prof:
        for x in data:
            train_step(x)
            prof.step()


def step_ms(trace: Path) -> float:
    """The median duration of the trace's ``ProfilerStep#N`` spans (the active steps, as the
    trace shows them: from one ``step()`` to the next), in ms."""
    events = json.loads(trace.read_text())["traceEvents"]
    spans = [e["dur"] for e in events if e.get("ph") == "X" and e.get("cat") != "gpu_user_annotation"
             and str(e.get("name", "")).startswith("ProfilerStep#")]  # the host's steps, not the GPU's copies
    return statistics.median(spans) / 1e3


def _timed(ip: Any, cell: str) -> tuple[float, float]:
    """Run ``cell``; (wall seconds, CPU seconds)."""
    w0, c0 = time.perf_counter(), time.process_time()
    result = ip.run_cell(cell)
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    result.raise_error()
    return wall, cpu


#: numbers the bare side's trace files (a new file each run)
_BARE_RUNS = itertools.count()


def bare(ip: Any, out: Path) -> tuple[float, float, float]:
    """The plain torch.profiler loop, run as a cell too; (loop s, CPU s, median step ms)."""
    trace = out / f"bare-{next(_BARE_RUNS)}.json"
    wall, cpu = _timed(ip, f"bare_loop(train_step, data, {str(trace)!r})\n{CELL_END}")
    return wall, cpu, step_ms(trace)


def magic(ip: Any, out: Path) -> tuple[float, float, float]:
    """The same loop under %%chakra_trace; (loop s, CPU s, median active-step ms)."""
    flags = "--cpu-only " if DEVICE == "cpu" else ""
    wall, cpu = _timed(ip, f"%%chakra_trace -q {flags}--no-memory-timeline --out {out}\n{CELL}{CELL_END}")
    return wall, cpu, step_ms(Path(ip.user_ns["_chakra_capture"].dir) / "kineto_trace_0.json")


def run_case(ip: Any, case: str, reps: int, out: Path) -> dict[str, Any]:
    """Set the case up in the shell, then alternate bare and magic ``reps`` times each."""
    for name in ("model", "opt", "train_step", "rows", "Row", "Net", "w1", "w2", "w3"):
        ip.user_ns.pop(name, None)
    if case == "variable":
        ip.run_cell(DEFINE_HELD).raise_error()
    elif case == "tensors":
        ip.run_cell(DEFINE_TENSORS).raise_error()
    elif case == "temporary":
        ip.run_cell(DEFINE_TEMPORARY).raise_error()
    else:
        ip.user_ns["train_step"] = make_workload()  # a new model: the magic has never seen it
    cold_bare = bare(ip, out)
    cold_magic = magic(ip, out)  # the first capture of this model: the cache is cold
    runs: dict[str, list[tuple[float, float, float]]] = {"bare": [], "magic": []}
    for i in range(reps):
        order = ("bare", "magic") if i % 2 == 0 else ("magic", "bare")
        for kind in order:
            runs[kind].append((bare if kind == "bare" else magic)(ip, out))
    med = {kind: tuple(statistics.median(r[k] for r in rs) for k in range(3)) for kind, rs in runs.items()}
    # each repetition's magic run over the bare run next to it (the load of the moment hits both)
    paired = tuple(
        statistics.median(m[k] / b[k] for b, m in zip(runs["bare"], runs["magic"], strict=True)) for k in range(3)
    )
    return {"med": med, "paired": paired, "cold": (cold_bare, cold_magic)}


def phases(ip: Any, reps: int, out: Path) -> None:
    """Print the median CPU time of each phase of a capture (``--phases``)."""
    import functools

    from tracemagic import magics
    from tracemagic.capture import files, loop, naming, notices, session
    from tracemagic.trace import layout

    spent: dict[str, float] = {}
    waited: dict[str, float] = {}

    def wrap(owner: Any, name: str, label: str) -> None:
        real = getattr(owner, name, None)
        if real is None:  # not in this version of the code (the bench runs against older refs too)
            return

        @functools.wraps(real)
        def timed(*args: Any, **kwargs: Any) -> Any:
            began, wall = time.process_time(), time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                spent[label] = spent.get(label, 0.0) + time.process_time() - began
                waited[label] = waited.get(label, 0.0) + time.perf_counter() - wall

        setattr(owner, name, timed)

    targets = [
        (magics.TracemagicMagics, "_options", "magic line parsed (kept per line)"),
        (loop, "prepare_cell", "cell rewritten and compiled (kept per cell)"),
        (session.CaptureSession, "open", "open: capture directory + running manifest"),
        (files, "make_capture_dir", "  capture directory"),
        (session.CaptureSession, "start", "start: notices filter + profiler"),
        (notices.Filter, "start", "  notices filter started"),
        (session.CaptureSession, "step", "step() x every iteration (torch's step inside)"),
        (torch.profiler.profile, "step", "  torch: prof.step() (trace export inside)"),
        (session.CaptureSession, "_on_trace_ready", "window written (export, naming, placing)"),
        (torch.profiler.profile, "export_chrome_trace", "  torch: export_chrome_trace"),
        (files, "_set_trace_name", "  trace read (once), traceName set to the final path"),
        (session._Profiler, "_modules", "    nn.Module events named (from the bytes read)"),
        (naming, "_module_calls", "      event tree searched"),
        (files, "place", "  placed under the final name"),
        (session.CaptureSession, "stop", "stop: profiler stopped, filter stopped"),
        (notices.Filter, "stop", "  notices filter stopped"),
        (session.CaptureSession, "finish", "finish: manifest built and written"),
        (session.CaptureSession, "_manifest", "  manifest built"),
        (files, "write_text", "manifest written (x2: running, final)"),
        (layout, "write_manifest", "manifest written (x2; older code, layout.write_manifest)"),
        (torch.profiler.profile, "stop_trace", "torch: stop_trace (in step() or stop())"),
        (notices._Pump, "sort_sink", "  torch's start/stop notices sorted (printed aside: Filter.aside)"),
    ]
    for owner, name, label in targets:
        wrap(owner, name, label)
    runs: list[tuple[dict[str, float], dict[str, float]]] = []
    totals: list[tuple[float, float, float]] = []
    for _ in range(reps):
        spent.clear()
        waited.clear()
        totals.append(magic(ip, out))
        runs.append((dict(spent), dict(waited)))
    wall, cpu = (statistics.median(t[k] for t in totals) * 1e3 for k in range(2))
    print(f"time per phase, medians of {reps} captures (ms), whole cell: CPU {cpu:.2f}, wall {wall:.2f}")
    print("       CPU      wall")
    for _, _, label in targets:
        c, w = (statistics.median(r[k].get(label, 0.0) for r in runs) * 1e3 for k in range(2))
        print(f"  {c:8.3f}  {w:8.3f}  {label}")


def verdict(ratio: float, goal: float) -> str:
    """``pass`` when ``ratio`` is within ``goal``, else ``falls short``."""
    return "pass" if ratio <= goal else "falls short"


def in_kernel(argv: list[str]) -> None:
    """``--kernel``: run the bench with ``argv`` inside a real ipykernel (nbclient), where a
    notebook runs the magic (its streams, its IO thread), and print what it printed."""
    import nbclient
    import nbformat

    code = (
        f"import sys; sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})\n"
        "import bench_magic_overhead\n"
        f"bench_magic_overhead.main({argv!r}, get_ipython())\n"
    )
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(code)]
    nbclient.NotebookClient(nb, kernel_name="python3", timeout=3600).execute()
    for output in nb.cells[0].outputs:
        if output.get("name") == "stdout":
            print(output["text"], end="")


def main(argv: list[str] | None = None, shell: Any = None) -> None:
    """Run the bench (``argv``: the command line; ``shell``: the IPython shell to run the
    cells in, default a plain ``InteractiveShell``)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0: torch's default)")
    parser.add_argument("--phases", action="store_true", help="print where the magic's own time goes instead")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the model runs")
    parser.add_argument("--kernel", action="store_true", help="run the cells in a real ipykernel (nbclient)")
    args = parser.parse_args(argv)
    if args.kernel:
        in_kernel([a for a in (sys.argv[1:] if argv is None else argv) if a != "--kernel"])
        return
    global DEVICE, ACTIVITIES, CELL_END
    if args.device == "cuda":
        if not torch.cuda.is_available():
            parser.error("--device cuda: torch sees no CUDA device here")
        DEVICE, ACTIVITIES, CELL_END = "cuda", [ProfilerActivity.CPU, ProfilerActivity.CUDA], "torch.cuda.synchronize()\n"
    if args.threads:
        torch.set_num_threads(args.threads)

    ip = shell if shell is not None else InteractiveShell.instance()
    ip.run_line_magic("load_ext", "tracemagic")
    torch.manual_seed(1)
    ip.user_ns.update(torch=torch, nn=nn, bare_loop=bare_loop, DEVICE=DEVICE,
                      data=[torch.randn(64, 256, device=DEVICE) for _ in range(args.steps)])
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        ip.user_ns["train_step"] = make_workload()  # warm both paths up once (imports, first calls)
        bare(ip, out)
        magic(ip, out)
        if args.phases:
            ip.run_cell(DEFINE_HELD).raise_error()
            magic(ip, out)
            phases(ip, args.reps, out)
            return
        for case in ("variable", "function", "tensors", "temporary"):
            results[case] = run_case(ip, case, args.reps, out)

    where = torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU"
    print(f"{args.reps} alternating repetitions per case, {args.steps} steps each, on {where}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} intra-op thread(s), "
          f"in {'a plain InteractiveShell' if shell is None else type(ip).__name__}")
    for case, res in results.items():
        med = res["med"]
        held = {
            "variable": "model in a notebook variable",
            "function": "model made in a function, no variable",
            "tensors": "no nn.Module called; 40,000 small objects in the namespace",
            "temporary": "forward makes its nn.ReLU each call; 40,000 small objects in the namespace",
        }[case]
        print(f"\n{case}: {held}")
        for kind, (loop_s, cpu_s, step_ms) in med.items():
            print(f"  {kind:>5}: loop {loop_s * 1e3:8.1f} ms (CPU {cpu_s * 1e3:7.1f} ms)   "
                  f"active step {step_ms:7.2f} ms   (medians)")
        loop, cpu, step = res["paired"]
        print(f"  whole loop   magic/bare  wall {loop:.3f} {verdict(loop, LOOP_GOAL)}"
              f"  |  CPU time {cpu:.3f} {verdict(cpu, LOOP_GOAL)}   (goal <= {LOOP_GOAL})")
        print(f"  active step  magic/bare  wall {step:.3f} {verdict(step, STEP_GOAL)}   (goal <= {STEP_GOAL})")
        print("  (ratios: median over the repetitions of magic / the bare run next to it)")
        print(f"  the magic's own cost per capture (magic - bare): wall {(med['magic'][0] - med['bare'][0]) * 1e3:+.1f} ms,"
              f" CPU {(med['magic'][1] - med['bare'][1]) * 1e3:+.1f} ms (fixed: a longer loop spreads it)")
        (cb, _, _), (cm, _, _) = res["cold"]
        if case not in ("tensors", "temporary"):
            print(f"  first capture of this model (cold cache, one run, for information): "
                  f"magic/bare {cm / cb:.3f}")


if __name__ == "__main__":
    main()
