"""The same paths on real GPUs (nccl), on every GPU of the node (one or more). Skipped on machines without GPUs."""

from __future__ import annotations

import psutil
from helpers import REAL_NODE, Kernel, gpu_count, gpu_module_marks, wait_until

pytestmark = gpu_module_marks()
#: The kernel of this module sees the node's GPUs (the rest of the suite runs the CPU path).
KERNEL_ENV = REAL_NODE

DDP = """
from air_magic import distributed

@distributed()
def train(steps: int, lr: float):
    import os, torch, torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl")
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1)).cuda(), device_ids=[local])
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    torch.manual_seed(1 + dist.get_rank())
    x, y = torch.randn(512, 256, device="cuda"), torch.randn(512, 1, device="cuda")
    losses = []
    for step in range(steps):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    checksum = sum(p.detach().double().sum().item() for p in model.parameters())
    print(f"rank {dist.get_rank()} on {torch.cuda.get_device_name(local)}: loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    return {"rank": dist.get_rank(), "device": local, "first": losses[0], "last": losses[-1], "checksum": checksum}
"""


def gpu_pids() -> set[int]:
    import pynvml

    pynvml.nvmlInit()
    try:
        pids = set()
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            pids |= {p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)}
        return pids
    finally:
        pynvml.nvmlShutdown()


def test_ddp_trains_on_every_gpu_through_the_decorator(kernel):
    """@distributed() with no arguments uses every GPU, trains a DDP model with nccl and returns per-rank results."""
    kernel.execute(DDP).check()
    out = kernel.execute("res = train.distributed(steps=50, lr=0.05); print(res)").check()
    print(out.stdout)
    res = eval(out.stdout.strip().splitlines()[-1])
    n = gpu_count()
    assert [r["rank"] for r in res] == list(range(n)) and [r["device"] for r in res] == list(range(n))
    assert all(r["last"] < r["first"] for r in res)
    assert len({round(r["checksum"], 6) for r in res}) == 1, "DDP keeps parameters identical on every rank"
    assert kernel.execute("train.settings").check().result is not None
    typ = kernel.execute("from air_magic import accelerators; accelerators.resolve(None, None)").check().result
    assert f"GPU_{n}x" in typ


def test_cuda_used_in_the_notebook_does_not_matter(kernel):
    """After the notebook itself initialized CUDA, warm and fresh-process calls still run on the GPUs."""
    kernel.execute(DDP).check()
    kernel.execute("import torch; x = torch.ones(1, device='cuda'); torch.cuda.synchronize()").check()
    for warm in (True, False):
        out = kernel.execute(f"len(train.with_overrides(warm={warm}).distributed(steps=3, lr=0.01))").check()
        assert out.result == str(gpu_count())


def test_failure_timeout_and_interrupt_free_the_gpus(kernel):
    """A rank failure, a timeout and a kernel interrupt each leave no process of the run holding GPU memory."""
    kernel.execute(
        "@distributed()\ndef holds(fail):\n    import os, time, torch\n"
        "    torch.cuda.set_device(int(os.environ['LOCAL_RANK']))\n"
        "    x = torch.empty(2**30, device='cuda')\n    print('holding', os.getpid(), flush=True)\n"
        "    if fail and int(os.environ['RANK']) == int(os.environ['WORLD_SIZE']) - 1:\n"
        "        raise RuntimeError(f'rank {os.environ[\"RANK\"]} fails')\n    time.sleep(600)\n"
    ).check()
    before = gpu_pids()
    err = kernel.execute("holds.distributed(True)")
    assert err.ename == "RuntimeError" and f"rank {gpu_count() - 1} fails" in err.traceback
    wait_until(lambda: not gpu_pids() - before, 15, "a rank of the failed call still holds GPU memory")
    err = kernel.execute("holds.with_overrides(timeout=20).distributed(False)", timeout=120)
    assert err.ename == "DistributedTimeoutError"
    wait_until(lambda: not gpu_pids() - before, 15, "a rank of the timed-out call still holds GPU memory")
    msg = kernel.send("holds.distributed(False)")
    wait_until(lambda: len(gpu_pids() - before) >= gpu_count(), 60, "every rank holds GPU memory", step=0.5)
    kernel.interrupt()
    assert kernel.collect(msg, timeout=60).ename == "KeyboardInterrupt"
    wait_until(lambda: not gpu_pids() - before, 15, "a rank of the interrupted call still holds GPU memory")


def test_nccl_job_listens_on_loopback_only(kernel, tmp_path):
    """While an nccl job on every GPU runs, every listening socket of the job's processes is on 127.0.0.1."""
    kernel.execute(DDP).check()
    kernel.execute(
        "@distributed()\ndef waits(marks):\n    import os, time, torch, torch.distributed as dist\n"
        "    torch.cuda.set_device(int(os.environ['LOCAL_RANK']))\n    dist.init_process_group('nccl')\n"
        "    t = torch.ones(1, device='cuda'); dist.all_reduce(t)\n"
        "    open(os.path.join(marks, 'ready-' + os.environ['RANK']), 'w').close()\n"
        "    while not os.path.exists(os.path.join(marks, 'sampled')):\n        time.sleep(0.1)\n"
        "    return t.item()"
    ).check()
    msg = kernel.send(f"waits.distributed({str(tmp_path)!r})")
    listening = []
    try:  # the ranks stay in the call, past NCCL's set-up, until their sockets are sampled
        wait_until(
            lambda: len(list(tmp_path.glob("ready-*"))) == gpu_count(),
            120,
            "the ranks never finished their all_reduce",
            step=0.5,
        )
        for proc in psutil.Process(kernel.pid).children(recursive=True):
            try:
                listening += [c.laddr for c in proc.net_connections("inet") if c.status == psutil.CONN_LISTEN]
            except psutil.Error:
                pass
    finally:
        (tmp_path / "sampled").touch()
    assert kernel.collect(msg, timeout=60).error is None
    assert listening, "the job's store at least was listening"
    assert all(addr.ip == "127.0.0.1" for addr in listening), listening


def test_cuda_tensors_in_results_and_errors_come_back_on_cpu_without_cuda_in_the_kernel(new_kernel):
    """A rank returning CUDA tensors (a state_dict) or raising with one hands the kernel CPU tensors; CUDA stays off
    there."""
    _tensors_come_back_on_cpu(new_kernel(**REAL_NODE))  # a kernel that never touched CUDA itself


def _tensors_come_back_on_cpu(kernel: Kernel) -> None:
    kernel.execute(
        "from air_magic import distributed\n"
        "@distributed()\ndef gives(fail):\n    import os, torch\n"
        "    torch.cuda.set_device(int(os.environ['LOCAL_RANK']))\n"
        "    model = torch.nn.Linear(4, 2).cuda()\n"
        "    if fail:\n        raise ValueError(torch.ones(2, device='cuda'))\n"
        "    return {'ones': torch.ones(2, device='cuda'), 'state': model.state_dict(), 'param': model.weight}\n"
    ).check()
    out = kernel.execute(
        "import torch\nres = gives.distributed(False)\n"
        "print(sorted({str(t.device) for r in res for t in [r['ones'], r['param'], *r['state'].values()]}),"
        " type(res[0]['param']).__name__, res[0]['param'].requires_grad, torch.cuda.is_initialized())"
    ).check()
    assert out.stdout.strip().splitlines()[-1] == "['cpu'] Parameter True False", out.stdout
    out = kernel.execute(
        "try:\n    gives.distributed(True)\nexcept ValueError as e:\n"
        "    print(e.args[0].device, torch.cuda.is_initialized())"
    ).check()
    assert out.stdout.strip().splitlines()[-1] == "cpu False", out.stdout


def test_hot_ranks_keep_their_cuda_context_and_free_the_gpu_when_released(kernel):
    """With keep_alive the next call runs in the same GPU processes; %distributed_release leaves no GPU memory in
    use."""
    kernel.execute(DDP).check()
    kernel.execute("%load_ext air_magic").check()
    before = gpu_pids()
    first = kernel.execute("hot = train.with_overrides(keep_alive=120)\nhot.distributed(steps=3, lr=0.01)").check()
    held = gpu_pids() - before
    assert len(held) == gpu_count(), "each hot rank keeps its CUDA context"
    second = kernel.execute("res = hot.distributed(steps=3, lr=0.01); print(res)").check()
    assert gpu_pids() - before == held, "the second call ran in the same processes"
    assert first.error is None and second.error is None
    kernel.execute("%distributed_release").check()
    wait_until(lambda: not gpu_pids() - before, 15, "a released hot rank still holds GPU memory", step=0.5)


def test_a_session_keeps_a_model_on_every_gpu_through_an_error_and_frees_the_gpus_when_it_ends(kernel):
    """A session cell's CUDA model is there for the next cell, in the same GPU processes, after a user error too;
    %distributed_session shows each rank's device; --end leaves no GPU memory in use."""
    kernel.execute("%load_ext air_magic").check()
    before = gpu_pids()
    kernel.execute(
        "%%distributed --session gpu\n"
        "import os, torch, torch.distributed as dist\n"
        "local = int(os.environ['LOCAL_RANK'])\ntorch.cuda.set_device(local)\ndist.init_process_group('nccl')\n"
        "model = torch.nn.Linear(1024, 1024).cuda()\nsteps = 0"
    ).check()
    held = gpu_pids() - before
    assert len(held) == gpu_count()
    typo = kernel.execute("%%distributed --session gpu\nmodel.weigth")
    assert typo.ename == "AttributeError" and "session 'gpu' was kept" in typo.traceback
    out = kernel.execute(
        "%%distributed --session gpu\n"
        "t = model(torch.ones(8, 1024, device='cuda')).sum()\ndist.all_reduce(t)\nsteps += 1\n(steps, t.device.type)"
    ).check()
    assert eval(out.result or "[]") == [(1, "cuda")] * gpu_count()
    assert gpu_pids() - before == held, "the later cells ran in the same GPU processes"
    listing = kernel.execute("%distributed_session").check().stdout
    assert "cuda:0" in listing and "model: Linear" in listing
    kernel.execute("%distributed_session --end gpu").check()
    wait_until(lambda: not gpu_pids() - before, 15, "a rank of the ended session still holds GPU memory", step=0.5)
