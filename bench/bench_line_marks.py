"""What do the line marks cost per step? The quickstart capture with them vs with ``--no-lines``.

``%%chakra_trace`` runs each statement of the cell under a ``tracemagic.line:N`` mark
(torch's C++ ``_RecordFunctionFast``; an attribute test outside the profiler's window). This
times the quickstart notebook's model and loop (``notebooks/quickstart.ipynb``: a small CNN,
batches of 16 32×32 images, SGD; 4 statements per step) captured both ways, as IPython
cells, CPU only (``--cpu-only --no-memory-timeline -q``, torch on 1 thread):

- recorded steps: the median wall time of the ``active`` iterations (``cap.iterations``:
  the loop's own clock, the session's work between iterations left out), the goal's figure
  (marks on / off at most 1.01);
- past the schedule: the median of the ``after`` iterations (the profiler off: the marks
  are one attribute test per statement).

Each round is a fresh process that runs the two variants interleaved (on, off, off, on, ...)
after a warm-up capture; the ratio is taken per process, and the median of the rounds'
ratios is printed with pass / falls short.

    .venv/bin/python bench/bench_line_marks.py [--rounds 3] [--reps 4]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

from benchlib import ROOT, _result, machine  # noqa: E402

#: the goal of issue 26: marked / unmarked, per recorded step
GOAL = 1.01

SETUP = """\
import torch
from torch import nn
torch.set_num_threads(1)
torch.manual_seed(0)

class SmallNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4),
        )
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(32 * 16, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, x):
        return self.classifier(self.features(x))

model = SmallNet()
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
loss_fn = nn.CrossEntropyLoss()
batches = [(torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,))) for _ in range(6)]
"""
#: the quickstart's training loop, longer: recorded steps, then steps past the schedule
CELL = """\
for step in range({steps}):
    x, y = batches[step % len(batches)]
    optimizer.zero_grad()
    loss = loss_fn(model(x), y)
    loss.backward()
    optimizer.step()
"""
HEAD = "%%chakra_trace -q -v _cap --cpu-only --no-memory-timeline --wait 1 --warmup 1 --active {active} --out {out}"

WORKER = r"""
import json, statistics, sys
from IPython.core.interactiveshell import InteractiveShell
spec = json.loads(sys.argv[1])
ip = InteractiveShell.instance()
ip.run_line_magic("load_ext", "tracemagic")
ip.run_cell(spec["setup"]).raise_error()

def run(flag):
    ip.run_cell(spec["head"] + flag + "\n" + spec["cell"]).raise_error()
    it = ip.user_ns["_cap"].iterations
    marked = ip.user_ns["_cap"].manifest.get("line_marks", {}).get("marked")
    active = it.loc[it["phase"] == "active", "wall_ms"]
    after = it.loc[it["phase"] == "after", "wall_ms"]
    return {"active": statistics.median(active), "after": statistics.median(after), "marked": marked}

run("")  # warm-up: imports, first-capture work
out = {"on": [], "off": []}
for k in range(spec["reps"]):
    order = ("on", "off") if k % 2 == 0 else ("off", "on")
    for name in order:
        out[name].append(run("" if name == "on" else " --no-lines"))
print("RESULT " + json.dumps(out))
"""


def fmt_x(value: float) -> str:
    """A ratio to 3 decimals (the goal is 1%)."""
    return f"{value:.3f}x"


def one_round(reps: int, steps: int, active: int) -> dict[str, Any] | None:
    """A fresh process: the two variants ``reps`` times each, interleaved."""
    with tempfile.TemporaryDirectory() as out:
        spec = {"setup": SETUP, "cell": CELL.format(steps=steps), "head": HEAD.format(active=active, out=out),
                "reps": reps}
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        proc = subprocess.run([sys.executable, "-c", WORKER, json.dumps(spec)], capture_output=True, text=True,
                              env=env, timeout=1800)
    return _result(proc, "line marks")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="fresh processes")
    parser.add_argument("--reps", type=int, default=4, help="captures of each variant per process")
    parser.add_argument("--steps", type=int, default=60, help="iterations of the loop per capture")
    parser.add_argument("--active", type=int, default=10, help="recorded steps per capture")
    args = parser.parse_args()
    print(f"machine: {machine()}")
    ratios: dict[str, list[float]] = {"active": [], "after": []}
    medians: dict[str, dict[str, list[float]]] = {"on": {"active": [], "after": []}, "off": {"active": [], "after": []}}
    for r in range(args.rounds):
        result = one_round(args.reps, args.steps, args.active)
        if result is None:
            raise SystemExit("a round failed (see above)")
        assert all(run["marked"] for run in result["on"]) and not any(run["marked"] for run in result["off"])
        for phase in ("active", "after"):
            on = statistics.median(run[phase] for run in result["on"])
            off = statistics.median(run[phase] for run in result["off"])
            medians["on"][phase].append(on)
            medians["off"][phase].append(off)
            ratios[phase].append(on / off)
        print(f"round {r + 1}: recorded step {medians['on']['active'][-1]:.3f} ms marked vs "
              f"{medians['off']['active'][-1]:.3f} ms --no-lines ({fmt_x(ratios['active'][-1])}); past the schedule "
              f"{medians['on']['after'][-1]:.3f} vs {medians['off']['after'][-1]:.3f} ms ({fmt_x(ratios['after'][-1])})")
    active, after = statistics.median(ratios["active"]), statistics.median(ratios["after"])
    verdict = "pass" if active <= GOAL else "falls short"
    print(f"per recorded step, marks on / --no-lines: {fmt_x(active)} (goal <= {GOAL:.2f}x): {verdict}")
    print(f"per step past the schedule (profiler off): {fmt_x(after)}")


if __name__ == "__main__":
    main()
