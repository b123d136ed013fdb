"""Shared-memory segments that carry CPU weight buckets, on both ends.

Owns the rollsafe shared-memory namespace: every CPU buffer a rollsafe sender hands to an engine
lives in a segment named ``/rollsafe-<sender token>-<n>`` under ``/dev/shm``, created by the
sender (``O_CREAT | O_EXCL``, mode 0600) and registered with torch's shared-memory manager, so
torch's ``file_system`` pickling names it as it is (the payload stays torch's, and SGLang's, own
``rebuild_storage_filename`` format). The receiving side never trusts a name it is given:

* :func:`open_segment` maps only names of that namespace, read-only (``O_RDONLY | O_NOFOLLOW``,
  ``PROT_READ``), only regular files whose size is exactly the size the payload declares (never
  grown), and never through torch's manager: nothing is registered for clean-up, so the engine
  never unlinks a segment. Another process's torch segment (``/torch_*``), a POSIX semaphore, a
  symlink or a segment of the wrong size is a :class:`SegmentError` naming it;
* mappings are cached by (name, inode, size), so a sender that reuses its buffers is mapped once.

The sender side (:func:`new_shared_buffer`, :func:`in_namespace`) is what
:func:`rollsafe.transports.pipeline.alloc_buffer` and the bucket serializer use.
"""

from __future__ import annotations

import collections
import errno
import functools
import mmap
import os
import re
import secrets
import stat
import threading
import warnings
from typing import Any

import torch

from rollsafe.errors import InvalidArgument, RollsafeError

__all__ = [
    "NAME_PATTERN",
    "SHM_DIR",
    "SegmentError",
    "in_namespace",
    "new_shared_buffer",
    "open_segment",
    "segment_name",
]

SHM_DIR = "/dev/shm"
#: a segment name as it appears in a payload (torch's handle: a leading slash)
NAME_PATTERN = re.compile(r"^/rollsafe-[0-9a-f]{16}-[0-9]{1,12}$")
_MAX_SEGMENT_BYTES = 1 << 40
#: torch's shared segments start with a reference count: the data begins this many bytes in
_HEADER = 64
_TOKEN = secrets.token_hex(8)  # this process's namespace (a new one in every process)
_counter = 0
_counter_lock = threading.Lock()


class SegmentError(RollsafeError, ValueError):
    """A shared-memory segment named by a payload may not be mapped; the message names it."""


@functools.cache
def _manager_handle() -> bytes:
    """torch's shared-memory manager socket (started on first use), as its pickles name it."""
    storage_cls: Any = torch.UntypedStorage
    probe = storage_cls(1)
    handle, _, _ = probe._share_filename_cpu_()
    return bytes(handle)


def _next_name() -> str:
    global _counter
    with _counter_lock:
        _counter += 1
        return f"/rollsafe-{_TOKEN}-{_counter}"


def _unlink(name: str) -> None:
    try:
        os.unlink(SHM_DIR + name)
    except OSError as exc:
        if exc.errno != errno.ENOENT:
            raise


def new_shared_buffer(nbytes: int) -> torch.Tensor:
    """A 1-D uint8 CPU tensor of ``nbytes`` in a new segment of the rollsafe namespace.

    The segment is removed from ``/dev/shm`` when the last torch mapping of it closes (torch's
    reference count; a receiver that maps it read-only keeps its mapping, and nothing new can
    open it); torch's shared-memory manager removes it if the process dies first."""
    if nbytes <= 0:
        raise InvalidArgument("nbytes", f"nbytes must be positive, got {nbytes}")
    torch.multiprocessing.set_sharing_strategy("file_system")  # type: ignore[no-untyped-call]
    name = _next_name()
    fd = os.open(SHM_DIR + name, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, nbytes)
    finally:
        os.close(fd)
    try:
        storage_cls: Any = torch.UntypedStorage
        storage = storage_cls._new_shared_filename_cpu(_manager_handle(), name.encode(), nbytes)
    except BaseException:
        _unlink(name)
        raise
    # torch's reference-counted mapping unlinks the name once the last torch mapping closes
    return torch.empty(0, dtype=torch.uint8).set_(storage)


def segment_name(tensor: torch.Tensor) -> str | None:
    """The rollsafe segment ``tensor``'s storage lives in, or None (not shared, or shared
    under another name: torch's own ``/torch_*`` segments are not in the namespace)."""
    if tensor.device.type != "cpu":
        return None
    storage: Any = tensor.untyped_storage()
    if not storage.is_shared():
        return None
    try:
        _, handle, _ = storage._share_filename_cpu_()
    except RuntimeError:  # shared by file descriptor, not by name
        return None
    name = bytes(handle).decode("ascii", "replace")
    return name if NAME_PATTERN.match(name) else None


def in_namespace(tensor: torch.Tensor) -> bool:
    """True if ``tensor`` lives in a rollsafe segment (it can travel as it is)."""
    return segment_name(tensor) is not None


# ---------------------------------------------------------------------------- receiving side
_CACHE_SIZE = 16
_cache: collections.OrderedDict[tuple[str, int, int, int], Any] = collections.OrderedDict()
_cache_lock = threading.Lock()


def open_segment(handle: Any, size: Any) -> Any:
    """Map the segment a payload names, read-only; return a torch ``UntypedStorage`` over it.

    ``handle`` must be a rollsafe segment name (bytes, as torch pickles it) and ``size`` its
    exact byte size. Raises :class:`SegmentError` naming the segment otherwise."""
    if not isinstance(handle, (bytes, bytearray)) or len(handle) > 128:
        raise SegmentError(f"shared-memory handle must be a short byte string, got {handle!r:.80}")
    name = bytes(handle).decode("ascii", "replace")
    if not NAME_PATTERN.match(name):
        raise SegmentError(
            f"shared-memory segment {name!r:.80} is not a rollsafe segment (/rollsafe-<token>-<n>);"
            " the engine maps no other process's memory"
        )
    if type(size) is not int or not 0 < size <= _MAX_SEGMENT_BYTES:
        raise SegmentError(f"shared-memory segment {name}: bad size {size!r:.40}")
    try:
        fd = os.open(SHM_DIR + name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        why = exc.strerror
        raise SegmentError(f"shared-memory segment {name} cannot be opened: {why}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise SegmentError(f"shared-memory segment {name} is not a regular file")
        if st.st_size != size + _HEADER:
            raise SegmentError(
                f"shared-memory segment {name} holds {st.st_size} bytes, the payload declares "
                f"{size} (+ {_HEADER} bytes of torch's reference count)"
            )
        key = (name, st.st_dev, st.st_ino, size)
        with _cache_lock:
            cached = _cache.get(key)
            if cached is not None:
                _cache.move_to_end(key)
                return cached
        view = mmap.mmap(fd, size + _HEADER, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "the given buffer is not writable": read-only on purpose
        data = torch.frombuffer(view, dtype=torch.uint8, offset=_HEADER, count=size)
        storage = data.untyped_storage()
    with _cache_lock:
        _cache[key] = storage
        while len(_cache) > _CACHE_SIZE:
            _cache.popitem(last=False)
    return storage
