"""What the owner of calls (air_magic/owner/) uses: the table of its calls, their handles and records, the runner
and its policy, its sessions, and the ledger and leases of GPUs and CPU slots.

Every process that makes calls (a Jupyter kernel, an `air-magic` command-line process, a detached call's owner
process) holds one owner, and the owner holds one of each of these: no call, kept world, unit or session is kept at
module level here. Nothing here reaches the owner or imports a listener (display/, tracking/, watching/, the
resource sampler: it speaks their interface, air_magic/listeners.py) or a front door (magics/, cli/, decorator.py,
cell.py), which tests/unit/test_import_map.py guards. It reaches ranks only through a launcher (launch/).

  table.py            every call of this process: id, small number, handle (`find`)
  handle.py           `DistributedCall`, every call's handle, run and started by the owner
  handle_listener.py  the listener a handle puts first, to learn what the runner does
  runner.py           `run(spec, launcher)`: the one path every call takes, and its policy
  setup.py            what a call is put together from: settings, world key, launch request
  stops.py            how a call is stopped (Stop, timeout, a failure's grace, the flight recorder)
  outcome.py          what an attempt's ranks left, turned into values or the one error to raise
  record.py           `call.json`, a call's record: its writer and readers
  rebuilt.py          the handle of an ended call, rebuilt from its record
  sessions.py         sessions as the owner sees them, and the calls that act on a session
  ledger.py, leases.py  which call holds which GPU or CPU slot, on this node and machine-wide
  attached.py         a call of another process, reached through its run directory
  detached.py         a call owned by a process of its own (`python -m air_magic.owner.detached` runs that owner)
  debugging.py        ranks' debuggers as the owner serves them: prompts, attaching, post-mortems

This package's `__init__` imports nothing, so importing any one of its modules costs only that module.
"""
