"""Sandbox launcher: run as `python -I -S _sandbox_init.py` by lichen.rewards.sandbox; standard library only.

It reads one JSON request from stdin (files, argv, stdin text, interpreter, uid/gid, limits, mode, the host paths
to expose, the control socket and cgroup fds the trainer passed) and then:
1. enters new mount, network, PID, IPC and UTS namespaces (mode "root"), or the same inside a new user
   namespace that maps the caller's uid (mode "userns", for a non-root trainer), and makes every mount private;
2. forks the child that becomes PID 1 of the new PID namespace, opens a pidfd for it and hands that pidfd to the
   trainer over the control socket before letting the child go on: the trainer kills the whole namespace through
   it when the run ends, whatever the program did to its session, process group or parent-death signal;
3. the child joins the run's cgroup (through the fd the trainer opened), builds a new root on a small tmpfs
   holding only read-only bind mounts of the exposed paths (the interpreter, its standard library, the shared
   libraries it loads), /dev/{null,zero,full,random,urandom}, a /proc of its own PID namespace and a private
   size-capped /tmp with the work directory, pivots into it and detaches the host's tree, so no data file,
   checkout or socket of the host is reachable; then it sets the resource limits (CPU, address space,
   processes, file size, open files, core), drops to the sandbox uid/gid with no supplementary groups (mode
   "root") or enters a nested user namespace as uid 1000 (mode "userns"), sets no-new-privileges and
   parent-death = SIGKILL, and execs the interpreter on argv inside the work directory with a minimal environment;
4. the launcher writes the child's stdin, waits, and exits with the child's code (128 + signal when killed).
The launcher itself gets parent-death = SIGKILL once in its namespaces, so a trainer killed with SIGKILL leaves no
sandbox behind (the program inside dies with the launcher).
The new network namespace has only a downed loopback interface: no connection leaves it. A setup failure exits
125 with a "lichen-sandbox:" line on stderr.
"""

import ctypes
import json
import os
import resource
import signal
import socket
import stat
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
MNT_DETACH = 2
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "ppc64": 203, "s390x": 217}
INNER_UID = 1000  # the program's uid inside the nested user namespace of mode "userns"
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
SETUP_FAILED = 125
STAGING = "/tmp"  # the new root is built on a tmpfs mounted here (in this mount namespace only)
WORKDIR = "/tmp/sandbox"  # inside the new root
DEVICES = ("null", "zero", "full", "random", "urandom")

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


def bind(source, target, extra):
    """Bind `source` on `target`, then remount it with `extra` flags, keeping the flags the kernel locks on a
    mount inherited from a more privileged namespace (nosuid, nodev, noexec, atime)."""
    mount(source, target, None, MS_BIND | MS_REC, None)
    keep = MS_NOSUID | MS_NODEV | MS_NOEXEC | ST_NOATIME | ST_NODIRATIME
    st = os.statvfs(target)
    flags = MS_BIND | MS_REMOUNT | extra | (st.f_flag & keep)
    if st.f_flag & ST_RELATIME:
        flags |= MS_RELATIME
    mount(None, target, None, flags, None)


def expose(root, path, depth=0):
    """Make host `path` visible read-only at the same path under `root`, recreating the symlinks on the way
    (/lib64 -> usr/lib64 and the like) so that every path the interpreter was built with resolves the same."""
    if depth > 40:
        raise OSError("too many symlinks under %s" % path)
    parts = [p for p in path.split("/") if p]
    current = ""
    for i, part in enumerate(parts):
        current += "/" + part
        target = root + current
        info = os.lstat(current)
        if stat.S_ISLNK(info.st_mode):
            link = os.readlink(current)
            if not os.path.lexists(target):
                os.symlink(link, target)
            rest = "/".join(parts[i + 1 :])
            return expose(root, os.path.normpath(os.path.join(os.path.dirname(current), link, rest)), depth + 1)
        if os.path.lexists(target) and (i < len(parts) - 1 or os.path.ismount(target)):
            continue  # a directory on the way, or already exposed (also inside an exposed parent)
        if i < len(parts) - 1:
            os.mkdir(target, 0o755)
        elif stat.S_ISDIR(info.st_mode):
            if not os.path.lexists(target):
                os.mkdir(target, 0o755)
            bind(current, target, MS_RDONLY | MS_NOSUID | MS_NODEV)
        else:
            if not os.path.lexists(target):
                open(target, "w").close()
            bind(current, target, MS_RDONLY | MS_NOSUID | MS_NODEV)


def build_root(req):
    """The program's whole file system: read-only exposed paths, a few devices, its /proc and a private /tmp."""
    root = STAGING
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    for path in req["expose"]:
        expose(root, path)
    os.mkdir(root + "/dev", 0o755)
    for name in DEVICES:
        open(root + "/dev/" + name, "w").close()
        bind("/dev/" + name, root + "/dev/" + name, MS_NOSUID | MS_NOEXEC)
    for name, target in (
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ):
        os.symlink(target, root + "/dev/" + name)
    os.mkdir(root + "/proc", 0o555)
    try:  # a /proc that shows only this PID namespace; not every container allows it
        mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
    except OSError:
        pass
    os.mkdir(root + "/tmp", 0o1777)
    mount("tmpfs", root + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, "size=%dm,mode=1777" % req["tmpfs_mb"])
    os.mkdir(root + WORKDIR, 0o700)
    for name, text in req["files"].items():
        write_file(os.path.join(root + WORKDIR, name), text)
    if req["mode"] == "root":
        for name in [""] + list(req["files"]):
            os.chown(os.path.join(root + WORKDIR, name), req["uid"], req["gid"])
    # pivot into the new root and detach the host's tree: unlike chroot, nothing of it stays reachable
    nr = SYS_PIVOT_ROOT.get(os.uname().machine)
    if nr is None:
        raise OSError("pivot_root: unknown system call number on %s" % os.uname().machine)
    os.chdir(root)
    check(libc.syscall(ctypes.c_long(nr), b".", b"."), "pivot_root")
    check(libc.umount2(b".", MNT_DETACH), "umount old root")
    os.chdir("/")
    mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV, None)


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


def child(req, stdin_fd, go_fd):
    try:
        # wait until the trainer holds this process's pidfd; if the launcher dies first, EOF: leave
        if os.read(go_fd, 1) != b"g":
            os._exit(SETUP_FAILED)
        os.close(go_fd)
        if req.get("cgroup_fd") is not None:
            os.write(req["cgroup_fd"], b"0")  # "0": this process; its descendants follow it
        build_root(req)
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
            # namespace above, so it cannot undo the read-only mounts or the tmpfs over /tmp
            check(libc.unshare(CLONE_NEWUSER), "unshare(user)")
            write_file("/proc/self/setgroups", "deny")
            write_file("/proc/self/uid_map", "%d 0 1" % INNER_UID)
            write_file("/proc/self/gid_map", "%d 0 1" % INNER_UID)
        check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(no_new_privs)")
        # after setresuid: changing credentials clears the parent-death signal
        check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(pdeathsig)")
        env = {
            "PATH": "/usr/bin:/bin",
            "HOME": WORKDIR,
            "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONHASHSEED": "0",
            "TMPDIR": WORKDIR,
        }
        python = req["python"]
        os.execve(python, [python, "-I"] + req["argv"], env)
    except BaseException as e:  # anything before exec: report and leave
        fail("child setup: %s: %s" % (type(e).__name__, e))


def hand_over(control_fd, pid):
    """Give the trainer a pidfd of the namespace's PID 1 (and the namespace's id, for its records)."""
    ns = os.readlink("/proc/%d/ns/pid" % pid)
    pidfd = os.pidfd_open(pid)
    with socket.socket(fileno=control_fd) as control:
        socket.send_fds(control, [json.dumps({"pid": pid, "ns": ns}).encode()], [pidfd])
    os.close(pidfd)


def main():
    try:
        req = json.loads(sys.stdin.read())
        enter_namespaces(req)
        # die with the trainer even when it is SIGKILLed (set after unshare: a user namespace changes credentials,
        # which clears the signal); the program below has the same towards this process
        check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(pdeathsig)")
        if os.getppid() != req.get("parent_pid", os.getppid()):
            fail("the process that started the sandbox is gone")
        read_fd, write_fd = os.pipe()
        go_read, go_write = os.pipe()
    except BaseException as e:
        fail("%s: %s" % (type(e).__name__, e))
    pid = os.fork()  # the first child after unshare(CLONE_NEWPID) is PID 1 of the new namespace
    if pid == 0:
        os.close(write_fd)
        os.close(go_write)
        child(req, read_fd, go_read)
    os.close(read_fd)
    os.close(go_read)
    try:
        hand_over(req["control_fd"], pid)
    except BaseException as e:
        os.kill(pid, signal.SIGKILL)
        fail("hand over the sandbox: %s: %s" % (type(e).__name__, e))
    os.write(go_write, b"g")
    os.close(go_write)
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
        view = view[os.write(fd, view) :]


if __name__ == "__main__":
    main()
