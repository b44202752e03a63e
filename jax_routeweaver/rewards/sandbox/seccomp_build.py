"""Build the jail's seccomp filters from `syscalls.ALLOWED` with libseccomp.

    python -m jax_routeweaver.rewards.sandbox.seccomp_build [--out DIR]

For each architecture of `syscalls.MACHINES` (x86_64, aarch64) it writes `<machine>.bpf`
(the BPF program bubblewrap loads: `seccomp_export_bpf`) and `<machine>.json` (the allowed
calls and the probes with their numbers on that architecture, and the libseccomp version).
Default action and bad-architecture action: fail with EPERM. Names an architecture lacks
(e.g. `open` on aarch64) are skipped there. Needs libseccomp (`libseccomp.so.2`), which the
trainer itself does not: the files are checked into the package.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import errno
import json
import os
from pathlib import Path

from jax_routeweaver.rewards.sandbox.syscalls import ALLOWED, FILTER_DIR, PROBES

# libseccomp's constants (seccomp.h): actions, filter attributes, architecture tokens (the
# kernel's AUDIT_ARCH_* values).
ACT_ALLOW = 0x7FFF0000
ACT_ERRNO = 0x00050000
ATTR_ACT_BADARCH = 2
ARCHES = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}


def act_errno(code: int) -> int:
    return ACT_ERRNO | (code & 0xFFFF)


def libseccomp() -> ctypes.CDLL:
    """libseccomp, its signatures declared."""
    lib = ctypes.CDLL(ctypes.util.find_library("seccomp") or "libseccomp.so.2")
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    for name, args in (("seccomp_arch_add", [ctypes.c_uint32]),
                       ("seccomp_arch_remove", [ctypes.c_uint32]),
                       ("seccomp_attr_set", [ctypes.c_int, ctypes.c_uint32]),
                       ("seccomp_rule_add_exact", [ctypes.c_uint32, ctypes.c_int,
                                                   ctypes.c_uint]),
                       ("seccomp_export_bpf", [ctypes.c_int])):
        getattr(lib, name).argtypes = [ctypes.c_void_p, *args]
        getattr(lib, name).restype = ctypes.c_int
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    lib.seccomp_arch_native.restype = ctypes.c_uint32
    lib.seccomp_syscall_resolve_name_arch.argtypes = [ctypes.c_uint32, ctypes.c_char_p]
    lib.seccomp_syscall_resolve_name_arch.restype = ctypes.c_int
    lib.seccomp_version.restype = ctypes.POINTER(ctypes.c_uint * 3)  # major, minor, micro
    return lib


def _check(rc: int, what: str) -> None:
    if rc < 0:
        raise OSError(-rc, f"libseccomp: {what}: {os.strerror(-rc)}")


def numbers(lib: ctypes.CDLL, arch: int, names: tuple[str, ...]) -> dict[str, int]:
    """name -> number on `arch`, for the names it has."""
    out = {}
    for name in names:
        nr = lib.seccomp_syscall_resolve_name_arch(arch, name.encode())
        if nr >= 0:
            out[name] = nr
    return out


def build(name: str, out: Path, lib: ctypes.CDLL) -> dict:
    """Write `out/<name>.bpf` and `out/<name>.json`; returns the json's content."""
    arch = ARCHES[name]
    allowed = numbers(lib, arch, ALLOWED)
    ctx = lib.seccomp_init(act_errno(errno.EPERM))
    if not ctx:
        raise OSError("libseccomp: seccomp_init failed")
    try:
        native = lib.seccomp_arch_native()
        if native != arch:  # a filter for `arch` only
            _check(lib.seccomp_arch_add(ctx, arch), f"arch_add {name}")
            _check(lib.seccomp_arch_remove(ctx, native), "arch_remove native")
        _check(lib.seccomp_attr_set(ctx, ATTR_ACT_BADARCH, act_errno(errno.EPERM)),
               "attr_set badarch")
        for call in allowed:  # libseccomp takes the native number and translates it
            nr = lib.seccomp_syscall_resolve_name_arch(native, call.encode())
            _check(lib.seccomp_rule_add_exact(ctx, ACT_ALLOW, nr, 0), f"allow {call}")
        out.mkdir(parents=True, exist_ok=True)
        with open(out / f"{name}.bpf", "wb") as f:
            _check(lib.seccomp_export_bpf(ctx, f.fileno()), "export_bpf")
    finally:
        lib.seccomp_release(ctx)
    meta = {"machine": name, "audit_arch": arch, "default": "EPERM", "bad_arch": "EPERM",
            "allowed": allowed, "probes": numbers(lib, arch, PROBES),
            "libseccomp": ".".join(map(str, lib.seccomp_version().contents))}
    (out / f"{name}.json").write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n")
    return meta


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=FILTER_DIR, help="where to write the files")
    args = p.parse_args(argv)
    lib = libseccomp()
    for name in ARCHES:
        meta = build(name, args.out, lib)
        print(f"{args.out / name}.bpf: {len(meta['allowed'])} calls allowed")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
