"""air_magic.data's dataset and DataLoader on local files: order, splits, resume on another layout, state.

Ranks are simulated in this process (RANK / WORLD_SIZE set before each
iteration, one DataLoader per rank, advanced in lockstep) where that is the
point; the resume across layouts also runs for real on air_magic workers.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import cloudpickle
import pytest

from air_magic import distributed
from air_magic.data import DataLoader, StreamingFileDataset, UCVolumeDataset
from air_magic.data.order import Plan, epoch_order

#: Real kernels and processes: seconds each.
pytestmark = pytest.mark.slow

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers need not import the test module

MANY_WORKERS = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


def make_files(root: Path, n: int, size: int = 16, sub: str = "") -> list[str]:
    """n small files named f000.bin.. under root/sub, each holding its own name."""
    (root / sub).mkdir(parents=True, exist_ok=True)
    names = []
    for i in range(n):
        name = f"{sub}/f{i:03d}.bin" if sub else f"f{i:03d}.bin"
        (root / name).write_bytes(name.encode().ljust(size, b"."))
        names.append(name)
    return names


def names(batch: list[str], root: Path) -> list[str]:
    return [os.path.relpath(p, root) for p in batch]


def set_rank(monkeypatch: pytest.MonkeyPatch, rank: int, world: int) -> None:
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", str(world))


def order_names(root: Path, n: int, seed: int, epoch: int) -> list[str]:
    files = sorted(p.name for p in root.iterdir())
    return [files[i] for i in epoch_order(n, seed, epoch, True)]


@pytest.fixture
def data(tmp_path: Path) -> Path:
    root = tmp_path / "data"
    make_files(root, 24)
    return root


def test_local_files_are_yielded_in_place_and_left_alone(data: Path):
    """Local sources are read where they are: the yielded paths are the source files, unchanged and not copied."""
    before = {p.name: p.read_bytes() for p in data.iterdir()}
    ds = StreamingFileDataset(data, shuffle=False)
    got = list(ds)
    assert got == [str(data / n) for n in sorted(before)]
    assert {p.name: p.read_bytes() for p in data.iterdir()} == before


def test_listing_is_sorted_recursive_and_glob_filtered(tmp_path: Path):
    """The listing is sorted; `recursive` adds subdirectories and `pattern` filters relative names."""
    make_files(tmp_path, 3)
    make_files(tmp_path, 2, sub="b")
    (tmp_path / "b" / "notes.txt").write_text("x")
    assert [Path(p).name for p in StreamingFileDataset(tmp_path, shuffle=False)] == ["f000.bin", "f001.bin", "f002.bin"]
    deep = StreamingFileDataset(tmp_path, recursive=True, pattern="*.bin", shuffle=False)
    assert deep.listing.names == ("b/f000.bin", "b/f001.bin", "f000.bin", "f001.bin", "f002.bin")
    only_b = StreamingFileDataset(f"file://{tmp_path}", recursive=True, pattern="b/*", shuffle=False)
    assert only_b.listing.names == ("b/f000.bin", "b/f001.bin", "b/notes.txt")
    with pytest.raises(FileNotFoundError, match="match"):
        StreamingFileDataset(tmp_path, pattern="*.png")


def test_transform_result_is_yielded(data: Path):
    """With `transform`, what it returns for each local path is what the dataset yields."""
    got = list(StreamingFileDataset(data, transform=lambda p: Path(p).read_bytes()[:8], shuffle=False))
    assert got[:2] == [b"f000.bin", b"f001.bin"]


def test_seeded_shuffle_is_one_order_per_epoch(data: Path):
    """The same seed gives the same order, each epoch a different one, and every file once per epoch."""
    a, b = StreamingFileDataset(data, seed=3), StreamingFileDataset(data, seed=3)
    first = list(a)
    assert first == list(b)
    assert sorted(first) == sorted(str(p) for p in data.iterdir())
    a.set_epoch(1)
    second = list(a)
    assert second != first and sorted(second) == sorted(first)
    assert list(StreamingFileDataset(data, seed=4)) != first


@pytest.mark.parametrize(
    ("split", "counts", "distinct"), [("pad", [4, 4, 4], 10), ("drop", [3, 3, 3], 9), ("uneven", [4, 3, 3], 10)]
)
def test_uneven_split_policies(split: str, counts: list[int], distinct: int):
    """10 files on 3 ranks: pad repeats the first files so ranks match, drop skips the tail, uneven reads each once."""
    plans = [Plan(10, 0, 0, r, 3, split, seed=1) for r in range(3)]
    files = [p.rank_files() for p in plans]
    assert [len(f) for f in files] == counts
    every = [i for f in files for i in f]
    assert len(set(every)) == distinct
    if split == "uneven":
        assert sorted(every) == list(range(10))


@MANY_WORKERS
def test_global_order_is_the_same_whatever_the_ranks_and_workers(data: Path, monkeypatch: pytest.MonkeyPatch):
    """Batch k of every layout (1x0, 2x2, 3x3 ranks x workers) holds the next files of one global order."""
    expected = order_names(data, 24, 7, 0)
    for world, workers in [(1, 0), (2, 2), (3, 3)]:
        loaders = []
        for rank in range(world):
            set_rank(monkeypatch, rank, world)
            loaders.append(iter(DataLoader(StreamingFileDataset(data, seed=7), batch_size=2, num_workers=workers)))
        for step in range(24 // (2 * world)):
            got = set()
            for loader in loaders:
                got |= set(names(next(loader), data))
            assert got == set(expected[step * 2 * world : (step + 1) * 2 * world]), (world, workers, step)
        for loader in loaders:
            assert next(loader, None) is None


@MANY_WORKERS
def test_ranks_may_use_different_worker_counts_and_start_methods(data: Path, monkeypatch: pytest.MonkeyPatch):
    """Rank 0 with no workers, rank 1 with 1 spawned and rank 2 with 3 forked workers read the epoch exactly once."""
    seen: list[str] = []
    kinds = [
        {"num_workers": 0},
        {"num_workers": 1, "multiprocessing_context": "spawn"},
        {"num_workers": 3, "multiprocessing_context": "fork"},
    ]
    for rank, kw in enumerate(kinds):
        set_rank(monkeypatch, rank, 3)
        for batch in DataLoader(StreamingFileDataset(data, seed=1), batch_size=2, **kw):
            seen += names(batch, data)
    assert sorted(seen) == sorted(p.name for p in data.iterdir())


def test_state_counts_delivered_batches_not_prefetched_ones(data: Path, monkeypatch: pytest.MonkeyPatch):
    """With prefetch_factor=8, saving after k batches and resuming starts at batch k+1."""
    set_rank(monkeypatch, 0, 1)
    reference = [names(b, data) for b in DataLoader(StreamingFileDataset(data, seed=2), batch_size=3, num_workers=2)]
    loader = DataLoader(StreamingFileDataset(data, seed=2), batch_size=3, num_workers=2, prefetch_factor=8)
    it = iter(loader)
    taken = [names(next(it), data) for _ in range(3)]
    state = loader.state_dict()
    del it
    assert taken == reference[:3]
    assert state["epoch"] == 0 and state["files_done"] == 9
    resumed = DataLoader(StreamingFileDataset(data, seed=2), batch_size=3, num_workers=2)
    resumed.load_state_dict(state)
    assert [names(b, data) for b in resumed] == reference[3:]
    assert resumed.state_dict()["epoch"] == 1 and resumed.state_dict()["files_done"] == 0


@MANY_WORKERS
def test_resume_from_2_ranks_x_2_workers_on_1_rank_x_3_workers(data: Path, monkeypatch: pytest.MonkeyPatch):
    """Part of an epoch on 2 ranks x 2 workers, state from rank 0 only, the rest on 1 rank x 3 workers: every file
    once."""
    loaders, iters = [], []
    for rank in range(2):
        set_rank(monkeypatch, rank, 2)
        loaders.append(DataLoader(StreamingFileDataset(data, seed=5), batch_size=2, num_workers=2, prefetch_factor=8))
        iters.append(iter(loaders[-1]))
    before: list[str] = []
    for _ in range(3):
        for it in iters:
            before += names(next(it), data)
    state = loaders[0].state_dict()
    del iters
    set_rank(monkeypatch, 0, 1)
    loader = DataLoader(UCVolumeDataset(data, seed=5), batch_size=2, num_workers=3)
    loader.load_state_dict(state)
    after = [n for b in loader for n in names(b, data)]
    assert sorted(before + after) == sorted(p.name for p in data.iterdir())
    assert after == order_names(data, 24, 5, 0)[12:]


def test_epochs_advance_automatically_and_set_epoch_keeps_a_resumed_position(
    data: Path, monkeypatch: pytest.MonkeyPatch
):
    """A finished iteration moves to the next epoch; set_epoch(current) after a resume keeps the position."""
    set_rank(monkeypatch, 0, 1)
    loader = DataLoader(StreamingFileDataset(data, seed=1), batch_size=4)
    first = [n for b in loader for n in names(b, data)]
    second = [n for b in loader for n in names(b, data)]
    assert first == order_names(data, 24, 1, 0) and second == order_names(data, 24, 1, 1)
    assert loader.epoch == 2
    loader.load_state_dict({**loader.state_dict(), "epoch": 1, "files_done": 8})
    loader.set_epoch(1)
    assert [n for b in loader for n in names(b, data)] == order_names(data, 24, 1, 1)[8:]
    loader.set_epoch(0)
    assert [n for b in loader for n in names(b, data)] == first


def test_changed_listing_is_a_clear_error(data: Path, monkeypatch: pytest.MonkeyPatch):
    """A state saved before a file was added refuses to load, saying the files changed."""
    set_rank(monkeypatch, 0, 1)
    loader = DataLoader(StreamingFileDataset(data), batch_size=2)
    state = loader.state_dict()
    (data / "new.bin").write_bytes(b"new")
    with pytest.raises(ValueError, match=r"changed since this state was saved \(24 files then, 25 now"):
        DataLoader(StreamingFileDataset(data), batch_size=2).load_state_dict(state)
    with pytest.raises(ValueError, match="seed"):
        DataLoader(StreamingFileDataset(data, seed=9), batch_size=2).load_state_dict(
            {**state, "num_files": 25, "fingerprint": StreamingFileDataset(data).listing.fingerprint}
        )


def test_loader_refuses_persistent_workers_and_other_datasets(data: Path):
    """persistent_workers=True and a dataset of another kind are refused with what to do instead."""
    with pytest.raises(ValueError, match="persistent_workers"):
        DataLoader(StreamingFileDataset(data), num_workers=1, persistent_workers=True)
    with pytest.raises(TypeError, match="torch.utils.data.DataLoader"):
        DataLoader([1, 2, 3])  # type: ignore[arg-type]


def _read_part(root: str, resume: dict | None, batches: int | None, workers: int) -> dict:
    """On each rank: read `batches` batches (None = the rest of the epoch) after `resume`; return files and state."""
    import os

    import torch.distributed as dist

    from air_magic.data import DataLoader, StreamingFileDataset

    dist.init_process_group("gloo")
    loader = DataLoader(StreamingFileDataset(root, seed=11), batch_size=2, num_workers=workers, prefetch_factor=8)
    if resume is not None:
        loader.load_state_dict(resume)
    seen = []
    for i, batch in enumerate(loader):
        seen += [os.path.basename(p) for p in batch]
        if batches is not None and i + 1 == batches:
            break
    dist.barrier()
    state = loader.state_dict()
    dist.destroy_process_group()
    return {"seen": seen, "state": state}


def test_resume_on_real_ranks_from_2x2_to_1x3(data: Path, here_runs: Path):
    """On air_magic workers: 3 batches on 2 ranks x 2 workers, then the rest on 1 rank x 3 workers, every file once."""
    first = distributed(2, accelerator_type="CPU", mlflow=False)(_read_part).distributed(str(data), None, 3, 2)
    state = first[0]["state"]
    assert state["files_done"] == 12 and [r["state"] for r in first] == [state, state]
    rest = distributed(1, accelerator_type="CPU", mlflow=False)(_read_part).distributed(str(data), state, None, 3)
    before = first[0]["seen"] + first[1]["seen"]
    assert sorted(before + rest[0]["seen"]) == sorted(p.name for p in data.iterdir())
    assert rest[0]["seen"] == order_names(data, 24, 11, 0)[12:]


def test_public_names_and_uc_aliases():
    """air_magic.data exports its classes, and the UCVolume names are the same classes (same arguments)."""
    from air_magic import data

    assert sorted(data.__all__) == sorted(
        [
            "StreamingFileDataset",
            "DataLoader",
            "CheckpointWriter",
            "CheckpointReader",
            "UCVolumeDataset",
            "UCVolumeWriter",
            "UCVolumeReader",
        ]
    )
    assert data.UCVolumeDataset is data.StreamingFileDataset
    assert data.UCVolumeWriter is data.CheckpointWriter and data.UCVolumeReader is data.CheckpointReader
