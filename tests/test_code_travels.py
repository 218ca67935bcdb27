"""The notebook's own modules reach every rank as the notebook has them: imported by name inside a function or a
cell, or by another such module; locally and on a simulated Ray cluster; the same after an edit and a reload. On Ray,
an installed package that a node lacks or has in another version is brought with the call, or the call refused."""

from __future__ import annotations

import contextlib
import os
import re
import sqlite3
import sys
from pathlib import Path

import cloudpickle
import pytest
import ray_cluster
from helpers import Kernel

HELPERS = "import helpers_ct2\n\n\ndef version():\n    return '{tag} ' + helpers_ct2.TAG\n"


def tiny_dist(root: Path, version: str) -> Path:
    """A directory where the distribution `tinydist_am` of `version` is installed (its package and its metadata)."""
    root.mkdir(parents=True)
    (root / "tinydist_am").mkdir()
    (root / "tinydist_am" / "__init__.py").write_text(f"VERSION = {version!r}\n")
    meta = root / f"tinydist_am-{version}.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text(f"Metadata-Version: 2.1\nName: tinydist_am\nVersion: {version}\n")
    (meta / "RECORD").write_text(f"tinydist_am/__init__.py,,\n{meta.name}/METADATA,,\n{meta.name}/RECORD,,\n")
    return root


cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture
def node_with_tinydist(cluster, tmp_path_factory):
    """A third node joins the shared cluster (tests/ray_cluster.py) for one test: its environment has `tinydist_am`
    1.0 installed, the two others none. It leaves the cluster after the test."""
    site = tiny_dist(tmp_path_factory.mktemp("node-site") / "site", "1.0")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p))
        node = ray_cluster.add_node(cluster)
    yield node
    ray_cluster.wait_all_free(60)
    ray_cluster.remove_node(cluster, node)


def _code_travels(k: Kernel, workdir, ray_address: str | None) -> None:
    """Every way the code reaches a rank, in one kernel: the files are deleted before the first call, then
    written anew and reloaded before the last (which runs in the same hot ranks)."""
    (workdir / "helpers_ct.py").write_text(HELPERS.format(tag="v1"))
    (workdir / "helpers_ct2.py").write_text("TAG = 'two'\n")
    nodes, per_node = (2, 1) if ray_address else (1, 2)
    setup = ""
    if ray_address:
        setup = f"from air_magic import ray_init\n_ = ray_init({ray_address!r}, log_to_driver=False)\n"
    k.execute(setup + "%load_ext air_magic\nimport helpers_ct\nfrom air_magic import distributed").check()
    (workdir / "helpers_ct.py").unlink()  # as on a node without the files
    (workdir / "helpers_ct2.py").unlink()
    k.execute(
        f"@distributed({per_node}, accelerator_type='CPU', num_nodes={nodes}, mlflow=False, keep_alive=120)\n"
        "def work():\n"
        "    import os\n"
        "    import helpers_ct\n"
        "    return helpers_ct.version(), os.getpid()\n"
        "print('FUNC', work.distributed())\n",
        timeout=300,
    ).check()
    cell = k.execute(
        f"%%distributed --gpus {per_node} --nodes {nodes} --accelerator-type CPU --no-mlflow --out got\n"
        "import helpers_ct\nhelpers_ct.version()\n",
        timeout=300,
    ).check()
    first = k.value("work.distributed()")
    assert "'v1 two'" in first and cell.stdout, first
    assert k.value("got") == "['v1 two', 'v1 two']"
    (workdir / "helpers_ct.py").write_text(HELPERS.format(tag="v2"))
    (workdir / "helpers_ct2.py").write_text("TAG = 'three'\n")
    k.execute("import importlib, helpers_ct2\nimportlib.reload(helpers_ct2)\nimportlib.reload(helpers_ct)").check()
    (workdir / "helpers_ct.py").unlink()
    (workdir / "helpers_ct2.py").unlink()
    second = k.value("work.distributed()")
    assert second.count("'v2 three'") == 2, second
    pids = [re.findall(r"(\d+)\)", text) for text in (first, second)]
    assert pids[0] == pids[1], f"the second call ran in other processes than the hot ranks: {first} / {second}"


@pytest.mark.slow
def test_modules_imported_by_name_travel_to_local_ranks(workdir, new_kernel):
    """Locally: a module beside the notebook, imported inside the function and the cell (and importing another),
    runs the notebook's copy once its file is gone; after an edit and reload, hot ranks run the new code."""
    k = new_kernel(env={"AIR_MAGIC_RUNS_DIR": str(workdir / "runs"), "AIR_MAGIC_DISPLAY": "text"})
    _code_travels(k, workdir, None)


@pytest.mark.slow
def test_the_decorator_alone_carries_a_module_whose_file_is_gone(workdir, new_kernel):
    """Without %load_ext: a module the notebook imported before and after `import air_magic`, whose file is then
    removed, is imported by name inside the function on both ranks from the notebook's copy."""
    (workdir / "early_da.py").write_text("TAG = 'early'\n")
    (workdir / "late_da.py").write_text("TAG = 'late'\n")
    k = new_kernel(env={"AIR_MAGIC_RUNS_DIR": str(workdir / "runs"), "AIR_MAGIC_DISPLAY": "text"})
    k.execute("import early_da\nfrom air_magic import distributed").check()
    k.execute("import late_da").check()
    (workdir / "early_da.py").unlink()
    (workdir / "late_da.py").unlink()
    k.execute(
        "@distributed(2, 'CPU', mlflow=False)\n"
        "def tags():\n"
        "    import early_da, late_da\n"
        "    return early_da.TAG + '/' + late_da.TAG\n"
        "got = tags.distributed()",
        timeout=180,
    ).check()
    assert k.value("got") == "['early/late', 'early/late']"


@pytest.mark.slow
def test_a_session_imports_the_notebooks_copy_and_the_reloaded_one_next(workdir, new_kernel):
    """Session cells import a module beside the notebook whose file is gone; after an edit and a reload in the
    notebook, the next session cell (same processes, same namespace otherwise) imports the new code."""
    (workdir / "helpers_ss.py").write_text("def version():\n    return 'v1'\n")
    k = new_kernel(env={"AIR_MAGIC_RUNS_DIR": str(workdir / "runs"), "AIR_MAGIC_DISPLAY": "text"})
    k.execute("%load_ext air_magic\nimport helpers_ss").check()
    (workdir / "helpers_ss.py").unlink()
    line = "%%distributed --session travels --gpus 2 --accelerator-type CPU --no-mlflow --out got\n"
    k.execute(line + "import os, helpers_ss\nkept = os.getpid()\nhelpers_ss.version()", timeout=180).check()
    assert k.value("got") == "['v1', 'v1']"
    (workdir / "helpers_ss.py").write_text("def version():\n    return 'v2'\n")
    k.execute("import importlib\nimportlib.reload(helpers_ss)").check()
    (workdir / "helpers_ss.py").unlink()
    k.execute(line + "import os, helpers_ss\n(helpers_ss.version(), kept == os.getpid())", timeout=180).check()
    assert k.value("got") == "[('v2', True), ('v2', True)]"
    k.execute("%distributed_release").check()


@pytest.mark.slow
def test_modules_imported_by_name_travel_to_ray_ranks(cluster, workdir, new_kernel):
    """On two Ray nodes: the same as locally, the files gone from every node's disk before the call."""
    k = new_kernel(env={"AIR_MAGIC_RUNS_DIR": str(workdir / "runs"), "AIR_MAGIC_DISPLAY": "text"})
    _code_travels(k, workdir, cluster.address)
    k.shutdown()  # before the cluster is checked free (new_kernel then finds it ended)
    ray_cluster_free(cluster)


def ray_cluster_free(cluster) -> None:
    """Nothing of the kernel's calls is left holding the cluster's CPUs (this process is joined to it)."""
    ray_cluster.wait_all_free(60)


@pytest.mark.slow
def test_a_package_a_node_lacks_or_has_in_another_version_is_refused_or_brought(
    cluster, node_with_tinydist, workdir, tmp_path, new_kernel
):
    """The notebook imported tinydist_am 2.0; two nodes lack it and the third has 1.0. With packages='check' the
    call is refused before any rank starts, naming the package, each node and version; with 'sync' (the default)
    every rank imports the notebook's 2.0, and a second call too."""
    site = tiny_dist(tmp_path / "notebook-site", "2.0")
    env = {"AIR_MAGIC_RUNS_DIR": str(workdir / "runs"), "AIR_MAGIC_DISPLAY": "text", "PYTHONPATH": str(site)}
    k = new_kernel(env=env)
    k.execute(
        f"from air_magic import ray_init, distributed\n"
        f"_ = ray_init({cluster.address!r}, packages='check', log_to_driver=False)\n"
        "import tinydist_am\n"
        "@distributed(1, accelerator_type='CPU', num_nodes=2, mlflow=False)\n"
        "def which():\n"
        "    import importlib.metadata, tinydist_am\n"
        "    return tinydist_am.VERSION, importlib.metadata.version('tinydist_am')\n"
    ).check()
    refused = k.execute("which.distributed()", timeout=300)
    message = " ".join(re.sub(r"\x1b\[[0-9;]*m", "", refused.traceback + refused.stdout).split())
    assert "tinydist_am 2.0 here, missing on node" in message, message
    assert "tinydist_am 2.0 here, 1.0 on node" in message and "No rank was started" in message, message
    assert "pip install 'tinydist_am==2.0'" in message and "packages='sync'" in message, message
    k.execute(f"_ = ray_init({cluster.address!r}, packages='sync')").check()
    for _ in range(2):  # the first call makes the runtime environment on the nodes: as patient as the refusal
        got = k.execute("print(repr(which.distributed()))", timeout=300).check().stdout.strip()
        assert got.endswith("[('2.0', '2.0'), ('2.0', '2.0')]"), got
    k.shutdown()  # before the cluster is checked free (new_kernel then finds it ended)
    ray_cluster_free(cluster)


@pytest.mark.slow
def test_what_ray_ranks_log_to_mlflow_and_use_reaches_the_panel_and_the_record(cluster, workdir, new_kernel):
    """Each rank of a call on two Ray nodes logs a metric: its values are in the call's chart files here, so the live
    charts and the static record show them for both ranks; what each rank uses, sampled on its node, arrives too, and
    the call's MLflow run holds it as system metrics, as a local call's does."""
    env = {
        "AIR_MAGIC_RUNS_DIR": str(workdir / "runs-charts"),
        "AIR_MAGIC_DISPLAY": "text",
        "MLFLOW_TRACKING_URI": f"sqlite:///{workdir}/charts-mlflow.db",
    }
    k = new_kernel(env=env)
    k.execute(
        f"from air_magic import ray_init\n_ = ray_init({cluster.address!r}, log_to_driver=False)\n%load_ext air_magic"
    ).check()
    k.execute(
        "%%distributed --nodes 2 --gpus 1 --accelerator-type CPU\n"
        "import os, time, mlflow\n"
        "time.sleep(2.5)\n"
        "for step in range(3):\n"
        "    mlflow.log_metric('loss', 10.0 * int(os.environ['RANK']) + step, step=step)\n",
        timeout=300,
    ).check()
    shown = k.execute(
        "import os\nfrom pathlib import Path\n"
        "from air_magic.display.charts import MetricsTail, charts_text\n"
        "run = max(Path(os.environ['AIR_MAGIC_RUNS_DIR']).iterdir(), key=lambda p: p.stat().st_mtime)\n"
        "tail = MetricsTail(run, 2)\ntail.poll()\nprint(charts_text(tail))\n"
        "from air_magic.launch.files.rank_files import read_usage\n"
        "from air_magic.launch.files.rundir import RunDir\n"
        "used = [read_usage(RunDir(run).usage(r), fresh=600) for r in range(2)]\n"
        "print('USED', [u is not None and u[1] > 10 * 2**20 for u in used])\n"
    ).check()
    assert "loss (3 values) — last rank 0: 2, rank 1: 12" in shown.stdout, shown.stdout
    assert "USED [True, True]" in shown.stdout, shown.stdout
    with contextlib.closing(sqlite3.connect(workdir / "charts-mlflow.db")) as db:
        logged = {key for (key,) in db.execute("SELECT DISTINCT key FROM metrics WHERE key LIKE 'system/%'")}
    wanted = {f"system/rank_{r}/{m}" for r in (0, 1) for m in ("cpu_percent", "memory_mib", "memory_peak_mib")}
    assert wanted <= logged, logged
    k.shutdown()  # before the cluster is checked free (new_kernel then finds it ended)
    ray_cluster_free(cluster)
