"""Profiling N steps of every rank (`profile=N`, `%%distributed --profile N`): the notebook's side.

profile.py   the public `Profile` (`JobResult.profile`) and its text table
analysis.py  the ranks' traces read: per-rank split, slowest rank and cause, top ops, collective skew
merge.py     every rank's trace in one Chrome/Perfetto file, a process per rank
listener.py  the runner listener that asks the ranks to profile and builds the `Profile` at the end

The rank's side is launch/rank/profiler.py (torch.profiler over the watch's steps), the file between them
launch/files/profile_windows.py; docs/profiling.md says what each number means.
"""

from __future__ import annotations

from ..errors import ConfigurationError


def check_profile(profile: object, watch: object) -> int | None:
    """`profile` as both front doors take it: None (off) or a whole number of steps, 1 or more, of a watched call."""
    if profile is None:
        return None
    if isinstance(profile, bool) or not isinstance(profile, int) or profile < 1:
        raise ConfigurationError(
            f"profile must be a whole number of steps to profile, 1 or more, or None (no profiling), got {profile!r}; "
            "for example profile=5 profiles 5 steps of every rank."
        )
    if watch is False:
        raise ConfigurationError(
            f"profile={profile} profiles {profile} of the watch's steps, and watch=False turns the watch off; "
            "leave watch on (drop watch=False / --no-watch), or drop profile."
        )
    return profile
