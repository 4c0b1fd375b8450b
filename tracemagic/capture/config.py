"""The options of one capture, validated once, before any user code runs.

``OPTIONS`` spells the capture options once, as argparse arguments, for both the
``%%chakra_trace`` magic and ``python -m tracemagic run``; ``config_from_options`` turns
them (or the keywords of ``tracemagic.capture(...)``) into a validated ``CaptureConfig``.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tracemagic.errors import CaptureError

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")


@dataclass(frozen=True)
class CaptureConfig:
    """What to record and where to write it.

    The schedule fields mean exactly what they mean in ``torch.profiler.schedule``;
    the flags are those of ``torch.profiler.profile``. ``loop_line`` counts the
    ``%%chakra_trace`` line as line 1, as the notebook shows it.
    """

    wait: int = 1
    warmup: int = 1
    active: int = 3
    repeat: int = 1
    skip_first: int = 0
    skip_first_wait: int = 0
    cpu_only: bool = False
    record_shapes: bool = True
    profile_memory: bool = True
    with_stack: bool = True
    with_flops: bool = False
    memory_timeline: bool = True
    et: bool = False
    out: Path = Path("traces")
    name: str = "capture"
    gzip: bool = False
    tb_names: bool = False
    loop_line: int | None = None
    handle: str = "chakra"
    stop: bool = False
    lines: bool = True
    slow: float | None = None
    slow_max: int = 3

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ``CaptureError`` naming the first bad option."""
        for option, value, low in (
            ("--wait", self.wait, 0),
            ("--warmup", self.warmup, 0),
            ("--active", self.active, 1),
            ("--repeat", self.repeat, 0),
            ("--skip-first", self.skip_first, 0),
            ("--skip-first-wait", self.skip_first_wait, 0),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise CaptureError(f"{option} must be an integer >= {low}, got {value!r}.")
        if self.slow is not None and (
            isinstance(self.slow, bool) or not isinstance(self.slow, (int, float)) or not self.slow > 1
        ):
            raise CaptureError(f"--slow must be a factor above 1 (e.g. 1.5), got {self.slow!r}.")
        if not isinstance(self.slow_max, int) or isinstance(self.slow_max, bool) or self.slow_max < 1:
            raise CaptureError(f"--slow-max must be an integer >= 1, got {self.slow_max!r}.")
        if self.loop_line is not None and (not isinstance(self.loop_line, int) or self.loop_line < 1):
            raise CaptureError(f"--loop must be a line number >= 1, got {self.loop_line!r}.")
        if not _NAME_RE.match(self.name):
            raise CaptureError(
                f"--name {self.name!r} is not a plain file name: use letters, digits "
                "and '_.+-' (it becomes the directory NAME-<timestamp>)."
            )
        if not str(self.out).strip():
            raise CaptureError("--out must name a directory, got an empty string.")
        if not self.handle.isidentifier():
            raise CaptureError(f"the session handle name {self.handle!r} is not an identifier.")

    @property
    def records_memory_categories(self) -> bool:
        """Whether torch can classify allocations (it needs shapes, memory and stacks)."""
        return self.memory_timeline and self.record_shapes and self.profile_memory and self.with_stack

    @property
    def steps_before_first_active(self) -> int:
        """How many steps the schedule skips before it records the first one."""
        wait = 0 if self.skip_first_wait else self.wait
        return self.skip_first + wait + self.warmup

    def as_dict(self) -> dict[str, Any]:
        """The options as plain JSON values, for the manifest."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}  # scalars: no deep copy
        out["out"] = str(self.out)
        return out


#: The capture options of ``%%chakra_trace`` and ``python -m tracemagic run``, in help
#: order: ``(flags, add_argument keywords)``. Each one's argparse ``dest`` is a keyword of
#: ``config_from_options``.
OPTIONS: tuple[tuple[tuple[str, ...], dict[str, Any]], ...] = (
    (
        ("--wait",),
        dict(type=int, default=1, metavar="N", help="schedule: steps skipped per cycle before warmup (default 1)"),
    ),
    (
        ("--warmup",),
        dict(
            type=int,
            default=1,
            metavar="N",
            help="schedule: warmup steps, traced but discarded (default 1; with 0 the profiler's "
            "start-up can land in the first recorded step, as the capture notes)",
        ),
    ),
    (
        ("--active",),
        dict(type=int, default=3, metavar="N", help="schedule: steps recorded per cycle, at least 1 (default 3)"),
    ),
    (
        ("--repeat",),
        dict(
            type=int,
            default=1,
            metavar="N",
            help="schedule: cycles to record, 0 = until the steps end; one trace per cycle (default 1)",
        ),
    ),
    (
        ("--skip-first",),
        dict(type=int, default=0, metavar="N", help="schedule: steps skipped once, before the first cycle (default 0)"),
    ),
    (
        ("--skip-first-wait",),
        dict(
            type=int,
            default=0,
            metavar="N",
            help="schedule: if not 0, the first cycle skips its wait steps (default 0)",
        ),
    ),
    (("--cpu-only",), dict(action="store_true", help="record CPU activity only, even when CUDA is available")),
    (("--no-shapes",), dict(action="store_true", help="do not record input shapes (record_shapes=False)")),
    (("--no-memory",), dict(action="store_true", help="do not record allocations (profile_memory=False)")),
    (
        ("--no-stack",),
        dict(action="store_true", help="no Python stacks (with_stack=False): no nn.Module events, no layer names"),
    ),
    (("--with-flops",), dict(action="store_true", help="estimate FLOPs of matmul/conv ops (with_flops=True)")),
    (
        ("--no-memory-timeline",),
        dict(action="store_true", help="skip memory_timeline_<rank>.json (allocation categories)"),
    ),
    (
        ("--et",),
        dict(
            action="store_true",
            help="also write the Execution Trace torch_et_<rank>.json over the same steps "
            "(for Chakra; one per cycle with --repeat)",
        ),
    ),
    (
        ("--out",),
        dict(default="traces", metavar="DIR", help="directory the capture directory is created in (default ./traces)"),
    ),
    (
        ("--name",),
        dict(default="capture", metavar="NAME", help="capture directory name: DIR/NAME-<timestamp> (default capture)"),
    ),
    (
        ("--gzip",),
        dict(
            action="store_true",
            help="write kineto_trace_<rank>.json.gz and memory_timeline_<rank>.json.gz (the ET stays plain JSON)",
        ),
    ),
    (
        ("--slow",),
        dict(
            type=float,
            default=None,
            metavar="FACTOR",
            help="watch the iterations after the schedule: one slower than FACTOR x the "
            "running median (after a warm-up) gets the NEXT iteration recorded (the slow "
            "one itself is over when it is seen) as kineto_trace_<rank>_slow<k>.json",
        ),
    ),
    (
        ("--slow-max",),
        dict(type=int, default=3, metavar="K", help="with --slow: the most slow-step traces to record (default 3)"),
    ),
)

#: ``CaptureConfig`` fields that make no sense outside a notebook cell.
_CELL_ONLY = {"loop_line", "handle", "stop", "lines"}
#: The option spellings that negate a field (``no_shapes=True`` = ``record_shapes=False``).
_NEGATED = {
    "no_shapes": "record_shapes",
    "no_memory": "profile_memory",
    "no_stack": "with_stack",
    "no_memory_timeline": "memory_timeline",
    "no_lines": "lines",
}


def option_dests() -> list[str]:
    """The argparse ``dest`` of each of ``OPTIONS`` (``skip_first``, ``no_shapes``, ...)."""
    return [flags[0].lstrip("-").replace("-", "_") for flags, _ in OPTIONS]


def config_from_options(**options: Any) -> CaptureConfig:
    """The validated ``CaptureConfig`` for the capture options given as keywords.

    Takes the field names (``record_shapes=False``) and the option spellings
    (``no_shapes=True``) alike; ``out`` may be a string (``~`` is expanded).

    Raises:
        CaptureError: an unknown option (naming the valid ones) or an invalid value.
    """
    fields = {f.name for f in dataclasses.fields(CaptureConfig)} - _CELL_ONLY
    values: dict[str, Any] = {}
    for key, value in options.items():
        if key in _NEGATED:
            values[_NEGATED[key]] = not value
        elif key in fields:
            values[key] = value
        else:
            known = ", ".join(sorted(fields | set(_NEGATED)))
            raise CaptureError(f"tracemagic.capture: unknown option {key!r}; the options are: {known}.")
    if "out" in values:
        values["out"] = Path(values["out"]).expanduser()
    return CaptureConfig(**values)


def config_from_args(args: argparse.Namespace, **fields: Any) -> CaptureConfig:
    """The validated ``CaptureConfig`` for ``OPTIONS`` parsed by argparse.

    Args:
        args: the parsed arguments (attributes other than ``OPTIONS``' are ignored).
        **fields: ``CaptureConfig`` fields set by options of the caller's own
            (the magic's ``loop_line``, ``tb_names``).

    Raises:
        CaptureError: an invalid value, naming the option.
    """
    config = config_from_options(**{dest: getattr(args, dest) for dest in option_dests()})
    return dataclasses.replace(config, **fields) if fields else config
