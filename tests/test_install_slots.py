"""The install's slot files and queue, as several proxies see them (here: several ``InstallSlots``).

``flock`` locks belong to an open file description, so two ``InstallSlots`` in one process
contend exactly as two proxies do. Processes are only started where the point is a process:
a slot handed to a child is held until that child exits; a waiter that dies leaves the queue.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from acp_proxy.operator.reports import slot_view
from acp_proxy.pool.install import InstallSlots, SlotRecord


def proxy(tmp_path: Path, name: str) -> InstallSlots:
    return InstallSlots(tmp_path / "state", name)


def record(instance: str, key: str, *, busy: bool, last_active: float = 0.0) -> SlotRecord:
    return SlotRecord(
        instance=instance, pid=os.getpid(), backend="fake", key=key, session=key, busy=busy, last_active=last_active
    )


def test_the_cap_holds_across_proxies_and_a_released_slot_is_free_again(tmp_path: Path) -> None:
    a, b = proxy(tmp_path, "a"), proxy(tmp_path, "b")
    first = a.try_take("fake", global_cap=2, backend_cap=None)
    second = b.try_take("fake", global_cap=2, backend_cap=None)
    assert first is not None
    assert second is not None
    assert a.try_take("fake", global_cap=2, backend_cap=None) is None
    assert b.try_take("fake", global_cap=2, backend_cap=None) is None
    first.release()
    third = b.try_take("fake", global_cap=2, backend_cap=None)
    assert third is not None
    assert {index for _, index in third.scope_indexes} == {index for _, index in first.scope_indexes}


def test_a_backend_cap_binds_that_backend_only(tmp_path: Path) -> None:
    a, b = proxy(tmp_path, "a"), proxy(tmp_path, "b")
    assert a.try_take("capped", global_cap=3, backend_cap=1) is not None
    assert b.try_take("capped", global_cap=3, backend_cap=1) is None  # the backend's one slot is held
    assert b.try_take("other", global_cap=3, backend_cap=None) is not None  # the install has room
    assert b.try_take("other", global_cap=3, backend_cap=None) is not None
    assert b.try_take("other", global_cap=3, backend_cap=None) is None  # now the install is full


def test_a_full_backend_scope_takes_nothing_from_the_install(tmp_path: Path) -> None:
    a = proxy(tmp_path, "a")
    assert a.try_take("capped", global_cap=2, backend_cap=1) is not None
    assert a.try_take("capped", global_cap=2, backend_cap=1) is None
    assert len(a.holders()) == 1  # the refused take let go of what it had got


def test_holders_say_who_holds_each_slot(tmp_path: Path) -> None:
    a, reader = proxy(tmp_path, "a"), proxy(tmp_path, "reader")
    held = a.try_take("fake", global_cap=4, backend_cap=None)
    assert held is not None
    [unwritten] = reader.holders()
    assert unwritten.record is None  # taken, not described yet: a start in progress
    held.publish(record("a", "s-1", busy=False, last_active=5.0))
    [described] = reader.holders()
    assert described.record == record("a", "s-1", busy=False, last_active=5.0)
    held.publish(record("a", "s-1", busy=True))  # shorter: the rest of the longer one is blanked
    [rewritten] = reader.holders()
    assert rewritten.record is not None
    assert rewritten.record.busy is True
    held.release()
    assert reader.holders() == []


def test_a_slot_handed_to_a_child_is_held_until_the_child_exits(proc_env: dict[str, str], tmp_path: Path) -> None:
    """What the wrapper does: the proxy lets go, the child keeps the lock, the kernel frees it at its exit."""
    a, b = proxy(tmp_path, "a"), proxy(tmp_path, "b")
    held = a.try_take("fake", global_cap=1, backend_cap=None)
    assert held is not None
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"],
        stdin=subprocess.PIPE,
        pass_fds=held.descriptors,
        env=proc_env,
    )
    try:
        held.release()
        assert b.try_take("fake", global_cap=1, backend_cap=None) is None
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(timeout=10)
    assert b.try_take("fake", global_cap=1, backend_cap=None) is not None


def test_the_queue_is_first_come_first_served_per_backend(tmp_path: Path) -> None:
    a, b = proxy(tmp_path, "a"), proxy(tmp_path, "b")
    early = a.enqueue("fake", 10.0)
    late = b.enqueue("fake", 20.0)
    other = b.enqueue("other", 30.0)
    assert a.ahead_of(early, "fake") == 0
    assert b.ahead_of(late, "fake") == 1
    assert b.ahead_of(other, "other") == 0  # another backend's line
    assert b.waiting("fake")
    early.leave()
    assert b.ahead_of(late, "fake") == 0
    late.leave()
    assert not a.waiting("fake")


def test_a_waiter_that_died_is_removed_from_the_queue(tmp_path: Path) -> None:
    a, b = proxy(tmp_path, "a"), proxy(tmp_path, "b")
    dead = a.enqueue("fake", 1.0)
    assert dead.fd is not None
    os.close(dead.fd)  # as the kernel does for a killed process: the file stays, its lock is gone
    dead.fd = None
    waiting = b.enqueue("fake", 2.0)
    assert b.ahead_of(waiting, "fake") == 0
    assert dead.path is not None
    assert not dead.path.exists()


def test_one_proxy_at_a_time_leads_and_the_next_takes_over(tmp_path: Path) -> None:
    a, b = proxy(tmp_path, "a"), proxy(tmp_path, "b")
    assert a.lead("memory-budget")
    assert a.lead("memory-budget")
    assert not b.lead("memory-budget")
    assert a._lead_fd is not None
    os.close(a._lead_fd)  # the leader exits
    assert b.lead("memory-budget")


def test_every_directory_and_file_is_private_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        a = proxy(tmp_path, "a")
        assert a.try_take("fake", global_cap=1, backend_cap=1) is not None
        a.enqueue("fake", time.monotonic()).leave()
    finally:
        os.umask(old)
    for path in [a.root, *a.root.rglob("*")]:
        assert path.stat().st_mode & 0o777 == (0o700 if path.is_dir() else 0o600), path


def test_status_shows_a_slot_taken_for_a_start_with_no_process_yet_as_a_start_in_progress(tmp_path: Path) -> None:
    """With a memory budget the slot is described as soon as it is taken (its backend, that it is
    starting), before there is a process: status and metrics show no adapter for it."""
    held = proxy(tmp_path, "a").try_take("fake", global_cap=4, backend_cap=None)
    assert held is not None
    held.publish(SlotRecord(instance="a", pid=os.getpid(), backend="fake", key="starting:0", starting=True))
    [view] = [slot_view(slot, lambda instance: True, time.monotonic()) for slot in proxy(tmp_path, "b").holders()]
    assert view == {"slot": held.index, "holder": None}
    held.release()
