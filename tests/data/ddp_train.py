"""A small DDP training job (gloo, CPU) captured with ``tracemagic.capture``.

Run it with ``torchrun --nproc_per_node=2 tests/data/ddp_train.py --out DIR``. Options
``--plain`` runs without ``tracemagic.capture`` (for ``-m tracemagic run -- ddp_train.py``).
Options make one rank slow (``--slow-rank 1 --slow-ms 50``: it sleeps in each step), raise
(``--fail-rank R --fail-step K``), die without cleanup (``--crash-rank R``, ``os._exit``), or
die in the last iteration, after its trace is written and before its manifest (``--kill-rank R``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import tracemagic


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="traces")
    parser.add_argument("--plain", action="store_true")
    parser.add_argument("--name", default="ddp")
    parser.add_argument("--iterations", type=int, default=6)
    parser.add_argument("--slow-rank", type=int, default=-1)
    parser.add_argument("--slow-ms", type=float, default=50.0)
    parser.add_argument("--fail-rank", type=int, default=-1)
    parser.add_argument("--crash-rank", type=int, default=-1)
    parser.add_argument("--kill-rank", type=int, default=-1)
    parser.add_argument("--fail-step", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=60.0)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = [(torch.randn(32, 64), torch.randint(0, 10, (32,))) for _ in range(args.iterations)]

    cap = tracemagic.capture(
        wait=1, warmup=1, active=3, out=args.out, name=args.name,
        no_memory_timeline=True, timeout=args.timeout,
    )
    try:
        with contextlib.nullcontext() if args.plain else cap:
            for i, (x, y) in enumerate(batches if args.plain else cap.steps(batches)):
                if rank == args.crash_rank and i == args.fail_step:
                    os._exit(3)  # dies like a killed process: no files, no manifest
                if rank == args.kill_rank and i == args.iterations - 1:
                    os._exit(3)  # the schedule's one cycle ended a step ago: its trace is on disk
                if rank == args.fail_rank and i == args.fail_step:
                    raise RuntimeError(f"rank {rank} fails in iteration {i}")
                if rank == args.slow_rank:
                    time.sleep(args.slow_ms / 1e3)
                loss = torch.nn.functional.cross_entropy(model(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad()
        if not args.plain:
            print(f"rank {rank}: {cap.result!r}", flush=True)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
