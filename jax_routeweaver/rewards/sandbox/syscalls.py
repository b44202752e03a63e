"""The jail's seccomp policy: the system calls a job may make. Every other one fails with EPERM.

An allow-list in the spirit of container runtimes' default profiles (Docker's, Podman's):
what a Python program, its standard library and the processes it starts need (files, memory,
threads, signals, clocks, pipes, sockets in the job's own network namespace, SysV and POSIX
IPC in its own IPC namespace). Left out, among others, and so refused with EPERM:

    io_uring_*                      a long run of kernel privilege escalations
    keyctl, add_key, request_key    the kernel keyrings (the trainer's keys)
    bpf, perf_event_open            kernel programs and performance counters
    userfaultfd                     a classic aid to kernel exploits
    ptrace, process_vm_*, kcmp      reading or steering another process
    mount, umount2, pivot_root, chroot, fsopen, fsmount, move_mount, open_tree, ...
    unshare, setns                  new namespaces (a user namespace is refused anyway)
    kexec_*, *_module, reboot, swapon, swapoff, acct, quotactl, syslog
    open_by_handle_at, name_to_handle_at   opening host files by handle
    settimeofday, clock_settime, adjtimex, sethostname, setdomainname, iopl, ioperm

The filter is a compiled BPF program per architecture, checked into the package
(`seccomp/<machine>.bpf`, with `<machine>.json`: the allowed calls' numbers and the probes'),
built from `ALLOWED` by `python -m jax_routeweaver.rewards.sandbox.seccomp_build` with
libseccomp; so the trainer needs libseccomp only to rebuild it. bubblewrap installs it
(`--seccomp FD`) just before it starts the harness, with no_new_privs set: it holds for the
program and everything it starts. A syscall of another ABI (32-bit, x32) fails with EPERM too.

To let a scorer's programs make a call that is not here: add its name to `ALLOWED`, run the
build (it rewrites both architectures' files), and commit the files; `tests/test_seccomp.py`
checks that the files allow exactly `ALLOWED`.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any

__all__ = ["ALLOWED", "FILTER_DIR", "MACHINES", "PROBES", "filter_files", "machine"]

ALLOWED: tuple[str, ...] = (
    # files and directories
    "read", "write", "readv", "writev", "pread64", "pwrite64", "preadv", "pwritev",
    "preadv2", "pwritev2", "open", "openat", "openat2", "creat", "close", "close_range",
    "lseek", "stat", "fstat", "lstat", "newfstatat", "statx", "statfs", "fstatfs", "access",
    "faccessat", "faccessat2", "getdents", "getdents64", "getcwd", "chdir", "fchdir",
    "mkdir", "mkdirat", "rmdir", "rename", "renameat", "renameat2", "unlink", "unlinkat",
    "link", "linkat", "symlink", "symlinkat", "readlink", "readlinkat", "chmod", "fchmod",
    "fchmodat", "chown", "fchown", "lchown", "fchownat", "umask", "truncate", "ftruncate",
    "fallocate", "fsync", "fdatasync", "sync_file_range", "flock", "fcntl", "ioctl", "dup",
    "dup2", "dup3", "pipe", "pipe2", "utime", "utimes", "utimensat", "futimesat", "sendfile",
    "copy_file_range", "splice", "tee", "fadvise64", "readahead", "memfd_create",
    "inotify_init", "inotify_init1", "inotify_add_watch", "inotify_rm_watch",
    "getxattr", "lgetxattr", "fgetxattr", "listxattr", "llistxattr", "flistxattr",
    # memory
    "brk", "mmap", "munmap", "mremap", "mprotect", "madvise", "msync", "mincore", "mlock",
    "mlock2", "munlock", "mlockall", "munlockall", "membarrier",
    # processes and threads
    "clone", "clone3", "fork", "vfork", "execve", "execveat", "exit", "exit_group", "wait4",
    "waitid", "kill", "tkill", "tgkill", "getpid", "getppid", "gettid", "getpgid",
    "getpgrp", "setpgid", "getsid", "setsid", "getuid", "geteuid", "getgid", "getegid",
    "getresuid", "getresgid", "getgroups", "setuid", "setgid", "setreuid", "setregid",
    "setresuid", "setresgid", "setgroups", "setfsuid", "setfsgid", "capget",
    "set_tid_address", "set_robust_list", "get_robust_list", "rseq", "futex", "futex_waitv",
    "arch_prctl", "prctl", "getrlimit", "setrlimit", "prlimit64", "getrusage", "times",
    "getpriority", "setpriority", "sched_yield", "sched_getaffinity", "sched_setaffinity",
    "sched_getparam", "sched_getscheduler", "sched_get_priority_max",
    "sched_get_priority_min", "sched_rr_get_interval", "getcpu", "pidfd_open",
    "pidfd_send_signal", "pidfd_getfd",
    # signals and timers
    "rt_sigaction", "rt_sigprocmask", "rt_sigreturn", "rt_sigpending", "rt_sigsuspend",
    "rt_sigtimedwait", "rt_sigqueueinfo", "rt_tgsigqueueinfo", "sigaltstack", "pause",
    "alarm", "getitimer", "setitimer", "timer_create", "timer_settime", "timer_gettime",
    "timer_getoverrun", "timer_delete", "timerfd_create", "timerfd_settime",
    "timerfd_gettime", "signalfd", "signalfd4",
    # clocks and the system
    "clock_gettime", "clock_getres", "clock_nanosleep", "nanosleep", "gettimeofday", "time",
    "uname", "sysinfo", "getrandom",
    # waiting on descriptors
    "poll", "ppoll", "select", "pselect6", "epoll_create", "epoll_create1", "epoll_ctl",
    "epoll_wait", "epoll_pwait", "epoll_pwait2", "eventfd", "eventfd2",
    # sockets (the job's network namespace holds only its own loopback)
    "socket", "socketpair", "bind", "listen", "accept", "accept4", "connect", "getsockname",
    "getpeername", "sendto", "recvfrom", "sendmsg", "recvmsg", "sendmmsg", "recvmmsg",
    "shutdown", "setsockopt", "getsockopt",
    # SysV and POSIX IPC (the job's IPC namespace)
    "shmget", "shmat", "shmdt", "shmctl", "semget", "semop", "semtimedop", "semctl",
    "msgget", "msgsnd", "msgrcv", "msgctl", "mq_open", "mq_unlink", "mq_timedsend",
    "mq_timedreceive", "mq_notify", "mq_getsetattr",
)

# The calls `routeweaver sandbox check` and the tests attack with (their numbers are in each
# machine's json): each must fail inside a job.
PROBES: tuple[str, ...] = (
    "io_uring_setup", "keyctl", "add_key", "request_key", "bpf", "perf_event_open",
    "userfaultfd", "ptrace", "process_vm_readv", "mount", "umount2", "pivot_root", "chroot",
    "unshare", "setns", "kexec_load", "init_module", "finit_module", "delete_module",
    "open_by_handle_at", "name_to_handle_at", "fsopen", "open_tree", "move_mount", "reboot",
    "swapon",
)

FILTER_DIR = Path(__file__).with_name("seccomp")
# `os.uname().machine` -> the filter's name.
MACHINES = {"x86_64": "x86_64", "amd64": "x86_64", "aarch64": "aarch64", "arm64": "aarch64"}


def machine() -> str | None:
    """This host's architecture as the filters name it; None when no filter is built for it."""
    return MACHINES.get(os.uname().machine.lower())


def filter_files(name: str | None = None) -> tuple[Path, dict[str, Any]]:
    """(the BPF program, its json: allowed and probe numbers) for architecture `name`
    (default: this host's), read once. OSError saying so when there is none: the jail never
    runs without its filter."""
    return _filter_files(name or machine())


@functools.cache
def _filter_files(name: str | None) -> tuple[Path, dict[str, Any]]:
    bpf = FILTER_DIR / f"{name}.bpf"
    if name is None or not bpf.is_file():
        raise OSError(f"no seccomp filter for this architecture ({os.uname().machine}); "
                      f"built ones: {sorted(p.stem for p in FILTER_DIR.glob('*.bpf'))}")
    return bpf, json.loads(bpf.with_suffix(".json").read_text())
