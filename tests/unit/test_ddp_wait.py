"""How a watched rank times DDP's all-reduce wait (launch/rank/ddp_wait.py), in this process with no process group:
a final callback queued during the backward pass, as DDP's reducer queues its wait for the buckets, is inside the
measured span; the environment turns it off; the outputs it finds tensors in."""

from __future__ import annotations

import time

import pytest
import torch
from torch.autograd import Variable

from air_magic import envvars
from air_magic.launch.rank import ddp_wait

#: What the stand-in for DDP's final wait sleeps, in seconds (a lower bound of the wait measured, on any machine).
PAUSE = 0.02


@pytest.fixture(autouse=True)
def nothing_left():
    ddp_wait.take()
    yield
    ddp_wait._armed = False
    ddp_wait.take()


def _backward(output: object, loss: torch.Tensor, weight: torch.Tensor) -> None:
    """`ddp_wait.watch(ddp, output)` as a DDP forward in training does, then a backward pass of `loss` in which the last
    gradient's hook queues a final callback that sleeps PAUSE s (as DDP's reducer queues, once its last bucket is
    ready, the wait for the buckets' all-reduces)."""
    ddp_wait.watch(None, output)

    def ready(_: torch.Tensor) -> None:
        Variable._execution_engine.queue_callback(lambda: time.sleep(PAUSE))

    handle = weight.register_post_accumulate_grad_hook(ready)
    try:
        loss.backward()
    finally:
        handle.remove()


def test_the_wait_is_from_the_gradients_computed_to_the_end_of_ddps_own_final_callback():
    """The wait measured holds the whole of a final callback queued late in the backward pass, and `take` hands it
    over once."""
    layer = torch.nn.Linear(4, 4)
    out = layer(torch.randn(2, 4))
    _backward(out, out.sum(), layer.weight)
    assert ddp_wait.take() >= PAUSE
    assert ddp_wait.take() == 0.0


def test_outputs_in_lists_tuples_and_dicts_are_found():
    """A DDP output may be a dict of tensors, or a tuple holding a list: the backward pass through any of them is
    measured; an output with no tensor (or none with a graph) arms nothing."""
    layer = torch.nn.Linear(4, 4)
    out = layer(torch.randn(2, 4))
    _backward({"logits": out, "n": 3}, out.sum(), layer.weight)
    assert ddp_wait.take() >= PAUSE
    doubled = layer(torch.randn(2, 4)) * 2
    _backward(("text", [doubled.detach(), doubled]), doubled.sum(), layer.weight)
    assert ddp_wait.take() >= PAUSE
    ddp_wait.watch(None, ("text", torch.zeros(2), {"k": None}))
    assert ddp_wait._armed is False


def test_air_magic_watch_ddp_0_turns_it_off(monkeypatch):
    """`AIR_MAGIC_WATCH_DDP=0` (or false, no, off): nothing is armed and no wait is measured; unset, it is on."""
    layer = torch.nn.Linear(4, 4)
    for value in ("0", "off", " False "):
        monkeypatch.setenv(envvars.WATCH_DDP, value)
        assert not ddp_wait.enabled()
        out = layer(torch.randn(2, 4))
        _backward(out, out.sum(), layer.weight)
        assert ddp_wait.take() == 0.0
    monkeypatch.delenv(envvars.WATCH_DDP)
    assert ddp_wait.enabled()
