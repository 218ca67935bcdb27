"""The warm supervisor: fork-started workers behave like fresh processes, and staleness is noticed."""

from __future__ import annotations

import psutil
import pytest

#: Real kernels and processes: seconds each.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def preload_kernel(new_module_kernel, workdir):
    """A kernel whose warm helper preloads torch and a local package, mypkg (AIR_MAGIC_PRELOAD)."""
    pkg = workdir / "pkgs" / "mypkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("VERSION = 1\n")
    k = new_module_kernel(
        env={
            "AIR_MAGIC_RUNS_DIR": str(workdir / "runs"),
            "AIR_MAGIC_PRELOAD": "torch,mypkg",
            "PYTHONPATH": str(workdir / "pkgs"),
        },
    )
    k.execute(f"import sys; sys.path.insert(0, {str(workdir / 'pkgs')!r})\nfrom air_magic import distributed").check()
    return k  # new_module_kernel checks at its end that the supervisor went with the kernel


def test_warm_and_fresh_workers_give_the_same_results_and_errors(preload_kernel):
    """The same function returns the same values and raises the same error whether workers are forked warm or spawned
    fresh."""
    preload_kernel.execute(
        """
@distributed(2)
def probe(fail):
    import os, sys, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    t = torch.ones(2) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    if fail and dist.get_rank() == 1:
        raise KeyError("missing")
    return (t.tolist(), os.environ["RANK"], "IPython" in sys.modules, torch.initial_seed())
warm = probe.with_overrides(warm=True).distributed(False)
fresh = probe.with_overrides(warm=False).distributed(False)
"""
    ).check()
    assert preload_kernel.execute("[w[:3] for w in warm] == [f[:3] for f in fresh]").check().result == "True"
    assert preload_kernel.execute("warm[1][:3]").check().result == "([3.0, 3.0], '1', False)"
    assert preload_kernel.execute("len({r[3] for r in warm + fresh})").check().result == "4", (
        "every process draws its own seed"
    )
    for warm in (True, False):
        err = preload_kernel.execute(f"probe.with_overrides(warm={warm}).distributed(True)")
        assert err.ename == "KeyError" and "rank 1 of 2" in err.traceback


def test_forked_ranks_do_not_share_random_streams(preload_kernel):
    """Python's and NumPy's random numbers differ between ranks and calls, as in fresh processes."""
    preload_kernel.execute(
        "@distributed(2, warm=True)\ndef draw():\n    import random, numpy\n"
        "    return (random.random(), float(numpy.random.rand()))\n"
        "a = draw.distributed(); b = draw.distributed()"
    ).check()
    assert preload_kernel.execute("len({x for pair in a + b for x in pair})").check().result == "8"


def test_package_upgraded_on_disk_is_seen_by_the_next_call(preload_kernel, workdir):
    """A preloaded package rewritten between two calls is seen by the second (the supervisor is replaced, and its log
    says why)."""
    preload_kernel.execute(
        "@distributed(2, warm=True)\ndef version():\n    import mypkg\n    return mypkg.VERSION"
    ).check()
    assert preload_kernel.execute("version.distributed()").check().result == "[1, 1]"
    before = {p.pid for p in psutil.Process(preload_kernel.pid).children()}
    init = workdir / "pkgs" / "mypkg" / "__init__.py"
    init.write_text("VERSION = 2\n")
    assert preload_kernel.execute("version.distributed()").check().result == "[2, 2]"
    after = {p.pid for p in psutil.Process(preload_kernel.pid).children()}
    assert after - before, "a fresh supervisor was started"
    log = (workdir / "runs" / f"supervisor-{preload_kernel.pid}.log").read_text()
    assert "replaced by a fresh helper: " in log and "mypkg" in log, log  # the helpers' log says why


def test_workers_are_children_of_the_supervisor_not_the_kernel(preload_kernel):
    """Workers never descend directly from the kernel, so what the notebook did to CUDA cannot reach them."""
    preload_kernel.execute("@distributed(2, warm=True)\ndef parent():\n    import os\n    return os.getppid()").check()
    ppids = eval(preload_kernel.execute("parent.distributed()").check().result)
    assert preload_kernel.pid not in ppids
    assert all("air_magic.launch.local.supervisor" in " ".join(psutil.Process(p).cmdline()) for p in set(ppids))
