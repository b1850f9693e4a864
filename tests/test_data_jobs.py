"""The messages between a mount's dispatcher and its data processes (data_jobs.py)."""

from __future__ import annotations

import pytest

from bucketfs.data_jobs import (
    CHANGED,
    LOG,
    NOTICE_MAX,
    Job,
    Setup,
    notice,
    owner_of,
    owner_of_job,
    pack_job,
    read_notice,
    unpack_job,
)


def test_a_job_comes_back_as_it_was_sent():
    for key in ("train/cat/001.jpg", "ünïcödé/ключ", "bad-\udcff-key", "k" * 1024):
        job = Job(2**63 + 5, key, '"d41d8cd98f00b204e9800998ecf8427e-3"', 10**12,
                  2**40, 1 << 20)
        assert unpack_job(pack_job(job)) == job
        assert owner_of_job(pack_job(job), 7) == owner_of(key, 7)


def test_a_job_cut_short_or_padded_is_refused():
    message = pack_job(Job(1, "a/b", "v1", 10, 0, 10))
    for bad in (message[:-1], message + b"x"):
        with pytest.raises(ValueError):
            unpack_job(bad)


def test_each_key_has_one_owner_and_every_process_gets_some():
    keys = [f"train/{n // 100:03d}/{n:06d}.jpg" for n in range(4000)]
    owners = [owner_of(key, 8) for key in keys]
    assert owners == [owner_of(key, 8) for key in keys]  # stable
    shares = [owners.count(index) for index in range(8)]
    assert min(shares) > 400 and max(shares) < 600  # ~500 each
    assert {owner_of(key, 1) for key in keys} == {0}


def test_a_setup_comes_back_as_it_was_sent():
    setup = Setup("s3://bucket/prefix/", {"ram_cache": 1 << 30, "metadata_ttl": float("inf"),
                                           "endpoint_url": None}, 3, 8, "/var/cache/x/data-3",
                  "s3 http://127.0.0.1:9000 bucket")
    assert Setup.unpack(setup.pack()) == setup


def test_notices_keep_their_kind_and_text_and_a_long_one_is_cut():
    assert read_notice(notice(CHANGED, "bad-\udcff-key")) == (CHANGED, "bad-\udcff-key")
    kind, text = read_notice(notice(LOG, "20\t" + "é" * NOTICE_MAX))
    assert kind == LOG and text.startswith("20\té") and len(notice(LOG, text)) <= NOTICE_MAX
