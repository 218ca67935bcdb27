"""A session's push, pull and reset go through the process's owner like any call: each is in its table with an id,
and holds the session's own slots while it runs."""

from __future__ import annotations

import pytest
from helpers import reported

pytestmark = pytest.mark.slow

REPORT = """
import json
from air_magic.owner import owner
calls = owner().table.all()
print("REPORT " + json.dumps([[c.spec.name, str(c.id), c.status] for c in calls]))
"""


def test_push_pull_and_reset_are_calls_of_the_owners_table_with_an_id(loaded_kernel, releases_hot_ranks):
    """After a session cell, a push, a pull and a reset: each is a finished call of the kernel's table, named for
    what it did, whose id is a run directory's name (not a bare number), and the pull brings the pushed value."""
    loaded_kernel.execute(
        "%%distributed --session own --gpus 2 --accelerator-type CPU --no-mlflow\nimport os\nrank = os.environ['RANK']"
    ).check()
    loaded_kernel.execute("lr = 0.5\n%distributed_push --session own lr").check()
    pulled = loaded_kernel.execute(
        "import json\nprint('PULLED', json.dumps(get_ipython().run_line_magic('distributed_pull', '--session own lr')))"
    ).check()
    assert "PULLED [0.5, 0.5]" in pulled.stdout
    loaded_kernel.execute("%distributed_session --reset own").check()
    calls = reported(loaded_kernel.execute(REPORT).check().stdout)
    names = [name for name, _, _ in calls]
    assert names[-3:] == ["push lr (session own)", "pull lr (session own)", "reset (session own)"], names
    for name, call_id, status in calls[-3:]:
        assert status == "finished", (name, status)
        assert not call_id.isdigit() and "-" in call_id, (name, call_id)
