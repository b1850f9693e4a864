"""The daemon's logs and command line: JSON lines on request, --log-level obeyed, and no
credential anywhere: not in a log line, not in the daemon's command line (`ps` shows it
to every user), not in an endpoint's user:password@."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bucketfs.logs import (
    REDACTED,
    JsonFormatter,
    PrivateLogFile,
    RedactingFilter,
    Throttle,
    held_back,
    redact,
)
from bucketfs.runtime import mounted as mount_entry
from tests.mounting import daemon_pid, force_unmount, mounted, read_log

SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYzEXAMPLEKEY"
ACCESS_KEY = "AKIAIOSFODNN7EXAMPLE"
PASSWORD = "hunter2-endpoint-password"
ENDPOINT = f"http://bob:{PASSWORD}@127.0.0.1:9/"


# --- Redaction and formats -----------------------------------------------------------


@pytest.mark.parametrize(("text", "shown"), [
    (f"cannot reach {ENDPOINT}", f"cannot reach http://{REDACTED}@127.0.0.1:9/"),
    ('Could not connect to "https://AKIA:abc@s3.example.com/b"',
     f'Could not connect to "https://{REDACTED}@s3.example.com/b"'),
    ("key s3://bucket/user@example.com/x", "key s3://bucket/user@example.com/x"),  # a key
    # A password with an unencoded "/" (not a valid URL, so the error names it).
    ("bad endpoint http://bob:pa/ss+w@rd@10.0.0.1:9000",
     f"bad endpoint http://{REDACTED}@10.0.0.1:9000"),
    ("HTTPS://bob:pa/ss@host/b", f"HTTPS://{REDACTED}@host/b"),
    ("mail bob@example.com", "mail bob@example.com"),
])
def test_url_userinfo_is_redacted(text, shown):
    assert redact(text, ()) == shown


def record(message: str, *args: object, exc: bool = False) -> logging.LogRecord:
    exc_info = None
    if exc:
        try:
            raise ValueError(f"boom with {SECRET}")
        except ValueError:
            exc_info = sys.exc_info()
    return logging.LogRecord("bucketfs.test", logging.WARNING, __file__, 1, message, args,
                             exc_info)


def test_json_lines_carry_level_logger_message_and_no_secret(monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    scrub, formatter = RedactingFilter(), JsonFormatter()
    entry = record("GET failed for %s via %s", "train/x.jpg", ENDPOINT, exc=True)
    assert scrub.filter(entry)
    line = formatter.format(entry)
    assert "\n" not in line and SECRET not in line and PASSWORD not in line
    data = json.loads(line)
    assert data["level"] == "WARNING" and data["logger"] == "bucketfs.test"
    assert data["message"].startswith("GET failed for train/x.jpg via http://<redacted>@")
    assert "Traceback" in data["message"] and f"boom with {REDACTED}" in data["message"]
    assert data["time"].endswith("Z")


# --- The daemon ----------------------------------------------------------------------


@pytest.fixture
def source(tmp_path: Path) -> Path:
    root = tmp_path / "bucket"
    (root / "d").mkdir(parents=True)
    (root / "d" / "f.txt").write_text("hello\n")
    return root


def cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]


@pytest.mark.fuse
def test_daemon_command_line_holds_no_options_and_json_logs_parse(source, tmp_path):
    cache = tmp_path / "cache"
    log = tmp_path / "mnt.log"
    env = {"AWS_SECRET_ACCESS_KEY": SECRET, "AWS_ACCESS_KEY_ID": ACCESS_KEY}
    with mounted(f"file://{source}", tmp_path / "mnt", "--endpoint-url", ENDPOINT,
                 "--cache-dir", str(cache), "--log-level", "debug", "--log-format", "json",
                 "--kernel-ttl", "7", env=env) as mnt:
        assert (mnt / "d" / "f.txt").read_text() == "hello\n"
        pid = daemon_pid(mnt)
        argv = cmdline(pid)
        # Only the URL and the mountpoint; the options came through a pipe.
        assert argv[1:7] == ["-P", "-m", "bucketfs", "mount", f"file://{source}", str(mnt)]
        assert argv[7:] == ["--foreground", "--ready-fd", argv[9], "--options-fd", argv[11]]
        text = " ".join(argv)
        for secret in (PASSWORD, "bob:", SECRET, ACCESS_KEY, "127.0.0.1:9"):
            assert secret not in text, text
        assert any(cache.iterdir()), "the options did not reach the daemon"
    text = read_log(log)
    for secret in (PASSWORD, SECRET, ACCESS_KEY):
        assert secret not in text
    lines = [json.loads(line) for line in text.splitlines()]
    assert all({"time", "level", "logger", "message"} <= set(line) for line in lines)
    messages = {line["message"]: line for line in lines}
    options = next(m for m in messages if " options: " in m)
    assert messages[options]["level"] == "DEBUG"
    assert f"endpoint_url=http://{REDACTED}@127.0.0.1:9/" in options
    assert f"cache_dir={cache}" in options and "kernel_ttl=7.0" in options
    assert any(m.startswith("mounted ") and messages[m]["level"] == "INFO" for m in messages)
    assert any(m.startswith("unmounted ") for m in messages)


@pytest.mark.fuse
def test_log_level_warning_leaves_out_info(source, tmp_path):
    log = tmp_path / "mnt.log"
    with mounted(f"file://{source}", tmp_path / "mnt", "--log-level", "warning") as mnt:
        assert (mnt / "d" / "f.txt").read_text() == "hello\n"
    assert read_log(log) == ""  # nothing went wrong: not one line


def said(path: Path, start: str) -> bool:
    """Whether a line of the text log at `path` has a message that starts so."""
    return any(line.split(": ", 1)[-1].startswith(start)
               for line in read_log(path).splitlines())


@pytest.mark.fuse
@pytest.mark.parametrize("planted", [False, True])
def test_a_rotated_log_is_opened_afresh_never_through_a_link(source, tmp_path, planted):
    """As logrotate rotates (the log renamed; without `copytruncate` or a signal), the
    daemon's next lines go to a new private file at the log's path. A link planted
    there instead is not followed: the lines go on to the renamed file."""
    log, rotated, elsewhere = tmp_path / "mnt.log", tmp_path / "mnt.log.1", tmp_path / "x"
    with mounted(f"file://{source}", tmp_path / "mnt") as mnt:
        assert (mnt / "d" / "f.txt").read_text() == "hello\n"
        assert said(log, "mounted ")  # logged before the mount says it is ready
        log.rename(rotated)
        if planted:
            elsewhere.write_text("")
            log.symlink_to(elsewhere)
    if planted:
        assert log.is_symlink() and elsewhere.read_text() == ""
        assert said(rotated, "unmounted ")
        assert said(rotated, f"cannot open the rotated log {log} (the log file {log} is a "
                             "link; remove it); writing on to this file")
    else:
        assert said(log, "unmounted ") and not said(rotated, "unmounted ")
        assert (log.stat().st_mode & 0o777) == 0o600


_ROTATING = """
import logging, os, sys
from bucketfs.logs import setup_logging
from bucketfs.private import open_private_log
log, rotated = sys.argv[1:]
os.dup2(open_private_log(log), 2)  # as `bucketfs mount` hands its daemon the log
setup_logging("info", log)
logging.getLogger("t").info("before")
os.rename(log, rotated)
logging.getLogger("t").info("after")
os.write(2, b"printed to stderr\\n")
"""


def test_the_daemons_stderr_follows_its_rotated_log(tmp_path):
    """What the daemon prints itself (stderr: a fatal traceback, libfuse's lines) goes
    to the new log after a rotation, as its logged lines do."""
    log, rotated = tmp_path / "x.log", tmp_path / "x.log.1"
    subprocess.run([sys.executable, "-c", _ROTATING, str(log), str(rotated)], check=True,
                   cwd=Path(__file__).parent.parent)
    assert said(rotated, "before") and not said(rotated, "after")
    assert said(log, "after") and "printed to stderr" in read_log(log)
    assert "printed to stderr" not in read_log(rotated)


def test_a_log_that_cannot_be_switched_never_fails_the_caller(tmp_path, monkeypatch):
    """A full disk when a rotation is followed (the old file's flush fails) is a failed
    write, as logging handles one, not an exception in the daemon's code; the next
    line follows the rotation."""
    log, rotated = tmp_path / "x.log", tmp_path / "x.log.1"
    handler = PrivateLogFile(str(log))
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger = logging.getLogger("bucketfs.test.rotation")
    logger.addHandler(handler)
    logger.propagate = False
    monkeypatch.setattr(logging, "raiseExceptions", False)
    try:
        logger.warning("before")
        log.rename(rotated)
        flush = handler.stream.flush

        def full(*_: object) -> None:
            raise OSError(28, "No space left on device")

        handler.stream.flush = full
        logger.warning("refused")  # raises nothing
        handler.stream.flush = flush
        logger.warning("after")
    finally:
        logger.removeHandler(handler)
        handler.close()
    assert "before" in rotated.read_text() and "after" in log.read_text()
    assert "after" not in rotated.read_text()


@pytest.mark.fuse
def test_foreground_logs_json_to_stderr(source, tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    daemon = subprocess.Popen(
        [sys.executable, "-m", "bucketfs", "mount", f"file://{source}", str(mnt),
         "--foreground", "--log-format", "json", "--endpoint-url", ENDPOINT],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while mount_entry(str(mnt)) is None and time.monotonic() < deadline:
            assert daemon.poll() is None, daemon.stderr.read() if daemon.stderr else ""
            time.sleep(0.05)
        assert (mnt / "d" / "f.txt").read_text() == "hello\n"
        daemon.send_signal(signal.SIGTERM)
        _, stderr = daemon.communicate(timeout=30)
    finally:
        if daemon.poll() is None:
            daemon.kill()
        force_unmount(mnt)
    assert daemon.returncode == 0, stderr
    lines = [json.loads(line) for line in stderr.splitlines()]
    # One warning: --endpoint-url does nothing for a file:// bucket (named, not its value).
    others = [(line["level"], line["message"]) for line in lines if line["level"] != "INFO"]
    assert len(others) == 1 and others[0][0] == "WARNING", others
    assert "s3.endpoint_url (--endpoint-url)" in others[0][1]
    assert any(line["message"].startswith("mounted ") for line in lines)
    assert PASSWORD not in stderr
    assert os.path.ismount(mnt) is False


# --- A repeated failure is logged once a minute ----------------------------------------


def test_the_throttle_lets_one_line_of_a_kind_through_per_interval_and_counts_the_rest():
    now = [100.0]
    throttle = Throttle(60.0, clock=lambda: now[0])
    assert throttle.admit("read: TransientError") == 0
    assert [throttle.admit("read: TransientError") for _ in range(5)] == [None] * 5
    assert throttle.admit("lookup: TransientError") == 0  # another kind has its own turn
    now[0] += 59.9
    assert throttle.admit("read: TransientError") is None
    now[0] += 0.1
    assert throttle.admit("read: TransientError") == 6  # what it held back since
    assert throttle.admit("read: TransientError") is None
    assert held_back(6) == " (6 more like it since the last)"
    assert held_back(0) == ""
