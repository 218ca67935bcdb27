"""What runs inside a rank's process, whichever launcher started it (the helper's fork, a fresh interpreter, Ray).

worker.py    loads a call's payload, runs it, leaves a result or an error file; a hot rank's loop between calls
session.py   a session's namespace on the rank, and what a call leaves there
carried.py   the notebook's own modules, served to the rank by name
debugger.py  breakpoint() and post-mortems, answered from the notebook's cell

Nothing here imports the notebook's side (the launchers, the runner) or IPython.
"""
