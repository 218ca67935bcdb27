"""The process boundary: where ranks run, behind one Launcher interface.

interface.py  the Launcher and JobHandle the runner talks to
protocol.py   the typed requests and events that cross the boundary
rundir.py     the run directory: its layout and privacy (the only place its paths are built)
stopper.py    stopping process trees (SIGTERM, grace, SIGKILL) for every helper
local.py      the local launcher: one supervisor per kernel, ranks on this machine
supervisor.py rendezvous.py worker.py errorfile.py   what runs in the helper and rank processes
ray/          the Ray launcher: ranks as Ray actors on several machines (imports Ray only when used)

Nothing here imports IPython, ipywidgets or MLflow.
"""
