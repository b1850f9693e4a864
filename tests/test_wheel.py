"""The wheel, as a user installs it: `python -m build`, then `pip install` of the wheel into
a new virtual environment without system site-packages, its dependencies resolved from
the package index as for any user (pip's cache may serve them). Then the installed
commands mount and read. Also the Python steps of packaging/Dockerfile: wheels of
everything built from only what its build stage copies, installed with --no-index.

Nothing from this checkout or its .venv is importable in the new environments: what
runs is the wheel's own files and entry points. These tests need the package index.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import bucketfs
from bucketfs.runtime import mounted as mount_entry
from bucketfs.runtime import state_dir
from tests.mounting import force_unmount, read_log
from tests.test_packaging import copied_sources, stages

ROOT = Path(__file__).resolve().parent.parent


def clean_env() -> dict[str, str]:
    """Not this checkout's environment: no PYTHONPATH, no venv of ours on PATH."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env["PATH"] = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    return env


def run(*args: str | Path, cwd: Path | None = None, timeout: float = 300,
        ) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([str(a) for a in args], capture_output=True, text=True,
                            cwd=cwd, env=clean_env(), timeout=timeout)
    assert result.returncode == 0, f"{args}: {result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


def new_venv(path: Path) -> Path:
    run(sys.executable, "-m", "venv", path)
    assert "include-system-site-packages = false" in (path / "pyvenv.cfg").read_text()
    return path


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A venv holding the wheel `python -m build` made (the README's install)."""
    base = tmp_path_factory.mktemp("wheel")
    run(sys.executable, "-m", "build", "--outdir", base / "dist", ROOT, cwd=base)
    (wheel,) = (base / "dist").glob("bucketfs-*.whl")
    venv = new_venv(base / "venv")
    run(venv / "bin" / "pip", "install", wheel)
    yield venv


def site_packages(venv: Path) -> Path:
    (found,) = venv.glob("lib/python*/site-packages")
    return found


def test_wheel_installs_its_packages_and_commands(installed):
    packages = site_packages(installed)
    for module in ("bucketfs/prefetch/scheduler.py", "bucketfs/hints/sampler.py",
                   "bucketfs/fstab.py", "bucketfs/check.py", "bucketfs/cache/tiered.py"):
        assert (packages / module).exists(), module
    # No generic top-level names claimed.
    assert not (packages / "prefetch").exists() and not (packages / "hints").exists()
    python = installed / "bin" / "python"
    where = run(python, "-c", "import bucketfs, bucketfs.prefetch, bucketfs.hints, pyfuse3; "
                "print(bucketfs.__file__)", cwd=installed).stdout.strip()
    assert where == str(packages / "bucketfs" / "__init__.py")
    result = subprocess.run([python, "-c", "import prefetch"], capture_output=True,
                            cwd=installed, env=clean_env())
    assert result.returncode != 0
    version = run(installed / "bin" / "bucketfs", "--version").stdout.strip()
    assert version == f"bucketfs {bucketfs.__version__}"
    assert (installed / "bin" / "mount.fuse.bucketfs").exists()


@pytest.mark.fuse
def test_installed_commands_mount_and_unmount(installed, tmp_path):
    source = tmp_path / "bucket"
    (source / "d").mkdir(parents=True)
    (source / "d" / "f.txt").write_text("from the wheel\n")
    bucketfs_cmd = installed / "bin" / "bucketfs"
    for how, mnt in (("bucketfs mount", tmp_path / "a"), ("mount helper", tmp_path / "b")):
        mnt.mkdir()
        log = tmp_path / f"{mnt.name}.log"
        try:
            # From the checkout's root, where a `bucketfs` directory lies: the daemon
            # must still run the installed package.
            if how == "bucketfs mount":
                run(bucketfs_cmd, "mount", f"file://{source}", mnt, "--log-file", log,
                    cwd=ROOT)
            else:
                run(installed / "bin" / "mount.fuse.bucketfs", f"file://{source}", mnt,
                    "-o", f"ro,_netdev,log_file={log}", cwd=ROOT)
            assert (mnt / "d" / "f.txt").read_text() == "from the wheel\n", read_log(log)
            pid = int((state_dir(str(mnt)) / "pid").read_text())
            daemon = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            assert daemon[0].decode().startswith(str(installed)), daemon  # the wheel runs
            # Its pyfuse3 is PyPI's, so the daemon answers opens itself, and says so.
            assert "lacks bucketfs's patch" in read_log(log)
            run(bucketfs_cmd, "check", mnt)
            run(bucketfs_cmd, "umount", mnt)
            assert mount_entry(str(mnt)) is None
        finally:
            force_unmount(mnt)


def dockerfile_python_commands() -> tuple[str, str, str]:
    """The build stage's patched pyfuse3 build and `pip wheel`, and the final stage's
    `pip install`, as written."""
    (_, build), (_, final) = stages((ROOT / "packaging" / "Dockerfile").read_text())
    (step,) = [args for op, args in build if op == "RUN" and "pip wheel" in args]
    patched, wheel = step.split(" && ")
    (install,) = [args for op, args in final if op == "RUN" and "pip install" in args]
    install = re.sub(r"^--mount=\S+\s+", "", install)  # the bind mount of /wheels
    return patched, wheel, install


def test_dockerfile_python_steps(tmp_path):
    """The Dockerfile's own pip commands on this machine's Python: wheels from the build
    stage's COPY sources alone, then an install that may not reach the index. Paths are
    moved under tmp_path, and --no-cache-dir is dropped so that pip's cache serves what
    it already downloaded or built."""
    context = tmp_path / "context"
    context.mkdir()
    for source in copied_sources():
        if (ROOT / source).is_dir():
            shutil.copytree(ROOT / source, context / source,
                            ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(ROOT / source, context / source)
    wheels = tmp_path / "wheels"
    venv = new_venv(tmp_path / "venv")
    patch_step, wheel_step, install_step = (
        command.replace("/wheels", str(wheels)).replace("--no-cache-dir", "")
        for command in dockerfile_python_commands())
    # The build stage's Python is any 3.11; the final stage's is the image's own, here
    # the new venv's.
    python = shlex.quote(sys.executable)
    run("sh", "-c", f"{python} {patch_step.removeprefix('python ')}", cwd=context)
    run("sh", "-c", f"{python} -m {wheel_step}", cwd=context)
    assert len(list(wheels.glob("pyfuse3-*.whl"))) == 1, "pyfuse3 built twice, or never"
    run("sh", "-c", f"{venv}/bin/python -m {install_step}", cwd=tmp_path)
    run(venv / "bin" / "bucketfs", "--version")
    run(venv / "bin" / "python", "-c", "import pyfuse3, rocksdict, boto3, "
        "google.cloud.storage, trio, prometheus_client, zlib_ng")
    # The image's pyfuse3 is the patched one, so its mounts skip OPEN (kernel_opens).
    run(venv / "bin" / "python", ROOT / "packaging" / "pyfuse3" / "build.py", "--check")
