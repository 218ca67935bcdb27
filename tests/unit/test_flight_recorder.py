"""NCCL's flight recorder (air_magic/launch/flight_recorder.py): its settings, and its dumps read into one sentence."""

from __future__ import annotations

import os
import pickle
from typing import Any

import pytest

from air_magic.launch.files import flight_recorder as fr


def _entry(seq: int, name: str = "all_reduce", state: str = "completed", pg: tuple[str, str] = ("0", "default_pg")):
    """One collective as torch's recorder writes it (the fields the parser reads, and a few it does not)."""
    return {
        "record_id": seq - 1,
        "pg_id": 0,
        "process_group": pg,
        "collective_seq_id": seq,
        "p2p_seq_id": 0,
        "op_id": seq,
        "profiling_name": f"nccl:{name}",
        "input_sizes": [[4]],
        "output_sizes": [[4]],
        "state": state,
        "retired": state == "completed",
        "is_p2p": False,
        "frames": [{"filename": "train.py", "line": 12, "name": "step"}],
    }


def _dump(entries: list[dict[str, Any]], world: int, enqueued: int, completed: int) -> dict[str, Any]:
    return {
        "version": "2.10",
        "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": str(list(range(world)))}},
        "pg_status": {
            "0": {
                "last_enqueued_collective": enqueued,
                "last_started_collective": -1,
                "last_completed_collective": completed,
            }
        },
        "entries": entries,
    }


def _world(waiting_at: int, behind: dict[int, int], world: int = 8) -> dict[int, dict[str, Any]]:
    """Every rank entered collectives 1..waiting_at (the last one pending), except `behind`: rank -> its last."""
    dumps = {}
    for rank in range(world):
        last = behind.get(rank, waiting_at)
        entries = [_entry(s) for s in range(max(1, last - 3), last + 1)]
        if last == waiting_at:
            entries[-1] = _entry(last, state="scheduled")
        dumps[rank] = _dump(entries, world, enqueued=last, completed=min(last, waiting_at - 1))
    return dumps


def test_one_sentence_names_the_ranks_that_wait_and_the_ranks_that_never_reached_the_collective():
    """Ranks 5 and 6 stopped before all_reduce #1204 that the others entered: one sentence says so."""
    dumps = _world(1204, {5: 1203, 6: 1203})
    said = fr.collectives_summary(dumps, 8)
    assert (
        said
        == "ranks 0, 1, 2, 3, 4 and 7 wait in all_reduce #1204; ranks 5 and 6 never reached it (their last was #1203)"
    )
    dumps = {r: d for r, d in dumps.items() if r in (3, 5, 6)}  # only some dumps came back
    said = fr.collectives_summary(dumps, 8)
    assert said is not None
    assert said.startswith("rank 3 waits in all_reduce #1204; ranks 5 and 6 never reached it")
    assert said.endswith("no record from ranks 0, 1, 2, 4 and 7")


def test_a_rank_in_another_collective_at_the_same_step_and_a_quiet_world_are_said_as_such():
    """A rank that entered broadcast where the others entered all_reduce is named; with nothing pending the sentence
    says no rank waits."""
    dumps = _world(7, {}, world=2)
    dumps[1]["entries"][-1] = _entry(7, "broadcast", state="scheduled")
    assert fr.collectives_summary(dumps, 2) == "rank 0 waits in all_reduce #7; rank 1 entered broadcast #7 instead"
    quiet = {r: _dump([_entry(1), _entry(2)], 2, enqueued=2, completed=2) for r in range(2)}
    assert fr.collectives_summary(quiet, 2) == "no rank waits in a collective (the last completed was #2)"
    assert fr.collectives_summary({}, 2) is None


def test_a_subgroup_is_named_and_gloo_dumps_are_read_by_their_status():
    """A wait in a group other than the default one names the group; entries whose state never changes (gloo's) are
    judged by the group's status."""
    dumps = {r: _dump([_entry(3)], 2, enqueued=3, completed=3) for r in range(2)}
    tp = ("1", "tensor_parallel")
    for rank, dump in dumps.items():
        dump["pg_config"]["1"] = {"name": "1", "desc": "tensor_parallel", "ranks": "[0, 1]"}
        dump["entries"].append(_entry(1, "all_gather", state="scheduled", pg=tp))
        dump["pg_status"]["1"] = {"last_enqueued_collective": 1, "last_completed_collective": 0 if rank else 1}
    assert fr.collectives_summary(dumps, 2) == "rank 1 waits in all_gather #1 (group tensor_parallel)"


def test_dumps_are_read_as_plain_data_only_and_named_in_the_note(tmp_path):
    """A dump file is unpickled without any class (a dump holding one is ignored); the note says what they show and
    how to read them."""
    env = fr.recorder_env(tmp_path, {})
    where = tmp_path / "flight_recorder"
    assert where.is_dir()
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert str(where / "rank_") in env.values()
    assert env["TORCH_NCCL_DEBUG_INFO_PIPE_FILE"] == str(where / "pipe_")
    assert fr.recorder_note(tmp_path) is None
    dumps = _world(4, {1: 3}, world=2)
    for rank, dump in dumps.items():
        (where / f"rank_{rank}").write_bytes(pickle.dumps(dump))
    (where / "rank_2").write_bytes(pickle.dumps({"entries": os.stat_result((0,) * 10)}))  # a class: never loaded
    assert set(fr.read_dumps(tmp_path)) == {0, 1}
    note = fr.recorder_note(tmp_path, 2) or ""
    assert note.startswith("NCCL's flight recorder: rank 0 waits in all_reduce #4; rank 1 never reached it")
    assert f"torchfrtrace {where} --prefix rank_" in note


def test_settings_the_user_chose_are_kept_and_pipes_are_left_out_where_asked(tmp_path):
    """Nothing the user set is overridden; without pipes (ranks on other machines) no pipe is asked for."""
    mine = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "0", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0", "TORCH_FR_DUMP_TEMP_FILE": "/x/"}
    assert fr.recorder_env(tmp_path, {**mine, "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": "/y/"}) == {}
    assert "TORCH_NCCL_DEBUG_INFO_PIPE_FILE" not in fr.recorder_env(tmp_path, {}, pipes=False)


def test_asking_for_dumps_writes_to_each_ranks_pipe_and_skips_pipes_no_one_reads(tmp_path):
    """A rank's pipe with a reader gets a request; one without a reader (its rank is gone) and a plain file do not."""
    where = tmp_path / "flight_recorder"
    where.mkdir()
    for rank in (0, 1):
        os.mkfifo(where / f"pipe_{rank}.pipe")
    (where / "pipe_2.pipe").write_text("")
    reader = os.open(where / "pipe_0.pipe", os.O_RDONLY | os.O_NONBLOCK)
    try:
        assert fr.ask_for_dumps(tmp_path) == {0}
        assert os.read(reader, 16) == b"1\n"
    finally:
        os.close(reader)


@pytest.mark.parametrize("data", [b"", b"\x80\x04not a pickle", b"[1, 2]"])
def test_what_is_no_dump_reads_as_none(data):
    """A half-written file, garbage or a JSON list is no dump."""
    assert fr.read_dump(data) is None
