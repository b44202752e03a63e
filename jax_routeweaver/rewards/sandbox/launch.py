"""The launcher: joins the job's cgroups, drops to the job's own uid, then becomes the jail.

Run as `python -S -I launch.py CONFIG_JSON` (standard library only; CONFIG is built by
`jail.launcher_argv`). In order:

1. join the job's cgroups (`cgroup_procs`): everything started from here on is counted there;
2. as root, with a job uid (`uid`): in a private mount namespace, lay a tmpfs over each host
   directory other users cannot enter (e.g. /root, when the interpreter lives in
   /root/.pyenv) and bind back only the paths the jail needs (`expose`), so that the job uid
   can reach them and nothing else there; then drop to that uid: no capability, no
   supplementary group. The jail's user namespace then maps its uid to this unprivileged
   host uid, never to root (a process whose host uid is root may write /proc/sys and other
   files that check the uid alone);
3. join a fresh, empty session keyring (`fresh_keyring`): the job possesses none of the
   trainer's keys (its seccomp filter refuses the keyring calls too);
4. `execv` bubblewrap (`argv`).

Any failure exits with code 96 and one line on stderr, before the harness is ready: the
sandbox reports it as a set-up failure (`SandboxError`).
"""

import ctypes
import errno
import json
import os
import sys

LAUNCH_FAILED = 96
KEYCTL_GET_KEYRING_ID, KEYCTL_JOIN_SESSION_KEYRING, KEY_SPEC_SESSION_KEYRING = 0, 1, -3
CLONE_NEWNS = 0x00020000
MS_NOSUID, MS_NODEV, MS_BIND, MS_MOVE, MS_REC, MS_PRIVATE = 2, 4, 4096, 8192, 16384, 1 << 18


def fail(what):
    os.write(2, f"routeweaver sandbox launch failed: {what}\n".encode())
    os._exit(LAUNCH_FAILED)


def libc_call(libc, name, *args):
    if getattr(libc, name)(*args) != 0:
        err = ctypes.get_errno()
        fail(f"{name}{args[:2]}: {os.strerror(err)}")


def expose(libc, groups, stage_dir):
    """`groups`: [[hidden_dir, [paths under it]], ...]: cover each hidden dir with a tmpfs
    that holds binds of its paths only. `stage_dir` (a directory none of the paths is under)
    gets a private tmpfs that holds the binds while their directory is covered."""
    libc_call(libc, "unshare", CLONE_NEWNS)
    libc_call(libc, "mount", None, b"/", None, MS_REC | MS_PRIVATE, None)
    libc_call(libc, "mount", b"tmpfs", stage_dir.encode(), b"tmpfs", MS_NOSUID | MS_NODEV,
              b"mode=700,size=64k")
    for k, (hidden, paths) in enumerate(groups):
        stages = []
        for j, path in enumerate(paths):
            stage = os.path.join(stage_dir, f"{k}-{j}")
            if os.path.isdir(path):
                os.mkdir(stage, 0o700)
            else:
                os.close(os.open(stage, os.O_CREAT | os.O_WRONLY, 0o600))
            libc_call(libc, "mount", path.encode(), stage.encode(), None, MS_BIND | MS_REC,
                      None)
            stages.append((stage, path))
        libc_call(libc, "mount", b"tmpfs", hidden.encode(), b"tmpfs", MS_NOSUID | MS_NODEV,
                  b"mode=755,size=64k")
        for stage, path in stages:
            os.makedirs(os.path.dirname(path), 0o755, exist_ok=True)
            if os.path.isdir(stage):
                os.mkdir(path, 0o755)
            else:
                os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o644))
            libc_call(libc, "mount", stage.encode(), path.encode(), None, MS_MOVE, None)


def fresh_keyring(libc, nr):
    """Join a new anonymous session keyring (`nr`: keyctl's number on this machine). Where
    keyrings are closed to this process (a host's own seccomp profile refuses keyctl: EPERM
    or ENOSYS), the job inherits that refusal; then check that the session keyring is
    indeed out of reach, else fail."""
    libc.syscall.restype = ctypes.c_long
    if libc.syscall(ctypes.c_long(nr), ctypes.c_long(KEYCTL_JOIN_SESSION_KEYRING),
                    ctypes.c_void_p(None)) >= 0:
        return
    err = ctypes.get_errno()
    reached = libc.syscall(ctypes.c_long(nr), ctypes.c_long(KEYCTL_GET_KEYRING_ID),
                           ctypes.c_long(KEY_SPEC_SESSION_KEYRING), ctypes.c_long(0)) >= 0
    if err not in (errno.EPERM, errno.ENOSYS) or reached:
        fail(f"keyctl(JOIN_SESSION_KEYRING): {os.strerror(err)}")


def main():
    config = json.loads(sys.argv[1])
    try:
        for procs in config["cgroup_procs"]:
            with open(procs, "w") as f:
                f.write(str(os.getpid()))
        uid = config["uid"]
        libc = ctypes.CDLL(None, use_errno=True)
        if uid is not None:
            libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_char_p]
            if config["expose"]:
                expose(libc, config["expose"], config["stage"])
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            if os.getresuid() != (uid, uid, uid):
                fail("the uid drop did not take")
        fresh_keyring(libc, config["keyctl"])
        os.execv(config["argv"][0], config["argv"])
    except OSError as e:
        fail(repr(e))


if __name__ == "__main__":
    main()
