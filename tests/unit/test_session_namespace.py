"""A session's namespace on a rank, as plain objects: what wins, what is kept, what travels back, what ends it."""

from __future__ import annotations

import os
import threading

import cloudpickle
import pytest

from air_magic.cell import CellProgram
from air_magic.launch.rank import session


@pytest.fixture(autouse=True)
def fresh_namespace():
    """Each test starts from an empty session namespace, as a new rank does."""
    session.namespace.reset()
    yield
    session.namespace.reset()


def cell(source: str, **notebook: object) -> CellProgram:
    return CellProgram.build(source, "<cell>", notebook)


def test_names_a_cell_binds_are_the_sessions_and_win_over_the_notebooks():
    """A name the session assigned is not overwritten by the notebook's; one it only read travels fresh each time."""
    ns = session.namespace
    assert session.run(cell("scale = 5\nscale + shift", scale=1, shift=10), (), {}, 0) == 15
    assert session.run(cell("scale * 100 + shift", scale=2, shift=7), (), {}, 0) == 507
    assert "scale" in ns.owned and "shift" not in ns.owned


def test_a_name_read_in_one_cell_and_not_the_next_is_not_taken_over_by_the_session():
    """A notebook global given to one cell and left alone stays the notebook's for later cells."""
    session.run(cell("lr", lr=0.1), (), {}, 0)
    session.run(cell("1"), (), {}, 0)
    assert session.run(cell("lr", lr=0.5), (), {}, 0) == 0.5


def test_what_a_cell_bound_before_it_raised_is_kept():
    """Names bound before an exception stay in the session."""
    with pytest.raises(ValueError):
        session.run(cell("done = 3\nraise ValueError('typo')"), (), {}, 0)
    assert session.namespace.globals["done"] == 3 and "done" in session.namespace.owned


def test_refs_are_replaced_by_the_ranks_own_objects_inside_containers():
    """Ref('x') in the arguments (also in lists, tuples, dicts) becomes the rank's object; a missing one: NameError."""
    session.namespace.assign({"model": "m0"})
    args = session.resolve_refs(
        (session.Ref("model"), [session.Ref("model")], {"k": session.Ref("model")}), session.namespace, 0
    )
    assert args == ("m0", ["m0"], {"k": "m0"})
    with pytest.raises(NameError, match="'nope' is not defined in the session on rank 1"):
        session.resolve_refs(session.Ref("nope"), session.namespace, 1)
    with pytest.raises(ValueError, match="name of a variable"):
        session.Ref("not a name")


def test_a_function_resolves_its_globals_in_the_session_first_and_its_global_assignments_land_there():
    """A notebook function reads session names before its own captured globals, and `global x` writes the session."""
    namespace = {"__name__": "__main__", "offset": 1}
    exec("def f(x):\n    global seen\n    seen = x + offset\n    return seen", namespace)  # noqa: S102
    f = cloudpickle.loads(cloudpickle.dumps(namespace["f"]))
    session.namespace.assign({"offset": 100})
    assert session.run(f, (1,), {}, 0) == 101
    assert session.namespace.globals["seen"] == 101


def test_an_unpicklable_or_oversized_value_comes_back_as_a_placeholder_and_stays_as_underscore(monkeypatch):
    """The reply carries a placeholder with the repr and why; the object stays on the rank as `_`."""
    lock = threading.Lock()
    reply = cloudpickle.loads(session.reply(lock, 1))
    assert isinstance(reply.value, session.Placeholder) and reply.value.rank == 1
    assert "cannot be pickled" in repr(reply.value) and "lock" in repr(reply.value)
    assert session.namespace.globals["_"] is lock
    assert cloudpickle.loads(session.reply(None, 0)).value is None
    monkeypatch.setattr(session, "RESULT_LIMIT", 10)
    big = cloudpickle.loads(session.reply(list(range(100)), 0))
    assert isinstance(big.value, session.Placeholder) and "over the" in big.value.why


def test_errors_from_torch_distributed_or_cuda_end_the_session_and_user_errors_do_not():
    """A user's exception keeps the rank; one raised inside torch.distributed or a CUDA error ends the session."""
    assert session.ends_session(ValueError("typo")) is None
    assert session.ends_session(KeyboardInterrupt()) is None
    assert "CUDA" in (session.ends_session(RuntimeError("CUDA error: an illegal memory access")) or "")
    code = compile("raise RuntimeError('gloo')", os.path.join("x", "torch", "distributed", "c10d.py"), "exec")
    try:
        exec(code, {})  # noqa: S102
    except RuntimeError as exc:
        assert "torch.distributed" in (session.ends_session(exc) or "")
