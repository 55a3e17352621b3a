"""Owns: where the groups' files live (``/dev/shm``, or the directory in
``COMPOSABLE_SHARD_SHM_DIR``), their names (which say what process made
each), and sweeping the files whose maker is gone.

Knows nothing of: what the files hold or how a group sets up (``files``),
process groups, tensors.

Public names: ``SHM_DIR_ENV``, ``shm_directory``, ``owner_marker``,
``file_name``, ``sweep_stale_files``.

[Note: stale files]
A group's files have names only during its setup (tens of milliseconds):
every rank removes every name once all ranks opened the files, or on any
failure it survives. A job whose every rank dies in that window (SIGKILL or
SIGTERM: torchrun, Slurm, the OOM killer) leaves them for good, up to
``bytes_per_rank`` each, in a tmpfs that only a reboot empties. So each
name says which process made it:
``composable_shard_<rank 0's pid>_<token>_<rank>_<pid>.<start>.<pidns>.<boot>``
(the maker's pid, its start time in clock ticks after boot from
``/proc/<pid>/stat``, the inode of its pid namespace, the head of the boot
id), and every rank sweeps the directory at each setup, before it measures
the free space: it removes a file only when all of these hold:

- the name has that form (other names, older forms included, are left);
- the file belongs to this user (another user's job is not ours to judge);
- it was made in this boot and this pid namespace: elsewhere (a container
  sharing ``/dev/shm`` through ``--ipc=host``) the pid names another
  process, so such files are left to their own namespace's setups;
- its maker is provably gone: no process has its pid (``kill(pid, 0)``:
  ESRCH), or the process with that pid started at another time (the pid
  was reused), or it is a zombie (it exited; its parent has not reaped
  it). A process that exists but cannot be inspected counts as alive.

No age threshold is needed: a live maker is never judged gone, and a dead
one cannot come back. A sweep racing another (two setups at once) ignores
names already removed. Pinned by tests/comm/test_stale_files.py.
"""

from __future__ import annotations

import errno
import os
import re

__all__ = ["SHM_DIR_ENV", "shm_directory", "owner_marker", "file_name", "sweep_stale_files"]

# The directory of the groups' files; every rank of a group must see the
# same one (setup checks). Tests point it at a private directory.
SHM_DIR_ENV = "COMPOSABLE_SHARD_SHM_DIR"
_DEFAULT_DIRECTORY = "/dev/shm"
_FILE_PREFIX = "composable_shard_"
_NAME = re.compile(
    re.escape(_FILE_PREFIX)
    + r"\d+_[0-9a-f]{32}_\d+_"  # rank 0's pid, the token, the rank
    + r"(?P<pid>\d+)\.(?P<start>\d+)\.(?P<pidns>\d+)\.(?P<boot>[0-9a-f]{8})"  # the maker
)


def shm_directory() -> str:
    """The directory this process makes its groups' files in (read at each
    setup)."""
    return os.environ.get(SHM_DIR_ENV) or _DEFAULT_DIRECTORY


def owner_marker() -> str:
    """What a name says of the process that made it: ``pid.start.pidns.boot``
    (see the Note); ``""`` where /proc cannot tell (files that no sweep
    will remove, as before)."""
    pid = os.getpid()
    start, pidns, boot = _state_and_start(pid)[1], _pid_namespace(), _boot_head()
    if start is None or pidns is None or boot is None:
        return ""
    return f"{pid}.{start}.{pidns}.{boot}"


def file_name(rank0_pid: int, token: str, rank: int, owner: str) -> str:
    """The name of rank ``rank``'s file in the setup named by rank 0's pid
    and ``token``, made by the process ``owner`` describes."""
    return f"{_FILE_PREFIX}{rank0_pid}_{token}_{rank}" + (f"_{owner}" if owner else "")


def sweep_stale_files(directory: str) -> list[str]:
    """Remove the files in ``directory`` whose maker is provably gone (see
    the Note); returns their names. Never raises: a sweep that cannot look
    or remove leaves the files."""
    pidns, boot = _pid_namespace(), _boot_head()
    if pidns is None or boot is None:
        return []
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    removed = []
    for name in names:
        found = _NAME.fullmatch(name)
        if found is None or int(found["pidns"]) != pidns or found["boot"] != boot:
            continue
        if not _maker_gone(int(found["pid"]), int(found["start"])):
            continue
        path = os.path.join(directory, name)
        try:
            if os.stat(path, follow_symlinks=False).st_uid != os.getuid():
                continue
            os.unlink(path)
        except OSError:
            continue  # removed meanwhile by another sweep or setup, or not ours to remove
        removed.append(name)
    return removed


def _maker_gone(pid: int, start: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass  # exists: another user's process with that pid
    except OSError as error:
        return error.errno == errno.ESRCH
    state, now = _state_and_start(pid)
    if now is None:
        return False  # it exists but /proc does not show it (hidepid): alive, for us
    return now != start or state in (b"Z", b"X")


def _state_and_start(pid: int) -> tuple[bytes, int | None]:
    """Process ``pid``'s state letter and when it started, in clock ticks
    after boot (fields 3 and 22 of ``/proc/<pid>/stat``; the command name
    before them may hold spaces and parentheses)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
        return fields[0], int(fields[19])
    except (OSError, IndexError, ValueError):
        return b"", None


def _pid_namespace() -> int | None:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


def _boot_head() -> str | None:
    try:
        with open("/proc/sys/kernel/random/boot_id") as boot_id:
            return boot_id.read().strip().replace("-", "")[:8]
    except OSError:
        return None
