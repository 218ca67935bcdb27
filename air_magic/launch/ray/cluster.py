"""Reaching a Ray cluster from the notebook: `ray_init`, the connection check, and what the cluster can hold.

`ray_init()` with no address starts Ray on this machine with every process
(GCS, raylet, dashboard and its agents, workers) on 127.0.0.1: on Linux Ray
otherwise binds the machine's network address, and whoever reaches a Ray
port can run code on it. With an address (or RAY_ADDRESS) it joins that
cluster as it is. Spares (spares.py) are on by default only for a Ray this
kernel started: on a cluster joined by address, actors held between calls are
what the user asked for, never a default. This module imports Ray only when
called, so a one-node call never needs it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import threading
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any
from urllib.parse import urlparse

from ...accelerators import DEFAULT_CPU_WORKERS, _check_count, parse_gpu_type
from ...envvars import FORCE_CPU
from ...errors import ConfigurationError
from ._compat import cluster_mode_off

#: The variable that, set to 0, makes Ray use 127.0.0.1 as this node's address (node_ip_address="127.0.0.1" alone
#: is not enough).
_LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
_context: Any = None
#: ray_init's `packages` (see there; launch/ray/packages.py does it).
PACKAGE_MODES = ("sync", "check", "off")
_packages = "sync"
#: How long a spare actor set waits for a call by default, in seconds (ray_init's `spares`; launch/ray/spares.py).
SPARE_IDLE = 300.0
#: 0 (no spares) until ray_init decides: a notebook connected by its own ray.init has none unless it asks.
_spare_idle = 0.0
#: ray_init started the Ray this notebook is connected to (rather than joining a cluster).
_started_here = False
#: What ends the spare sets kept now when ray_init turns spares off (the launcher gives it: see spares_off).
_end_spares: list[Callable[[], None]] = []
_warming: threading.Thread | None = None

INSTALL_HINT = "pip install 'air_magic[ray]'"


def import_ray() -> ModuleType:
    """The `ray` module, or a ConfigurationError that says how to install it."""
    try:
        import ray
    except ImportError as exc:
        raise ConfigurationError(
            f"Ray is not installed in this environment, and more than one node needs it: run `{INSTALL_HINT}` "
            "(the same version on every machine of the cluster), then call air_magic.ray_init()."
        ) from exc
    return ray


@contextlib.contextmanager
def _loopback_only() -> Iterator[None]:
    """While Ray starts here: every process it starts takes 127.0.0.1 as this node's address."""
    old = os.environ.get(_LOOPBACK_ENV)
    os.environ[_LOOPBACK_ENV] = "0"  # read by the processes Ray starts, at their import
    try:
        with cluster_mode_off():  # this process read the variable when it imported ray
            yield
    finally:
        if old is None:
            os.environ.pop(_LOOPBACK_ENV, None)
        else:
            os.environ[_LOOPBACK_ENV] = old


def ray_init(
    address: str | None = None, *, packages: str = "sync", spares: bool | float | None = None, **ray_init_kwargs: Any
) -> Any:
    """Connect this notebook to Ray, so that `distributed(..., num_nodes=N)` can run on N machines.

    address: None starts a Ray of this kernel's own on this machine, everything listening on
        127.0.0.1 only (the dashboard too, unless `dashboard_host=` says otherwise), or joins the
        cluster in RAY_ADDRESS when it is set; "auto" joins the cluster started on this machine with
        `ray start`; "ray://host:10001" connects through Ray Client; "host:6379" joins as a driver.
    packages: what a call does when a node's installed packages differ from the notebook's (compared, before
        any rank starts, for the distributions the notebook has imported). "sync" (the default): the call's
        ranks get the notebook's exact versions through a Ray runtime environment (its `py_modules`, uploaded
        and unpacked once per node); what cannot travel so is refused as with "check". "check": the call is
        refused, naming each package, node and version. "off": calls run with the nodes' packages as they are.
        It can be changed by calling ray_init again.
    spares: after a call that started new actors and ended them (not kept as hot ranks), a spare set of
        actors for the same shape (nodes, ranks per node, GPU or not, packages) is started in the background,
        each importing torch; the next call of that shape that needs new actors runs in it instead of waiting
        seconds for new Ray worker processes. A spare has no process group and never ran
        code of yours. It holds that shape's CPUs (and GPUs) until a call takes it, another call of this
        notebook needs what it holds, `%distributed_release`, or it has waited 300 s (a number of seconds
        here sets that time). None (the default): on where ray_init starts Ray here, off on a cluster
        joined by address (or RAY_ADDRESS), where a call leaves nothing held unless asked. True or a number
        turns them on, False off (and ends those started); calling ray_init again sets it anew.
    ray_init_kwargs: passed to `ray.init` (num_cpus=, runtime_env=, namespace=, ...).

    Once connected, every node with CPUs starts a Ray worker for this notebook in the background, so
    that the first call does not wait for that (AIR_MAGIC_WARM=0 turns this off).

    Calling it again is harmless: it returns the context of the connection already made. Returns
    Ray's context; its `dashboard_link` attribute opens the dashboard (through the Jupyter server
    when this kernel runs under one with jupyter-server-proxy and the dashboard is on this machine).
    """
    global _context, _packages, _started_here
    if packages not in PACKAGE_MODES:
        raise ConfigurationError(f"packages must be one of {', '.join(map(repr, PACKAGE_MODES))}, got {packages!r}.")
    if spares is not None and (not isinstance(spares, (int, float)) or spares < 0):
        raise ConfigurationError(f"spares must be None, True, False or a number of seconds >= 0, got {spares!r}.")
    _packages = packages
    ray = import_ray()
    if ray.is_initialized():
        if _context is None:  # connected by the user's own ray.init: not a Ray that ray_init started
            _context = ray.init(ignore_reinit_error=True)
            _context.dashboard_link = dashboard_link(getattr(_context, "dashboard_url", None))
            _started_here = False
        _set_spares(spares)
        return _context
    joining = address is not None or bool(os.environ.get("RAY_ADDRESS"))
    if joining:
        context = ray.init(address=address, **ray_init_kwargs)
    else:
        ray_init_kwargs.setdefault("dashboard_host", "127.0.0.1")
        ray_init_kwargs.setdefault("_node_ip_address", "127.0.0.1")
        with _loopback_only():
            # "local": a new Ray of this kernel's own, even when `ray start` left one running here
            context = ray.init(address="local", **ray_init_kwargs)
    context.dashboard_link = dashboard_link(getattr(context, "dashboard_url", None))
    _context, _started_here = context, not joining
    _set_spares(spares)
    prestart_workers()  # the nodes start a worker for this notebook while the user types
    return context


def _set_spares(spares: bool | float | None) -> None:
    """ray_init's `spares`: None is on for a Ray ray_init started here, off on a cluster it joined."""
    global _spare_idle
    if spares is None:
        spares = _started_here
    _spare_idle = (SPARE_IDLE if spares else 0.0) if isinstance(spares, bool) else float(spares)
    if not _spare_idle:
        for end in _end_spares:
            end()


def prestart_workers() -> None:
    """In the background: have every node with CPUs start a Ray worker for this notebook.

    A node starts its first worker for a notebook (a Ray job) slowly; done right after `ray_init`, the
    first call finds workers started on every node instead of waiting for them (and a call made before
    this is over waits for it rather than have the nodes start more workers at once). AIR_MAGIC_WARM=0
    turns it off, as for the local launcher. Where Ray keeps no idle worker (`RAY_num_workers_soft_limit=0` in
    this process's environment: a node then ends a worker one second after its task), nothing is warmed: the
    worker would be gone before the first call.
    """
    global _warming
    from ..boot import warm_default

    if _warming is not None or not warm_default() or os.environ.get("RAY_num_workers_soft_limit", "").strip() == "0":
        return
    _warming = threading.Thread(target=_boot_nodes, name="air_magic-ray-warm-up", daemon=True)
    _warming.start()


def packages_mode() -> str:
    """What ray_init(packages=...) chose."""
    return _packages


def spare_idle() -> float:
    """How long a spare actor set waits for a call, in seconds; 0: spares are off (ray_init's `spares`)."""
    return _spare_idle


def spares_off(end: Callable[[], None]) -> None:
    """`end` ends the spare sets kept now; ray_init calls it when it turns spares off."""
    _end_spares.append(end)


def warming() -> threading.Thread | None:
    """The thread of `prestart_workers`, if `ray_init` started one."""
    return _warming


def _boot_nodes() -> None:
    with contextlib.suppress(Exception):  # a warm-up that fails costs the first call its head start, no more
        ray = require_connected()
        from ray import cloudpickle
        from ray.util.placement_group import placement_group  # noqa: F401 - imported now, not in the first call
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from . import rank

        cloudpickle.register_pickle_by_value(rank)  # the nodes need not import it (see rank.py)
        boot = ray.remote(num_cpus=0, max_retries=0)(rank.node_ready)
        refs = [
            boot.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote()
            for n in alive_nodes(ray)
            if n.get("Resources", {}).get("CPU", 0) > 0
        ]
        ray.wait(refs, num_returns=len(refs), timeout=300)


def dashboard_link(url: str | None) -> str | None:
    """The dashboard's link: through the Jupyter server's proxy when it runs on this machine, else direct."""
    if not url:
        return None
    parsed = urlparse(url if "://" in url else f"http://{url}")
    if parsed.hostname in ("127.0.0.1", "localhost", "::1") and parsed.port:
        from ...jupyter import jupyter_base_url

        base = jupyter_base_url()
        if base is not None:
            return f"{base}proxy/{parsed.port}/"
    return parsed.geturl()


def require_connected() -> ModuleType:
    """The `ray` module of a connected notebook, or a ConfigurationError that says to call ray_init."""
    ray = sys.modules.get("ray")
    if ray is None and importlib.util.find_spec("ray") is None:
        import_ray()  # raises, with the install hint
    if ray is None or not ray.is_initialized():
        raise ConfigurationError(
            "num_nodes > 1 runs on a Ray cluster, and this notebook is not connected to one: call "
            "`from air_magic import ray_init; ray_init()` first (Ray on this machine), or "
            "ray_init('auto') / ray_init('ray://<head>:10001') to join a running cluster."
        )
    return ray


def check_shape(num: int | None, accelerator_type: str | None) -> tuple[int, str]:
    """Ranks per node and type as far as they can be checked without the cluster (at decoration)."""
    if num is not None:
        _check_count(num, "num_accelerators")
    if accelerator_type is None:
        return num or 1, "detected on the cluster"
    if not isinstance(accelerator_type, str):
        raise ConfigurationError(
            f"accelerator_type must be a string such as 'GPU_2xH100' or 'CPU', got {accelerator_type!r}."
        )
    if accelerator_type.strip().upper() == "CPU":
        return num or DEFAULT_CPU_WORKERS, "CPU"
    parsed = parse_gpu_type(accelerator_type)
    if parsed is None:
        raise ConfigurationError(
            f"accelerator_type {accelerator_type!r} is not understood; write it as 'GPU_<n>x<MODEL>' or 'CPU'."
        )
    count, _ = parsed
    if count is not None and num is not None and count != num:
        raise ConfigurationError(
            f"num_accelerators={num} contradicts accelerator_type {accelerator_type!r}; give one or make them agree."
        )
    return count or num or 1, accelerator_type.strip()


def alive_nodes(ray: ModuleType) -> list[dict[str, Any]]:
    return [n for n in ray.nodes() if n.get("Alive")]


def _gpu_model(node: dict[str, Any]) -> str | None:
    for key in node.get("Resources", {}):
        if key.startswith("accelerator_type:"):
            return str(key.split(":", 1)[1])
    return None


def resolve(num: int | None, accelerator_type: str | None, num_nodes: int) -> tuple[int, str]:
    """Ranks per node and the type string, asking the connected cluster (at the call)."""
    per_node, wanted = check_shape(num, accelerator_type)
    ray = require_connected()
    if wanted == "CPU":
        return per_node, "CPU"
    nodes = alive_nodes(ray)
    gpu_nodes = [n for n in nodes if n.get("Resources", {}).get("GPU", 0) > 0]
    if accelerator_type is None and (os.environ.get(FORCE_CPU) or not gpu_nodes):
        return num or DEFAULT_CPU_WORKERS, "CPU"
    if not gpu_nodes:
        raise ConfigurationError(
            f"accelerator_type {accelerator_type!r} asks for GPUs, but no node of the Ray cluster has one; "
            "pass accelerator_type='CPU' to run CPU workers with gloo."
        )
    count, model = (parse_gpu_type(wanted) or (None, None)) if accelerator_type is not None else (None, None)
    models = {_gpu_model(n) for n in gpu_nodes} - {None}
    if model and model.upper() not in {str(x).upper() for x in models}:
        raise ConfigurationError(
            f"accelerator_type {accelerator_type!r} does not match the GPUs of the Ray cluster "
            f"({', '.join(sorted(map(str, models))) or 'model unknown'})."
        )
    if num is None and count is None:
        per_node = int(max(n["Resources"]["GPU"] for n in gpu_nodes))  # every GPU of a node
    name = model or (min(map(str, models)) if len(models) == 1 else None)
    return per_node, f"GPU_{per_node}x{name}" if name else "GPU"
