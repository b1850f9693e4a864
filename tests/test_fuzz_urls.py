"""Hostile bucket URLs: any text is a BucketUrl or a BadUrl with one line; what parses
is what was typed (no character silently dropped), prints back to itself, and never
carries credentials; no error message echoes them."""

from __future__ import annotations

import unicodedata

import pytest
from hypothesis import assume, event, given
from hypothesis import strategies as st

from bucketfs.backends.urls import SCHEMES, BadUrl, BucketUrl, parse_bucket_url
from tests.fuzzing import fuzz, one_line

# Every code point, lone surrogates included (a non-UTF-8 argv arrives as those).
any_char = st.characters(codec=None, categories=None)
# What makes URLs hard: separators, brackets, credentials, look-alikes; and, less often,
# control characters and lone surrogates.
tricky_char = st.sampled_from(list("/:@?#[]%\\ .\uff03\uff0f\u2100éü中"))
bad_char = st.sampled_from(list("\t\n\r\0\x7f\x85\udcff"))
plain_char = st.sampled_from("abcz09-_")
url_char = st.one_of(tricky_char, plain_char, plain_char, any_char, bad_char)
url_text = st.text(url_char, max_size=40)
schemes = st.sampled_from(["s3", "S3", "gs", "Gs", "file", "FILE", "http", "", "s4"])


def outcome(text: str) -> BucketUrl | BadUrl:
    """The parse, or its BadUrl; any other exception fails the property."""
    try:
        return parse_bucket_url(text)
    except BadUrl as exc:
        assert one_line(str(exc)), str(exc)
        return exc


def assert_sound(url: BucketUrl) -> None:
    assert url.scheme in SCHEMES
    assert url.prefix == "" or url.prefix.endswith("/")
    if url.scheme == "file":
        assert url.bucket.startswith("/") and url.prefix == ""
    else:
        assert url.bucket and "@" not in url.bucket and "/" not in url.bucket
        assert not any(unicodedata.category(ch) in ("Cc", "Cs") for ch in url.bucket + url.prefix)
    assert not any(unicodedata.category(ch) == "Cc" for ch in url.bucket + url.prefix)
    assert parse_bucket_url(str(url)) == url  # prints back to itself
    assert url.bucket_url == (f"file://{url.bucket}" if url.scheme == "file"
                              else f"{url.scheme}://{url.bucket}")


@fuzz(1000)
@given(text=url_text | st.builds("{}://{}".format, schemes, url_text))
def test_any_text_parses_soundly_or_is_refused_in_one_line(text):
    result = outcome(text)
    event(type(result).__name__)
    if isinstance(result, BucketUrl):
        assert_sound(result)


# Buckets and paths without the characters that end a bucket or start a query.
bucket_text = st.text(url_char.filter(lambda c: c not in "/?#@"), max_size=12)
path_text = st.text(url_char.filter(lambda c: c not in "?#"), max_size=40)


def has(text: str, *categories: str) -> bool:
    return any(unicodedata.category(ch) in categories for ch in text)


@fuzz(800)
@given(scheme=st.sampled_from(["s3", "S3", "gs", "GS"]), bucket=bucket_text, path=path_text)
def test_the_bucket_and_prefix_typed_are_the_ones_mounted(scheme, bucket, path):
    text = f"{scheme}://{bucket}/{path}"
    result = outcome(text)
    if has(text, "Cc"):
        assert isinstance(result, BadUrl) and "control characters" in str(result)
        return
    if isinstance(result, BadUrl):
        event("refused")
        # Only for a reason the text really has.
        assert (not bucket or "[" in bucket or "]" in bucket or has(text, "Cs")
                or unicodedata.normalize("NFKC", bucket) != bucket), (text, str(result))
        return
    event("parsed")
    prefix = path.lstrip("/")
    if prefix and not prefix.endswith("/"):
        prefix += "/"
    assert result == BucketUrl(scheme.lower(), bucket, prefix)
    assert_sound(result)


@fuzz(400)
@given(authority=st.sampled_from(["", "localhost"]), path=path_text)
def test_a_file_url_mounts_the_path_typed(authority, path):
    text = f"file://{authority}/{path}"
    result = outcome(text)
    if has(text, "Cc"):
        assert isinstance(result, BadUrl)
        return
    assert result == BucketUrl("file", ("/" + path).rstrip("/") or "/", "")
    assert_sound(result)


secret = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E, exclude_characters="/@'\""),
                 min_size=6, max_size=16)


@fuzz(400)
@given(scheme=schemes, user=st.text(st.sampled_from("abcxyz019-_."), max_size=8), secret=secret,
       host=st.sampled_from(["bucket", "localhost", "b", "", "[::1]"]), path=path_text)
def test_credentials_are_refused_and_never_echoed(scheme, user, secret, host, path):
    userinfo = f"{user}:{secret}@"
    text = f"{scheme}://{userinfo}{host}/{path}"
    assume(userinfo not in path)
    result = outcome(text)
    assert isinstance(result, BadUrl), result
    assert userinfo not in str(result), str(result)
    if secret not in text.replace(userinfo, "", 1):  # it does not also appear as a key
        assert secret not in str(result), str(result)


@pytest.mark.parametrize(("text", "needle"), [
    ("s3://[bucket/x", "cannot be parsed"),  # was ValueError from urlsplit
    ("gs://b\uff03c/x", "cannot be parsed"),  # NFKC turns it into "#": ValueError
    ("s3://b/train\n/x", "control characters"),  # mounted "train/x/" instead
    ("s3://b/x\t", "control characters"),
    ("s3://b/x?", "query or fragment"),  # an empty query was dropped: "x/"
    ("s3://b/x#", "query or fragment"),
    ("file:", "absolute path"),  # mounted /
    ("file://", "absolute path"),
    ("https://user:hunter22@host/x", "<redacted>@host"),  # echoed the password
])
def test_found_by_fuzzing(text, needle):
    with pytest.raises(BadUrl) as info:
        parse_bucket_url(text)
    assert needle in str(info.value) and one_line(str(info.value))
    assert "hunter22" not in str(info.value)
