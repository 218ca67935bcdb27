"""air_magic.data's checkpoint writer and reader with torch.distributed.checkpoint, locally and on S3.

DDP and FSDP2 models with their optimizers are saved on 2 air_magic CPU ranks
and loaded back on 2, 1 and 4; the order of what reaches S3 and what an
interrupted save leaves are checked in this process with a one-rank group.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any, ClassVar

import cloudpickle
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from s3_server import S3
from torch.distributed.checkpoint import CheckpointException

from air_magic import distributed
from air_magic.data import CheckpointReader, CheckpointWriter
from air_magic.data.checkpoint import _StagedFileSystem

#: Real kernels and processes: seconds each.
pytestmark = pytest.mark.slow

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers need not import the test module


def _checkpoint_job(role: str, urls: dict[str, str]) -> dict[str, Any]:
    """On each rank: train and save DDP and FSDP2 (role "save"), or load them from every URL; rank 0 returns full
    states."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch import nn
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    from air_magic.data import CheckpointReader, CheckpointWriter, UCVolumeReader, UCVolumeWriter

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)

    def build(kind: str) -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(100 + rank)  # different on every rank: only a load makes them agree
        net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        if kind == "fsdp":
            fully_shard(net[0])
            fully_shard(net[2])
            model: nn.Module = fully_shard(net)
        else:
            torch.manual_seed(0)
            model = DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)))
        return model, torch.optim.AdamW(model.parameters(), lr=0.05)

    out: dict[str, Any] = {}
    for kind in ("ddp", "fsdp"):
        if role == "save":
            model, opt = build(kind)
            g = torch.Generator().manual_seed(rank)
            for _ in range(3):
                loss = model(torch.randn(4, 8, generator=g)).square().mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
            msd, osd = get_state_dict(model, opt)
            for where, url in urls.items():
                writer = (UCVolumeWriter if where == "s3" else CheckpointWriter)(f"{url}/{kind}")
                state = {"model": msd, "optim": osd}
                if where == "s3-async":
                    dcp.async_save(state, storage_writer=writer).result()
                else:
                    dcp.save(state, storage_writer=writer)
            out[kind] = get_state_dict(model, opt, options=full)
        else:
            for where, url in urls.items():
                model, opt = build(kind)
                msd, osd = get_state_dict(model, opt)
                reader = (UCVolumeReader if where == "s3" else CheckpointReader)(f"{url}/{kind}")
                dcp.load({"model": msd, "optim": osd}, storage_reader=reader)
                set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
                out[f"{kind} from {where}"] = get_state_dict(model, opt, options=full)
    dist.destroy_process_group()
    return out if rank == 0 else {}


def assert_same(a: Any, b: Any, where: str) -> None:
    """Nested dicts/lists of tensors and numbers are equal, exactly."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{where}: keys {sorted(a)} vs {sorted(b)}"
        for key in a:
            assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


@pytest.mark.timeout(600)
@pytest.mark.filterwarnings("ignore:4 CPU workers:ResourceWarning")
def test_ddp_and_fsdp2_saved_on_2_ranks_load_identically_on_2_1_and_4(s3: S3, here_runs: Path, tmp_path: Path):
    """Model and optimizer of DDP and FSDP2, saved on 2 ranks locally, on S3 and with async_save, load back identical on
    2, 1 and 4 ranks."""
    bucket = s3.bucket()
    urls = {"local": str(tmp_path / "ckpt"), "s3": f"s3://{bucket}/ckpt", "s3-async": f"s3://{bucket}/async"}
    saved = distributed(2, accelerator_type="CPU", mlflow=False)(_checkpoint_job).distributed("save", urls)[0]
    for kind in ("ddp", "fsdp"):
        model, optim = saved[kind]
        assert len(model) == 4 and len(optim["state"]) == 4, f"{kind}: expected 4 parameters with Adam state"
    fs = s3.fs()
    for name in ("ckpt/ddp", "ckpt/fsdp", "async/ddp", "async/fsdp"):
        assert sorted(p.rsplit("/", 1)[1] for p in fs.ls(f"{bucket}/{name}")) == [
            ".metadata",
            "__0_0.distcp",
            "__1_0.distcp",
        ]
    for world in (2, 1, 4):
        loaded = distributed(world, accelerator_type="CPU", mlflow=False)(_checkpoint_job).distributed("load", urls)[0]
        assert sorted(loaded) == sorted(f"{k} from {w}" for k in ("ddp", "fsdp") for w in urls)
        for key, state in loaded.items():
            assert_same(state, saved[key.split()[0]], f"{key} on {world} ranks")
    assert not list(Path(tmp_path).glob("**/*.tmp"))


@pytest.fixture
def one_rank():
    """A one-process gloo group in this process, for saves that need no other rank."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class Recorder(_StagedFileSystem):
    """The staged file system, recording uploads and renames, and failing the upload of names in `fail`."""

    events: ClassVar[list[str]] = []
    fail: ClassVar[set[str]] = set()

    def init_path(self, path: Any, **kwargs: Any) -> str:
        url = super().init_path(path, **kwargs)
        real_put, real_mv = self.fs.put_file, self.fs.mv

        def put_file(local: str, remote: str, **kw: Any) -> None:
            name = remote.rsplit("/", 1)[-1]
            if name in self.fail:
                raise ConnectionError("the network went away")
            real_put(local, remote, **kw)
            Recorder.events.append(f"put {name}")

        def mv(src: str, dst: str, **kw: Any) -> None:
            real_mv(src, dst, **kw)
            Recorder.events.append(f"mv {src.rsplit('/', 1)[-1]} -> {dst.rsplit('/', 1)[-1]}")

        self.fs = _Proxy(self.fs, put_file=put_file, mv=mv)
        return url


class _Proxy:
    def __init__(self, inner: Any, **overrides: Any) -> None:
        self._inner, self._overrides = inner, overrides

    def __getattr__(self, name: str) -> Any:
        return self._overrides.get(name) or getattr(self._inner, name)


def _recording_writer(url: str, fail: set[str], **kw: Any) -> CheckpointWriter:
    writer = CheckpointWriter(url, retries=1, backoff=0.01, **kw)
    Recorder.events, Recorder.fail = [], fail
    writer.fs = Recorder(None, {}, 1, 0.01)  # type: ignore[assignment]
    writer.path = writer.fs.init_path(url)
    return writer


def test_metadata_is_published_last_and_an_interrupted_overwrite_never_loads(s3: S3, one_rank: None):
    """Every data file is uploaded and checked before .metadata appears; a save that fails midway leaves nothing
    loadable."""
    url = f"s3://{s3.bucket()}/ck"
    state = {"w": torch.arange(1000.0), "step": 3}
    dcp.save(state, storage_writer=_recording_writer(url, set(), thread_count=2))
    assert Recorder.events[-2:] == ["put .metadata.tmp", "mv .metadata.tmp -> .metadata"]
    assert {e for e in Recorder.events[:-2]} == {"put __0_0.distcp", "put __0_1.distcp"}
    back = {"w": torch.zeros(1000), "step": 0}
    dcp.load(back, storage_reader=CheckpointReader(url))
    assert torch.equal(back["w"], state["w"]) and back["step"] == 3

    with pytest.raises(
        CheckpointException, match=rf"could not upload {re.escape(url)}/__0_0\.distcp after 2 attempts: ConnectionError"
    ):
        dcp.save({"w": torch.ones(1000), "step": 4}, storage_writer=_recording_writer(url, {"__0_0.distcp"}))
    assert not s3.fs().exists(f"{url}/.metadata")
    # torch 2.13 names the missing .metadata; earlier versions only say "metadata is None".
    with pytest.raises(CheckpointException, match=r"\.metadata|metadata is None"):
        dcp.load(back, storage_reader=CheckpointReader(url, retries=0))


def test_writer_with_overwrite_false_refuses_an_existing_checkpoint(tmp_path: Path, one_rank: None):
    """overwrite=False is an error when a checkpoint is already there; the default replaces it without a warning."""
    dcp.save({"x": torch.ones(3)}, storage_writer=CheckpointWriter(tmp_path))
    dcp.save({"x": torch.full((3,), 2.0)}, storage_writer=CheckpointWriter(f"file://{tmp_path}"))
    with pytest.raises(CheckpointException, match="overwrite=False"):
        dcp.save({"x": torch.zeros(3)}, storage_writer=CheckpointWriter(tmp_path, overwrite=False))
    back = {"x": torch.zeros(3)}
    dcp.load(back, storage_reader=CheckpointReader(tmp_path))
    assert back["x"].tolist() == [2.0, 2.0, 2.0]
