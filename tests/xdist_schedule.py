"""How scripts/run-tests.sh's two pytest-xdist workers share the suite: a work unit is a
test file, so a file's tests run on one worker and start its module-scoped engines once;
the files that share the session's server (tests/e2e/conftest.py `server`) are one unit.

The scheduler groups by node id on the controller, which has no items (hence no
markers) to read. xdist's own `--dist loadgroup` encodes a marker into the node id, but
with pytest 9.2 that encoding is lost (xdist 3.8 writes `item._nodeid`, which pytest
9.2 no longer reads: nodes.Node.nodeid is built from `_id`) and every file ran on both
workers, each starting its own engines: the suite took 46 min instead of about 30."""

from __future__ import annotations

import pytest
from xdist.remote import Producer
from xdist.scheduler import LoadScopeScheduling

SESSION_SERVER = "session-server"
# Files whose tests use the session's server; one worker runs them all.
SESSION_SERVER_FILES = frozenset({
    "tests/e2e/test_chat.py",
    "tests/e2e/test_dashboard.py",
    "tests/e2e/test_device_sampling.py",
    "tests/e2e/test_server.py",
})


def work_unit(nodeid: str) -> str:
    """The unit a test belongs to: its file, or SESSION_SERVER."""
    path = nodeid.split("::", 1)[0]
    return SESSION_SERVER if path in SESSION_SERVER_FILES else path


class FileScheduling(LoadScopeScheduling):
    """xdist's scope scheduling (whole units to the next free worker, the units with the
    most tests first: its default `--loadscope-reorder`), with work_unit as the scope."""

    def _split_scope(self, nodeid: str) -> str:
        return work_unit(nodeid)


def pytest_xdist_make_scheduler(config: pytest.Config, log: Producer) -> FileScheduling:
    return FileScheduling(config, log)
