"""What accelerators this node has, and whether a requested setting fits them.

Detection goes through NVML (nvidia-ml-py), which reads the driver without
creating a CUDA context, so the notebook's own process never initializes CUDA.
Types are written `GPU_<n>x<MODEL>` (`GPU_8xH100`) or `CPU`.
"""

from __future__ import annotations

import enum
import os
import re
import warnings
from dataclasses import dataclass
from functools import lru_cache

from .envvars import FORCE_CPU
from .errors import ConfigurationError

#: Workers started on a machine without GPUs when no count is given.
DEFAULT_CPU_WORKERS = 2

_TYPE_RE = re.compile(r"^GPU(?:_(\d+)x([A-Za-z0-9]+))?$", re.IGNORECASE)


def parse_gpu_type(text: str) -> tuple[int | None, str | None] | None:
    """GPUs per node and model of a type string: 'GPU_2xH100' -> (2, 'H100'), 'GPU' -> (None, None); None if not one."""
    m = _TYPE_RE.match(text.strip())
    if m is None:
        return None
    return (int(m.group(1)) if m.group(1) is not None else None), m.group(2)


_FORM_FACTOR = re.compile(r"^(\d+GB|SXM\d*|PCIE|HBM\d*e?|NVL|MIG.*)$", re.IGNORECASE)


#: GPU models the named types below cover; any other model works as a plain string ("GPU_4xRTX4090").
KNOWN_MODELS = ("A10", "A100", "L4", "L40S", "H100", "H200", "B200", "B300")


class GPUType(enum.StrEnum):
    """Deprecated GPU model names (`gpu_type=GPUType.H100`); use AcceleratorType. Accepted wherever a string is."""

    A10 = "A10"
    A100 = "A100"
    L4 = "L4"
    L40S = "L40S"
    H100 = "H100"
    H200 = "H200"
    B200 = "B200"
    B300 = "B300"


#: Accelerator types by name, `AcceleratorType.GPU_8xH100 == "GPU_8xH100"`, plus `AcceleratorType.CPU`.
#: Members are strings, so they are accepted wherever a type string is, and a string is accepted wherever they are.
AcceleratorType = enum.StrEnum(  # type: ignore[misc]
    "AcceleratorType",
    [("CPU", "CPU")] + [(f"GPU_{n}x{m}", f"GPU_{n}x{m}") for m in KNOWN_MODELS for n in (1, 2, 4, 8)],
    module=__name__,
)
AcceleratorType.__doc__ = "Accelerator types `GPU_<n>x<MODEL>` and `CPU`, as strings (`AcceleratorType.GPU_8xH100`)."


@dataclass(frozen=True)
class Node:
    """The accelerators of this node as detected."""

    gpu_count: int
    gpu_model: str | None

    @property
    def kind(self) -> str:
        return "GPU" if self.gpu_count else "CPU"

    def type_for(self, n: int) -> str:
        return f"GPU_{n}x{self.gpu_model}" if self.gpu_count else "CPU"


def model_from_name(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'H100'; 'NVIDIA GeForce RTX 4090' -> 'RTX4090'."""
    words = [w for w in re.split(r"[\s\-]+", name) if w]
    words = [w for w in words if w.upper() not in {"NVIDIA", "TESLA", "GEFORCE", "QUADRO"}]
    kept: list[str] = []
    for w in words:
        if _FORM_FACTOR.match(w):
            break
        kept.append(w)
    return "".join(kept) or "GPU"


def _visible(count: int) -> int:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return count
    ids = [v for v in visible.split(",") if v.strip() and v.strip() != "-1"]
    return min(count, len(ids)) if visible.strip() != "-1" else 0


@lru_cache(maxsize=1)
def _nvml_devices() -> tuple[int, str | None]:
    try:
        import pynvml
    except ImportError:  # nvidia-ml-py not installed: treat as no GPU
        return 0, None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:  # no driver: a CPU machine
        return 0, None
    try:
        count = pynvml.nvmlDeviceGetCount()
        if count == 0:
            return 0, None
        name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0))
        if isinstance(name, bytes):
            name = name.decode()
        return count, model_from_name(name)
    finally:
        pynvml.nvmlShutdown()


def detect() -> Node:
    """The node as NVML sees it, limited by CUDA_VISIBLE_DEVICES. Never touches CUDA."""
    if os.environ.get(FORCE_CPU):
        return Node(0, None)
    count, model = _nvml_devices()
    count = _visible(count)
    return Node(count, model if count else None)


def _check_count(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigurationError(
            f"{what} must be a positive whole number, got {value!r}; "
            "pass for example num_accelerators=2, or None for every GPU of the node."
        )
    if value <= 0:
        raise ConfigurationError(f"{what} must be at least 1, got {value}; pass None to use every GPU of the node.")
    return value


def resolve(num: object, accelerator_type: str | None, node: Node | None = None) -> tuple[int, str]:
    """Turn the user's (num_accelerators, accelerator_type) into (world size, type string).

    Raises ConfigurationError, naming what was detected, when they do not fit the node.
    """
    node = node or detect()
    n = None if num is None else _check_count(num, "num_accelerators")
    if isinstance(accelerator_type, GPUType):
        warnings.warn(
            f"GPUType.{accelerator_type.name} is deprecated; use accelerator_type='GPU_<n>x{accelerator_type}' "
            "(AcceleratorType) instead.",
            FutureWarning,
            stacklevel=4,
        )
        accelerator_type = legacy_gpu_type(str(accelerator_type), n)
    if accelerator_type is not None and not isinstance(accelerator_type, str):
        raise ConfigurationError(
            f"accelerator_type must be a string such as 'GPU_2xH100' or 'CPU', got {accelerator_type!r}."
        )
    if accelerator_type is not None and accelerator_type.strip().upper() == "CPU":
        n = DEFAULT_CPU_WORKERS if n is None else n
        cores = os.cpu_count() or 1
        if n > cores:
            warnings.warn(
                f"{n} CPU workers on a machine with {cores} cores will be slow; "
                f"pass num_accelerators={cores} or fewer.",
                ResourceWarning,
                stacklevel=4,
            )
        return n, "CPU"
    if accelerator_type is None:
        if node.kind == "CPU":
            return resolve(n, "CPU", node)
        n = node.gpu_count if n is None else n
        if n > node.gpu_count:
            raise ConfigurationError(
                f"num_accelerators={n} but this node has {node.gpu_count} GPU(s) "
                f"({node.type_for(node.gpu_count)}); pass num_accelerators={node.gpu_count} or fewer."
            )
        return n, node.type_for(n)
    parsed = parse_gpu_type(accelerator_type)
    if parsed is None:
        raise ConfigurationError(
            f"accelerator_type {accelerator_type!r} is not understood; write it as "
            f"'GPU_<n>x<MODEL>' (this node: {node.type_for(node.gpu_count)!r}) or 'CPU'."
        )
    if node.kind == "CPU":
        raise ConfigurationError(
            f"accelerator_type {accelerator_type!r} asks for GPUs, but none were detected on this node; "
            "pass accelerator_type='CPU' (or leave it out) to run CPU workers with gloo."
        )
    want, model = parsed
    if model and model.upper() != (node.gpu_model or "").upper():
        raise ConfigurationError(
            f"accelerator_type {accelerator_type!r} does not match this node, which has "
            f"{node.type_for(node.gpu_count)!r}; pass accelerator_type={node.type_for(node.gpu_count)!r} "
            "or leave it out."
        )
    if want is not None:
        if n is not None and n != want:
            raise ConfigurationError(
                f"num_accelerators={n} contradicts accelerator_type {accelerator_type!r}; give one or make them agree."
            )
        n = want
    n = node.gpu_count if n is None else n
    if n > node.gpu_count or n <= 0:
        raise ConfigurationError(
            f"{n} GPU(s) asked for, but this node has {node.type_for(node.gpu_count)!r}; "
            f"ask for {node.gpu_count} or fewer."
        )
    return n, node.type_for(n)


def legacy_gpu_type(gpu_type: str, n: int | None) -> str:
    """Map the old `gpu_type="H100"` to the new type syntax."""
    if gpu_type.strip().upper() in {"CPU", "GPU"} or gpu_type.upper().startswith("GPU_"):
        return gpu_type
    node = detect()
    count = n if n is not None else node.gpu_count
    return f"GPU_{count}x{gpu_type.strip()}"
