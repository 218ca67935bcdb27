"""air_magic's rank hook: the `sitecustomize` of every Python process under a command run's script, whose
PYTHONPATH has this directory first (cli/node.py). This directory holds only this file, so it shadows nothing else.

In a process with `RANK` and `LOCAL_RANK` set (a rank that torchrun, `python -m torch.distributed.run` or
`accelerate launch` started) it loads cli/command_rank.py from its file, without importing the air_magic package,
and calls its `hook()`. Then, in every process, it runs the `sitecustomize` that Python would have imported without
this one (the next on sys.path: the user's, the environment's), as Python imports only the first one found. It never
raises: a failing `sitecustomize` of the user's is said as Python says it.
"""

from __future__ import annotations

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


def _hook() -> None:
    if "RANK" not in os.environ or "LOCAL_RANK" not in os.environ:
        return
    try:
        import importlib.util

        path = os.path.join(os.path.dirname(_HERE), "command_rank.py")
        spec = importlib.util.spec_from_file_location("_air_magic_command_rank", path)
        if spec is None or spec.loader is None:
            return
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        module.hook()
    except Exception:  # noqa: BLE001, S110 - the process runs on as it would without air_magic
        pass


def _chain() -> None:
    """Run the next `sitecustomize` on sys.path (this directory skipped), as `sitecustomize`."""
    try:
        import importlib.machinery
        import importlib.util

        here = os.path.realpath(_HERE)
        rest = [p for p in sys.path if os.path.realpath(p or os.curdir) != here]
        spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
        if spec is None or spec.loader is None:
            return
        module = importlib.util.module_from_spec(spec)
    except Exception:  # noqa: BLE001 - nothing found to run
        return
    ours = sys.modules.get("sitecustomize")
    sys.modules["sitecustomize"] = module
    try:
        spec.loader.exec_module(module)
    except Exception as err:  # noqa: BLE001 - as site.py says a failing sitecustomize
        if ours is not None:
            sys.modules["sitecustomize"] = ours
        if sys.flags.verbose:
            import traceback

            traceback.print_exc()
        else:
            sys.stderr.write(f"Error in sitecustomize; set PYTHONVERBOSE for traceback:\n{type(err).__name__}: {err}\n")


_hook()
_chain()
