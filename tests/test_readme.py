"""The README stays true to the code: every option, API name and command it shows exists."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import tracemagic
from tracemagic.facade import Trace

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
#: the pages the README sends to for the details (moved out of it to keep it short)
DOCS = {p.name: p.read_text(encoding="utf-8") for p in sorted((ROOT / "docs").glob("*.md"))}
#: the README and the docs pages: every name and command they show must exist
ALL = "\n".join([README, *DOCS.values()])


def _magic_options(ip, magic: str) -> list[set[str]]:
    """The option strings of each option of a magic's magic_arguments parser."""
    function = ip.find_cell_magic(magic) or ip.find_line_magic(magic)
    parser = function.__func__.parser if hasattr(function, "__func__") else function.parser
    return [set(action.option_strings) for action in parser._actions if "--help" not in action.option_strings]


def test_every_magic_option_in_the_readme_exists(ip) -> None:
    documented = set(re.findall(r"%%chakra_trace[^\n`]*", README))
    used = {opt for line in documented for opt in re.findall(r"(--[a-z][a-z-]+)", line)}
    table = re.findall(r"^\| (`-.*?) \|", README, flags=re.M)
    used |= {opt for row in table for opt in re.findall(r"`(--?[a-z][a-z-]*)", row)}
    options = _magic_options(ip, "chakra_trace")
    known = set().union(*options)
    assert used and used <= known, sorted(used - known)
    # and the README lists every option the magic has (by its short or long name)
    missing = [sorted(names) for names in options if not names & used]
    assert not missing, missing


def test_every_trace_method_and_module_function_in_the_readme_exists() -> None:
    for method in set(re.findall(r"\btrace\.([a-z_]+)\(", ALL)):
        assert callable(getattr(Trace, method, None)), method
    for name in set(re.findall(r"\btracemagic\.([a-z_]+)\(", ALL)):
        assert callable(getattr(tracemagic, name, None)), name
    for dotted in set(re.findall(r"`?(tracemagic\.export\.[a-z_]+\.[a-z_]+)\(", ALL)):
        module, _, function = dotted.rpartition(".")
        assert callable(getattr(__import__(module, fromlist=[function]), function, None)), dotted


def test_every_cli_command_in_the_readme_exists() -> None:
    blocks = "\n".join([README, *(b for page in DOCS.values() for b in re.findall(r"```[a-z]*\n(.*?)```", page, flags=re.S))])
    commands = set(re.findall(r"^\s*(?:torchrun .*? -m )?tracemagic ([a-z]+)\b", blocks, flags=re.M))
    assert {"summary", "report", "diff"} <= set(re.findall(r"^tracemagic ([a-z]+)\b", README, flags=re.M))
    for command in commands:
        done = subprocess.run([sys.executable, "-m", "tracemagic", command, "--help"], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, (command, done.stderr)


def test_the_two_commands_are_make_targets() -> None:
    assert "make demo" in README and "make test" in README
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^demo:", makefile, flags=re.M) and re.search(r"^test:", makefile, flags=re.M)
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def test_the_readme_is_short_and_links_every_docs_page() -> None:
    """A newcomer reads the README in two minutes; the details are in docs/, each page linked
    from it, and every page it links exists."""
    assert len(README.splitlines()) <= 220, "keep the README short: move details to a docs/ page"
    linked = set(re.findall(r"\]\(docs/([\w.-]+\.md)\)", README))
    assert linked == set(DOCS), (sorted(linked), sorted(DOCS))
    for section in ("## The two commands", "## In a notebook", "## What each tab answers", "## Open a trace",
                    "## Notebooks and Binder"):
        assert section in README, section


def test_every_file_a_capture_writes_is_named_in_the_docs(tmp_path: Path) -> None:
    """Each file a capture directory holds (with ``--repeat``, ``--et`` and ``--gzip``) is
    named in the docs, the README's ``--gzip`` row and the option's help name every kind it
    compresses (the memory timelines were gzip'd too while they said only the Kineto trace
    was), and docs/capture.md lists every phase ``cap.iterations`` gives (``skip`` was missing)."""
    import torch

    from tracemagic.capture.config import OPTIONS

    model = torch.nn.Linear(8, 8)
    with tracemagic.capture(wait=0, warmup=1, active=1, repeat=2, skip_first=1, et=True, gzip=True,
                            cpu_only=True, out=tmp_path, name="files") as cap:
        for _ in cap.steps(range(6)):
            model(torch.randn(4, 8)).sum().backward()
    written = sorted(p.name for p in cap.result.dir.iterdir() if not p.name.startswith("."))
    patterns = {re.sub(r"_cycle\d+", "_cycle<k>", re.sub(r"_\d+(?=[._])", "_<rank>", name)) for name in written}
    assert "kineto_trace_<rank>_cycle<k>.json.gz" in patterns, written
    for pattern in patterns:
        assert pattern.removesuffix(".gz") in ALL, pattern
    gzip_row = next(line for line in README.splitlines() if line.startswith("| `--gzip`"))
    gzip_help = next(spec["help"] for flags, spec in OPTIONS if flags == ("--gzip",))
    for pattern in patterns:
        kind = pattern.split("_<rank>")[0]
        assert pattern.endswith(".gz") == (f"{kind}_<rank>.json.gz" in gzip_row), (pattern, gzip_row)
        assert pattern.endswith(".gz") == (f"{kind}_<rank>.json.gz" in gzip_help), (pattern, gzip_help)
    phases = re.search(r"its phase ((?:`\w+`/?)+)", DOCS["capture.md"])
    assert phases, "docs/capture.md lists the iterations' phases"
    documented = set(re.findall(r"`(\w+)`", phases.group(1)))
    assert set(cap.result.iterations["phase"]) <= documented, (set(cap.result.iterations["phase"]), documented)


def test_the_tables_not_in_microseconds_are_named() -> None:
    """The README says every table's times are in µs: a table with times in another unit
    (``iterations()``' ``wall_ms``) is named there as the exception."""
    from tracemagic.analysis.schema import TABLES

    sentence = README[README.index("Every table is a pandas DataFrame") :].split("\n\n")[0]
    for table in TABLES.values():
        if table.method and any(re.search(r"(?<!_per)_(ms|s|ns)$", column) for column in table.columns):
            assert f"`{table.call}`" in sentence, (table.name, sentence)


def test_every_environment_variable_the_package_reads_is_documented() -> None:
    """Each ``TRACEMAGIC_*`` variable the package reads is named in the README or the docs
    (``TRACEMAGIC_TRACE_DIR`` and ``TRACEMAGIC_DEBUG`` were not)."""
    read = {name for path in (ROOT / "tracemagic").rglob("*.py")
            for name in re.findall(r"[\"'](TRACEMAGIC_[A-Z_]+)[\"']", path.read_text(encoding="utf-8"))}
    assert {"TRACEMAGIC_CACHE_DIR", "TRACEMAGIC_LOG"} <= read, read
    assert not {name for name in read if name not in ALL}, sorted(name for name in read if name not in ALL)


def test_the_script_capture_takes_the_magic_options_the_docs_say(ip) -> None:
    """docs/ranks.md says which of the magic's options ``tracemagic.capture`` does not take
    (it said "same options as the magic"; ``stop=True`` is a CaptureError): those are refused,
    every other capture option of the magic is taken as a keyword."""
    from tracemagic.errors import CaptureError

    said = re.search(r"tracemagic\.capture\(.*?# the magic's capture options, as keywords\s*#\s*\(not ([^)]*)\)",
                     DOCS["ranks.md"], flags=re.S)
    assert said, "docs/ranks.md names the magic options tracemagic.capture does not take"
    refused = set(re.findall(r"--[a-z-]+", said.group(1)))
    shown = {"--output", "--var", "--quiet"}  # how the magic hands the capture to the notebook
    for names in _magic_options(ip, "chakra_trace"):
        option = max(names, key=len)
        if option in shown:
            continue
        keyword = option.lstrip("-").replace("-", "_")
        value = {"--loop": 2, "--report": "r.html", "--vs": "last", "--out": "traces", "--name": "x",
                 "--slow": 2.0}.get(option, 1 if option in ("--wait", "--warmup", "--active", "--repeat",
                                                             "--skip-first", "--skip-first-wait", "--slow-max")
                                     else True)
        if option in refused:
            with pytest.raises(CaptureError, match="unknown option"):
                tracemagic.capture(**{keyword: value})
        else:
            tracemagic.capture(**{keyword: value})
