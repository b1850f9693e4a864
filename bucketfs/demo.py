"""The embedded demo: a real ImageFolder dataset read by a PyTorch DataLoader through a
bucketfs mount.

    python -m bucketfs.demo [--dir DIR] [--images N] [--workers W]

1. make (or reuse) N JPEGs in DIR/bucket/class_XX/img_YYYYY.jpg;
2. mount file://DIR/bucket on DIR/mnt with `python -m bucketfs mount`, caching in
   DIR/cache (emptied first, so the first epoch is cold);
3. run a shuffled epoch of torchvision's ImageFolder over the mount, with HintSampler
   telling the daemon the order: cold, then again (cached), then the same epoch from
   local disk as a baseline; check that both see the same files and classes, that the
   first batch decodes to the same tensors and that every file has the same bytes;
4. unmount, mount again with the same cache and run the epoch once more: served from
   the SSD tier, without a request to the bucket;
5. say, for each epoch, what the bucket was asked (the daemon's own counters, from its
   status: bucketfs/demo_report.py) and what hints did; unmount, whatever happened (an
   error, Ctrl-C, SIGTERM).

`make_image_dataset` is also what tests and benchmarks use to make a dataset: it needs
Pillow, not torch or numpy.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import filecmp
import io
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from bucketfs import demo_report as report

PROG = "bucketfs demo"
DEFAULT_DIR = "demo-data"
DEFAULT_IMAGES = 500
CLASSES = 10
BATCH_SIZE = 32
IMAGE_SIDE = 64

#: JPEG qualities the generator picks from; a mix, as in a scraped dataset.
_QUALITIES = (75, 80, 85, 90, 95)
#: Spread of file sizes: sigma of the log of the size (0.5 gives roughly 0.4x..2.5x).
_SIZE_SIGMA = 0.5
#: Weight of per-pixel noise blended over the shapes; sets how well the JPEGs compress.
_NOISE = 0.2
_MIN_SIDE, _MAX_SIDE = IMAGE_SIDE, 2048

_CLASS_DIR = re.compile(r"class_\d{2,}")
_IMAGE_FILE = re.compile(r"img_\d{5,}\.jpg")
_PARTIAL_FILE = re.compile(r"\.img_\d{5,}\.jpg\.tmp")


class DemoError(Exception):
    """The demo cannot go on; the message is the one line the user sees."""


class Terminated(KeyboardInterrupt):
    """SIGTERM: stops the demo the way Ctrl-C does."""


# --- the dataset -----------------------------------------------------------------------


def make_image_dataset(
    root: Path, classes: int, per_class: int, seed: int, mean_kb: float = 110
) -> list[Path]:
    """Write `classes * per_class` JPEGs as root/class_XX/img_YYYYY.jpg and return their
    paths, sorted.

    Each image is coloured shapes under per-pixel noise, from a generator seeded by
    (seed, class, index), so the same arguments give the same pixels (and, with the same
    Pillow/libjpeg, the same bytes). Width, height and JPEG quality vary per image so that
    file sizes follow a lognormal spread whose mean is about `mean_kb` kilobytes
    (1 KB = 1000 bytes). Every side is at least 64 pixels. Files are written under a
    temporary name and renamed, so an interrupted run never leaves a truncated JPEG.
    """
    if classes < 1 or per_class < 1:
        raise ValueError("classes and per_class must be at least 1")
    if not mean_kb > 0:
        raise ValueError("mean_kb must be positive")
    try:
        from PIL import Image  # noqa: F401  (fail here with one clear message)
    except ImportError:
        raise ImportError("make_image_dataset needs Pillow: pip install pillow") from None

    bits_per_pixel = _calibrate(seed)
    # A lognormal with this mu has mean exp(mu + sigma^2 / 2) = mean_kb.
    mu = math.log(mean_kb * 1000) - _SIZE_SIGMA**2 / 2
    width = max(2, len(str(classes - 1)))
    paths = []
    for label in range(classes):
        directory = root / f"class_{label:0{width}d}"
        directory.mkdir(parents=True, exist_ok=True)
        colour = _colour(random.Random(f"bucketfs-demo/{seed}/class/{label}"))
        for i in range(per_class):
            index = label * per_class + i
            rng = random.Random(f"bucketfs-demo/{seed}/image/{label}/{index}")
            quality = rng.choice(_QUALITIES)
            target_bytes = rng.lognormvariate(mu, _SIZE_SIGMA)
            pixels = target_bytes * 8 / bits_per_pixel[quality]
            aspect = rng.uniform(0.75, 1.33)
            w = _clamp(round(math.sqrt(pixels * aspect)))
            h = _clamp(round(math.sqrt(pixels / aspect)))
            path = directory / f"img_{index:05d}.jpg"
            _write_atomically(path, _jpeg(_picture(rng, w, h, colour), quality))
            paths.append(path)
    return sorted(paths)


def _clamp(side: int) -> int:
    return min(_MAX_SIDE, max(_MIN_SIDE, side))


def _colour(rng: random.Random) -> tuple[int, int, int]:
    return (rng.randrange(256), rng.randrange(256), rng.randrange(256))


def _picture(rng: random.Random, w: int, h: int, background: tuple[int, int, int]) -> Any:
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (w, h), background)
    draw = ImageDraw.Draw(image)
    for _ in range(rng.randint(4, 12)):
        x0, y0 = rng.randrange(w), rng.randrange(h)
        box = (x0, y0, x0 + rng.randrange(w // 8, w // 2 + 1),
               y0 + rng.randrange(h // 8, h // 2 + 1))
        if rng.random() < 0.5:
            draw.ellipse(box, fill=_colour(rng))
        else:
            draw.rectangle(box, fill=_colour(rng))
    noise = Image.frombytes("RGB", (w, h), rng.randbytes(w * h * 3))
    return Image.blend(image, noise, _NOISE)


def _jpeg(image: Any, quality: int) -> bytes:
    out = io.BytesIO()
    image.save(out, "JPEG", quality=quality)
    return out.getvalue()


def _calibrate(seed: int) -> dict[int, float]:
    """Bits per pixel of this kind of picture at each quality, measured on a probe: the
    ratio hardly depends on the image size, so it turns a target file size into pixels."""
    side = 320
    rng = random.Random(f"bucketfs-demo/{seed}/probe")
    probe = _picture(rng, side, side, _colour(rng))
    return {q: len(_jpeg(probe, q)) * 8 / (side * side) for q in _QUALITIES}


def _write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def dataset_files(root: Path) -> list[str] | None:
    """The demo's images under root as sorted relative paths, or None when root holds
    anything else (which the demo must not delete)."""
    if not root.exists():
        return []
    found = []
    for entry in root.iterdir():
        if not (entry.is_dir() and _CLASS_DIR.fullmatch(entry.name)):
            return None
        for file in entry.iterdir():
            if _PARTIAL_FILE.fullmatch(file.name):
                continue  # left by an interrupted run; overwritten when regenerated
            if not (file.is_file() and _IMAGE_FILE.fullmatch(file.name)):
                return None
            found.append(f"{entry.name}/{file.name}")
    return sorted(found)


def ensure_dataset(root: Path, images: int, seed: int = 0) -> tuple[int, int, bool]:
    """Make the demo's dataset in root unless the same set of files is already there.
    Returns (classes, per_class, generated)."""
    classes = min(CLASSES, images)
    per_class = images // classes
    width = max(2, len(str(classes - 1)))
    wanted = sorted(f"class_{label:0{width}d}/img_{label * per_class + i:05d}.jpg"
                    for label in range(classes) for i in range(per_class))
    existing = dataset_files(root)
    if existing is None:
        raise DemoError(f"{root} holds files the demo did not make; choose another --dir")
    if existing == wanted:
        return classes, per_class, False
    if root.exists():
        shutil.rmtree(root)
    make_image_dataset(root, classes, per_class, seed)
    return classes, per_class, True


# --- mounting --------------------------------------------------------------------------


@contextlib.contextmanager
def _interrupts_deferred() -> Iterator[None]:
    """Let the block finish before Ctrl-C or SIGTERM (if not ignored) raises
    KeyboardInterrupt."""
    interrupted: list[int] = []
    previous = {signum: signal.signal(signum, lambda n, _f: interrupted.append(n))
                for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if any(previous[signum] is not signal.SIG_IGN for signum in interrupted):
            raise Terminated if signal.SIGTERM in interrupted else KeyboardInterrupt


def _bucketfs(*args: str) -> subprocess.CompletedProcess[str]:
    """Run a bucketfs command to completion, even if Ctrl-C comes meanwhile: a mount cut
    short would leave a daemon that mounts after we stopped looking."""
    with _interrupts_deferred():
        # Its own session: Ctrl-C at the terminal does not reach it.
        return subprocess.run([sys.executable, "-m", "bucketfs", *args],
                              stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              start_new_session=True)


def _last_line(result: subprocess.CompletedProcess[str]) -> str:
    lines = (result.stderr or result.stdout).strip().splitlines()
    return lines[-1] if lines else f"exit status {result.returncode}"


def _is_bucketfs_mount(path: Path) -> bool:
    from bucketfs.runtime import FSTYPE, mounted

    entry = mounted(str(path))
    return entry is not None and entry.fstype == FSTYPE


def _is_stale(path: Path) -> bool:
    """A mount whose daemon is gone answers every request with ENOTCONN. (Not os.stat:
    the kernel may answer that from its attribute cache without asking the daemon.)"""
    try:
        os.statvfs(path)
    except OSError as exc:
        return exc.errno == errno.ENOTCONN
    return False


def prepare_mountpoint(mountpoint: Path) -> None:
    """Make sure nothing is mounted on mountpoint, clearing what a killed run left."""
    mountpoint.mkdir(parents=True, exist_ok=True)
    if _is_bucketfs_mount(mountpoint):
        if not _is_stale(mountpoint):
            raise DemoError(f"{mountpoint} is already mounted (is another demo running?); "
                            f"to unmount it: bucketfs umount {mountpoint}")
        unmount(mountpoint)  # left behind by an earlier run whose daemon was killed


def mount(bucket: Path, mountpoint: Path, cache: Path) -> None:
    result = _bucketfs("mount", f"file://{bucket}", str(mountpoint), "--cache-dir", str(cache))
    if result.returncode != 0:
        raise DemoError(f"mount failed: {_last_line(result)}")
    if result.stderr.strip():  # warnings
        print(result.stderr.strip(), file=sys.stderr)


@contextlib.contextmanager
def mounted(bucket: Path, mountpoint: Path, cache: Path) -> Iterator[None]:
    """Mount, and unmount whatever happens in the block."""
    try:
        mount(bucket, mountpoint, cache)
        yield
    finally:
        # Ctrl-C again must not stop the unmount half-way.
        previous = {signum: signal.signal(signum, signal.SIG_IGN)
                    for signum in (signal.SIGINT, signal.SIGTERM)}
        failing = sys.exc_info()[1] is not None
        try:
            if _is_bucketfs_mount(mountpoint):  # not when the mount itself failed
                unmount(mountpoint)
        except DemoError as exc:
            if not failing:
                raise
            # Report it, but let the error that got us here be the one the run ends on.
            print(f"{PROG}: error: {exc}", file=sys.stderr)
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)


def empty_cache(cache: Path) -> None:
    """A cold start: nothing an earlier run cached. Only a bucketfs cache is emptied."""
    if not cache.exists():
        return
    from bucketfs.cache.admin import CacheAdminError, clear_cache

    try:
        clear_cache(cache)
    except CacheAdminError as exc:
        raise DemoError(f"{exc}; choose another --dir") from None


def unmount(mountpoint: Path, attempts: int = 10) -> None:
    """Unmount, retrying while the mount is busy (DataLoader workers still exiting)."""
    for attempt in range(attempts):
        result = _bucketfs("umount", str(mountpoint))
        if result.returncode == 0 or not _is_bucketfs_mount(mountpoint):
            return
        if attempt + 1 < attempts:
            time.sleep(0.5)
    raise DemoError(f"unmount failed: {_last_line(result)}; "
                    f"run: bucketfs umount {mountpoint}")


# --- the epoch -------------------------------------------------------------------------


def _import_torch() -> tuple[Any, Any, Any]:
    # Deferred: Ctrl-C in the middle of importing torch can be swallowed by the import
    # machinery or turn into an unrelated ImportError.
    try:
        with _interrupts_deferred():
            import torch
            import torchvision
            from torchvision import datasets, transforms
    except ImportError as exc:
        raise DemoError(f"the demo needs torch and torchvision ({exc}): "
                        "pip install 'bucketfs[torch]'") from None
    except RuntimeError as exc:
        # A torchvision built for another torch fails to register its operators.
        raise DemoError(f"torchvision does not load into this torch ({exc}); install them "
                        "as a pair: pip install --upgrade torch torchvision") from None
    del torchvision
    return torch, datasets, transforms


class Epoch:
    """One pass over an ImageFolder tree, timed; with `hinted`, through HintSampler."""

    def __init__(self, root: Path, workers: int, seed: int, *, hinted: bool = False) -> None:
        torch, datasets, transforms = _import_torch()
        self.torch = torch
        transform = transforms.Compose([
            transforms.Resize(IMAGE_SIDE), transforms.CenterCrop(IMAGE_SIDE),
            transforms.ToTensor(),
        ])
        started = time.perf_counter()
        self.dataset = datasets.ImageFolder(str(root), transform=transform)
        self.list_seconds = time.perf_counter() - started
        self.root = root
        self.workers = workers
        self.seed = seed
        self.hinted = hinted
        self.seconds = 0.0
        self.images = 0
        self.batches = 0

    def run(self) -> None:
        from torch.utils.data import DataLoader, RandomSampler

        # The order DataLoader(shuffle=True, generator=...) would draw, so every epoch
        # (hinted or not) reads the same files in the same order.
        sampler: Any = RandomSampler(self.dataset,
                                     generator=self.torch.Generator().manual_seed(self.seed))
        if self.hinted:
            from bucketfs.hints import HintSampler

            sampler = HintSampler(sampler, self.dataset)
        loader = DataLoader(self.dataset, batch_size=BATCH_SIZE, sampler=sampler,
                            num_workers=self.workers)
        started = time.perf_counter()
        batches = iter(loader)
        try:
            for images, _labels in batches:
                self.images += len(images)
                self.batches += 1
        finally:
            # Dropping the iterator stops its worker processes now, even when an error or
            # Ctrl-C is on its way out (the traceback keeps this frame, not the iterator),
            # so the unmount that follows does not find the mount busy.
            del batches
        self.seconds = time.perf_counter() - started

    def first_batch(self) -> tuple[Any, Any]:
        from torch.utils.data import DataLoader

        return next(iter(DataLoader(self.dataset, batch_size=BATCH_SIZE, shuffle=False)))

    def files(self) -> list[tuple[str, int]]:
        return [(os.path.relpath(path, self.root), label) for path, label in self.dataset.samples]

    @property
    def rate(self) -> float:
        return self.images / self.seconds if self.seconds > 0 else math.inf


def compare(mounted: Epoch, local: Epoch) -> str:
    """Check that the mount and the local tree are the same dataset; say what was checked."""
    torch = mounted.torch
    if mounted.dataset.classes != local.dataset.classes:
        raise DemoError(f"the mount shows classes {mounted.dataset.classes}, local disk "
                        f"{local.dataset.classes}")
    files = mounted.files()
    if files != local.files():
        missing = sorted(set(local.files()) - set(files))[:3]
        extra = sorted(set(files) - set(local.files()))[:3]
        raise DemoError(f"the mount lists {len(files)} images, local disk "
                        f"{len(local.files())} (missing {missing}, extra {extra})")
    (m_images, m_labels), (l_images, l_labels) = mounted.first_batch(), local.first_batch()
    if not (torch.equal(m_images, l_images) and torch.equal(m_labels, l_labels)):
        raise DemoError("the first batch decodes differently from the mount and local disk")
    for relative, _label in files:
        if not filecmp.cmp(mounted.root / relative, local.root / relative, shallow=False):
            raise DemoError(f"{relative} has different bytes on the mount and local disk")
    return (f"same {len(files)} files and {len(mounted.dataset.classes)} classes; "
            f"first batch of {len(m_images)} decodes identically; every file byte-identical")


# --- the command -----------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bucketfs.demo",
        description="Make a small ImageFolder dataset of JPEGs, mount it with bucketfs "
                    "(file://) and read it through a PyTorch DataLoader: a cold epoch, a "
                    "cached one, and one after a remount, served from the SSD cache.",
    )
    parser.add_argument("--dir", default=DEFAULT_DIR, type=Path,
                        help=f"working directory: DIR/bucket holds the dataset, DIR/mnt is "
                             f"the mountpoint, DIR/cache the SSD cache (default "
                             f"./{DEFAULT_DIR})")
    parser.add_argument("--images", type=int, default=DEFAULT_IMAGES,
                        help=f"number of images, in up to {CLASSES} classes "
                             f"(default {DEFAULT_IMAGES})")
    parser.add_argument("--workers", type=int, default=min(4, os.cpu_count() or 1),
                        help="DataLoader worker processes (default: up to 4, one per core)")
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    return parser


def _raise_on_sigterm(signum: int, frame: object) -> None:
    raise Terminated


def run(args: argparse.Namespace) -> None:
    if args.images < 1:
        raise DemoError("--images must be at least 1")
    if args.workers < 0:
        raise DemoError("--workers must not be negative")
    _import_torch()  # before making anything: say at once if torch is missing
    base = args.dir.resolve()
    bucket, mountpoint = base / "bucket", base / "mnt"

    started = time.perf_counter()
    classes, per_class, generated = ensure_dataset(bucket, args.images, args.seed)
    total_bytes = sum(p.stat().st_size for p in bucket.glob("class_*/img_*.jpg"))
    count = classes * per_class
    how = f"generated in {time.perf_counter() - started:.1f} s" if generated else "reused"
    if count != args.images:
        how += f"; {args.images} rounded down to {classes} classes of {per_class}"
    print(f"dataset: {bucket}: {count} JPEGs in {classes} classes, "
          f"{total_bytes / 1e6:.1f} MB (mean {total_bytes / count / 1e3:.0f} KB), {how}")

    prepare_mountpoint(mountpoint)
    cache = base / "cache"
    empty_cache(cache)
    with mounted(bucket, mountpoint, cache):
        print(f"mounted: file://{bucket} on {mountpoint}, caching in {cache} (emptied: "
              "the first epoch is cold)")
        cold = Epoch(mountpoint, args.workers, args.seed, hinted=True)
        names = cold.dataset.classes
        shown = ", ".join(names) if len(names) <= 4 else f"{names[0]} .. {names[-1]}"
        print(f"classes: {len(names)} ({shown}); samples: {len(cold.dataset)}; batches of "
              f"up to {BATCH_SIZE}, workers={args.workers}")
        cold.run()
        after_cold = report.snapshot(mountpoint)
        print(report.epoch_line("epoch 1, cold", cold.images, cold.seconds,
                                report.requests(after_cold)))
        cached = Epoch(mountpoint, args.workers, args.seed, hinted=True)
        cached.run()
        after_cached = report.snapshot(mountpoint)
        local = Epoch(bucket, args.workers, args.seed)
        local.run()
        print(report.epoch_line("epoch 2, cached", cached.images, cached.seconds,
                                report.requests(after_cached, after_cold)))
        print(report.epoch_line("local disk", local.images, local.seconds, None,
                                f"the baseline: epoch 2 took {cached.seconds / local.seconds:.2f}x "
                                "its time"))
        for epoch in (cold, cached):
            if epoch.images != len(epoch.dataset):
                raise DemoError(f"an epoch read {epoch.images} of {len(epoch.dataset)} images")
        print(f"check: {compare(cold, local)}")
    print(f"unmounted: {mountpoint}; mounting it again with the same cache")
    with mounted(bucket, mountpoint, cache):
        again = Epoch(mountpoint, args.workers, args.seed, hinted=True)
        again.run()
        after_again = report.snapshot(mountpoint)
        print(report.epoch_line("epoch 3, after remount", again.images, again.seconds,
                                report.requests(after_again), report.ssd_note(after_again)))
    print(report.hints_line(after_cold, len(cold.dataset)))
    print(report.EXPLAIN)
    print(f"unmounted: {mountpoint}")
    print(report.POINTER)


def _one_line(exc: Exception) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    # An error in a DataLoader worker arrives as "Caught X in DataLoader worker process N."
    # followed by the worker's traceback, whose last line is the error itself.
    if len(lines) > 1 and "Traceback" in str(exc):
        return f"{lines[0]} {lines[-1]}"
    return f"{type(exc).__name__}: {lines[0]}"


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    signal.signal(signal.SIGTERM, _raise_on_sigterm)
    try:
        run(args)
    except (DemoError, report.ReportError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as exc:
        print(f"{PROG}: {'terminated' if isinstance(exc, Terminated) else 'interrupted'}",
              file=sys.stderr)
        return 143 if isinstance(exc, Terminated) else 130
    except Exception as exc:
        print(f"{PROG}: error: {_one_line(exc)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
