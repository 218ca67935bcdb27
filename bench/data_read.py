"""Data-read benchmark: air_magic.data against plain fsspec and a plain DataLoader, from S3 and from local disk.

Writes N files, serves a copy from an S3 API on 127.0.0.1 (moto's server), and
reads every file once per measurement, in the same run:

- plain fsspec loop, S3: `fs.cat_file(url)` for each file, one process
- StreamingFileDataset, S3, cold: DataLoader workers fetching into an empty cache
- StreamingFileDataset, S3, warm: the next epoch, served from the cache
- plain fsspec loop, local disk
- plain DataLoader over local paths (a map-style dataset that reads each path)
- StreamingFileDataset, local disk

Each reader reads the whole file in the worker (the usual place to decode) and
hands back its length. Files per second and MB/s (10^6 bytes) are the median of
`--repeat` S3 epochs (the cold one with a fresh cache each time) and of
`--local-repeat` warm-cache and local epochs, interleaved.

    python bench/data_read.py [--files 2000] [--size-kib 64] [--workers 2] [--repeat 1] [--local-repeat 7]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def read_length(path: str) -> int:
    """Read the whole file; its length."""
    with open(path, "rb") as f:
        return len(f.read())


class PathsDataset:
    """A map-style dataset over local paths: the plain-DataLoader baseline."""

    def __init__(self, paths: list[str]) -> None:
        self.paths = paths

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> int:
        return read_length(self.paths[i])


def timed(fn: Callable[[], int]) -> tuple[float, int]:
    t0 = time.perf_counter()
    nbytes = fn()
    return time.perf_counter() - t0, nbytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=2000)
    parser.add_argument("--size-kib", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=1, help="epochs from S3 (slow: the cold cache each time)")
    parser.add_argument("--local-repeat", type=int, default=7, help="warm-cache and local epochs, interleaved")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "data_read.json")
    args = parser.parse_args()

    logging.disable(logging.CRITICAL)  # the S3 server's request log
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    os.environ.update(
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_ENDPOINT_URL=f"http://{host}:{port}",
    )
    import fsspec
    import s3fs
    import torch.utils.data

    from air_magic.data import DataLoader, StreamingFileDataset

    work = Path(tempfile.mkdtemp(prefix="air_magic-bench-"))
    try:
        src = work / "files"
        src.mkdir()
        size = args.size_kib * 1024
        for i in range(args.files):
            (src / f"f{i:05d}.bin").write_bytes(os.urandom(size))
        s3 = s3fs.S3FileSystem(skip_instance_cache=True)
        s3.mkdir("bench-data")
        s3.put(str(src) + "/", "bench-data/files/", recursive=True)
        url = "s3://bench-data/files"
        paths = sorted(str(p) for p in src.iterdir())
        total = args.files * size
        loader_kw = {"batch_size": args.batch_size, "num_workers": args.workers}

        def epoch(ds: StreamingFileDataset) -> int:
            return sum(int(b.sum()) for b in DataLoader(ds, **loader_kw))

        def fsspec_loop(fs: fsspec.AbstractFileSystem, names: list[str]) -> int:
            return sum(len(fs.cat_file(n)) for n in names)

        s3_names = [f"{url}/{Path(p).name}" for p in paths]
        local_fs = fsspec.filesystem("file")
        cache_root = work / "cache"
        results: dict[str, list[float]] = {}

        def record(name: str, seconds: float, nbytes: int) -> None:
            assert nbytes == total, f"{name} read {nbytes} bytes, expected {total}"
            results.setdefault(name, []).append(seconds)
            print(f"  {name}: {seconds:.3f} s", flush=True)

        ds = StreamingFileDataset(url, transform=read_length, cache_dir=cache_root, seed=0)
        for rep in range(args.repeat):
            print(f"S3 epoch {rep + 1} of {args.repeat}", flush=True)
            record(
                "S3, plain fsspec loop",
                *timed(lambda: fsspec_loop(s3fs.S3FileSystem(skip_instance_cache=True), s3_names)),
            )
            shutil.rmtree(cache_root, ignore_errors=True)
            ds = StreamingFileDataset(url, transform=read_length, cache_dir=cache_root, seed=rep)
            record("S3, StreamingFileDataset, cold cache", *timed(lambda ds=ds: epoch(ds)))
        plain = torch.utils.data.DataLoader(PathsDataset(paths), shuffle=True, **loader_kw)
        local = StreamingFileDataset(src, transform=read_length)
        for rep in range(args.local_repeat):  # interleaved, so a busy moment hits every reader alike
            print(f"warm and local epoch {rep + 1} of {args.local_repeat}", flush=True)
            ds.set_epoch(rep + 1)
            record("S3, StreamingFileDataset, warm cache", *timed(lambda ds=ds: epoch(ds)))
            record("local, plain fsspec loop", *timed(lambda: fsspec_loop(local_fs, paths)))
            record("local, plain DataLoader over paths", *timed(lambda plain=plain: sum(int(b.sum()) for b in plain)))
            local.set_epoch(rep)
            record("local, StreamingFileDataset", *timed(lambda local=local: epoch(local)))

        table = {}
        for name, secs in results.items():
            med = statistics.median(secs)
            table[name] = {
                "seconds": round(med, 3),
                "files_per_s": round(args.files / med, 1),
                "MB_per_s": round(total / med / 1e6, 1),
                "all_seconds": [round(s, 3) for s in secs],
            }
        warm = table["S3, StreamingFileDataset, warm cache"]["seconds"]
        base = table["local, plain DataLoader over paths"]["seconds"]
        local_ds = table["local, StreamingFileDataset"]["seconds"]
        summary = {
            "warm_cache_vs_plain_local_dataloader": round(warm / base, 3),
            "warm_cache_vs_local_streaming_dataset": round(warm / local_ds, 3),
        }
        report = {
            "files": args.files,
            "file_size_bytes": size,
            "workers": args.workers,
            "batch_size": args.batch_size,
            "repeat": args.repeat,
            "local_repeat": args.local_repeat,
            "load_average": os.getloadavg(),
            "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "platform": platform.platform()},
            "results": table,
            "summary": summary,
        }
        print(
            f"\n{args.files} files of {args.size_kib} KiB, {args.workers} DataLoader workers, median of "
            f"{args.repeat} S3 and {args.local_repeat} warm/local epochs; load average {os.getloadavg()}:"
        )
        for name, row in table.items():
            print(f"  {name:42s} {row['files_per_s']:9.1f} files/s {row['MB_per_s']:8.1f} MB/s")
        print(
            f"  warm cache / plain local DataLoader: {summary['warm_cache_vs_plain_local_dataloader']:.3f}; "
            f"warm cache / local StreamingFileDataset: {summary['warm_cache_vs_local_streaming_dataset']:.3f}"
        )
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"written to {args.out}")
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
