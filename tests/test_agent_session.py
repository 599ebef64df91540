"""The run folder's lock (agent/run/session.py): held, it refuses a second holder, naming the first; released, its
file is gone; a file left by a killed run is taken over; a file removed while another opened it is not
mistaken for the lock."""
from __future__ import annotations

import fcntl
import json
import os

import pytest

from agent.run.session import LOCK_NAME, RunBusy, RunLock, _same_file, check_free


def test_a_held_lock_refuses_a_second_holder_and_its_file_is_removed_when_released(tmp_path):
    lock = RunLock(tmp_path).acquire()
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    with pytest.raises(RunBusy, match=f"is in use by pid {os.getpid()} on "):
        RunLock(tmp_path).acquire()                         # another open file: flock refuses it as it would a process
    with pytest.raises(RunBusy):
        check_free(tmp_path)
    lock.release()
    assert not (tmp_path / LOCK_NAME).exists()
    check_free(tmp_path)                                    # free now
    with RunLock(tmp_path):                                 # and taken again
        assert (tmp_path / LOCK_NAME).exists()
    assert not (tmp_path / LOCK_NAME).exists()


def test_the_file_a_killed_run_left_is_taken_over(tmp_path):
    (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": 4194304, "host": "gone", "since": "then", "command": "x"}))
    check_free(tmp_path)                                    # nobody holds it: the kernel dropped the dead run's lock
    with RunLock(tmp_path):
        assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()


def test_a_file_opened_just_before_its_holder_removed_it_is_not_the_lock(tmp_path):
    holder = RunLock(tmp_path).acquire()
    late = os.open(tmp_path / LOCK_NAME, os.O_RDWR)         # a second run, between its open and its flock
    holder.release()
    with RunLock(tmp_path) as third:                        # a third run takes the lock: a new file
        fcntl.flock(late, fcntl.LOCK_EX | fcntl.LOCK_NB)    # the removed file's lock is free to take ...
        assert not _same_file(late, tmp_path / LOCK_NAME)   # ... and acquire sees it is not the run's lock
        assert _same_file(third.fd, tmp_path / LOCK_NAME)
        with pytest.raises(RunBusy):
            RunLock(tmp_path).acquire()
    os.close(late)
