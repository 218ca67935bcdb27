"""Pickling what a rank sends back to the notebook so that it never brings CUDA with it.

A CUDA tensor pickled as it is rebuilds as a CUDA tensor in the notebook, which
creates a CUDA context there (memory held on that GPU for the rest of the
session). Results and exceptions therefore travel with every tensor moved to
the CPU; everything else pickles as cloudpickle would. Runs in the worker.
"""

from __future__ import annotations

import io
import pickle
import sys
from typing import Any, BinaryIO

import cloudpickle


class _CpuPickler(cloudpickle.Pickler):
    """cloudpickle, except that a tensor on an accelerator is pickled as its CPU copy."""

    def reducer_override(self, obj: Any) -> Any:
        torch = sys.modules.get("torch")  # never import torch on the user's behalf
        if torch is not None and isinstance(obj, torch.Tensor) and obj.device.type not in ("cpu", "meta"):
            cpu = obj.detach().to("cpu")
            if isinstance(obj, torch.nn.Parameter):
                cpu = torch.nn.Parameter(cpu, requires_grad=obj.requires_grad)
            else:
                cpu.requires_grad_(obj.requires_grad and cpu.is_leaf and cpu.is_floating_point())
            return cpu.__reduce_ex__(pickle.DEFAULT_PROTOCOL)
        return super().reducer_override(obj)


def dump(value: Any, file: BinaryIO) -> None:
    _CpuPickler(file, protocol=pickle.DEFAULT_PROTOCOL).dump(value)


def dumps(value: Any) -> bytes:
    buf = io.BytesIO()
    dump(value, buf)
    return buf.getvalue()
