"""The ServerArgs field names the config checks `throughput.sglang_args` against are those of the
pinned SGLang release, read from its wheel (see tests/replicas/engines/sglang_source.py)."""

from __future__ import annotations

from megaserve.deploy.sglang_server_args import (
    SCALAR_FIELDS,
    SCALAR_TYPES,
    SERVER_ARGS_FIELDS,
    SGLANG_VERSION,
    UNCHECKED_FIELDS,
)
from megaserve.replicas.engines.sglang_engine import INCREMENTAL_ARG, OWNED_ARGS, SGLANG_DEFAULTS
from tests.replicas.engines.sglang_source import SGLangSource, pinned_version, type_names, wheel_path


def test_the_list_is_of_the_pinned_release():
    assert SGLANG_VERSION == pinned_version()


def test_the_list_is_exactly_server_args_fields_in_the_pinned_wheel():
    fields = set(SGLangSource(wheel_path()).server_args_fields())
    assert sorted(fields - SERVER_ARGS_FIELDS) == [], "ServerArgs fields missing from the list"
    assert sorted(SERVER_ARGS_FIELDS - fields) == [], "names in the list that ServerArgs lacks"


def test_the_scalar_fields_and_their_types_are_those_of_the_pinned_wheel():
    fields = SGLangSource(wheel_path()).server_args_fields()
    expected: dict[tuple[str, ...], set[str]] = {}
    for name, annotation in fields.items():
        accepted = type_names(annotation)
        if accepted <= SCALAR_TYPES.keys() and accepted != {"None"}:
            expected.setdefault(tuple(sorted(accepted)), set()).add(name)
    assert {types: set(names) for types, names in SCALAR_FIELDS.items()} == expected
    assert UNCHECKED_FIELDS == set(fields).difference(*expected.values())  # lists, dicts, Literal, classes


def test_every_key_megaserve_sets_for_sglang_is_in_the_list():
    assert {*OWNED_ARGS, *SGLANG_DEFAULTS, INCREMENTAL_ARG} <= SERVER_ARGS_FIELDS
