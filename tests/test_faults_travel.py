"""Return values, exceptions and arguments that do not travel between the notebook and the ranks: clear errors."""

from __future__ import annotations

import pytest
from faults_common import (
    assert_nothing_left,
    assert_nothing_lost,
    procs,
    run_dirs,
)
from helpers import reported

pytestmark = [pytest.mark.usefixtures("here_runs"), pytest.mark.slow]


# -- 9. return values and exceptions that do not travel ---------------------------------------------


def test_unpicklable_returns_a_gigabyte_and_unpicklable_exceptions_give_a_result_or_a_clear_error(fault_kernel):
    """A lock returned, 1 GiB returned by rank 0, an exception that will not pickle or whose str() fails: each is a
    value or a clear error."""
    before = procs()
    out = fault_kernel.execute(
        """
class NoPickle(Exception):
    def __reduce__(self):
        raise TypeError("this exception refuses to be pickled")
class Unloadable:
    def __reduce__(self):  # pickles on the rank, fails when the notebook unpickles it
        return (int, ("not a number",))
class BadStr(Exception):
    def __str__(self):
        raise RuntimeError("str() is broken")
@distributed(2, timeout=180)
def gives(kind):
    import os, threading
    rank = int(os.environ["RANK"])
    print(f"rank {rank} {kind}", flush=True)
    if rank == 0 and kind == "lock":
        return threading.Lock()
    if rank == 0 and kind == "big":
        return b"x" * 2**30
    if rank == 1 and kind == "nopickle":
        raise NoPickle("cannot travel")
    if rank == 1 and kind == "badstr":
        raise BadStr()
    if rank == 1 and kind == "unloadable":
        return Unloadable()
    return rank
summary = {}
for kind in ("lock", "big", "nopickle", "badstr", "unloadable"):
    value, error, ended = timed(gives, kind)
    summary[kind] = {"error": type(error).__name__, "text": "" if error is None or kind == "badstr" else str(error),
                     "notes": getattr(error, "__notes__", []),
                     "value": None if value is None else [len(v) if isinstance(v, bytes) else v for v in value]}
    del value
print("REPORT " + json.dumps(summary))
""",
        timeout=240,
    ).check()
    got = reported(out.stdout)
    assert got["lock"]["error"] == "SerializationError" and "return value of rank 0" in got["lock"]["text"]
    assert "could not be pickled" in got["lock"]["text"]
    assert got["big"] == {"error": "NoneType", "text": "", "notes": [], "value": [2**30, 1]}
    assert got["nopickle"]["error"] == "RankFailedError"
    assert "NoPickle: cannot travel" in got["nopickle"]["text"] and "rank 1" in got["nopickle"]["notes"][0]
    assert got["badstr"]["error"] == "BadStr" and "rank 1 of 2" in got["badstr"]["notes"][0]
    assert got["unloadable"]["error"] == "SerializationError"
    assert "return value of rank 1 could not be rebuilt" in got["unloadable"]["text"]
    assert "invalid literal for int()" in got["unloadable"]["text"]
    assert_nothing_left(before)
    dirs = run_dirs(out.stdout)
    assert len(dirs) == 5
    # Where one rank fails, the other may be stopped before it printed anything: only the lines a rank certainly
    # wrote (both ranks when both returned, else the failing rank's) are checked.
    failing = {"lock": 0, "nopickle": 1, "badstr": 1}
    for d, kind in zip(dirs, ("lock", "big", "nopickle", "badstr", "unloadable")):
        ranks = (failing[kind],) if kind in failing else (0, 1)
        assert_nothing_lost(d, {r: [f"rank {r} {kind}"] for r in ranks}, out.stdout)


# -- 10. arguments ---------------------------------------------------------------------------------


def test_lambdas_and_closures_work_and_unpicklable_or_huge_arguments_are_named(fault_kernel):
    """A lambda and a closure from the notebook run on every rank; a socket argument is named before anything starts; a
    huge tensor warns with its size."""
    before = procs()
    out = fault_kernel.execute(
        """
import socket, warnings, torch
def make_scaler(k):
    def scale(x):
        return k * x
    return scale
@distributed(2, timeout=120)
def applies(f, g, data):
    import os
    r = int(os.environ["RANK"])
    print(f"rank {r} applies", flush=True)
    return f(r) + g(r) + float(data.sum())
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    big = torch.ones(300 * 2**20 // 4)  # 300 MiB of float32
    values = applies.distributed(lambda x: x + 100, make_scaler(10), big)
    del big
s = socket.socket()
_, error, _ = timed(applies, s, s, None)
s.close()
print("REPORT " + json.dumps({"values": values, "warnings": [f"{w.category.__name__}: {w.message}" for w in caught],
                              "error": type(error).__name__, "text": str(error)}))
""",
        timeout=180,
    ).check()
    got = reported(out.stdout)
    assert got["values"] == [100 + 0 + 300 * 2**18, 101 + 10 + 300 * 2**18]
    (warning,) = [w for w in got["warnings"] if "PayloadSizeWarning" in w]
    assert "300 MiB" in warning
    assert got["error"] == "SerializationError"
    assert "positional argument 0 (socket)" in got["text"] and "positional argument 1 (socket)" in got["text"]
    dirs = run_dirs(out.stdout)
    assert len(dirs) == 1, "the socket call started nothing"
    assert_nothing_left(before)
    assert_nothing_lost(dirs[0], {r: [f"rank {r} applies"] for r in (0, 1)}, out.stdout)
