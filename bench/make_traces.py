"""Generate CPU Kineto traces of ~10, ~100 and ~500 MB for ``bench/bench_load.py``.

The ~10 and ~100 MB traces are real captures: a small Transformer language model trained
on CPU under ``torch.profiler`` with ``record_shapes``, ``profile_memory`` and
``with_stack`` on (cpu_op events with Input Dims, python_function events with the
``nn.Module`` hierarchy, ``[memory]`` instants, fwdbwd flows, one ProfilerStep per step).
The number of profiled steps is calibrated from a short capture (~1.7 MB per step).

The ~500 MB trace is NOT a fresh capture (that would take minutes and GBs of profiler
memory): it is the ~100 MB capture's events written 5 times, each copy shifted later in
time by the capture's span, with its ProfilerStep numbers, ids (External id, Record
function id, Python id/parent id, Ev Idx, flow ids) shifted so they stay unique. Its
structure per step is therefore real; only the repetition is synthetic.

Usage: ``.venv/bin/python bench/make_traces.py [--sizes 10,100,500] [--out bench/out]``.
Existing files are reused unless ``--force``.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
from pathlib import Path

OUT = Path(__file__).resolve().parent / "out"
_ID_ARGS = ("External id", "Record function id", "Python id", "Python parent id", "Ev Idx")
_STEP = re.compile(r"ProfilerStep#(\d+)")


def _model():
    import torch
    from torch import nn

    class TinyLM(nn.Module):
        def __init__(self, vocab: int = 1000, d: int = 64, layers: int = 2) -> None:
            super().__init__()
            self.embed = nn.Embedding(vocab, d)
            layer = nn.TransformerEncoderLayer(d, 4, 4 * d, batch_first=True)
            self.encoder = nn.TransformerEncoder(layer, layers)
            self.head = nn.Linear(d, vocab)

        def forward(self, x):
            return self.head(self.encoder(self.embed(x)))

    torch.manual_seed(0)
    return TinyLM()


def capture(steps: int, path: Path) -> float:
    """Profile ``steps`` training steps of the model into ``path``; seconds taken."""
    import torch
    from torch import nn
    from torch.profiler import ProfilerActivity, profile, schedule

    model = _model()
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    x = torch.randint(0, 1000, (8, 32))
    y = torch.randint(0, 1000, (8, 32))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    start = time.perf_counter()
    with profile(
        activities=[ProfilerActivity.CPU],
        record_shapes=True,
        profile_memory=True,
        with_stack=True,
        schedule=schedule(wait=1, warmup=1, active=steps, repeat=1),
        on_trace_ready=lambda p: p.export_chrome_trace(str(tmp)),
    ) as prof:
        for _ in range(steps + 2):
            loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
            prof.step()
    os.replace(tmp, path)
    return time.perf_counter() - start


def replicate(src: Path, dst: Path, target_bytes: int) -> int:
    """Write ``src``'s events again and again, each copy shifted in time and ids (see the
    module doc), until the file reaches ``target_bytes``; the number of copies."""
    import orjson

    top = orjson.loads(src.read_bytes())
    events = top.pop("traceEvents")
    timed = [e for e in events if isinstance(e.get("ts"), (int, float)) and e.get("ph") != "M"]
    t0 = min(e["ts"] for e in timed)
    t1 = max(e["ts"] + e.get("dur", 0) for e in timed)
    span = (t1 - t0) + 1000.0
    steps = [int(m.group(1)) for e in events if (m := _STEP.fullmatch(str(e.get("name", ""))))]
    step_span = (max(steps) - min(steps) + 1) if steps else 0
    id_span = 1 + max(
        [int(v) for e in events for k, v in (e.get("args") or {}).items() if k in _ID_ARGS and isinstance(v, int)]
        + [int(e["id"]) for e in events if isinstance(e.get("id"), int)]
        + [0]
    )
    tmp = dst.with_suffix(".tmp")
    with open(tmp, "wb") as out:
        out.write(orjson.dumps(top)[:-1] + (b',"traceEvents":[' if top else b'{"traceEvents":['))
        first = True
        written = 0
        k = -1
        while written < target_bytes:
            k += 1
            chunk = []
            for e in events:
                if k and e.get("ph") == "M":
                    continue  # process/thread names once
                if k:
                    e = dict(e)
                    if "ts" in e:
                        e["ts"] = e["ts"] + k * span
                    if isinstance(e.get("id"), int):
                        e["id"] = e["id"] + k * id_span
                    name = e.get("name")
                    if step_span and isinstance(name, str) and (m := _STEP.fullmatch(name)):
                        e["name"] = f"ProfilerStep#{int(m.group(1)) + k * step_span}"
                    args = e.get("args")
                    if args:
                        args = dict(args)
                        for key in _ID_ARGS:
                            if isinstance(args.get(key), int) and args[key] >= 0:
                                args[key] += k * id_span
                        e["args"] = args
                chunk.append(e)
            body = orjson.dumps(chunk)[1:-1]
            if body:
                out.write(body if first else b"," + body)
                written += len(body) + 1
                first = False
        out.write(b"]}")
    os.replace(tmp, dst)
    return k + 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10,100,500", help="MB, comma-separated (10, 100, 500)")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--force", action="store_true")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)

    per_step = None
    for mb in sizes:
        path = out / f"cpu_{mb}mb.pt.trace.json"
        if path.exists() and not args.force:
            print(f"{path}: exists ({path.stat().st_size / 1e6:.1f} MB)")
            continue
        real_base = out / "cpu_100mb.pt.trace.json"
        if mb > 200 and (real_base.exists() or 100 in sizes):
            if not real_base.exists():
                main(["--sizes", "100", "--out", str(out)])
            start = time.perf_counter()
            copies = replicate(real_base, path, int(mb * 1e6 * 0.98))
            print(f"{path}: {path.stat().st_size / 1e6:.1f} MB = {copies} time-shifted copies of "
                  f"{real_base.name} ({time.perf_counter() - start:.1f} s)")
            continue
        if per_step is None:
            with tempfile.TemporaryDirectory() as tmp:
                probe = Path(tmp) / "probe.json"
                capture(4, probe)
                per_step = probe.stat().st_size / 4
        steps = max(1, round(mb * 1e6 / per_step))
        seconds = capture(steps, path)
        print(f"{path}: {path.stat().st_size / 1e6:.1f} MB, {steps} profiled steps, captured in {seconds:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
