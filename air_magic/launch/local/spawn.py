"""Starting the supervisor's children: workers and rendezvous stores, forked from the warm state or spawned fresh.

Every child leads a session of its own, reads /dev/null on stdin and writes to
its log (a worker: its rank's log file). A forked child takes the caller's
environment, closes every pipe of the supervisor, gets its signal handlers back
and is given what a fresh interpreter would have had (random seeds, thread
count); a spawned one is a fresh interpreter started by `posix_spawn` with the
boot line of its module.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

from .. import protocol as p
from ..boot import INTERNAL_ERROR, PACKAGE_PARENT, boot_command
from ..rank.worker import DONE_FD_ENV
from ..rendezvous import STORE_FD
from .preload import Preloaded

#: The descriptor a spawned worker's done pipe arrives on.
DONE_FD = 3
#: Signals a spawned child gets back at their defaults (the supervisor catches or ignores them).
_DEFAULT_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGPIPE, signal.SIGCHLD)


def spawn(
    executable: str,
    module: str,
    args: list[str],
    env: dict[str, str],
    *,
    log: str | None = None,
    fds: dict[int, int] | None = None,
    parent: str = PACKAGE_PARENT,
) -> int:
    """A fresh interpreter running `module.main()` with `args`, in a session of its own; its pid.

    `log`: where its stdout and stderr go (else it keeps the supervisor's); `fds`: descriptor it
    sees -> descriptor of ours.
    """
    actions: list[tuple[int, ...] | tuple[int, int, str, int, int]] = [
        (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0)
    ]
    if log is not None:
        actions += [
            (os.POSIX_SPAWN_OPEN, 1, log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600),
            (os.POSIX_SPAWN_DUP2, 1, 2),
        ]
    actions += [(os.POSIX_SPAWN_DUP2, ours, theirs) for theirs, ours in (fds or {}).items()]
    return os.posix_spawn(
        executable,
        [executable, "-c", boot_command(module, parent=parent), *args],
        env,
        file_actions=actions,
        setsid=True,
        setsigdef=_DEFAULT_SIGNALS,
    )


class Spawner:
    """Starts workers and stores for one supervisor; `private_fds()` are its pipes, closed in every forked child."""

    def __init__(self, preloaded: Preloaded, private_fds: Callable[[], Iterable[int]]) -> None:
        self.preloaded = preloaded
        self.private_fds = private_fds

    def worker(
        self,
        msg: p.LaunchJob,
        rank: int,
        env: dict[str, str],
        log: str,
        close: Iterable[int] = (),
        done: int | None = None,
    ) -> int:
        """One rank of `msg`'s job, writing to `log`: forked from the warm state (`msg.fork`), or a fresh interpreter.

        `close`: descriptors the forked rank closes; `done`: the write end of a pipe on which the rank says it
        is done, just before it exits.
        """
        if done is not None:
            env = dict(env, **{DONE_FD_ENV: str(done if msg.fork else DONE_FD)})
        if not msg.fork:
            args, fds = [msg.run_dir, str(rank)], ({DONE_FD: done} if done is not None else None)
            return spawn(
                msg.executable, "air_magic.launch.rank.worker", args, env, log=log, fds=fds, parent=msg.package_parent
            )

        def body() -> int:
            from ..rank.worker import run_forked

            for fd in close:
                try:
                    os.close(fd)
                except OSError:
                    pass  # already closed with the pools' ends
            _reset_inherited_state(env)
            self.preloaded.hide_in_child()
            run_forked(Path(msg.run_dir), rank)  # ends the process
            return INTERNAL_ERROR

        return self.fork(body, env=env, log=log)

    def store(self, msg: p.LaunchJob, env: dict[str, str], sock: socket.socket, port: int) -> int:
        """A process serving the TCPStore of `msg`'s job on listening socket `sock` (forked when warm)."""
        n = msg.world_size
        if msg.fork and "torch" in sys.modules:
            return self.fork(lambda: _serve_store(sock.fileno(), port, n), env=env, log=None)
        args, fds = [str(port), str(n)], {STORE_FD: sock.fileno()}
        return spawn(msg.executable, "air_magic.launch.rendezvous", args, env, fds=fds, parent=msg.package_parent)

    def fork(self, body: Callable[[], int], env: dict[str, str], log: str | None) -> int:
        """A child forked from here that runs `body()` and exits with what it returns; never returns in the child."""
        pid = os.fork()
        if pid:
            return pid
        code = INTERNAL_ERROR
        try:
            os.setsid()
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            out = os.open(log or os.devnull, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            os.dup2(out, 1)
            os.dup2(out, 2)
            for fd in (null, out, *self.private_fds()):
                os.close(fd)  # no child holds another's pipes: a hot rank sees end-of-file when its pool goes
            signal.set_wakeup_fd(-1)
            for sig in (signal.SIGCHLD, signal.SIGTERM):
                signal.signal(sig, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            os.environ.clear()
            os.environ.update(env)
            code = body()
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:  # noqa: BLE001 - a broken fork must never return into the supervisor
            import traceback

            traceback.print_exc()
        finally:
            os._exit(code)


def _serve_store(fd: int, port: int, n: int) -> int:
    from ..rendezvous import serve

    serve(fd, port, n)
    return 0


def _reset_inherited_state(env: dict[str, str]) -> None:
    """In a forked worker: give it what a fresh interpreter would have had."""
    random.seed()  # a fresh interpreter seeds from the OS; forks would share one stream
    np_random = sys.modules.get("numpy.random")
    if np_random is not None:
        np_random.seed()
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.seed()  # fresh interpreters draw a random initial seed too
    threads = env.get("OMP_NUM_THREADS", "")
    if torch is not None and threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))  # OpenMP read the supervisor's value at import
