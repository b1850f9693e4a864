"""`mount.fuse.bucketfs`: what mount(8) runs for an fstab line of type fuse.bucketfs.

    s3://my-bucket/train  /mnt/train  fuse.bucketfs  ro,_netdev,cache_dir=/var/cache/bucketfs  0 0

mount(8) looks for `/sbin/mount.fuse.bucketfs` and runs it as
`mount.fuse.bucketfs SOURCE MOUNTPOINT [-sfnv] [-N NS] [-t TYPE] -o OPTIONS`. The options
are the bucketfs options by name (`cache_dir=DIR`, `endpoint_url=URL`; a boolean alone
means true), `config=FILE` for a TOML file of them, and the generic ones mount(8) and
systemd act on, which are ignored here. The mount then runs exactly as
`bucketfs mount SOURCE MOUNTPOINT` with those options: daemonized, returning once the
mount serves or with the one line that says why it cannot.
"""

from __future__ import annotations

import getopt
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

from bucketfs.config import OPTIONS_BY_NAME

PROG = "bucketfs"
#: What `-t` may say, and the subtype mount(8) matched to find this helper.
TYPES = ("fuse.bucketfs", "bucketfs")

#: Options mount(8), systemd or the kernel act on, or that change nothing on a
#: read-only tree of 0444 files and 0555 directories (no device, setuid or executable
#: file exists to honour nodev, nosuid or noexec; nothing is written for sync or atime
#: to matter). `rw` is here because mount(8) adds it whenever `ro` is not given (also
#: for `defaults`): the mount is read-only whatever it says, and writes fail with EROFS.
GENERIC = frozenset({
    "ro", "rw", "defaults", "auto", "noauto", "nofail", "_netdev",
    "user", "nouser", "users", "owner", "group",
    "suid", "nosuid", "dev", "nodev", "exec", "noexec",
    "sync", "async", "dirsync",
    "atime", "noatime", "relatime", "norelatime", "strictatime", "nostrictatime",
    "diratime", "nodiratime", "lazytime", "nolazytime", "silent", "loud",
})
#: Prefixes of userspace options (x-systemd.automount, X-mount.mkdir, comment=...).
GENERIC_PREFIXES = ("x-", "X-", "comment=")
#: Refused: the one line says what to do instead.
REFUSED = {
    "remount": "cannot be remounted; unmount it and mount again",
    "bind": "bind mounts are for mount(8) itself, not a bucket",
}


class UsageError(ValueError):
    """A bad command line or -o list; the message is one line naming the culprit."""


@dataclass
class MountRequest:
    url: str
    mountpoint: str
    config: str | None = None
    #: Option name -> value as written (a string), or True for a bare boolean.
    overrides: dict[str, str | bool] = field(default_factory=dict)
    #: `-f`: mount(8)'s fake mount; do everything but mount.
    fake: bool = False
    verbose: bool = False
    #: Options left out on purpose (generic ones, or unknown ones under `-s`).
    ignored: list[str] = field(default_factory=list)

    def argv(self) -> list[str]:
        """The equivalent `bucketfs mount` command line (a false boolean is left out:
        false is every boolean's default)."""
        args = ["bucketfs", "mount", self.url, self.mountpoint]
        if self.config:
            args += ["--config", self.config]
        for name, value in self.overrides.items():
            option = OPTIONS_BY_NAME[name]
            if option.parse.__name__ != "_bool":
                args += [option.flag, str(value)]
                continue
            try:
                if option.parse(value):
                    args.append(option.flag)
            except ValueError:  # refused when mounting; shown as written
                args.append(f"{option.flag}={value}")
        return args


def split_options(text: str) -> list[str]:
    """`a=1,b="x,y",c` -> ['a=1', 'b=x,y', 'c']: commas inside double quotes stay, as
    libmount writes them."""
    items, current, quoted = [], [], False
    for char in text:
        if char == '"':
            quoted = not quoted
        elif char == "," and not quoted:
            items.append("".join(current))
            current = []
        else:
            current.append(char)
    if quoted:
        raise UsageError(f"unbalanced quote in mount options {text!r}")
    items.append("".join(current))
    return [item for item in items if item]


def translate(url: str, mountpoint: str, options: Sequence[str], *,
              sloppy: bool = False) -> MountRequest:
    """A MountRequest from the items of -o lists. Unknown options are refused (ignored
    with `sloppy`, mount's -s); values are checked later, by the same code as flags."""
    request = MountRequest(url, mountpoint)
    for item in options:
        name, has_value, value = item.partition("=")
        if item in GENERIC or item.startswith(GENERIC_PREFIXES):
            request.ignored.append(item)
            continue
        if name in REFUSED:
            raise UsageError(f"mount option {name}: a bucketfs mount {REFUSED[name]}")
        if name == "config":
            if not value:
                raise UsageError("mount option config needs a file: config=FILE")
            request.config = value
            continue
        option = OPTIONS_BY_NAME.get(name)
        if option is None:
            if sloppy:
                request.ignored.append(item)
                continue
            raise UsageError(f"unknown mount option {name!r} (bucketfs options are "
                             "its flags with underscores: cache_dir=DIR)")
        if option.parse.__name__ == "_bool":
            request.overrides[name] = value if has_value else True
        elif not has_value or not value:
            raise UsageError(f"mount option {name} needs a value: {name}=VALUE")
        else:
            request.overrides[name] = value
    return request


def parse_command_line(argv: Sequence[str]) -> MountRequest:
    """mount(8)'s helper convention: SOURCE MOUNTPOINT, then -s -f -n -v, -N, -t, -o."""
    try:
        opts, positional = getopt.gnu_getopt(list(argv), "sfnvo:t:N:")
    except getopt.GetoptError as exc:
        raise UsageError(str(exc)) from None
    if len(positional) != 2:
        raise UsageError("usage: mount.fuse.bucketfs URL MOUNTPOINT [-o OPTIONS]")
    flags = {flag for flag, _ in opts}
    if "-N" in flags:
        raise UsageError("mounting in another namespace (-N) is not supported")
    for flag, value in opts:
        if flag == "-t" and value not in TYPES:
            raise UsageError(f"this helper mounts type fuse.bucketfs, not {value}")
    items = [item for flag, value in opts if flag == "-o" for item in split_options(value)]
    request = translate(*positional, items, sloppy="-s" in flags)
    request.fake = "-f" in flags
    request.verbose = "-v" in flags
    return request


def main(argv: Sequence[str] | None = None) -> int:
    # Imported here: the command line is checked before the SDKs load.
    from bucketfs.cli import build_parser, cmd_mount, error
    from bucketfs.logs import redact

    try:
        request = parse_command_line(sys.argv[1:] if argv is None else argv)
    except UsageError as exc:
        return error(str(exc))
    if request.verbose:
        for item in request.ignored:
            print(f"{PROG}: ignoring mount option {item}", file=sys.stderr)
        print(f"{PROG}: {redact(' '.join(request.argv()))}", file=sys.stderr)
    if request.fake:
        return 0
    args = build_parser().parse_args(["mount", "--", request.url, request.mountpoint])
    args.config = request.config
    for name, value in request.overrides.items():
        setattr(args, name, value)
    return cmd_mount(args)
