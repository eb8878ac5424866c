"""One controller per state dir: the journal's lock, in process (two open descriptions of the lock
file conflict as two processes' would). The processes themselves: tests/reliability/test_dir_locks.py."""

from __future__ import annotations

import os

import pytest

from dockd import dirlock
from dockd.controller.journal import Journal
from dockd.controller.records import JournalError


def test_a_second_journal_on_a_locked_state_dir_is_refused_naming_the_holder(tmp_path, monkeypatch):
    monkeypatch.setattr(dirlock, "WAIT", 0.2)
    first = Journal(tmp_path / "state")
    first.lock()
    first.load(lease_timeout=60, now=0.0)
    names = sorted(os.listdir(tmp_path / "state"))
    second = Journal(tmp_path / "state")
    with pytest.raises(JournalError, match=f"--state-dir {tmp_path / 'state'} is in use by another dockd process "
                                           f"\\(pid {os.getpid()}"):
        second.lock()
    assert sorted(os.listdir(tmp_path / "state")) == names
    first.close()  # (its exit would do the same)
    second.lock()
    second.load(lease_timeout=60, now=0.0)
    second.close()


def test_a_lock_file_that_is_not_a_regular_file_is_refused(tmp_path):
    os.mkfifo(tmp_path / "lock")
    with pytest.raises(JournalError, match="not a regular file"):
        Journal(tmp_path).lock()
