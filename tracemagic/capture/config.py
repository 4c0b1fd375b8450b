"""The options of one capture, validated once, before any user code runs."""

from __future__ import annotations

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
        if self.loop_line is not None and (
            not isinstance(self.loop_line, int) or self.loop_line < 1
        ):
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
        return (
            self.memory_timeline and self.record_shapes and self.profile_memory and self.with_stack
        )

    @property
    def steps_before_first_active(self) -> int:
        """How many steps the schedule skips before it records the first one."""
        wait = 0 if self.skip_first_wait else self.wait
        return self.skip_first + wait + self.warmup

    def as_dict(self) -> dict[str, Any]:
        """The options as plain JSON values, for the manifest."""
        out = dataclasses.asdict(self)
        out["out"] = str(self.out)
        return out
