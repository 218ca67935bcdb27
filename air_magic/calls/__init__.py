"""The owner of calls and kept worlds: the process that makes calls keeps everything that belongs to them.

That process is a Jupyter kernel, an `air-magic` command-line process, or a detached call's owner process
(`python -m air_magic.calls.detached RUN_DIR`); each is an owner with the same code. It holds the table of its
calls, their handles, each call's record in its run directory, the runner's policy (setup, stops, outcome), the
sessions it keeps, and the machine-wide ledger and leases of GPUs and CPU slots. It reaches ranks only through
a launcher (launch/), draws nothing itself (display/ and tracking/ are listeners it is handed), and imports no
front door (magics/, cli/, decorator.py, cell.py), which tests/unit/test_import_map.py guards.

  table.py            every call of this process: id, small number, handle (`find`)
  handle.py           `DistributedCall`, every call's handle; `run` and `spawn`, the front doors' way in
  handle_listener.py  the listener a handle puts first, to learn what the runner does
  runner.py           `run(spec, launcher)`: the one path every call takes, and its policy
  setup.py            what a call is put together from: listeners, settings, world key, launch request
  stops.py            how a call is stopped (Stop, timeout, a failure's grace, the flight recorder)
  outcome.py          what an attempt's ranks left, turned into values or the one error to raise
  listeners.py        the listener interface: what the runner tells the display and the tracking
  record.py           `call.json`, a call's record, and the handle rebuilt from it
  sessions.py         sessions as the owner sees them, and the calls that act on a session
  ledger.py, leases.py  which call holds which GPU or CPU slot, on this node and machine-wide
  attached.py         a call of another process, reached through its run directory
  detached.py         a call owned by a process of its own; `python -m` runs that owner
  debugging.py        ranks' debuggers as the owner serves them: prompts, attaching, post-mortems

This package's `__init__` imports nothing, so importing any one of its modules costs only that module.
"""
