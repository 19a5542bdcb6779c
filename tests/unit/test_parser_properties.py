"""Property tests (hypothesis) on every parser that reads untrusted text: whatever it is given, it returns
a value or raises its own error, one line, never anything else (no OverflowError, RecursionError,
TypeError, MemoryError from inside it).

Parsers: request bodies (``contracts.jsonbound`` then ``qrm.requests``), the kernel's cpu lists and masks,
node files (meminfo, distances), and the state files (checkpoint, node state, usage history).
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.errors import AdmissionError
from agent.lending import parse_node_state
from agent.qrm.requests import Limits, parse_request
from agent.qrm.state import CorruptCheckpoint, decode
from agent.reporter.capacity import parse_history
from agent.topology.parse import (format_cpulist, parse_cpulist, parse_cpumask, parse_distances,
                                  parse_meminfo_total)
from contracts.jsonbound import BoundError, loads_bounded

SETTINGS = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=40),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=12), children, max_size=5),
    max_leaves=25)
request_keys = st.sampled_from(["name", "qos", "cpus", "millicpu", "tier", "gpus", "nic", "numa_binding",
                                "numa_exclusive", "memory_enhancement", "katalyst.kubewharf.io/qos_level", "label"])
request_docs = st.dictionaries(request_keys, json_values | st.sampled_from(
    ["dedicated_cores", "shared_cores", "reclaimed_cores", "system_cores", "low", "web", "tasks", "cpu.shares",
     "pod/abc", '{"numa_binding": "true"}', "[" * 3000, 10 ** 400, 1e308]), max_size=6)


def one_line(exc: Exception) -> bool:
    return "\n" not in str(exc) and len(str(exc)) < 2000


@SETTINGS
@given(st.binary(max_size=300) | st.text(max_size=300).map(str.encode))
def test_bounded_json_returns_a_value_or_one_bound_error(raw):
    try:
        loads_bounded(raw)
    except BoundError as exc:
        assert one_line(exc)


@SETTINGS
@given(st.integers(min_value=0, max_value=5000), st.sampled_from(["[", "{\"a\":"]))
def test_nesting_of_any_depth_is_refused_not_overflowed(depth, opener):
    raw = opener * depth + "1" + ("]" if opener == "[" else "}") * depth
    try:
        loads_bounded(raw)
        assert depth <= 32
    except BoundError as exc:
        assert depth > 32 and "nested too deeply" in str(exc)


@SETTINGS
@given(request_docs | json_values, st.booleans())
def test_a_request_document_is_a_request_or_one_admission_error(doc, pod):
    try:
        request = parse_request(doc, Limits(cpus=64, gpus=2), pod=pod)
    except AdmissionError as exc:
        assert one_line(exc)
        return
    assert 0 <= request.millicpu <= 64_000 and 0 <= request.cpus <= 64 and request.gpus <= 2


@SETTINGS
@given(st.text(alphabet="0123456789,-x ", max_size=40))
def test_cpu_lists_round_trip_or_are_refused(text):
    try:
        cpus = parse_cpulist(text)
    except ValueError as exc:
        assert one_line(exc)
        return
    assert parse_cpulist(format_cpulist(cpus)) == tuple(sorted(set(cpus)))


@SETTINGS
@given(st.text(max_size=80))
def test_masks_meminfo_and_distances_parse_or_refuse(text):
    for parser in (parse_cpumask, parse_meminfo_total, parse_distances):
        try:
            parser(text)
        except ValueError as exc:
            assert one_line(exc)


@SETTINGS
@given(st.binary(max_size=400) | json_values.map(lambda v: __import__("json").dumps(v).encode()))
def test_a_checkpoint_is_decoded_or_corrupt(raw):
    try:
        decode(raw)
    except CorruptCheckpoint as exc:
        assert one_line(exc)


@SETTINGS
@given(json_values)
def test_node_state_and_history_documents_parse_or_refuse(doc):
    for parser in (parse_node_state, parse_history):
        try:
            parser(doc)
        except (ValueError, TypeError, KeyError) as exc:  # what statefiles.load_json keeps aside
            assert one_line(exc)
