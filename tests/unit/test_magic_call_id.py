"""The magics that act on one call declare their ID once (magics/options.call_id): %distributed_attach requires it."""

from __future__ import annotations

import pytest
from IPython.core.error import UsageError
from IPython.core.magic_arguments import parse_argstring

from air_magic.magics import options
from air_magic.magics.calls import CallMagics


def _id_type(magic) -> object:
    (action,) = [a for a in magic.parser._actions if a.dest == "id"]
    return action.type


def test_attach_takes_the_shared_call_id_and_requires_it():
    assert _id_type(CallMagics.distributed_attach) is options.call_id_text is _id_type(CallMagics.distributed_show)
    assert parse_argstring(CallMagics.distributed_attach, " 20260105-101500-train ").id == "20260105-101500-train"
    with pytest.raises(UsageError):
        parse_argstring(CallMagics.distributed_attach, "")
    assert parse_argstring(CallMagics.distributed_show, "").id is None
