"""Network policy checks, class plan and the nft ruleset, without a kernel."""

import pytest

from agent.errors import TidalError
from agent.isolation.net.classify import CgroupMatch, Classifier, ruleset
from agent.isolation.net.policy import ClassRates, NetConfig, NetError, NicRole, format_rate, parse_nic, parse_rate

MBIT = 1_000_000


@pytest.mark.parametrize("text, bits", [
    ("100mbit", 100 * MBIT), ("10gbit", 10_000 * MBIT), ("1.5gbit", 1500 * MBIT), ("800kbit", 800_000),
    ("125mbps", 1000 * MBIT), ("64bit", 64), (" 25Gbit ", 25_000 * MBIT),
], ids=["mbit", "gbit", "fraction", "kbit", "bytes", "bits", "case-and-space"])
def test_rates_parse_in_tc_units(text, bits):
    assert parse_rate(text) == bits


@pytest.mark.parametrize("text, message", [
    ("100", "expected a number and a unit"), ("fast", "expected a number and a unit"),
    ("0mbit", "must be above zero"), ("-5mbit", "expected a number and a unit"),
], ids=["no-unit", "word", "zero", "negative"])
def test_bad_rates_are_one_clear_error(text, message):
    with pytest.raises(NetError, match=message):
        parse_rate(text)


def test_nic_role_parses_name_and_rate():
    assert parse_nic("eth1:10gbit", "10.0.0.1") == NicRole("eth1", 10_000 * MBIT, "10.0.0.1")
    with pytest.raises(NetError, match="expected NAME:RATE"):
        parse_nic("eth1")


@pytest.mark.parametrize("config, message", [
    (NetConfig(NicRole("a0", MBIT), NicRole("a0", MBIT)), "both the online and the offline role"),
    (NetConfig(NicRole("a0", MBIT), margin=0.7), "margin 0.7"),
    (NetConfig(NicRole("a0", MBIT), offline_floor=0.45, system_share=0.45), "leave online less than 10%"),
    (NetConfig(NicRole("a0", MBIT), mark=0x1, mask=0xFF0000), "inside mask"),
    (NetConfig(NicRole("a0", MBIT), table=254), "free routing table"),
], ids=["overlapping-roles", "margin", "no-room-for-online", "mark-outside-mask", "main-table"])
def test_config_checks_refuse_what_cannot_work(config, message):
    with pytest.raises(NetError, match=message):
        config.check()


def test_class_plan_guarantees_add_up_to_the_shaped_rate():
    config = NetConfig(NicRole("a0", 10_000 * MBIT))
    rates = ClassRates.plan(config, 10_000 * MBIT)
    assert rates.shaped == 9_800 * MBIT
    assert rates.online + rates.system + rates.offline_floor == rates.shaped
    assert rates.offline_floor == 500 * MBIT


@pytest.mark.parametrize("online_peak, want", [
    (0, 9_700), (3_000 * MBIT, 6_700), (9_800 * MBIT, 500), (20_000 * MBIT, 500),
], ids=["idle", "some", "saturated", "over"])
def test_offline_ceiling_is_link_less_online_peak_less_margin_never_below_floor(online_peak, want):
    config = NetConfig(NicRole("a0", 10_000 * MBIT))
    rates = ClassRates.plan(config, 10_000 * MBIT)
    assert rates.offline_ceiling(config, 10_000 * MBIT, online_peak) == want * MBIT


def test_cgroup_match_names_the_path_under_sys_fs_cgroup_and_the_depth_in_its_hierarchy():
    hybrid = CgroupMatch.of("/sys/fs/cgroup/unified/tidal/reclaimed", "/sys/fs/cgroup/unified")
    assert hybrid == CgroupMatch("unified/tidal/reclaimed", 2)
    v2 = CgroupMatch.of("/sys/fs/cgroup/kubepods/tidal/reclaimed", "/sys/fs/cgroup")
    assert v2 == CgroupMatch("kubepods/tidal/reclaimed", 3)
    assert CgroupMatch.of("/run/cgroup2/tidal/reclaimed", "/run/cgroup2") is None  # nft could not resolve it


def test_ruleset_marks_prioritises_and_nats_only_offline_and_replaces_itself_atomically():
    config = NetConfig(NicRole("a0", MBIT), NicRole("b0", MBIT))
    classifier = Classifier("nft-cgroupv2", CgroupMatch("unified/tidal/reclaimed", 2),
                            CgroupMatch("unified/tidal/system", 2))
    text = ruleset(config, classifier, "b0", ["a0", "b0"])
    lines = text.splitlines()
    # idempotent replace: declare, delete, define (one nft transaction)
    assert lines[:3] == ["table inet tidal {}", "delete table inet tidal", "table inet tidal {"]
    assert 'socket cgroupv2 level 2 "unified/tidal/reclaimed" meta mark set meta mark & 0xff00ffff | 0x00110000 ' \
           'meta priority set 1a1d:20 ct mark set meta mark' in text
    assert 'socket cgroupv2 level 2 "unified/tidal/system" meta priority set 1a1d:30' in text
    assert text.count("masquerade to :61440-65535") == 2
    assert "type route hook output" in text  # a changed mark makes the kernel route again


def test_net_options_need_an_online_nic():
    from agent.cli import net_config

    assert net_config(None, None, None, None, True) is None
    with pytest.raises(TidalError, match="need --online-nic"):
        net_config(None, "b0:1gbit", None, None, True)
    with pytest.raises(TidalError, match="needs --offline-nic"):
        net_config("a0:1gbit", None, "10.0.0.1", None, True)
    assert net_config("a0:1gbit", "b0:1gbit", "10.0.0.1", None, True).offline.gateway == "10.0.0.1"


def test_rates_format_for_people():
    assert format_rate(97_000_000) == "97mbit"
    assert format_rate(9_700_000_000) == "9.7gbit"


@pytest.mark.parametrize("link, want", [(200 * MBIT, 3028), (10_000 * MBIT, 125_000)], ids=["200mbit", "10gbit"])
def test_htb_bursts_last_100us_at_the_class_rate_and_never_under_two_frames(link, want):
    """What HTB sends back to back queues downstream, ahead of online's next packet: the
    default keeps it to 100 µs of the rate (two full frames where that is less)."""
    rates = ClassRates.plan(NetConfig(NicRole("a0", link)), link)
    assert rates.burst(link) == want
