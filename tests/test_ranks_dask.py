"""``tracemagic.load_ranks``: a job's ranks parsed and summarized on a Dask cluster.

The job: 32 ranks made from the 8 real DLRM ranks (NCCL, V100) of
``param_dlrm_kineto.tar.gz``, each copy given its own ``distributedInfo.rank``. A
``LocalCluster`` of two worker processes opens and summarizes them; the tables must equal
those of the same job loaded whole in this process (``tracemagic.load``), and the step
times those of the raw JSON.
"""

from __future__ import annotations

import gc
import json
import pickle
import sys
import tarfile
import weakref
from pathlib import Path
from typing import Any, Iterator

import distributed
from dask.config import set as dask_config
import pandas as pd
import pytest
from conftest import TRACES, rank_file

import tracemagic
import tracemagic.job
from tracemagic.errors import TraceError
from tracemagic.views.dashboard import Dashboard

ROOT = Path(__file__).resolve().parents[1]
RANKS = 32
TABLES = ("ranks_table", "steps", "collectives", "stragglers")


def _members() -> list[dict[str, Any]]:
    """The 8 DLRM rank traces as parsed JSON, by their recorded rank."""
    with tarfile.open(TRACES / "param_dlrm_kineto.tar.gz") as archive:
        docs = [json.load(archive.extractfile(m)) for m in archive if m.isfile()]  # type: ignore[arg-type]
    return sorted(docs, key=lambda doc: doc["distributedInfo"]["rank"])


def make_job(folder: Path, ranks: int) -> dict[int, dict[str, Any]]:
    """``ranks`` rank files in ``folder``: DLRM rank ``k % 8`` recorded as rank ``k``."""
    folder.mkdir()
    docs = _members()
    written = {}
    for rank in range(ranks):
        doc = json.loads(json.dumps(docs[rank % len(docs)]))
        doc["distributedInfo"]["rank"] = rank
        (folder / f"worker{rank}_step_12.pt.trace.json").write_text(json.dumps(doc))
        written[rank] = doc
    return written


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, dict[str, Any]]]:
    folder = tmp_path_factory.mktemp("job") / "ranks"
    return folder, make_job(folder, RANKS)


@pytest.fixture(scope="module")
def client() -> Iterator[Any]:
    cluster = distributed.LocalCluster(
        n_workers=2, processes=True, threads_per_worker=1, dashboard_address=None,
        env={"PYTHONPATH": str(ROOT)},  # the workers import this checkout's tracemagic
    )
    with cluster, distributed.Client(cluster) as client:
        yield client


def assert_same_tables(a: Any, b: Any) -> None:
    for name in TABLES:
        x, y = getattr(a, name)(), getattr(b, name)()
        pd.testing.assert_frame_equal(x, y, check_exact=True, obj=name)
        assert x.attrs == y.attrs, name


def test_the_cluster_does_the_work_and_the_tables_equal_loading_the_job_whole(
    job: tuple[Path, dict[int, dict[str, Any]]], client: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder, docs = job

    def not_here(*args: object) -> None:
        raise AssertionError("a rank was opened in the client process")

    with monkeypatch.context() as patched, distributed.get_task_stream(client) as stream:
        patched.setattr(tracemagic.job, "open_rank", not_here)  # this process only: the workers import their own
        ranks = tracemagic.load_ranks(folder, client, cache_dir=tmp_path / "cache")
    tasks = stream.data
    workers = set(client.scheduler_info()["workers"])
    opened = [t for t in tasks if str(t["key"]).startswith("tracemagic-open-")]
    summarized = [t for t in tasks if str(t["key"]).startswith("tracemagic-summary-")]
    assert len(opened) == len(summarized) == RANKS
    assert {t["worker"] for t in opened + summarized} == workers, "both workers opened ranks"
    assert ranks.rank_ids == list(range(RANKS)) and not ranks.failed

    whole = tracemagic.load(folder, use_cache=False)  # every rank parsed in this process
    assert_same_tables(whole, ranks)
    here = tracemagic.load_ranks(folder, cache_dir=tmp_path / "here")
    assert_same_tables(here, ranks)

    # step times from the raw JSON: each rank's one ProfilerStep#12
    steps = ranks.steps().set_index("rank")
    for rank, doc in docs.items():
        (step,) = [e for e in doc["traceEvents"] if str(e.get("name", "")).startswith("ProfilerStep#")]
        assert steps.loc[rank, "dur"] == pytest.approx(float(step["dur"]))
        assert steps.loc[rank, "step"] == int(step["name"].split("#")[1])
    # collectives: every NCCL kernel of a rank inside its step, matched over all 32 ranks
    found = ranks.collectives()
    for rank in (0, 13, 31):
        doc = docs[rank]
        (step,) = [e for e in doc["traceEvents"] if str(e.get("name", "")).startswith("ProfilerStep#")]
        nccl = [e for e in doc["traceEvents"] if e.get("cat") == "kernel" and "nccl" in e["name"].lower()]
        assert (found["rank"] == rank).sum() == len(nccl) > 0
    assert (found["ranks"] == RANKS).all()

    # what came back is small: the summaries are a sliver of the JSON
    json_bytes = sum(p.stat().st_size for p in folder.iterdir())
    assert len(pickle.dumps(ranks._summaries)) < json_bytes / 20

    # one rank's whole trace, from a worker: the same as opened here, on the job's clock
    remote, local = ranks.rank(13), here.rank(13)
    pd.testing.assert_frame_equal(remote.events, local.events)
    assert remote.meta["time_zero_us"] == local.meta["time_zero_us"]
    pd.testing.assert_frame_equal(remote.steps(), whole.steps().query("rank == 13").reset_index(drop=True))
    with pytest.raises(KeyError, match="rank 99"):
        ranks.rank(99)

    # the dashboard's Ranks tab from the summaries: what it shows for the job loaded whole
    job_tab, whole_tab = ranks.dashboard().section("ranks"), Dashboard(whole).section("ranks")
    assert ranks.dashboard().keys == ["ranks"]
    pd.testing.assert_frame_equal(job_tab.table, whole_tab.table)
    assert job_tab.facts == whole_tab.facts
    assert [f.to_plotly_json()["data"] for f in job_tab.figures] == [f.to_plotly_json()["data"] for f in whole_tab.figures]


def test_a_damaged_rank_fails_alone(job: tuple[Path, dict[int, dict[str, Any]]], client: Any, tmp_path: Path) -> None:
    source, _ = job
    folder = tmp_path / "ranks"
    folder.mkdir()
    for rank in range(8):
        name = f"worker{rank}_step_12.pt.trace.json"
        data = (source / name).read_bytes()
        (folder / name).write_bytes(data[: len(data) // 2] if rank == 5 else data)  # rank 5 cut in half
    damaged = str(folder / "worker5_step_12.pt.trace.json")
    for ranks in (tracemagic.load_ranks(folder, client, cache_dir=tmp_path / "c"),
                  tracemagic.load_ranks(folder, cache_dir=tmp_path / "h")):
        assert list(ranks.failed) == [damaged]
        assert isinstance(ranks.failed[damaged], TraceError) and "worker5" in str(ranks.failed[damaged])
        assert ranks.rank_ids == [0, 1, 2, 3, 4, 6, 7]
        assert ranks.ranks_table()["rank"].tolist() == [0, 1, 2, 3, 4, 6, 7]
        assert set(ranks.collectives()["ranks"]) == {7}
        assert any("worker5" in w for w in ranks.warnings)
    with pytest.raises(TraceError):
        tracemagic.load(folder, use_cache=False)  # loading the job whole stops at the damage


def test_a_tar_or_a_glob_of_ranks_in_this_process(job: tuple[Path, Any], tmp_path: Path) -> None:
    tar = TRACES / "param_dlrm_kineto.tar.gz"
    ranks, whole = tracemagic.load_ranks(tar), tracemagic.load(tar, use_cache=False)
    assert ranks.rank_ids == whole.rank_ids == list(range(8))
    assert_same_tables(whole, ranks)
    pd.testing.assert_frame_equal(ranks.rank(6).steps(), whole.steps().query("rank == 6").reset_index(drop=True))
    some = tracemagic.load_ranks(job[0] / "worker1?_*.json", cache_dir=tmp_path)  # ranks 10..19
    assert some.rank_ids == list(range(10, 20))
    assert some.files[12].endswith("worker12_step_12.pt.trace.json")


def test_a_second_file_of_a_rank_fails_alone(job: tuple[Path, Any], tmp_path: Path) -> None:
    folder = tmp_path / "ranks"
    folder.mkdir()
    for rank in (0, 1, 2):
        name = f"worker{rank}_step_12.pt.trace.json"
        (folder / name).write_bytes((job[0] / name).read_bytes())
    (folder / "worker9_again.pt.trace.json").write_bytes((job[0] / "worker1_step_12.pt.trace.json").read_bytes())
    ranks = tracemagic.load_ranks(folder, cache_dir=tmp_path / "c")  # distributedInfo says rank 1 twice
    assert ranks.rank_ids == [0, 1, 2]
    (again,) = ranks.failed.values()
    assert "rank 1 again" in str(again) and again.path == str(folder / "worker9_again.pt.trace.json")


def test_a_ranks_profiler_cycles_are_named_as_such_and_world_sizes_checked(tmp_path: Path) -> None:
    """``load`` stacks a ``--repeat`` capture's cycles of one rank; ``load_ranks`` reads one
    file a rank, and told the user to "load the ranks of one run together", which they had
    done. It now says what the files are and what reads them whole; and it warns of a rank
    beyond its world size and of world sizes that differ, as ``load`` does."""
    cycles = tmp_path / "cycles"
    cycles.mkdir()
    rank_file(cycles / "kineto_trace_0_cycle1.json", 0, [1, 2])
    rank_file(cycles / "kineto_trace_0_cycle2.json", 0, [4, 5], t0=2000.0)
    rank_file(cycles / "kineto_trace_1_cycle1.json", 1, [1, 2])
    ranks = tracemagic.load_ranks(cycles, use_cache=False)
    assert ranks.rank_ids == [0, 1]
    (again,) = ranks.failed.values()
    assert again.path == str(cycles / "kineto_trace_0_cycle2.json")
    assert "profiler cycles of one rank" in str(again) and "tracemagic.load()" in str(again)
    whole = tracemagic.load(cycles, use_cache=False)  # what the message says reads them whole
    assert whole.steps().query("rank == 0")["step"].tolist() == [1, 2, 4, 5]
    handler = tmp_path / "handler"  # tensorboard_trace_handler's cycles under torchrun: a rank in each
    handler.mkdir()
    rank_file(handler / "host_7.100.pt.trace.json", 0, [2, 3])
    rank_file(handler / "host_7.200.pt.trace.json", 0, [6, 7], t0=2000.0)
    (again,) = tracemagic.load_ranks(handler, use_cache=False).failed.values()
    assert "profiler cycles of one rank" in str(again) and "tracemagic.load()" in str(again)
    assert tracemagic.load(handler, use_cache=False).steps()["step"].tolist() == [2, 3, 6, 7]

    job = tmp_path / "job"
    job.mkdir()
    rank_file(job / "a.json", 0, [1], world=2)
    rank_file(job / "b.json", 5, [1], world=4)
    ranks = tracemagic.load_ranks(job, use_cache=False)
    assert ranks.rank_ids == [0, 5] and not ranks.failed
    assert f"{job / 'b.json'}: rank 5 is not below its world_size 4" in ranks.warnings
    (differ,) = [w for w in ranks.warnings if "world_size differs" in w]
    assert "2 in " in differ and "a.json" in differ and "4 in " in differ and "b.json" in differ
    assert sorted(ranks.warnings) == sorted(tracemagic.load(job, use_cache=False).warnings)


def test_client_without_dask_names_the_extra(job: tuple[Path, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "distributed", None)  # import distributed -> ImportError
    with pytest.raises(ImportError, match=r"pip install tracemagic\[dask\]"):
        tracemagic.load_ranks(job[0], client=object())


def test_cache_entries_removed_while_listed_are_skipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Workers share one cache folder: one lists it (to evict) while another removes an entry."""
    from tracemagic.trace import cache

    tracemagic.load(TRACES / "hta_triton_example.json.gz", cache_dir=tmp_path)
    (entry,) = cache.entries(tmp_path)
    real_stat = Path.stat

    def vanished(self: Path, *args: Any, **kwargs: Any) -> Any:
        if self.parent == tmp_path and self.name.startswith(entry.name):
            raise FileNotFoundError(self)
        return real_stat(self, *args, **kwargs)

    monkeypatch.setattr(Path, "stat", vanished)
    assert cache.entries(tmp_path) == []


def test_a_rank_whose_task_raises_anything_fails_alone(
    job: tuple[Path, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not only a TraceError: any exception of one rank's task (a bug, a worker's MemoryError)."""
    folder = tmp_path / "ranks"
    folder.mkdir()
    for rank in range(4):
        name = f"worker{rank}_step_12.pt.trace.json"
        (folder / name).write_bytes((job[0] / name).read_bytes())
    real = tracemagic.job.open_rank
    victim = str(folder / "worker2_step_12.pt.trace.json")

    def breaks_on_rank_2(rank: Any, options: Any) -> Any:
        if rank.name == victim:
            raise MemoryError("no room for rank 2")
        return real(rank, options)

    monkeypatch.setattr(tracemagic.job, "open_rank", breaks_on_rank_2)
    ranks = tracemagic.load_ranks(folder, cache_dir=tmp_path / "c")
    assert ranks.rank_ids == [0, 1, 3]
    (error,) = ranks.failed.values()
    assert list(ranks.failed) == [victim]
    assert isinstance(error, TraceError) and error.path == victim
    assert "MemoryError: no room for rank 2" in str(error) and isinstance(error.__cause__, MemoryError)
    assert ranks.ranks_table()["rank"].tolist() == [0, 1, 3]


def test_a_rank_whose_worker_dies_fails_alone(job: tuple[Path, Any], tmp_path: Path) -> None:
    """Rank 2's worker process exits while opening it (every time): KilledWorker fails rank 2 only."""
    folder = tmp_path / "ranks"
    folder.mkdir()
    for rank in range(6):
        name = f"worker{rank}_step_12.pt.trace.json"
        (folder / name).write_bytes((job[0] / name).read_bytes())

    class DiesOnRank2(distributed.WorkerPlugin):  # defined here: pickled by value to the workers
        def transition(self, key: Any, start: str, finish: str, **kwargs: Any) -> None:
            if finish == "executing" and str(key).startswith("tracemagic-open-2-"):
                import os

                os._exit(1)

    # one task at a time per worker, so that a death takes no other rank's task with it
    with dask_config({"distributed.scheduler.allowed-failures": 1, "distributed.scheduler.worker-saturation": 1.0}):
        cluster = distributed.LocalCluster(
            n_workers=2, processes=True, threads_per_worker=1, dashboard_address=None,
            env={"PYTHONPATH": str(ROOT)},
        )
        with cluster, distributed.Client(cluster) as client:
            client.register_plugin(DiesOnRank2())
            ranks = tracemagic.load_ranks(folder, client, cache_dir=tmp_path / "c")
    victim = str(folder / "worker2_step_12.pt.trace.json")
    assert list(ranks.failed) == [victim]
    error = ranks.failed[victim]
    assert isinstance(error, TraceError) and "KilledWorker" in str(error) and "worker2" in str(error)
    assert isinstance(error.__cause__, distributed.KilledWorker)
    assert ranks.rank_ids == [0, 1, 3, 4, 5]
    here = tracemagic.load_ranks(folder / "worker[!2]_*.json", cache_dir=tmp_path / "h")
    assert_same_tables(here, ranks)


@pytest.mark.parametrize("members", [8, 16])
def test_in_this_process_one_rank_is_held_at_a_time(
    members: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tar member has no cache to read it back from: it is parsed again, not kept, so the
    ranks alive at once stay one however many the archive holds."""
    docs = _members()
    archive = tmp_path / "job.tar"
    with tarfile.open(archive, "w") as tar:
        for rank in range(members):
            doc = json.loads(json.dumps(docs[rank % len(docs)]))
            doc["distributedInfo"]["rank"] = rank
            path = tmp_path / f"rank{rank}.json"
            path.write_text(json.dumps(doc))
            tar.add(path, arcname=path.name)
            path.unlink()
    real = tracemagic.job.open_rank
    alive: list[weakref.ref[Any]] = []
    most = [0]

    def held() -> int:
        return sum(ref() is not None for ref in alive)

    def counted(rank: Any, options: Any) -> Any:
        if held():
            gc.collect()  # only what a collection cannot free counts
        most[0] = max(most[0], held())  # ranks still held when the next one opens
        trace = real(rank, options)
        alive.append(weakref.ref(trace))
        return trace

    monkeypatch.setattr(tracemagic.job, "open_rank", counted)
    ranks = tracemagic.load_ranks(archive)
    assert ranks.rank_ids == list(range(members)) and not ranks.failed
    assert most[0] == 0, f"{most[0] + 1} ranks held at once"
    assert len(alive) == 2 * members  # round one and round two each open every rank once

    folder = tmp_path / "ranks"  # the same ranks as files, without the cache: no more held
    with tarfile.open(archive) as tar:
        tar.extractall(folder, filter="data")
    alive.clear()
    assert tracemagic.load_ranks(folder, use_cache=False).rank_ids == list(range(members))
    assert most[0] == 0 and len(alive) == 2 * members
