"""Does ``%%chakra_trace`` cost more than torch.profiler itself? Bare ``profile()`` vs the magic.

Same model, same data, same flags (record_shapes, profile_memory, with_stack; CPU; schedule
wait=1 warmup=1 active=3) and both write the Kineto trace. The magic runs with
``--no-memory-timeline -q`` because the bare loop computes no allocation categories and
displays nothing. Both run as IPython cells. Runs alternate (bare, magic, bare, ...) so drift hits both alike.

Printed: the median wall time of the whole profiled loop (trace export included) and the
median wall time of an active (recorded) step, for each, and the ratios magic / bare.

    .venv/bin/python bench/bench_magic_overhead.py [--reps 7] [--steps 20]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from IPython.core.interactiveshell import InteractiveShell
from torch import nn
from torch.profiler import ProfilerActivity, profile, schedule

CELL = """\
for x in data:
    train_step(x)
"""


def make_workload(steps: int) -> tuple[Any, list[torch.Tensor]]:
    """A 4-layer MLP training step and its batches."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def train_step(x: torch.Tensor) -> None:
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()

    return train_step, [torch.randn(64, 256) for _ in range(steps)]


def bare(ip: Any, out: Path) -> tuple[float, float]:
    """The plain torch.profiler loop, run as a cell too; (loop seconds, median step ms)."""
    t0 = time.perf_counter()
    result = ip.run_cell(f"_bench = bare_loop(train_step, data, {str(out)!r})")
    elapsed = time.perf_counter() - t0
    result.raise_error()
    return elapsed, ip.user_ns["_bench"]


def bare_loop(train_step: Any, data: list[torch.Tensor], out: str) -> float:
    """What a user writes by hand; returns the median active-step ms."""
    active_ms: list[float] = []
    with profile(
        activities=[ProfilerActivity.CPU],
        schedule=schedule(wait=1, warmup=1, active=3, repeat=1),
        on_trace_ready=lambda p: p.export_chrome_trace(str(Path(out) / "bare.json")),
        record_shapes=True,
        profile_memory=True,
        with_stack=True,
    ) as prof:
        t_step = time.perf_counter()
        for i, x in enumerate(data):
            train_step(x)
            if 2 <= i <= 4:
                active_ms.append((time.perf_counter() - t_step) * 1e3)
            prof.step()
            t_step = time.perf_counter()
    return statistics.median(active_ms)


def magic(ip: Any, out: Path) -> tuple[float, float]:
    """The same loop under %%chakra_trace; returns (loop seconds, median active-step ms)."""
    t0 = time.perf_counter()
    result = ip.run_cell(f"%%chakra_trace -q --no-memory-timeline --out {out}\n{CELL}")
    elapsed = time.perf_counter() - t0
    result.raise_error()
    steps = ip.user_ns["_chakra_capture"].manifest["steps"]
    return elapsed, statistics.median(s["wall_ms"] for s in steps if s["complete"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()

    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "tracemagic")
    train_step, data = make_workload(args.steps)
    ip.user_ns.update(train_step=train_step, data=data, bare_loop=bare_loop)
    results: dict[str, list[tuple[float, float]]] = {"bare": [], "magic": []}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        bare(ip, out)  # warm up both paths once
        magic(ip, out)
        for _ in range(args.reps):
            results["bare"].append(bare(ip, out))
            results["magic"].append(magic(ip, out))

    med = {k: (statistics.median(v[0] for v in r), statistics.median(v[1] for v in r))
           for k, r in results.items()}
    print(f"{args.reps} alternating repetitions, {args.steps} steps each, torch {torch.__version__}")
    for kind, (loop_s, step_ms) in med.items():
        print(f"  {kind:>5}: loop {loop_s * 1e3:8.1f} ms   active step {step_ms:7.2f} ms (median)")
    print(f"ratio magic/bare: loop {med['magic'][0] / med['bare'][0]:.3f}   "
          f"active step {med['magic'][1] / med['bare'][1]:.3f}")


if __name__ == "__main__":
    main()
