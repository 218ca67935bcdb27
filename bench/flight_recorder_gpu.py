"""On one GPU: NCCL's flight recorder dumped on request through its pipe, read by air_magic, and py-spy's native frames.

A rank (a child process, world of 1, NCCL) queues an all_reduce behind a long GPU sleep and blocks in
torch.cuda.synchronize(). The parent then does what a call's stacks do: asks for the recorder's dump through
the rank's pipe (launch/flight_recorder.py) and reads it back into one sentence, and takes the rank's native frames
with py-spy (launch/native_frames.py). Two ranks on two GPUs (one skips an all_reduce) need a machine with two GPUs;
here the second rank's dump is the first one's cut before its pending collective, to read the real format.

    python bench/flight_recorder_gpu.py   (torch with CUDA; py-spy on PATH or beside the Python)
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for name in ("air_magic", "air_magic.launch"):  # the modules alone, without the package's imports (no IPython here)
    module = types.ModuleType(name)
    module.__path__ = [str(ROOT / name.replace(".", "/"))]
    sys.modules[name] = module

from air_magic.launch import native_frames
from air_magic.launch.files import flight_recorder

RANK = """
import os, sys, datetime, torch, torch.distributed as dist
torch.cuda.set_device(0)
dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=300), device_id=torch.device("cuda", 0))
t = torch.ones(1 << 20, device="cuda")
for _ in range(3):
    dist.all_reduce(t)
torch.cuda.synchronize()
torch.cuda._sleep(int(2e11))  # about 100 s of GPU time: the next all_reduce waits behind it
dist.all_reduce(t)
print("pending", flush=True)
def waiting_for_the_gpu():
    torch.cuda.synchronize()
waiting_for_the_gpu()
"""


def main() -> None:
    run_dir = Path(tempfile.mkdtemp(prefix="fr-"))
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT="29561", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    env.update(flight_recorder.recorder_env(run_dir, env))
    print("env:", {k: v for k, v in env.items() if k.startswith("TORCH_")})
    rank = subprocess.Popen([sys.executable, "-c", RANK], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert rank.stdout is not None
        started = time.monotonic()
        line = rank.stdout.readline()
        print(f"rank: {line.strip()!r} after {time.monotonic() - started:.1f} s")
        time.sleep(1.0)
        print("flight_recorder/:", sorted(os.listdir(run_dir / "flight_recorder")))
        since, at = time.time(), time.monotonic()
        asked = flight_recorder.ask_for_dumps(run_dir)
        found = flight_recorder.wait_for_dumps(run_dir, asked, since, 10.0)
        print(
            f"asked ranks {sorted(asked)} through the pipe; dumps {sorted(found)} after {time.monotonic() - at:.2f} s"
        )
        dumps = flight_recorder.read_dumps(run_dir)
        for r, dump in dumps.items():
            entries = dump.get("entries") or []
            print(f"rank {r}: version {dump.get('version')}, {len(entries)} entries, pg_status {dump.get('pg_status')}")
            for e in entries[-2:]:
                keep = ("collective_seq_id", "profiling_name", "state", "process_group", "retired")
                print("   ", {k: e.get(k) for k in keep})
        print("summary (1 rank):", flight_recorder.collectives_summary(dumps, 1))
        if 0 in dumps:
            real = dumps[0]
            pending = max(int(e["collective_seq_id"]) for e in real["entries"])
            behind = dict(real, entries=[e for e in real["entries"] if int(e["collective_seq_id"]) < pending])
            behind["pg_status"] = {
                k: dict(v, last_enqueued_collective=pending - 1, last_completed_collective=pending - 1)
                for k, v in (real.get("pg_status") or {}).items()
            }
            print("summary (rank 1 cut before it):", flight_recorder.collectives_summary({0: real, 1: behind}, 2))
        print("note:", flight_recorder.recorder_note(run_dir, 1))
        at = time.monotonic()
        native = native_frames.native_stacks([rank.pid])[rank.pid]
        print(f"py-spy --native: {time.monotonic() - at:.2f} s, {len(native.splitlines())} lines")
        print("\n".join(native.splitlines()[:40]))
    finally:
        rank.kill()
        rank.wait()


if __name__ == "__main__":
    main()
