"""Hostile configuration: arbitrary TOML documents, keys, values and command-line
overrides either load into values the mount can use, or raise ConfigError with one line
that names the first offending key. No other exception ever escapes."""

from __future__ import annotations

import math
import socket
import tomllib
from pathlib import Path
from typing import Any

import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from bucketfs.config import (
    MAX_SIZE,
    OPTIONS,
    OPTIONS_BY_KEY,
    OPTIONS_BY_NAME,
    Config,
    ConfigError,
    Option,
    load_config,
    parse_duration,
    parse_size,
)
from tests.fuzzing import fuzz, one_line

SECTIONS = sorted({o.section for o in OPTIONS})
NAMES = sorted(OPTIONS_BY_NAME)
UNITS = {"": 1, "B": 1, "k": 1000, "KB": 1000, "MB": 1000**2, "GB": 1000**3, "TB": 1000**4,
         "KiB": 1024, "mib": 1024**2, "GiB": 1024**3, "TiB": 1024**4}

# --- Strategies --------------------------------------------------------------------------

sizes = st.builds(lambda ws, n, frac, unit: f"{ws}{n}{frac}{ws}{unit}{ws}",
                  st.sampled_from(["", " "]), st.integers(0, 10**30),
                  st.sampled_from(["", ".5", ".000001", ".9999"]), st.sampled_from(list(UNITS)))
tricky_text = st.sampled_from([
    "", " ", "forever", "inf", "-inf", "nan", "NaN", "1e400", "-1", "0", "-0", "true", "off",
    "4GiB", "1.5KiB", "1e5", "0x10", "1_000", "\u0663", "12 parsecs", "9" * 5000,
    "cost-lrfu", "path", "debug", "127.0.0.1", "65536", "4294967295", "4294967294",
    "-4294967296", "\0", "a\nb", "\u2028", "\ud800", "\x85",
])
text_values = st.one_of(tricky_text, sizes, st.text(max_size=30),
                        st.integers(-(2**70), 2**70).map(str),
                        st.floats().map(repr))
# TOML literals that no Python value below produces: dates, times, other int bases.
RAW = object()
raw_toml = st.sampled_from(["1979-05-27", "07:32:00", "1979-05-27T07:32:00Z", "0x1F",
                            "0o17", "0b101", "1_000", "+inf", "-nan", "1e400", "[]", "{}"])
scalars = st.one_of(
    st.booleans(), st.integers(-(2**80), 2**80), st.floats(), text_values,
    raw_toml.map(lambda literal: (RAW, literal)),
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                               max_size=3),
    max_leaves=6,
)
# Keys hold no surrogates (st.text never draws them), so each survives the file as is.
section_names = st.sampled_from(SECTIONS) | st.text(max_size=8)
option_names = st.sampled_from(NAMES) | st.text(max_size=8)
tables = st.dictionaries(option_names, values, max_size=4)


def known_entry(option: Option) -> st.SearchStrategy[tuple[str, Any]]:
    """A known key, with its own example value most of the time: so that many documents
    load and the loaded values are checked too, not only the refusals."""
    own = st.just((RAW, option.example)) if option.example else text_values
    return st.tuples(st.just(option.key), st.one_of(own, own, own, values))


def by_section(entries: list[tuple[str, Any]]) -> dict[str, Any]:
    document: dict[str, Any] = {}
    for key, value in entries:
        section, name = key.split(".")
        document.setdefault(section, {})[name] = value
    return document


documents = st.one_of(
    st.dictionaries(section_names, tables | values, max_size=5),
    st.lists(st.sampled_from(OPTIONS).flatmap(known_entry), max_size=6,
             unique_by=lambda entry: entry[0]).map(by_section),
)
overrides = st.just({}) | st.dictionaries(st.sampled_from(NAMES), text_values | st.just(True),
                                          max_size=4)


def toml_value(value: Any) -> str:
    if isinstance(value, tuple) and value[0] is RAW:
        return value[1]
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return repr(value) if math.isfinite(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, str):
        return toml_string(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return "{" + ", ".join(f"{toml_string(k)} = {toml_value(v)}" for k, v in value.items()) + "}"


def toml_string(text: str) -> str:
    out = []
    for ch in text:
        if ch in '"\\' or ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04X}")
        elif 0xD800 <= ord(ch) <= 0xDFFF:
            out.append("?")  # a TOML file is UTF-8: no lone surrogates
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def render(document: dict[str, Any]) -> str:
    """The TOML text: plain keys first, then tables (TOML wants them in that order)."""
    top = [(k, v) for k, v in document.items() if not isinstance(v, dict)]
    sections = [(k, v) for k, v in document.items() if isinstance(v, dict)]
    lines = [f"{toml_string(k)} = {toml_value(v)}" for k, v in top]
    for name, table in sections:
        lines.append(f"[{toml_string(name)}]")
        lines += [f"{toml_string(k)} = {toml_value(v)}" for k, v in table.items()]
    return "\n".join(lines) + "\n"


def first_problem(data: dict[str, Any], flags: dict[str, Any],
                  ) -> tuple[str | None, dict[str, Any]]:
    """The model: the text the error must hold, naming the first bad key in the order
    the loader meets them (None: it loads), and the values it loads."""
    loaded: dict[str, Any] = {}
    for section, table in data.items():
        if not isinstance(table, dict):
            return f"unknown key {section!r}", loaded
        for name, value in table.items():
            key = f"{section}.{name}"
            option = OPTIONS_BY_KEY.get(key)
            if option is None:  # quoted when it holds a line break or control character
                return f"unknown key {key if key.isprintable() else repr(key)}", loaded
            try:
                loaded[option.name] = option.parse(value)
            except Exception:
                return f"bad value for {option.key}", loaded
    for name, value in flags.items():
        option = OPTIONS_BY_NAME[name]
        try:
            loaded[name] = option.parse(value)
        except Exception:
            return f"option {option.flag}: bad value for {option.key}", loaded
    final = Config(loaded)
    if final.readahead_max > final.readahead_budget:
        return "read.readahead_max must not exceed read.readahead_budget", loaded
    if final.block_size == 0:
        return "cache.block_size must be positive", loaded
    return None, loaded


def assert_usable(config: Config) -> None:
    """What the mount will do with each value must work: the checks of its consumers."""
    for name in ("uid", "gid"):
        value = getattr(config, name)
        assert value is None or 0 <= value < 2**32 - 1, (name, value)  # uid_t, not -1
    for option in OPTIONS:
        value = getattr(config, option.name)
        if option.parse.__name__ == "parse_size":
            assert isinstance(value, int) and 0 <= value <= MAX_SIZE, (option.key, value)
        elif option.parse.__name__ == "parse_duration":
            assert value >= 0 and not math.isnan(value), (option.key, value)
        elif option.parse.__name__ == "_seconds":
            assert 0 < value < math.inf, (option.key, value)
            with socket.socket() as sock:
                sock.settimeout(value)  # raises OverflowError past time_t
        elif option.parse.__name__ == "_positive_int":
            assert isinstance(value, int) and value > 0, (option.key, value)
    assert 0 <= config.metrics_port <= 65535
    assert config.block_size > 0 and config.readahead_max <= config.readahead_budget


@pytest.fixture(scope="module")
def conf_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz-config") / "mount.conf"


# --- Properties --------------------------------------------------------------------------


@fuzz(600)
@given(document=documents, flags=overrides)
def test_any_document_and_flags_load_or_name_the_first_bad_key(conf_file, document, flags):
    text = render(document)
    conf_file.write_text(text, encoding="utf-8")
    # tomllib is not under test: it tells the model what the file holds.
    expected, loaded = first_problem(tomllib.loads(text), flags)
    try:
        config = load_config(conf_file, flags)
    except ConfigError as exc:
        message = str(exc)
        assert one_line(message), message
        assert expected is not None, f"refused a good configuration: {message}"
        assert expected in message, (expected, message)
        event("refused")
        return
    event("loaded")
    assert expected is None, f"loaded despite {expected}"
    for name, value in loaded.items():
        assert getattr(config, name) == value, name
    assert_usable(config)


@fuzz(300)
@given(text=st.text(max_size=200) | st.binary(max_size=200))
def test_any_file_contents_load_or_fail_in_one_line(conf_file, text):
    conf_file.write_bytes(text if isinstance(text, bytes) else text.encode())
    try:
        config = load_config(conf_file, {})
    except ConfigError as exc:
        message = str(exc)
        assert one_line(message), message
        assert message.startswith(str(conf_file)) or "cache.block_size" in message \
            or "read.readahead_max" in message, message
    else:
        assert_usable(config)


@fuzz(400)
@given(name=st.sampled_from(NAMES), value=text_values)
def test_any_flag_value_loads_or_names_its_flag(name, value):
    option = OPTIONS_BY_NAME[name]
    try:
        config = load_config(None, {name: value})
    except ConfigError as exc:
        message = str(exc)
        assert one_line(message), message
        assert option.key in message, message  # the option, or the rule it broke
    else:
        assert_usable(config)


@fuzz(300)
@given(n=st.integers(0, 10**40), unit=st.sampled_from(list(UNITS)),
       spaces=st.sampled_from(["", " ", "\t"]))
def test_sizes_are_exact_or_refused_as_too_large(n, unit, spaces):
    text = f"{spaces}{n}{spaces}{unit}{spaces}"
    exact = n * UNITS[unit]
    if exact > MAX_SIZE:
        with pytest.raises(ValueError, match="cannot exceed") as info:
            parse_size(text)
        assert one_line(str(info.value))
    else:
        assert parse_size(text) == exact  # exact, not through a float


@fuzz(300)
@given(value=text_values | st.integers(-(2**80), 2**80) | st.floats() | st.none()
       | st.lists(st.integers(), max_size=2))
def test_sizes_and_durations_of_anything(value):
    for parse in (parse_size, parse_duration):
        try:
            result = parse(value)
        except ValueError as exc:
            assert one_line(str(exc)), str(exc)
        else:
            if parse is parse_size:
                assert isinstance(result, int) and 0 <= result <= MAX_SIZE
            else:
                assert result >= 0 and not math.isnan(result)


# --- Found by the properties above (kept as plain regressions) ------------------------


@pytest.mark.parametrize(("text", "needle"), [
    ("[read]\nreadahead_max = \"" + "9" * 400 + "\"\n", "cannot exceed"),  # was OverflowError
    ('[origin]\nconnect_timeout = ' + "9" * 400 + "\n", "at most 86400"),  # was OverflowError
    ("[origin]\nread_timeout = inf\n", "at most 86400"),  # loaded; sockets refuse it
    ("[mount]\nuid = -1\n", "bad value for mount.uid"),  # loaded; pyfuse3 refuses it
    ("[mount]\ngid = 4294967296\n", "bad value for mount.gid"),
    ('[read]\n"a\\nb" = 1\n', "unknown key 'read.a\\nb'"),  # was a two-line message
    ("x = " + "[" * 3000 + "]" * 3000 + "\n", "nested too deeply"),  # was RecursionError
])
def test_found_by_fuzzing(conf_file, text, needle):
    conf_file.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(conf_file, {})
    assert needle in str(info.value) and one_line(str(info.value))


def test_long_sizes_are_exact():
    # A float holds 53 bits: 2**62 + 1 came back as 2**62 before.
    assert parse_size(str(2**62 + 1)) == 2**62 + 1
    assert parse_size(f"{MAX_SIZE}B") == MAX_SIZE
    with pytest.raises(ValueError, match="cannot exceed"):
        parse_size(str(MAX_SIZE + 1))
