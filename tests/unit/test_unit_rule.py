"""tests/unit/ holds only pure tests: no kernel, no subprocess, no process started (docs/contributing.md)."""

from __future__ import annotations

import ast
from pathlib import Path

UNIT = Path(__file__).resolve().parent

#: Modules whose import means a test starts a process or a kernel (tests/helpers.py drives kernels,
#: faults_common runs calls, lab and s3_server start servers, ray_cluster a cluster).
STARTS_PROCESSES = {
    "subprocess",
    "multiprocessing",
    "jupyter_client",
    "nbclient",
    "helpers",
    "faults_common",
    "lab",
    "s3_server",
    "ray_cluster",
    "ray",
}
#: Calls that start a process without importing one of the above.
STARTING_CALLS = {"fork", "forkpty", "spawnv", "spawnl", "system", "popen", "Popen", "posix_spawn", "execv"}


def _violations(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr in STARTING_CALLS:
                found.append(f"{path.name}:{node.lineno} calls {node.func.attr}()")
            continue
        else:
            continue
        found += [f"{path.name}:{node.lineno} imports {n}" for n in names if n.split(".")[0] in STARTS_PROCESSES]
    return found


def test_unit_modules_start_no_process():
    """No module of tests/unit imports a process or kernel starter or calls fork/Popen/system."""
    modules = sorted(UNIT.glob("test_*.py"))
    assert len(modules) > 5
    found = [v for path in modules for v in _violations(path)]
    assert found == [], "move these tests out of tests/unit (and mark them slow): " + "; ".join(found)


def test_the_rule_catches_a_module_that_starts_a_process(tmp_path):
    """The check sees a subprocess import, a kernel helper and a fork."""
    probe = tmp_path / "test_probe.py"
    probe.write_text("import subprocess\nfrom helpers import Kernel\nimport os\nos.fork()\n")
    assert [v.split(" ", 1)[1] for v in _violations(probe)] == ["imports subprocess", "imports helpers", "calls fork()"]


class _Item:
    """What tests/conftest.py reads of a collected test: its id, its fixtures (with those they use) and its marks."""

    def __init__(self, nodeid: str, fixturenames: list[str], slow: bool) -> None:
        self.nodeid, self.fixturenames, self.slow = nodeid, fixturenames, slow

    def get_closest_marker(self, name: str):
        return object() if name == "slow" and self.slow else None


def test_a_test_that_starts_processes_without_the_slow_mark_is_named():
    """Collection refuses a test that uses a kernel, a cluster or another process-starting fixture (or a fixture
    built on one) unless it is marked slow, so `make check` (-m "not slow") starts nothing."""
    import conftest

    items = [
        _Item("a.py::uses_kernel", ["workdir", "kernel"], slow=False),
        _Item("a.py::uses_cluster_through_ray_kernel", ["ray_kernel", "cluster", "workdir"], slow=False),
        _Item("a.py::marked", ["kernel"], slow=True),
        _Item("a.py::pure", ["tmp_path"], slow=False),
    ]
    assert conftest.unmarked_slow(items) == ["a.py::uses_kernel", "a.py::uses_cluster_through_ray_kernel"]
