"""The sandbox's seccomp filter, as raw classic BPF for bubblewrap's `--seccomp FD`.

Why a filter at all: `--unshare-net` removes TCP/UDP and abstract unix sockets, but a
unix socket bound to a path stays reachable through the read-only root (connect() needs no
write access to the mount). On a node that means munged, the accounting database, dbus and,
on clusters, slurmstepd's step sockets, which accept the job owner's uid: a sandbox of the
same user could signal its own job. So socket(AF_UNIX) fails with EACCES (socketpair, which
only joins two ends inside the sandbox, stays allowed), and io_uring_setup fails with ENOSYS,
since io_uring can open and connect sockets without the socket syscall. Syscalls of another
ABI (i386 or x32 on x86_64, where socketcall would bypass the check) fail with ENOSYS.

Hand-written BPF rather than libseccomp: no extra package on every environment node for
eleven instructions. Only x86_64 and aarch64 are known; others raise.
"""

from __future__ import annotations

import errno
import platform
import struct

# Classic BPF opcodes (linux/filter.h) and seccomp return values (linux/seccomp.h).
_LD_W_ABS = 0x20  # BPF_LD | BPF_W | BPF_ABS
_JEQ_K = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
_JGE_K = 0x35  # BPF_JMP | BPF_JGE | BPF_K
_RET_K = 0x06  # BPF_RET | BPF_K
_ALLOW = 0x7FFF0000
_ERRNO = 0x00050000
# struct seccomp_data: int nr; u32 arch; u64 ip; u64 args[6] (args[0]'s low word at 16, little endian)
_NR, _ARCH, _ARG0 = 0, 4, 16
_AF_UNIX = 1
_X32_BIT = 0x40000000

# machine -> (AUDIT_ARCH_*, __NR_socket, __NR_io_uring_setup)
ARCHES = {
    "x86_64": (0xC000003E, 41, 425),
    "aarch64": (0xC00000B7, 198, 425),
}


class UnsupportedArch(RuntimeError):
    pass


def _op(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def filter_program(machine: str = "") -> bytes:
    """The filter for `machine` (default: this one), as the bytes bwrap reads from its fd."""
    machine = machine or platform.machine()
    if machine not in ARCHES:
        raise UnsupportedArch(f"the sandbox's seccomp filter knows {sorted(ARCHES)}, not {machine!r}")
    arch, nr_socket, nr_io_uring = ARCHES[machine]
    enosys, eacces = _ERRNO | errno.ENOSYS, _ERRNO | errno.EACCES
    # Jump offsets count instructions after the jump; targets: 8 allow, 9 EACCES, 10 ENOSYS.
    prog = [
        _op(_LD_W_ABS, _ARCH),
        _op(_JEQ_K, arch, 0, 8),  # another ABI -> 10
        _op(_LD_W_ABS, _NR),
        _op(_JGE_K, _X32_BIT, 6, 0),  # x32 numbers on x86_64 -> 10 (never set on aarch64)
        _op(_JEQ_K, nr_io_uring, 5, 0),  # -> 10
        _op(_JEQ_K, nr_socket, 0, 2),  # not socket -> 8
        _op(_LD_W_ABS, _ARG0),
        _op(_JEQ_K, _AF_UNIX, 1, 0),  # AF_UNIX -> 9
        _op(_RET_K, _ALLOW),
        _op(_RET_K, eacces),
        _op(_RET_K, enosys),
    ]
    return b"".join(prog)
