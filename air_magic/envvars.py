"""Every `AIR_MAGIC_*` environment variable, named once: the ones users set, and the ones air_magic sets for itself.

Every other module imports the name from here (tests/unit/test_import_map.py checks that no other module
spells one). The user-facing ones are documented in docs/environment.md; the internal ones are how
air_magic's own processes (the helper, ranks, the MLflow relay) find each other, and are not for users.
Not for: reading or parsing the values (each variable's reader lives with what it configures).
"""

from __future__ import annotations

# -- set by users (docs/environment.md) ---------------------------------------------------------------------
#: Where run directories live (default ~/.cache/air_magic/runs).
RUNS_DIR = "AIR_MAGIC_RUNS_DIR"
#: `0`/false/no/off: ranks start as fresh interpreters, and `ray_init` has no Ray worker started ahead.
WARM = "AIR_MAGIC_WARM"
#: Comma-separated modules a warm helper (and a Ray rank's actor) imports before any call.
PRELOAD = "AIR_MAGIC_PRELOAD"
#: How a call shows its progress: auto, panel or text.
DISPLAY = "AIR_MAGIC_DISPLAY"
#: Treat the machine as having no GPU (CPU ranks), whatever is installed.
FORCE_CPU = "AIR_MAGIC_FORCE_CPU"
#: A rank's pickled return value above this many MiB gets a ResultSizeWarning.
LARGE_RESULT_MIB = "AIR_MAGIC_LARGE_RESULT_MIB"
#: CPU worker slots of this node that calls running at once share (calls/ledger.py); default: the core count.
CPU_SLOTS = "AIR_MAGIC_CPU_SLOTS"

#: Seconds of no progress from which a watched call names a hung rank, at least (default 30; docs/watching.md).
HANG_AFTER = "AIR_MAGIC_HANG_AFTER"
#: `0`/false/no/off: the watch does not measure DDP's gradient all-reduce wait (launch/rank/ddp_wait.py; on by
#: default), which then counts as compute: a compute straggler under DDP is not named (docs/watching.md).
WATCH_DDP = "AIR_MAGIC_WATCH_DDP"

#: A workload file's secret `scope/key`: this prefix, then SCOPE_KEY upper-cased, non-alphanumerics as `_`.
SECRET_PREFIX = "AIR_MAGIC_SECRET_"
#: The 0600 YAML file of secrets `{scope: {key: value}}` (default ~/.config/air_magic/secrets.yaml).
SECRETS_FILE = "AIR_MAGIC_SECRETS_FILE"
#: For a command run's ranks (cli/command_rank.py): `0` turns the rank hook off, `no-watch` keeps it but records no
#: steps for the watch (cli/command_watch.py), `debug` has it say why it failed.
RANK_HOOK = "AIR_MAGIC_RANK_HOOK"
#: `never`: `air-magic run` refuses a workload whose `environment.dependencies` are not installed, naming them, instead
#: of installing them into a cached environment layered over yours (cli/layer.py); unset or `auto`: it installs.
INSTALL = "AIR_MAGIC_INSTALL"

USER_FACING = (
    RUNS_DIR,
    WARM,
    PRELOAD,
    DISPLAY,
    FORCE_CPU,
    LARGE_RESULT_MIB,
    CPU_SLOTS,
    HANG_AFTER,
    WATCH_DDP,
    SECRET_PREFIX,
    SECRETS_FILE,
    RANK_HOOK,
    INSTALL,
)

# -- set by air_magic for its own processes (internal: not for users, may change) -----------------------------
#: In a rank: the call's run directory on the rank's machine (the Ray scratch directory on another node).
INTERNAL_RUN_DIR = "AIR_MAGIC_INTERNAL_RUN_DIR"
#: In every process of a job: the job's id, so that a process that left the job's tree is still found.
JOB = "AIR_MAGIC_JOB"
#: In a local rank: the supervisor's pid; the rank dies with it.
SUPERVISOR_PID = "AIR_MAGIC_SUPERVISOR_PID"
#: In a hot rank: its command and done pipes' descriptors ("cmd,done").
HOT_FDS = "AIR_MAGIC_HOT_FDS"
#: In a rank: the descriptor of the pipe on which it says it is about to exit.
DONE_FD = "AIR_MAGIC_DONE_FD"
#: In a Ray rank: the Ray node it runs on.
RAY_NODE_ID = "AIR_MAGIC_RAY_NODE_ID"
#: In a rank: the call's MLflow run.
MLFLOW_RUN_ID = "AIR_MAGIC_MLFLOW_RUN_ID"
#: In a rank ("1"): its MLflow calls are relayed to the notebook's store, not written to it.
MLFLOW_RELAY = "AIR_MAGIC_MLFLOW_RELAY"

#: In a rank ("1"): a `breakpoint()` there is answered from the notebook through the run directory (debug_channel.py).
DEBUG_SERVED = "AIR_MAGIC_INTERNAL_DEBUG_SERVED"

#: In a rank ("1"): the call is watched: the rank keeps its step times (launch/rank/steps.py).
WATCH = "AIR_MAGIC_INTERNAL_WATCH"

#: In a watched rank: how many of its steps to profile with torch.profiler (launch/rank/profiler.py).
PROFILE = "AIR_MAGIC_INTERNAL_PROFILE"

#: In a GPU rank ("1"): keep CUDA's allocation history, for the snapshot an out-of-memory error writes
#: (launch/rank/memory.py).
MEMORY_HISTORY = "AIR_MAGIC_INTERNAL_MEMORY_HISTORY"

#: In a command run's script: the attempt's directory of this node's rank files (cli/command_rank.py); a Python
#: process under it with RANK and LOCAL_RANK set becomes a rank of the run.
RANK_DIR = "AIR_MAGIC_INTERNAL_RANK_DIR"
#: In a command run's rank and what it starts: the rank's pid, so that its children (DataLoader workers, a
#: subprocess) are not ranks of their own.
RANK_HOOKED = "AIR_MAGIC_INTERNAL_RANK_HOOKED"

INTERNAL = (
    INTERNAL_RUN_DIR,
    JOB,
    SUPERVISOR_PID,
    HOT_FDS,
    DONE_FD,
    RAY_NODE_ID,
    MLFLOW_RUN_ID,
    MLFLOW_RELAY,
    DEBUG_SERVED,
    WATCH,
    PROFILE,
    MEMORY_HISTORY,
    RANK_DIR,
    RANK_HOOKED,
)
