"""Configuration: TOML file, command-line overrides, one-line errors naming the key."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from bucketfs.backends.urls import BadUrl, parse_bucket_url
from bucketfs.config import ConfigError, load_config, parse_size, render_example

ROOT = Path(__file__).resolve().parent.parent


def write(tmp_path, text):
    path = tmp_path / "mount.conf"
    path.write_text(text)
    return path


def test_example_file_documents_every_option_and_loads():
    text = (ROOT / "mount.conf.example").read_text()
    assert text == render_example(), "regenerate mount.conf.example from bucketfs.config"
    config = load_config(ROOT / "mount.conf.example", {})
    assert config.block_size == 4 * 1024**2
    assert config.metadata_ttl == math.inf


def test_file_values_and_flag_overrides(tmp_path):
    path = write(tmp_path, '[cache]\nblock_size = "2MiB"\n[read]\nreadahead_max = "16MiB"\n'
                           '[mount]\nmetadata_ttl = 60\n[s3]\naddressing_style = "path"\n')
    config = load_config(path, {"block_size": "4MiB"})
    assert config.block_size == 4 * 1024**2  # the flag wins
    assert config.readahead_max == 16 * 1024**2
    assert config.metadata_ttl == 60
    assert config.addressing_style == "path"
    assert config.max_connections == 32  # default


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("[read]\nbogus = 1\n", "unknown key read.bogus"),
        ("[nosuch]\nblock_size = 1\n", "unknown key nosuch.block_size"),
        ("block_size = 1\n", "unknown key 'block_size'"),
        ('[cache]\nblock_size = "lots"\n', "bad value for cache.block_size"),
        ('[cache]\neviction = "random"\n', "bad value for cache.eviction"),
        ('[s3]\naddressing_style = "sideways"\n', "bad value for s3.addressing_style"),
        ("[origin]\nmax_connections = 0\n", "bad value for origin.max_connections"),
        ("[mount]\nallow_other = 3\n", "bad value for mount.allow_other"),
        ("[read\n", "not valid TOML"),
    ],
)
def test_bad_files_name_the_key(tmp_path, text, needle):
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text), {})
    assert needle in str(info.value)
    assert "\n" not in str(info.value)


def test_bad_flag_names_the_flag(tmp_path):
    with pytest.raises(ConfigError, match=r"option --block-size: bad value for cache\.block_size"):
        load_config(None, {"block_size": "-3"})


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(tmp_path / "absent.conf", {})


def test_sizes():
    assert parse_size("4GiB") == 4 * 1024**3
    assert parse_size("512MB") == 512 * 10**6
    assert parse_size(65536) == 65536
    assert parse_size("1.5KiB") == 1536
    with pytest.raises(ValueError):
        parse_size("12 parsecs")


@pytest.mark.parametrize(
    ("url", "scheme", "bucket", "prefix"),
    [
        ("s3://bucket", "s3", "bucket", ""),
        ("s3://bucket/", "s3", "bucket", ""),
        ("s3://bucket/train/imgs", "s3", "bucket", "train/imgs/"),
        ("gs://b/p/", "gs", "b", "p/"),
        ("file:///srv/data/", "file", "/srv/data", ""),
    ],
)
def test_urls(url, scheme, bucket, prefix):
    parsed = parse_bucket_url(url)
    assert (parsed.scheme, parsed.bucket, parsed.prefix) == (scheme, bucket, prefix)


@pytest.mark.parametrize("url", ["http://x/y", "s3://", "file://host/x", "s3://key:secret@b/p",
                                 "/just/a/path"])
def test_bad_urls(url):
    with pytest.raises(BadUrl) as info:
        parse_bucket_url(url)
    assert "secret" not in str(info.value)
