"""A POSIX access ACL with one named group, set on an open descriptor (no path is followed).

The run root needs two groups that write it: its own group (the maintainers, whose group
every run directory inherits through the setgid bit) and the submitters, who create run
directories. One extra ACL entry gives the second; the mode's group bits become the ACL's
mask. Written as the kernel's `system.posix_acl_access` attribute (linux/posix_acl_xattr.h),
so no setfacl program is needed.
"""

from __future__ import annotations

import errno
import os
import struct

from dtk.common.errors import UserError

_VERSION = 2
_USER_OBJ, _GROUP_OBJ, _GROUP, _MASK, _OTHER = 0x01, 0x04, 0x08, 0x10, 0x20
_UNDEFINED = 0xFFFFFFFF
XATTR = "system.posix_acl_access"


def encode(mode: int, gid: int, group_perm: int) -> bytes:
    """The attribute for `mode`'s owner/group/other bits plus group `gid` with `group_perm`
    (rwx as 0-7); entries in the kernel's order (by tag, then id)."""
    owner, group, other = (mode >> 6) & 7, (mode >> 3) & 7, mode & 7
    entries = [(_USER_OBJ, owner, _UNDEFINED), (_GROUP_OBJ, group, _UNDEFINED), (_GROUP, group_perm, gid),
               (_MASK, group | group_perm, _UNDEFINED), (_OTHER, other, _UNDEFINED)]
    return struct.pack("<I", _VERSION) + b"".join(struct.pack("<HHI", *e) for e in entries)


def named_groups(fd: int) -> dict[int, int]:
    """gid -> permission of the named-group entries on the open file (empty without an ACL)."""
    try:
        raw = os.getxattr(fd, XATTR)
    except OSError as exc:
        if exc.errno in (errno.ENODATA, errno.ENOTSUP):
            return {}
        raise
    out = {}
    for offset in range(4, len(raw), 8):
        tag, perm, ident = struct.unpack_from("<HHI", raw, offset)
        if tag == _GROUP:
            out[ident] = perm
    return out


def grant_group(fd: int, *, mode: int, gid: int, perm: int, shown: str) -> None:
    """Give group `gid` `perm` on the open file, beside `mode`'s own classes."""
    try:
        os.setxattr(fd, XATTR, encode(mode, gid, perm))
    except OSError as exc:
        if exc.errno in (errno.ENOTSUP, errno.EOPNOTSUPP):
            raise UserError(f"{shown}: its file system does not support POSIX ACLs, which the run root needs"
                            " (the maintainers own it and the submitters create run directories in it);"
                            " put the team folder on a file system with ACLs (ext4, xfs, NFSv4, Lustre)") from None
        raise


# The append-only attribute (chattr +a): writes only at the end, no truncation, no removal
# or rename, for every user (root included) until root clears it. linux/fs.h.
_FS_IOC_GETFLAGS, _FS_IOC_SETFLAGS, _FS_APPEND_FL = 0x80086601, 0x40086602, 0x00000020


def _flags(fd: int) -> int:
    import fcntl

    buf = bytearray(8)  # the ioctl's size says long; the kernel copies an int into its start
    fcntl.ioctl(fd, _FS_IOC_GETFLAGS, buf)
    return struct.unpack_from("<i", buf)[0]


def set_append_only(fd: int, on: bool, *, shown: str) -> None:
    """Set or clear the append-only attribute of the open file (root only)."""
    import fcntl

    try:
        flags = _flags(fd)
        wanted = flags | _FS_APPEND_FL if on else flags & ~_FS_APPEND_FL
        if wanted != flags:
            fcntl.ioctl(fd, _FS_IOC_SETFLAGS, struct.pack("<i", wanted) + bytes(4))
    except OSError as exc:
        if exc.errno in (errno.ENOTTY, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EINVAL):
            raise UserError(f"{shown}: its file system has no append-only attribute (chattr +a), which the audit"
                            " log's head needs; put the team folder on ext4, xfs or btrfs") from None
        if exc.errno == errno.EPERM:
            raise UserError(f"{shown}: only root may set the append-only attribute; run prepare as root") from None
        raise


def is_append_only(path: str) -> bool:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        return bool(_flags(fd) & _FS_APPEND_FL)
    except OSError:
        return False
    finally:
        os.close(fd)
