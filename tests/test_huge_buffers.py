"""Large block buffers in whole transparent huge pages (bucketfs/huge_buffers.py): where
they lie and what is advised, and when GETs get them (a host that takes freed memory
back, read from a made-up /sys)."""

from __future__ import annotations

import logging
import mmap
from pathlib import Path

import pytest

from bucketfs import huge_buffers, huge_pages
from bucketfs.cache.direct_writes import address_of
from tests.pages import mapping_flags

PAGE = mmap.PAGESIZE
HUGE = huge_buffers.HUGE_PAGE
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled").exists()


@pytest.fixture(autouse=True)
def huge_pages_on():
    before = huge_buffers.settings.enabled
    huge_buffers.settings.enabled = True
    yield
    huge_buffers.settings.enabled = before


@pytest.mark.parametrize("size", [PAGE + 4 * 1024 * 1024, PAGE + 4 * 1024 * 1024 + 100,
                                  PAGE + HUGE])
def test_a_read_buffer_puts_the_data_on_a_huge_page_boundary(size):
    view = huge_buffers.read_from(size, PAGE)
    assert len(view) == size and not view.readonly
    assert address_of(view) % PAGE == 0  # direct I/O's alignment
    assert address_of(view[PAGE:]) % HUGE == 0
    view[:] = b"\x07" * size  # all of it is the caller's to fill
    assert bytes(view[-3:]) == b"\x07\x07\x07"


@pytest.mark.skipif(not THP, reason="this kernel has no transparent huge pages")
def test_only_the_data_of_a_read_buffer_is_advised_huge():
    """The header's page stays ordinary: advised, its 2 MiB range would be one huge page
    of its own, 2 MiB of memory for a few bytes."""
    view = huge_buffers.read_from(PAGE + 4 * 1024 * 1024, PAGE)
    assert "hg" in mapping_flags(address_of(view[PAGE:]))
    assert "hg" not in mapping_flags(address_of(view))


@pytest.mark.skipif(not THP, reason="this kernel has no transparent huge pages")
def test_a_small_read_buffer_is_not_advised():
    view = huge_buffers.read_from(PAGE + HUGE // 2, PAGE)
    assert "hg" not in mapping_flags(address_of(view[PAGE:]))


@pytest.mark.skipif(not THP, reason="this kernel has no transparent huge pages")
def test_with_huge_pages_off_a_read_buffer_is_ordinary_private_memory():
    huge_buffers.settings.enabled = False
    view = huge_buffers.read_from(PAGE + 4 * 1024 * 1024, PAGE)
    assert len(view) == PAGE + 4 * 1024 * 1024 and address_of(view) % PAGE == 0
    flags = mapping_flags(address_of(view[PAGE:]))
    assert "hg" not in flags and "sh" not in flags


@pytest.mark.skipif(not THP, reason="this kernel has no transparent huge pages")
@pytest.mark.parametrize("size", [4 * 1024 * 1024, HUGE + 12345])
def test_a_fresh_get_buffer_is_private_exact_and_advised_huge(size):
    """Exactly `size` long: a longer one would be sliced (copied) to hand the body out."""
    buffer = huge_buffers.fresh(size)
    assert len(buffer) == size
    address = address_of(buffer)
    assert address % PAGE == 0
    flags = mapping_flags(address)
    assert "hg" in flags and "sh" not in flags  # huge, and not shared memory


def fake_sys(root: Path, *, order: str | None = "9",
             devices: dict[str, tuple[str, str]] | None = None) -> Path:
    """A /sys with page reporting at `order` (None: no such module) and virtio devices
    named to (device id, feature bits)."""
    if order is not None:
        parameters = root / "module/page_reporting/parameters"
        parameters.mkdir(parents=True)
        (parameters / "page_reporting_order").write_text(order + "\n")
    for name, (device, features) in (devices or {}).items():
        path = root / "bus/virtio/devices" / name
        path.mkdir(parents=True)
        (path / "device").write_text(device + "\n")
        (path / "features").write_text(features + "\n")
    return root


REPORTING = "0110010" + "0" * 57  # this VM's balloon: bit 5, free page reporting
NOT_REPORTING = "0110000" + "0" * 57


@pytest.mark.parametrize("order, devices, taken_back", [
    ("9", {"virtio0": ("0x0005", REPORTING)}, True),
    ("0", {"virtio3": ("0x0001", "1"), "virtio0": ("0x0005", REPORTING)}, True),
    ("9", {"virtio0": ("0x0005", NOT_REPORTING)}, False),  # a balloon that does not
    ("9", {"virtio2": ("0x0001", REPORTING)}, False),  # a network card's bit 5
    ("10", {"virtio0": ("0x0005", REPORTING)}, False),  # only blocks above a huge page
    ("-1", {"virtio0": ("0x0005", REPORTING)}, False),  # never set up
    (None, {"virtio0": ("0x0005", REPORTING)}, False),  # a kernel without it
    ("9", {}, False),  # no virtio devices: bare metal
])
def test_a_host_that_takes_freed_memory_back_is_told_apart(tmp_path, order, devices,
                                                          taken_back):
    root = fake_sys(tmp_path, order=order, devices=devices)
    assert huge_pages.host_takes_freed_memory(root) is taken_back


def test_the_option_decides_and_is_logged(tmp_path, caplog):
    taking = fake_sys(tmp_path / "vm", devices={"virtio0": ("0x0005", REPORTING)})
    keeping = fake_sys(tmp_path / "metal", devices={})
    caplog.set_level(logging.INFO, logger="bucketfs.huge_buffers")
    assert huge_buffers.choose("auto", taking) is False
    assert huge_buffers.settings.enabled is False
    assert "free page reporting" in caplog.text
    assert huge_buffers.choose("auto", keeping) is True
    assert huge_buffers.settings.enabled is True
    assert huge_buffers.choose("never", keeping) is False
    assert huge_buffers.choose("always", taking) is True
    assert "huge_buffers = always" in caplog.text
