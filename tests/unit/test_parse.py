"""Parsers on literal strings (docs/architecture.md convention 2)."""

import pytest

from agent.topology.parse import (
    cpuinfo_model_and_flags,
    cpuinfo_physical_ids,
    format_cpulist,
    parse_cpulist,
    parse_cpumask,
    parse_distances,
    parse_int,
    parse_meminfo_total,
    parse_cpuinfo,
)
from agent.topology.synthetic import format_cpumask


@pytest.mark.parametrize("text,expected", [
    ("0-3,8", (0, 1, 2, 3, 8)),
    ("0", (0,)),
    ("", ()),
    ("\n", ()),
    ("5,1-2\n", (1, 2, 5)),
    ("0-63\n\x00", tuple(range(64))),
    ("0-15:2/4", (0, 1, 4, 5, 8, 9, 12, 13)),
    ("3,3,3", (3,)),
], ids=["ranges", "single", "empty", "newline", "unordered", "trailing-nul", "stride", "duplicates"])
def test_parse_cpulist(text, expected):
    assert parse_cpulist(text) == expected


@pytest.mark.parametrize("text", ["a-b", "3-1", "1,,2", "-1", "1-", "0-7:0/4", "0-7:5/4", "1 2"],
                         ids=["letters", "descending", "empty-item", "negative", "open-range",
                              "zero-stride", "stride-over-group", "space"])
def test_parse_cpulist_rejects_garbage(text):
    with pytest.raises(ValueError, match="cpu list"):
        parse_cpulist(text)


@pytest.mark.parametrize("text,expected", [
    ("0000ff00,00000000", tuple(range(40, 48))),
    ("00000101", (0, 8)),
    ("ff", tuple(range(8))),
    ("00000000,00000000", ()),
    ("80000000,00000001", (0, 63)),
    ("00000000,00000101\n", (0, 8)),
], ids=["high-word", "one-word", "short-word", "zero", "edges", "newline"])
def test_parse_cpumask(text, expected):
    assert parse_cpumask(text) == expected


@pytest.mark.parametrize("text", ["xyz", "123456789", "ff,,ff"], ids=["not-hex", "word-too-long", "empty-word"])
def test_parse_cpumask_rejects_garbage(text):
    with pytest.raises(ValueError, match="cpu mask"):
        parse_cpumask(text)


@pytest.mark.parametrize("cpus,expected", [
    ([0, 1, 2, 3, 8], "0-3,8"), ([], ""), ([5], "5"), ([3, 1, 2], "1-3"), ([0, 2, 4], "0,2,4"),
], ids=["mixed", "empty", "single", "unsorted", "gaps"])
def test_format_cpulist(cpus, expected):
    assert format_cpulist(cpus) == expected
    assert parse_cpulist(expected) == tuple(sorted(cpus))


@pytest.mark.parametrize("cpus,nbits", [([0, 8], 32), ([40, 47], 64), ([0, 255], 256), ([], 16)],
                         ids=["one-word", "two-words", "eight-words", "empty"])
def test_cpumask_round_trip(cpus, nbits):
    assert parse_cpumask(format_cpumask(cpus, nbits)) == tuple(cpus)


@pytest.mark.parametrize("text,expected", [
    ("Node 0 MemTotal:       8386704 kB\nNode 0 MemFree: 1 kB\n", 8386704 * 1024),
    ("MemTotal:   280840 kB\n", 280840 * 1024),
    ("MemFree: 1 kB\nMemTotal: 100\n", 100),
], ids=["node", "global", "no-unit"])
def test_parse_meminfo_total(text, expected):
    assert parse_meminfo_total(text) == expected


@pytest.mark.parametrize("text", ["MemFree: 1 kB\n", "MemTotal: lots kB"], ids=["missing", "garbage"])
def test_parse_meminfo_rejects(text):
    with pytest.raises(ValueError):
        parse_meminfo_total(text)


def test_parse_int_and_distances():
    assert parse_int("0x030000\n") == 0x030000
    assert parse_int("-1") == -1
    assert parse_distances("10 21 21\n") == (10, 21, 21)
    with pytest.raises(ValueError):
        parse_int("zz")
    with pytest.raises(ValueError):
        parse_distances("10 x")


@pytest.mark.parametrize("text,model,flag", [
    ("processor\t: 0\nmodel name\t: Intel(R) Xeon(R)\nflags\t\t: fpu sse\n", "Intel(R) Xeon(R)", "sse"),
    ("Processor\t: ARMv7 Processor rev 1 (v7l)\nprocessor\t: 0\n\nFeatures\t: swp half\n",
     "ARMv7 Processor rev 1 (v7l)", "swp"),
    ("processor\t: 0\nBogoMIPS\t: 100\nFeatures\t: fp asimd\nCPU implementer\t: 0x48\nCPU part\t: 0xd01\n",
     "HiSilicon part 0xd01", "asimd"),
    ("processor\t: 0\ncpu\t\t: POWER7 (architected)\n", "POWER7 (architected)", None),
    ("vendor_id       : IBM/S390\nfeatures\t: esan3 zarch\n", "IBM/S390", "zarch"),
], ids=["x86", "arm-old", "arm64", "power", "s390"])
def test_cpuinfo_model_and_flags(text, model, flag):
    got_model, flags = cpuinfo_model_and_flags(parse_cpuinfo(text))
    assert got_model == model
    if flag:
        assert flag in flags
    else:
        assert flags == ()


def test_cpuinfo_physical_ids():
    text = "processor : 0\nphysical id : 1\ncore id : 3\n\nprocessor : 1\n"
    assert cpuinfo_physical_ids(parse_cpuinfo(text)) == {0: (1, 3), 1: (None, None)}
