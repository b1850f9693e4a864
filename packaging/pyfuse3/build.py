"""Build pyfuse3 with bucketfs's small patch, as a wheel, and optionally install it.

    python packaging/pyfuse3/build.py --install              # into this Python
    python packaging/pyfuse3/build.py --wheel-dir /wheels    # a wheel only (Docker)
    python packaging/pyfuse3/build.py --check                # exit 0 if installed

Why a patch (docs/ARCHITECTURE.md, "Libraries beyond the stack", has the figures):

1. `read` learns its inode when the kernel opens files itself. bucketfs answers OPEN with
   ENOSYS; the kernel then stops sending OPEN and RELEASE for the life of the mount
   (FUSE no_open) and keeps each file's page cache, so a warm read costs the daemon
   nothing. Every READ then carries file handle 0, and stock pyfuse3 passes only the
   handle to `read`; patched, it passes the inode in place of a zero handle.
2. `Operations.max_background` reaches the kernel: how many read-ahead requests it keeps
   in flight (its default, 12, starves 16 concurrent readers).
3. A read's reply is written to /dev/fuse without the GIL. That write is the kernel
   copying the bytes into the reader's pages, 40% of the daemon's GIL-held time on warm
   reads; the worker threads (GETs, the SSD tier) run meanwhile.
4. While requests are queued, a worker takes the next one at once (/dev/fuse made
   non-blocking), instead of a trio lock and a wait for readability per request.
5. `take_init` gives a session an INIT that another process answered. A process serving
   a clone of a connection's /dev/fuse descriptor (given to `init` as "/dev/fd/N")
   never sees the kernel's INIT, and libfuse answers every request of a session that
   has seen none with EIO. Used by `bench.fuse_clones` (pyfuse3 in more than one
   process on one connection); bucketfs itself serves from one process.
6. A read may be answered by another process. An `Operations` with `read_unique` set
   gets each READ's `unique` (from the request's header) as a fourth argument to
   `read`, and may return `REPLIED_ELSEWHERE` once some process sharing the session's
   /dev/fuse descriptor has written the reply under that `unique`; libfuse then frees
   the request and sends nothing. Used by `bench.fuse_clones` (one process dispatching
   reads to others that hold the bytes); bucketfs itself answers its own reads.

pyfuse3 ships no binary wheels, so every install compiles it from its sdist anyway; the
patch adds a Cython run (pip fetches Cython as a build dependency). The sdist is pinned
by version and SHA-256, and every hunk must match exactly once, so a new pyfuse3 fails
here loudly rather than building something unpatched. Without this build bucketfs runs
on a stock pyfuse3 and answers every OPEN itself (`kernel_opens` is then off).
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

VERSION = "3.5.0"
#: `pyfuse3.BUCKETFS_PATCH` of a build with these hunks; raised whenever they change.
PATCH_VERSION = 5
SDIST_SHA256 = "88399a9494b88603230bba300f4ba9ad63fece5ed514ca3633d555a0c6a42b24"

#: (file in the sdist, exact text, replacement). Each text must occur exactly once.
HUNKS: tuple[tuple[str, str, str], ...] = (
    ("src/pyfuse3/__init__.pyx",
     'log = logging.getLogger("pyfuse3")\n',
     "#: Patched for bucketfs (packaging/pyfuse3/build.py): `read` gets the inode as its\n"
     "#: fh when no OPEN preceded it, and `Operations.max_background` is honoured.\n"
     f"BUCKETFS_PATCH = {PATCH_VERSION}\n"
     "#: What a `read` returns when another process wrote its reply (hunk 6).\n"
     "REPLIED_ELSEWHERE = object()\n\n"
     'log = logging.getLogger("pyfuse3")\n'),
    ("src/pyfuse3/__init__.pyx",
     "cdef object py_retval\n",
     "cdef object py_retval\n"
     "# The `unique` of the request being processed, read from its header as it is\n"
     "# received, and whether `Operations.read` takes it (`read_unique`).\n"
     "cdef uint64_t current_unique = 0\n"
     "cdef int read_unique = 0\n"),
    ("src/pyfuse3/handlers.pxi",
     "    cdef uint64_t fh\n\ncdef void fuse_init",
     "    cdef uint64_t fh\n    cdef uint64_t unique\n\ncdef void fuse_init"),
    ("src/pyfuse3/handlers.pxi",
     "    # Blocking rather than async, in case we decide to let the\n",
     "    global read_unique\n"
     "    read_unique = 1 if getattr(operations, 'read_unique', False) else 0\n"
     "    # Read-ahead requests the kernel keeps in flight (its default is 12).\n"
     "    max_background = getattr(operations, 'max_background', 0)\n"
     "    if max_background:\n"
     "        conn.max_background = max_background\n"
     "        conn.congestion_threshold = max_background * 3 // 4\n\n"
     "    # Blocking rather than async, in case we decide to let the\n"),
    ("src/pyfuse3/handlers.pxi",
     "    c.off = off\n    c.fh = fi.fh\n    save_retval(fuse_read_async(c))\n",
     "    c.off = off\n"
     "    # No OPEN preceded this read (open raised ENOSYS: FUSE no_open), so the kernel\n"
     "    # sends fh 0; the inode stands in for it, so that the handler knows the file.\n"
     "    c.fh = fi.fh if fi.fh != 0 else ino\n"
     "    c.unique = current_unique\n"
     "    save_retval(fuse_read_async(c))\n"),
    ("src/pyfuse3/handlers.pxi",
     "        buf = await operations.read(c.fh, c.off, c.size)\n",
     "        if read_unique:\n"
     "            buf = await operations.read(c.fh, c.off, c.size, c.unique)\n"
     "            if buf is REPLIED_ELSEWHERE:\n"
     "                # Another process sharing the descriptor wrote the reply under\n"
     "                # c.unique: free the request, send nothing.\n"
     "                fuse_reply_none(c.req)\n"
     "                return\n"
     "        else:\n"
     "            buf = await operations.read(c.fh, c.off, c.size)\n"),
    ("src/pyfuse3/handlers.pxi",
     "        ret = fuse_reply_buf(c.req, <const_char*> pybuf.buf, <size_t> pybuf.len)\n"
     "        PyBuffer_Release(&pybuf)\n",
     "        # The reply's copy into the reader's pages (up to max_read bytes) need not\n"
     "        # hold the GIL: the buffer stays pinned until PyBuffer_Release.\n"
     "        with nogil:\n"
     "            ret = fuse_reply_buf(c.req, <const_char*> pybuf.buf, <size_t> pybuf.len)\n"
     "        PyBuffer_Release(&pybuf)\n"),
    ("src/pyfuse3/__init__.pyx",
     "    session_fd = fuse_session_fd(session)\n",
     "    session_fd = fuse_session_fd(session)\n"
     "    # Non-blocking, so that a worker can take the next request without waiting for\n"
     "    # readability first (see _session_loop); an empty queue reads as EAGAIN.\n"
     "    os.set_blocking(session_fd, False)\n"),
    ("src/pyfuse3/internal.pxi",
     "async def _session_loop(nursery, int min_tasks, int max_tasks):\n"
     "    cdef int res\n"
     "    cdef fuse_buf buf\n",
     "async def _session_loop(nursery, int min_tasks, int max_tasks):\n"
     "    cdef int res\n"
     "    cdef fuse_buf buf\n"
     "    cdef int quick = 0\n"),
    ("src/pyfuse3/internal.pxi",
     "        if not await _wait_fuse_readable():\n"
     "            break\n"
     "\n"
     "        res = fuse_session_receive_buf(session, &buf)\n",
     "        # While requests are queued, take the next one at once: the read lock and\n"
     "        # the wait for readability cost three trio scheduling rounds and epoll calls\n"
     "        # per request. Every 8th request goes the long way, which also lets the\n"
     "        # rest of the program run.\n"
     "        res = fuse_session_receive_buf(session, &buf) if quick < 8 else -errno.EAGAIN\n"
     "        if res == -errno.EAGAIN:\n"
     "            quick = 0\n"
     "            if not await _wait_fuse_readable():\n"
     "                break\n"
     "            res = fuse_session_receive_buf(session, &buf)\n"
     "            if res == -errno.EAGAIN:  # another worker took it\n"
     "                continue\n"
     "        else:\n"
     "            quick += 1\n"),
    ("src/pyfuse3/internal.pxi",
     "        save_retval(None)\n"
     "        fuse_session_process_buf(session, &buf)\n",
     "        # The request's `unique` (fuse_in_header: len, opcode, then unique), which\n"
     "        # fuse_read hands to a read that another process may answer (hunk 6).\n"
     "        if not buf.flags & FUSE_BUF_IS_FD:\n"
     "            set_current_unique((<uint64_t*> (<char*> buf.mem + 8))[0])\n"
     "        save_retval(None)\n"
     "        fuse_session_process_buf(session, &buf)\n"),
    ("src/pyfuse3/internal.pxi",
     "cdef void save_retval(object val):\n",
     "cdef void set_current_unique(uint64_t unique):\n"
     "    global current_unique\n"
     "    current_unique = unique\n\n\n"
     "cdef void save_retval(object val):\n"),
    ("src/pyfuse3/__init__.pyx",
     "\n\n@async_wrapper\nasync def main(int min_tasks=1, int max_tasks=99):\n",
     "\n\ndef take_init(request):\n"
     '    """Hand the session an INIT request that another process answered (a bucketfs\n'
     "    patch): one serving a clone of the connection's /dev/fuse descriptor, given to\n"
     '    init() as "/dev/fd/N", never receives the kernel\'s INIT, and libfuse answers\n'
     "    every other request with EIO until it has seen one. libfuse's reply goes to the\n"
     "    kernel under the request's `unique`, which no request in flight may have: the\n"
     '    kernel refuses it (ENOENT), which libfuse takes for an interrupted request."""\n'
     "    cdef fuse_buf buf\n"
     "    cdef bytes data = bytes(request)\n"
     "    if session == NULL:\n"
     "        raise RuntimeError('Need to call init() before take_init()')\n"
     "    buf.mem = <void*> <char*> data\n"
     "    buf.size = len(data)\n"
     "    buf.flags = 0\n"
     "    buf.fd = -1\n"
     "    buf.pos = 0\n"
     "    save_retval(None)\n"
     "    fuse_session_process_buf(session, &buf)\n"
     "\n\n@async_wrapper\nasync def main(int min_tasks=1, int max_tasks=99):\n"),
)


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True)


def fetch_sdist(into: Path) -> Path:
    pip("download", "--no-deps", "--no-binary", ":all:", "--dest", str(into),
        f"pyfuse3=={VERSION}")
    (sdist,) = into.glob(f"pyfuse3-{VERSION}.tar.gz")
    digest = hashlib.sha256(sdist.read_bytes()).hexdigest()
    if digest != SDIST_SHA256:
        sys.exit(f"pyfuse3 {VERSION} sdist has SHA-256 {digest}, expected {SDIST_SHA256}")
    return sdist


def apply_hunks(source: Path) -> None:
    for name, old, new in HUNKS:
        path = source / name
        text = path.read_text()
        if text.count(old) != 1:
            sys.exit(f"{name}: the patch no longer matches pyfuse3 {VERSION}")
        path.write_text(text.replace(old, new))
    # The sdist ships C generated from the unpatched .pyx; remove it so that it is
    # generated again from the patched source.
    for generated in (source / "src" / "pyfuse3").glob("*.c"):
        if generated.read_text(errors="replace").startswith("/* Generated by Cython"):
            generated.unlink()


def build_wheel(wheel_dir: Path) -> Path:
    with tempfile.TemporaryDirectory(prefix="pyfuse3-build-") as work:
        sdist = fetch_sdist(Path(work))
        with tarfile.open(sdist) as archive:
            archive.extractall(work, filter="data")
        source = Path(work) / f"pyfuse3-{VERSION}"
        apply_hunks(source)
        wheel_dir.mkdir(parents=True, exist_ok=True)
        pip("wheel", "--no-deps", "--wheel-dir", str(wheel_dir), str(source))
    (wheel,) = wheel_dir.glob(f"pyfuse3-{VERSION}-*.whl")
    return wheel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wheel-dir", type=Path, help="where to leave the wheel")
    parser.add_argument("--install", action="store_true",
                        help="install the wheel into this Python")
    parser.add_argument("--check", action="store_true",
                        help="exit 0 if this Python's pyfuse3 carries this patch, else 1")
    args = parser.parse_args()
    if args.check:
        try:
            import pyfuse3
        except ImportError:
            sys.exit(1)
        sys.exit(0 if getattr(pyfuse3, "BUCKETFS_PATCH", 0) == PATCH_VERSION else 1)
    if not args.install and args.wheel_dir is None:
        parser.error("give --install, --wheel-dir, or both")
    with tempfile.TemporaryDirectory(prefix="pyfuse3-wheel-") as scratch:
        wheel = build_wheel(args.wheel_dir or Path(scratch))
        if args.install:
            pip("install", "--force-reinstall", "--no-deps", str(wheel))
        print(f"built {wheel.name} with bucketfs's patch")


if __name__ == "__main__":
    main()
