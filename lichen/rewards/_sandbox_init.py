"""Sandbox launcher: run as `python -I -S _sandbox_init.py` by lichen.rewards.sandbox; standard library only.

It reads one JSON request from stdin (files, argv, stdin text, interpreter, uid/gid, limits, mode) and then:
1. enters new mount, network, PID, IPC and UTS namespaces (mode "root"), or the same inside a new user
   namespace that maps the caller's uid (mode "userns", for a non-root trainer);
2. makes every mount private (nothing it mounts reaches the host) and read-only (but /proc, /sys, /dev), mounts a
   size-capped tmpfs over each world-writable directory (/tmp, /var/tmp, /dev/shm, /run/lock, /dev/mqueue) and
   writes the files into a fresh work directory on the new /tmp;
3. forks the child that becomes PID 1 of the new PID namespace: it mounts a /proc of that namespace, sets the
   resource limits (CPU, address space, processes, file size, open files, core), drops to the sandbox uid/gid
   with no supplementary groups (mode "root") or enters a nested user namespace as uid 1000 (mode "userns"),
   sets no-new-privileges and parent-death = SIGKILL, and execs the
   interpreter on argv inside the work directory with a minimal environment;
4. writes the child's stdin, waits, and exits with the child's code (128 + signal when it was killed).
When PID 1 of a PID namespace dies the kernel kills every process left in it, so killing this launcher's process
group (the host does, on timeout) removes the whole sandbox. The new network namespace has only a downed
loopback interface: no connection leaves it. A setup failure exits 125 with a "lichen-sandbox:" line on stderr.
"""

import ctypes
import json
import os
import resource
import signal
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE, MS_RELATIME = 32, 4096, 0x4000, 1 << 18, 1 << 21
ST_NOATIME, ST_NODIRATIME, ST_RELATIME = 1024, 2048, 4096  # statvfs f_flag bits (same as MS_ for the first two)
INNER_UID = 1000  # the program's uid inside the nested user namespace of mode "userns"
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
SETUP_FAILED = 125
WORLD_WRITABLE = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock", "/dev/mqueue")
WORKDIR = "/tmp/sandbox"

libc = ctypes.CDLL(None, use_errno=True)


def fail(message):
    os.write(2, ("lichen-sandbox: " + message + "\n").encode())
    os._exit(SETUP_FAILED)


def check(ret, what):
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, "%s: %s" % (what, os.strerror(err)))


def mount(source, target, fstype, flags, data):
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    check(libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)), "mount " + target)


def write_file(path, text):
    with open(path, "w") as f:
        f.write(text)


def enter_namespaces(req):
    flags = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS
    if req["mode"] == "userns":
        uid, gid = os.geteuid(), os.getegid()
        check(libc.unshare(CLONE_NEWUSER | flags), "unshare")
        write_file("/proc/self/setgroups", "deny")
        write_file("/proc/self/uid_map", "0 %d 1" % uid)
        write_file("/proc/self/gid_map", "0 %d 1" % gid)
    else:
        check(libc.unshare(flags), "unshare")
    mount(None, "/", None, MS_REC | MS_PRIVATE, None)  # before any other mount: nothing may propagate out


def mount_points():
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4].replace("\\040", " ") for line in f]
    return list(dict.fromkeys(points))


def make_read_only():
    """Bind-remount every mount read-only (keeping its locked nosuid/nodev/noexec/atime flags), except the
    kernel's /proc, /sys and /dev: the program may write only to the private tmpfs mounted afterwards."""
    keep = MS_NOSUID | MS_NODEV | MS_NOEXEC | ST_NOATIME | ST_NODIRATIME
    for point in mount_points():
        if point in ("/proc", "/sys", "/dev") or point.startswith(("/proc/", "/sys/", "/dev/")):
            continue
        try:
            st = os.statvfs(point)
        except OSError:  # hidden under another mount, or gone
            continue
        flags = MS_BIND | MS_REMOUNT | MS_RDONLY | (st.f_flag & keep)
        if st.f_flag & ST_RELATIME:
            flags |= MS_RELATIME
        try:
            mount(None, point, None, flags, None)
        except OSError:
            if point == "/":
                raise


def prepare_filesystem(req):
    make_read_only()
    opts = "size=%dm,mode=1777" % req["tmpfs_mb"]
    for path in WORLD_WRITABLE:
        if os.path.isdir(path) and not os.path.islink(path):
            mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, opts)
    os.mkdir(WORKDIR, 0o700)
    for name, text in req["files"].items():
        write_file(os.path.join(WORKDIR, name), text)
    if req["mode"] == "root":
        for name in [""] + list(req["files"]):
            os.chown(os.path.join(WORKDIR, name), req["uid"], req["gid"])


def set_limits(limits):
    pairs = (
        (resource.RLIMIT_CPU, limits["cpu_s"], limits["cpu_s"] + 1),
        (resource.RLIMIT_AS, limits["memory_bytes"], limits["memory_bytes"]),
        (resource.RLIMIT_NPROC, limits["max_procs"], limits["max_procs"]),
        (resource.RLIMIT_FSIZE, limits["max_file_bytes"], limits["max_file_bytes"]),
        (resource.RLIMIT_NOFILE, limits["max_open_files"], limits["max_open_files"]),
        (resource.RLIMIT_CORE, 0, 0),
    )
    for which, soft, hard in pairs:
        resource.setrlimit(which, (soft, hard))


def child(req, stdin_fd):
    try:
        try:  # a /proc that shows only this PID namespace; not every container allows it
            mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
        except OSError:
            pass
        os.dup2(stdin_fd, 0)
        os.closerange(3, 1 << 16)
        os.chdir(WORKDIR)
        set_limits(req["limits"])
        if req["mode"] == "root":
            try:
                os.setgroups([])
                os.setresgid(req["gid"], req["gid"], req["gid"])
                os.setresuid(req["uid"], req["uid"], req["uid"])
            except OSError as e:
                fail("setresuid %d: %s" % (req["uid"], e))
            if os.getresuid() != (req["uid"],) * 3 or 0 in os.getresuid() or 0 in os.getresgid():
                fail("setresuid %d: still running as %s" % (req["uid"], os.getresuid()))
        if req["mode"] == "userns":
            # a nested user namespace in which the program is not root: it holds no capability over the mount
            # namespace above, so it cannot undo the read-only remounts or the tmpfs over /tmp
            check(libc.unshare(CLONE_NEWUSER), "unshare(user)")
            write_file("/proc/self/setgroups", "deny")
            write_file("/proc/self/uid_map", "%d 0 1" % INNER_UID)
            write_file("/proc/self/gid_map", "%d 0 1" % INNER_UID)
        check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(no_new_privs)")
        # after setresuid: changing credentials clears the parent-death signal
        check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(pdeathsig)")
        env = {"PATH": "/usr/bin:/bin", "HOME": WORKDIR, "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1",
               "PYTHONHASHSEED": "0", "TMPDIR": WORKDIR}
        python = req["python"]
        os.execve(python, [python, "-I"] + req["argv"], env)
    except BaseException as e:  # anything before exec: report and leave
        fail("child setup: %s: %s" % (type(e).__name__, e))


def main():
    try:
        req = json.loads(sys.stdin.read())
        enter_namespaces(req)
        prepare_filesystem(req)
        read_fd, write_fd = os.pipe()
    except BaseException as e:
        fail("%s: %s" % (type(e).__name__, e))
    pid = os.fork()  # the first child after unshare(CLONE_NEWPID) is PID 1 of the new namespace
    if pid == 0:
        os.close(write_fd)
        child(req, read_fd)
    os.close(read_fd)
    # written here, not on a thread: after unshare(CLONE_NEWPID) this process may not create threads. A child
    # that exits without reading closes the pipe, so the write ends (EPIPE) instead of blocking.
    try:
        _write_all(write_fd, req["stdin"].encode())
    except OSError:
        pass
    os.close(write_fd)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        os._exit(128 + os.WTERMSIG(status))
    os._exit(os.WEXITSTATUS(status))


def _write_all(fd, data):
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


if __name__ == "__main__":
    main()
