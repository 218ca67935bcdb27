"""The run directory's formats: one module per kind of file a call leaves, used by every reader and writer.

rundir.py          every path in a run directory, and its privacy (0700 / 0600)
scratch.py         a Ray rank's scratch directory on its node, held while its process lives
rank_files.py      a rank's log, usage and metric files, read the same way by every launcher
errorfile.py       a rank's exception as files
stack_dumps.py     the stacks ranks write to their logs, read back
debug_channel.py   a rank's debugger prompt out and the answer back
flight_recorder.py NCCL's flight recorder dumps and what they say
step_times.py      a watched rank's step times and what it does now
command_logs.py    where a command run keeps its ranks' logs, per attempt and node
node_mirror.py     a command run's node files, sent back from a node of another machine as they change

These modules start nothing and import no other part of launch/ but protocol.py, the marks of stacks.py
and each other.
"""
