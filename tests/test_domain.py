"""Section 4 of outpost.py: the pure functions (timing engine, validation, outcomes, naming).

No I/O: every function here is called with its inputs, ``now`` included."""

from __future__ import annotations

import hashlib
import json
import re
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest
from conftest import T0, definition
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import outpost
from outpost import RunStatus

REPO = "/srv/app"
BERLIN, NEW_YORK = "Europe/Berlin", "America/New_York"


def utc(text: str) -> datetime:
    return datetime.fromisoformat(text).replace(tzinfo=UTC)


def cron(expression: str, timezone: str = "UTC") -> dict:
    return {"kind": "cron", "expression": expression, "timezone": timezone}


def local_fires(timing: dict, after: datetime, count: int, **kwargs) -> list[str]:
    """next_fires as local wall times with their offset, the way a human checks them."""
    tz = ZoneInfo(timing["timezone"])
    return [f.astimezone(tz).isoformat() for f in outpost.next_fires(timing, after, count, **kwargs)]


def normalize(now: datetime = T0, agents: tuple[str, ...] = ("demo",), **overrides) -> dict:
    return outpost.normalize_definition(definition(REPO, **overrides), now, agents=agents)


###############################################################################
# next_fires: cron, interval, once
###############################################################################

@pytest.mark.parametrize(("expression", "timezone", "after", "expected"), [
    ("*/5 * * * *", "UTC", "2026-11-30T08:00:00",
     ["2026-11-30T08:05:00+00:00", "2026-11-30T08:10:00+00:00", "2026-11-30T08:15:00+00:00"]),
    ("0 9 * * 1-5", BERLIN, "2026-12-04T12:00:00",   # a Friday afternoon: next is Monday
     ["2026-12-07T09:00:00+01:00", "2026-12-08T09:00:00+01:00", "2026-12-09T09:00:00+01:00"]),
    ("0 9 * * *", NEW_YORK, "2026-11-30T08:00:00",   # 03:00 in New York: today 09:00 is still ahead
     ["2026-11-30T09:00:00-05:00", "2026-12-01T09:00:00-05:00", "2026-12-02T09:00:00-05:00"]),
    ("@hourly", "UTC", "2026-11-30T08:30:00",
     ["2026-11-30T09:00:00+00:00", "2026-11-30T10:00:00+00:00", "2026-11-30T11:00:00+00:00"]),
    ("@daily", BERLIN, "2026-11-30T08:00:00",
     ["2026-12-01T00:00:00+01:00", "2026-12-02T00:00:00+01:00", "2026-12-03T00:00:00+01:00"]),
    ("@monthly", "UTC", "2026-11-30T08:00:00",
     ["2026-12-01T00:00:00+00:00", "2027-01-01T00:00:00+00:00", "2027-02-01T00:00:00+00:00"]),
])
def test_cron_fires_at_its_next_wall_times_in_its_timezone(expression, timezone, after, expected):
    assert local_fires(cron(expression, timezone), utc(after), 3) == expected


def test_cron_never_fires_at_the_after_instant_itself():
    assert outpost.next_fires(cron("*/5 * * * *"), utc("2026-11-30T08:05:00"), 1) == [utc("2026-11-30T08:10:00")]


INTERVAL = {"kind": "interval", "seconds": 600, "timezone": "UTC"}


@pytest.mark.parametrize(("after_s", "expected_s"), [
    (0, [600, 1200, 1800]),          # right at creation: the first fire is one interval later
    (1, [600, 1200, 1800]),
    (1200, [1800, 2400, 3000]),      # exactly on a fire: strictly after it
    (1234, [1800, 2400, 3000]),      # in between: the grid of anchor + k * seconds, not after + seconds
    (-5000, [600, 1200, 1800]),      # before the anchor: never earlier than anchor + 1 interval
])
def test_interval_fires_on_the_anchor_grid(after_s, expected_s):
    anchor = T0 + timedelta(microseconds=123456)
    fires = outpost.next_fires(INTERVAL, anchor + timedelta(seconds=after_s), 3, anchor=anchor)
    assert fires == [anchor + timedelta(seconds=s) for s in expected_s]


@pytest.mark.parametrize("timezone", [BERLIN, NEW_YORK])
def test_interval_follows_real_time_across_a_dst_change(timezone):
    timing = {"kind": "interval", "seconds": 3600, "timezone": timezone}
    anchor = utc("2027-03-13T00:00:00")
    fires = outpost.next_fires(timing, anchor, 72, anchor=anchor)
    assert [b - a for a, b in zip(fires, fires[1:], strict=False)] == [timedelta(hours=1)] * 71


@pytest.mark.parametrize(("at", "after", "expected"), [
    ("2026-12-01T09:00:00+01:00", "2026-11-30T08:00:00", [utc("2026-12-01T08:00:00")]),
    ("2026-12-01T09:00:00+01:00", "2026-12-01T08:00:00", []),     # its instant: already fired
    ("2026-12-01T09:00:00+01:00", "2026-12-02T00:00:00", []),
])
def test_once_fires_a_single_time(at, after, expected):
    assert outpost.next_fires({"kind": "once", "at": at, "timezone": BERLIN}, utc(after), 5) == expected


###############################################################################
# DST rules of docs/schedules.md
###############################################################################

@pytest.mark.parametrize(("expression", "timezone", "after", "expected"), [
    pytest.param("30 2 * * *", BERLIN, "2027-03-27T12:00:00",
                 ["2027-03-28T03:00:00+02:00", "2027-03-29T02:30:00+02:00"], id="berlin-daily-gap-fires-at-03:00"),
    pytest.param("30 2 * * *", BERLIN, "2027-10-30T12:00:00",
                 ["2027-10-31T02:30:00+02:00", "2027-11-01T02:30:00+01:00"], id="berlin-daily-repeat-fires-first-copy"),
    pytest.param("30 2 * * *", BERLIN, "2027-10-31T00:45:00",    # 02:45 CEST, between the two 02:30s
                 ["2027-11-01T02:30:00+01:00"], id="berlin-daily-repeat-no-second-copy"),
    pytest.param("30 * * * *", BERLIN, "2027-03-27T23:00:00",
                 ["2027-03-28T00:30:00+01:00", "2027-03-28T01:30:00+01:00", "2027-03-28T03:30:00+02:00"],
                 id="berlin-hourly-skips-gap-hour"),
    pytest.param("30 * * * *", BERLIN, "2027-10-30T23:00:00",
                 ["2027-10-31T01:30:00+02:00", "2027-10-31T02:30:00+02:00", "2027-10-31T02:30:00+01:00",
                  "2027-10-31T03:30:00+01:00"], id="berlin-hourly-fires-both-copies"),
    pytest.param("*/20 2 * * *", BERLIN, "2027-03-27T12:00:00",
                 ["2027-03-28T03:00:00+02:00", "2027-03-29T02:00:00+02:00"], id="berlin-gap-collapses-to-one-fire"),
    pytest.param("0,30 2,3 * * *", BERLIN, "2027-03-27T12:00:00",
                 ["2027-03-28T03:00:00+02:00", "2027-03-28T03:30:00+02:00", "2027-03-29T02:00:00+02:00"],
                 id="berlin-gap-and-03:00-one-instant"),
    pytest.param("*/20 2 * * *", BERLIN, "2027-10-30T12:00:00",
                 ["2027-10-31T02:00:00+02:00", "2027-10-31T02:20:00+02:00", "2027-10-31T02:40:00+02:00",
                  "2027-11-01T02:00:00+01:00"], id="berlin-repeat-fixed-hour-once"),
    pytest.param("30 2 * * *", NEW_YORK, "2027-03-13T12:00:00",
                 ["2027-03-14T03:00:00-04:00", "2027-03-15T02:30:00-04:00"], id="new-york-daily-gap"),
    pytest.param("30 1 * * *", NEW_YORK, "2027-11-06T12:00:00",
                 ["2027-11-07T01:30:00-04:00", "2027-11-08T01:30:00-05:00"], id="new-york-daily-repeat"),
    pytest.param("30 * * * *", NEW_YORK, "2027-03-14T05:00:00",
                 ["2027-03-14T00:30:00-05:00", "2027-03-14T01:30:00-05:00", "2027-03-14T03:30:00-04:00"],
                 id="new-york-hourly-gap"),
    pytest.param("30 * * * *", NEW_YORK, "2027-11-07T04:00:00",
                 ["2027-11-07T00:30:00-04:00", "2027-11-07T01:30:00-04:00", "2027-11-07T01:30:00-05:00",
                  "2027-11-07T02:30:00-05:00"], id="new-york-hourly-repeat"),
])
def test_dst_rules_of_api_4_1(expression, timezone, after, expected):
    assert local_fires(cron(expression, timezone), utc(after), len(expected)) == expected


def test_daily_cron_fires_once_per_day_through_both_berlin_changes_of_2027():
    fires = outpost.next_fires(cron("30 2 * * *", BERLIN), utc("2027-01-01T00:00:00"), 365)
    days = [f.astimezone(ZoneInfo(BERLIN)).date() for f in fires]
    assert days == [days[0] + timedelta(days=i) for i in range(365)]


###############################################################################
# Property tests of the timing engine
###############################################################################

ZONES = ["UTC", BERLIN, NEW_YORK, "Europe/London", "Australia/Lord_Howe", "Pacific/Chatham",
         "America/Santiago", "America/Havana", "Antarctica/Troll", "Asia/Kolkata"]
MINUTE = timedelta(minutes=1)


def offset_changes(tz: ZoneInfo, start: datetime, end: datetime) -> list[datetime]:
    """Instants in [start, end) where ``tz`` changes its UTC offset (a scan independent of outpost)."""
    def offset(t: datetime) -> timedelta | None:
        return t.astimezone(tz).utcoffset()

    found, day = [], start
    while day < end:
        if offset(day) != offset(day + timedelta(days=1)):
            t = day
            while offset(t + timedelta(hours=1)) == offset(day):
                t += timedelta(hours=1)
            while offset(t) == offset(day):
                t += MINUTE
            found.append(t)
        day += timedelta(days=1)
    return found


CHANGES = {z: offset_changes(ZoneInfo(z), utc("2026-01-01T00:00:00"), utc("2029-01-01T00:00:00")) for z in ZONES}


def field(lo: int, hi: int) -> st.SearchStrategy[list[int]]:
    return st.lists(st.integers(lo, hi), min_size=1, max_size=3, unique=True).map(sorted)


@st.composite
def cron_cases(draw) -> tuple[list[int], list[int] | None, str, datetime]:
    """(minutes, hours or None for ``*``, zone, after): after either anywhere in 2026-2028
    or within two days before / three hours after one of the zone's DST changes."""
    minutes = draw(field(0, 59))
    hours = draw(st.one_of(st.none(), field(0, 23)))
    zone = draw(st.sampled_from(ZONES))
    if CHANGES[zone] and draw(st.booleans()):
        after = draw(st.sampled_from(CHANGES[zone])) + timedelta(seconds=draw(st.integers(-2 * 86400, 3 * 3600)))
    else:
        after = draw(st.datetimes(datetime(2026, 1, 1), datetime(2028, 12, 31))).replace(tzinfo=UTC)
    return minutes, hours, zone, after


def expression_of(minutes: list[int], hours: list[int] | None) -> str:
    return f"{','.join(map(str, minutes))} {'*' if hours is None else ','.join(map(str, hours))} * * *"


PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPERTY
@given(cron_cases(), st.integers(1, 10))
def test_next_fires_are_strictly_increasing_utc_instants_after_after(case, count):
    minutes, hours, zone, after = case
    fires = outpost.next_fires(cron(expression_of(minutes, hours), zone), after, count)
    assert len(fires) == count
    assert all(f.utcoffset() == timedelta(0) for f in fires)
    assert fires[0] > after
    assert all(a < b for a, b in zip(fires, fires[1:], strict=False))   # strictly increasing, so unique


@PROPERTY
@given(cron_cases(), st.integers(2, 8))
def test_stepping_one_fire_at_a_time_equals_asking_for_n(case, count):
    minutes, hours, zone, after = case
    timing = cron(expression_of(minutes, hours), zone)
    fires = outpost.next_fires(timing, after, count)
    for k in range(count - 1):
        assert outpost.next_fires(timing, fires[k], 1)[0] == fires[k + 1]


def reference_fires(minutes: list[int], hours: list[int] | None, tz: ZoneInfo, after: datetime,
                    days: int) -> list[datetime]:
    """The DST rules of docs/schedules.md read literally, one real minute at a time.

    Hour field ``*``: every instant whose local wall time matches (gap skipped, both copies).
    Otherwise: a matching wall time fires at its first occurrence only (fold 0), and a matching
    wall time that the clocks jump over fires at the first instant after the jump."""
    def matches(wall: datetime) -> bool:
        return wall.minute in minutes and (hours is None or wall.hour in hours)

    found: set[datetime] = set()
    t = after.replace(second=0, microsecond=0)
    previous = (t - MINUTE).astimezone(tz).replace(tzinfo=None)
    while t < after + timedelta(days=days):
        local = t.astimezone(tz)
        wall = local.replace(tzinfo=None)
        if t > after:
            if matches(wall) and (hours is None or local.fold == 0):
                found.add(t)
            skipped = previous + MINUTE
            while hours is not None and skipped < wall:   # wall times inside a gap
                if matches(skipped):
                    found.add(t)
                skipped += MINUTE
        previous = wall
        t += MINUTE
    return sorted(found)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cron_cases())
def test_next_fires_agree_with_a_minute_by_minute_reading_of_the_dst_rules(case):
    minutes, hours, zone, after = case
    fires = outpost.next_fires(cron(expression_of(minutes, hours), zone), after, 5)
    assert fires == reference_fires(minutes, hours, ZoneInfo(zone), after, days=6)[:5]


###############################################################################
# timing_warnings: what compose asks a human to read
###############################################################################

NOW = utc("2026-11-30T08:00:00")


@pytest.mark.parametrize(("timing", "expected"), [
    pytest.param(cron("30 2 * * *", BERLIN), [
        ("2027-03-28 02:30", "does not exist", "Europe/Berlin", "fires once, at 03:00"),
        ("2027-10-31 02:30", "occurs twice", "Europe/Berlin", "fires once, at the first"),
    ], id="berlin-daily"),
    pytest.param(cron("30 * * * *", BERLIN), [
        ("2027-03-28 02:30", "does not exist", "follows real time", "skips the missing hour"),
        ("2027-10-31 02:30", "occurs twice", "follows real time", "both copies"),
    ], id="berlin-hourly"),
    pytest.param(cron("30 2 * * *", NEW_YORK), [
        ("2027-03-14 02:30", "does not exist", "America/New_York", "03:00"),
    ], id="new-york-gap-only"),
    pytest.param(cron("30 1 * * *", NEW_YORK), [
        ("2027-11-07 01:30", "occurs twice", "America/New_York", "once"),
    ], id="new-york-repeat-only"),
])
def test_dst_warnings_name_the_day_the_wall_time_and_what_happens(timing, expected):
    warnings = outpost.timing_warnings(timing, NOW)
    assert len(warnings) == len(expected)
    for sentence, parts in zip(warnings, expected, strict=True):
        assert all(p in sentence for p in parts), sentence


def test_a_dst_warning_does_not_call_a_five_minute_schedule_hourly():
    """A new user read "this hourly schedule" for */5 * * * *: the words fit every cron that
    follows real time, however often it fires."""
    (gap, repeat) = outpost.timing_warnings(cron("*/5 * * * *", BERLIN), NOW)
    assert "hourly" not in gap + repeat
    assert "every hour or more often" in gap and "skips the missing hour" in gap


@pytest.mark.parametrize(("at", "expected"), [
    ("2027-03-28T02:30", ["2027-03-28 02:30", "does not exist", BERLIN, "fires once, at 03:00"]),
    ("2027-10-31T02:30", ["2027-10-31 02:30", "occurs twice", BERLIN, "fires once, at the first"]),
])
def test_a_once_schedule_whose_wall_time_a_dst_change_moves_gets_a_warning(at, expected):
    """Defect 12: 02:30 on a spring-forward day moved to 03:00 without a word."""
    requested = {"kind": "once", "at": at, "timezone": BERLIN}
    timing = outpost.normalize_timing(requested, NOW, check_past=True)
    (warning,) = outpost.timing_warnings(timing, NOW, requested)
    assert all(part in warning for part in expected), warning
    assert outpost.timing_warnings(timing, NOW, {**requested, "at": timing["at"]}) == []   # an exact instant


@pytest.mark.parametrize(("timing", "expected"), [
    (cron("0 9 1 * 1"), "EITHER matches"),
    ({"kind": "interval", "seconds": 60, "timezone": "UTC"}, "shorter than a typical agent run"),
    ({"kind": "interval", "seconds": 299, "timezone": "UTC"}, "shorter than a typical agent run"),
])
def test_warnings_for_day_of_month_or_day_of_week_and_short_intervals(timing, expected):
    warnings = outpost.timing_warnings(timing, NOW)
    assert len(warnings) == 1
    assert expected in warnings[0]


@pytest.mark.parametrize("timing", [
    cron("0 9 * * *"), cron("*/5 * * * *"), cron("0 9 1 * *"), cron("0 9 * * 1-5"),
    cron("30 2 * * *", "Asia/Kolkata"),                     # a zone without DST
    cron("30 4 * * *", BERLIN),                             # never near a change
    {"kind": "interval", "seconds": 300, "timezone": "UTC"},
    {"kind": "once", "at": "2027-03-28T03:00:00+02:00", "timezone": BERLIN},
])
def test_no_warning_for_plain_timings(timing):
    assert outpost.timing_warnings(timing, NOW) == []


###############################################################################
# normalize_definition: validation (docs/schedules.md)
###############################################################################

@pytest.mark.parametrize(("overrides", "field"), [
    pytest.param({"name": ""}, "name", id="name-empty"),
    pytest.param({"name": "   "}, "name", id="name-blank"),
    pytest.param({"name": "x" * 101}, "name", id="name-101"),
    pytest.param({"name": 7}, "name", id="name-not-string"),
    pytest.param({"brief": ""}, "brief", id="brief-empty"),
    pytest.param({"brief": "x" * 32769}, "brief", id="brief-32769"),
    pytest.param({"repository": "srv/app"}, "repository", id="repository-relative"),
    pytest.param({"repository": "./app"}, "repository", id="repository-dot-relative"),
    pytest.param({"workdir": "../other"}, "workdir", id="workdir-parent"),
    pytest.param({"workdir": "sub/../../other"}, "workdir", id="workdir-inner-parent"),
    pytest.param({"workdir": "/etc"}, "workdir", id="workdir-absolute"),
    pytest.param({"source_ref": "-main"}, "source_ref", id="source_ref-dash"),
    pytest.param({"source_ref": "--upload-pack=touch /tmp/x"}, "source_ref", id="source_ref-option"),
    pytest.param({"agent": "claude"}, "agent", id="agent-unknown"),
    pytest.param({"timing": None}, "timing", id="timing-missing"),
    pytest.param({"timing": {"kind": "cron", "expression": "0 9 * * *"}}, "timing.timezone", id="tz-missing"),
    pytest.param({"timing": {"kind": "cron", "expression": "0 9 * * *", "timezone": ""}}, "timing.timezone",
                 id="tz-empty"),
    pytest.param({"timing": {"kind": "cron", "expression": "0 9 * * *", "timezone": "Mars/Olympus"}},
                 "timing.timezone", id="tz-invalid"),
    pytest.param({"timing": {"kind": "interval", "seconds": 60}}, "timing.timezone", id="interval-tz-missing"),
    pytest.param({"timing": {"kind": "weekly", "timezone": "UTC"}}, "timing.kind", id="kind-unknown"),
    pytest.param({"timing": cron("0 0 9 * * *")}, "timing.expression", id="cron-six-fields"),
    pytest.param({"timing": cron("9 * * *")}, "timing.expression", id="cron-four-fields"),
    pytest.param({"timing": cron("@reboot")}, "timing.expression", id="cron-reboot"),
    pytest.param({"timing": cron("61 * * * *")}, "timing.expression", id="cron-out-of-range"),
    pytest.param({"timing": cron("0 0 31 2 *")}, "timing.expression", id="cron-never-fires"),
    pytest.param({"timing": {**cron("0 9 * * *"), "seconds": 5}}, "timing.seconds", id="cron-unknown-field"),
    pytest.param({"timing": {"kind": "interval", "seconds": 9, "timezone": "UTC"}}, "timing.seconds",
                 id="interval-9"),
    pytest.param({"timing": {"kind": "interval", "seconds": 31622401, "timezone": "UTC"}}, "timing.seconds",
                 id="interval-31622401"),
    pytest.param({"timing": {"kind": "interval", "seconds": 60.5, "timezone": "UTC"}}, "timing.seconds",
                 id="interval-fraction"),
    pytest.param({"timing": {"kind": "interval", "seconds": True, "timezone": "UTC"}}, "timing.seconds",
                 id="interval-bool"),
    pytest.param({"timing": {"kind": "once", "at": "2026-11-30T07:59:59Z", "timezone": "UTC"}}, "timing.at",
                 id="once-past"),
    pytest.param({"timing": {"kind": "once", "at": "2026-11-30T09:00:00+01:00", "timezone": "UTC"}}, "timing.at",
                 id="once-now"),
    pytest.param({"timing": {"kind": "once", "at": "2026-11-30T08:30:00", "timezone": "Asia/Tokyo"}},
                 "timing.at", id="once-wall-time-past-in-its-zone"),
    pytest.param({"timing": {"kind": "once", "at": "next tuesday", "timezone": "UTC"}}, "timing.at",
                 id="once-not-iso"),
    pytest.param({"limits": {"timeout_seconds": 0}}, "limits.timeout_seconds", id="timeout-0"),
    pytest.param({"limits": {"timeout_seconds": 86401}}, "limits.timeout_seconds", id="timeout-86401"),
    pytest.param({"limits": {"timeout_seconds": "60"}}, "limits.timeout_seconds", id="timeout-string"),
    pytest.param({"limits": {"cpu": 2}}, "limits.cpu", id="limits-unknown-field"),
    pytest.param({"notify": "loudly"}, "notify", id="notify-unknown"),
    pytest.param({"concurrency_policy": "queue"}, "concurrency_policy", id="concurrency-unknown"),
    pytest.param({"catch_up": {"policy": "replay_all"}}, "catch_up.policy", id="catch_up-policy-unknown"),
    pytest.param({"catch_up": {"policy": "enqueue_missed_with_cap", "max": 0}}, "catch_up.max", id="max-0"),
    pytest.param({"catch_up": {"policy": "enqueue_missed_with_cap", "max": 26}}, "catch_up.max", id="max-26"),
    pytest.param({"colour": "red"}, "colour", id="unknown-top-level-field"),
])
def test_invalid_definition_is_refused_naming_the_field(overrides, field):
    with pytest.raises(outpost.ValidationFailed) as caught:
        normalize(**overrides)
    assert caught.value.errors[0]["field"] == field
    assert caught.value.problem()["status"] == 422
    assert caught.value.problem()["code"] == "validation_failed"


@pytest.mark.parametrize(("expression", "reversed_range", "instead"), [
    ("0 23-3/2 * * *", "23-3/2", "1,3,23"),          # meant 23, 1, 3; croniter fired 02:00 and 23:00
    ("0 0 20-5/5 * *", "20-5/5", "4,20,25,30"),      # meant the 4th; croniter fired the 5th
    ("* * * 9-8/3 *", "9-8/3", "3,6,9,12"),
    ("0 9 * * sat-tue/2", "sat-tue/2", "1,6"),
    ("0 22-2 * * *", "22-2", "22-23,0-2"),
    ("30-10 * * * *", "30-10", "30-59,0-10"),
    ("0 9 * DEC-FEB *", "DEC-FEB", "12,1-2"),
    ("0 9 * * 7-2", "7-2", "0-2"),                  # 7 is Sunday, 0
])
def test_a_reversed_cron_range_is_refused_saying_what_to_write(expression, reversed_range, instead):
    """Defect 11: a range that wraps (23-3) was accepted and fired at times it does not read as.
    Refused as Vixie cron and cronie refuse it, naming the range and what to write instead."""
    with pytest.raises(outpost.ValidationFailed) as caught:
        normalize(timing=cron(expression))
    error = caught.value.errors[0]
    assert error["field"] == "timing.expression"
    assert f"{reversed_range} is reversed" in error["message"] and f"write {instead} instead" in error["message"]


@pytest.mark.parametrize("expression", ["0 9 * * 1-5", "0 22-23,0-2 * * *", "0 9 * * 5-7", "0 0 1-1 * *",
                                        "*/15 9-17 * * mon-fri", "0 0 * jan-dec sun-sat"])
def test_ranges_in_order_are_accepted(expression):
    assert normalize(timing=cron(expression))["timing"]["expression"] == expression


@pytest.mark.parametrize(("overrides", "path", "value"), [
    pytest.param({"name": "x" * 100}, ("name",), "x" * 100, id="name-100"),
    pytest.param({"brief": "x" * 32768}, ("brief",), "x" * 32768, id="brief-32768"),
    pytest.param({"workdir": "sub/dir"}, ("workdir",), "sub/dir", id="workdir-nested"),
    pytest.param({"timing": {"kind": "interval", "seconds": 10, "timezone": "UTC"}}, ("timing", "seconds"), 10,
                 id="interval-10"),
    pytest.param({"timing": {"kind": "interval", "seconds": 31622400, "timezone": "UTC"}}, ("timing", "seconds"),
                 31622400, id="interval-31622400"),
    pytest.param({"timing": cron("@daily")}, ("timing", "expression"), "@daily", id="alias-daily"),
    pytest.param({"timing": cron("@hourly")}, ("timing", "expression"), "@hourly", id="alias-hourly"),
    pytest.param({"timing": cron(" 0  9 * *   1-5 ")}, ("timing", "expression"), "0 9 * * 1-5", id="cron-spaces"),
    pytest.param({"limits": {"timeout_seconds": 1}}, ("limits", "timeout_seconds"), 1, id="timeout-1"),
    pytest.param({"limits": {"timeout_seconds": 86400}}, ("limits", "timeout_seconds"), 86400, id="timeout-86400"),
    pytest.param({"limits": {"model": "opus"}}, ("limits", "model"), "opus", id="model"),
    pytest.param({"catch_up": {"policy": "enqueue_missed_with_cap", "max": 25}}, ("catch_up", "max"), 25,
                 id="max-25"),
    pytest.param({"catch_up": {"policy": "skip_missed"}}, ("catch_up",), {"policy": "skip_missed"},
                 id="skip_missed"),
    pytest.param({"notify": "failures_only"}, ("notify",), "failures_only", id="notify-failures_only"),
    pytest.param({"concurrency_policy": "always_enqueue"}, ("concurrency_policy",), "always_enqueue",
                 id="always_enqueue"),
])
def test_valid_boundaries_are_accepted(overrides, path, value):
    result = normalize(**overrides)
    for key in path:
        result = result[key]
    assert result == value


def test_defaults_are_filled_in():
    raw = {"name": "nightly", "brief": "do it", "repository": REPO, "agent": "demo",
           "timing": cron("0 9 * * *", BERLIN)}
    assert outpost.normalize_definition(raw, T0, agents=["demo"]) == {
        "name": "nightly", "brief": "do it", "repository": REPO, "workdir": ".", "source_ref": "HEAD",
        "agent": "demo", "timing": cron("0 9 * * *", BERLIN),
        "limits": {"timeout_seconds": 3600, "model": None}, "notify": "attention",
        "concurrency_policy": "skip_if_active", "catch_up": {"policy": "enqueue_missed_with_cap", "max": 1}}


def test_agent_must_be_a_configured_profile():
    assert normalize(agents=("demo", "claude"), agent="claude")["agent"] == "claude"
    with pytest.raises(outpost.ValidationFailed):
        normalize(agents=("demo",), agent="claude")


@pytest.mark.parametrize(("at", "timezone", "instant"), [
    ("2026-12-01T09:00:00", BERLIN, "2026-12-01T08:00:00"),           # CET, UTC+1
    ("2027-07-01T09:00:00", BERLIN, "2027-07-01T07:00:00"),           # CEST, UTC+2
    ("2026-12-01T09:00:00", NEW_YORK, "2026-12-01T14:00:00"),
    ("2026-12-01T09:00:00Z", BERLIN, "2026-12-01T09:00:00"),          # an offset wins over the zone
    ("2026-12-01T09:00:00+05:30", BERLIN, "2026-12-01T03:30:00"),
    ("2027-03-28T02:30:00", BERLIN, "2027-03-28T01:00:00"),           # in the gap: first instant after it
])
def test_once_without_offset_is_wall_time_in_its_timezone(at, timezone, instant):
    timing = normalize(timing={"kind": "once", "at": at, "timezone": timezone})["timing"]
    assert outpost.next_fires(timing, T0, 1) == [utc(instant)]


###############################################################################
# confirmation_of
###############################################################################

def test_confirmation_is_sha256_of_the_canonical_json():
    d = normalize(name="Größe ✓", brief="Datum: {{date}}")
    canonical = json.dumps(d, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    assert outpost.confirmation_of(d) == "sha256:" + hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def test_confirmation_does_not_depend_on_key_order():
    d = normalize()
    assert outpost.confirmation_of(dict(reversed(list(d.items())))) == outpost.confirmation_of(d)


@pytest.mark.parametrize(("key", "value"), [
    ("name", "nightly-2"), ("brief", "@print bye"), ("repository", "/srv/other"), ("workdir", "sub"),
    ("source_ref", "main"), ("agent", "claude"), ("timing", cron("*/10 * * * *")),
    ("timing", cron("*/5 * * * *", BERLIN)), ("limits", {"timeout_seconds": 60, "model": None}),
    ("limits", {"timeout_seconds": 3600, "model": "opus"}), ("notify", "always"),
    ("concurrency_policy", "always_enqueue"), ("catch_up", {"policy": "skip_missed"}),
    ("catch_up", {"policy": "enqueue_missed_with_cap", "max": 2}),
])
def test_confirmation_changes_when_any_field_changes(key, value):
    d = normalize(agents=("demo", "claude"))
    assert outpost.confirmation_of({**d, key: value}) != outpost.confirmation_of(d)


###############################################################################
# Run outcome (docs/agent-clis.md), attention (5.6), failure streak (5.3)
###############################################################################

@pytest.mark.parametrize(("exit_code", "result", "stderr", "timed_out", "status", "error_has"), [
    pytest.param(0, None, "", False, RunStatus.SUCCEEDED, None, id="exit-0"),
    pytest.param(0, {"status": "succeeded", "summary": "ok"}, "noise", False, RunStatus.SUCCEEDED, None,
                 id="exit-0-succeeded-json"),
    pytest.param(0, {"is_error": False}, "", False, RunStatus.SUCCEEDED, None, id="is_error-false"),
    pytest.param(0, {"is_error": True, "error": "the tests failed"}, "", False, RunStatus.FAILED, "the tests failed",
                 id="is_error-true"),
    pytest.param(0, {"status": "failed"}, "", False, RunStatus.FAILED, "", id="status-failed"),
    pytest.param(0, {"type": "turn.failed"}, "", False, RunStatus.FAILED, "", id="type-turn.failed"),
    pytest.param(0, {"type": "error", "error": {"message": "boom"}}, "", False, RunStatus.FAILED, "boom",
                 id="type-error"),
    pytest.param(0, {"status": "needs_you", "question": "which branch?"}, "", False, RunStatus.NEEDS_YOU, None,
                 id="needs_you"),
    pytest.param(1, None, "Traceback\nValueError: bad input\n", False, RunStatus.FAILED,
                 "ValueError: bad input", id="exit-1-stderr-tail"),
    pytest.param(2, {"status": "succeeded"}, "", False, RunStatus.FAILED, "2", id="exit-2-json-says-success"),
    pytest.param(1, {"status": "needs_you"}, "died", False, RunStatus.FAILED, "died", id="exit-1-needs_you"),
    pytest.param(-9, None, "", False, RunStatus.FAILED, "ended by SIGKILL", id="killed"),
    pytest.param(None, None, "still working", True, RunStatus.FAILED, "timeout", id="timeout"),
    pytest.param(0, None, "", True, RunStatus.FAILED, "timeout", id="timeout-wins-over-exit-0"),
])
def test_run_outcome(exit_code, result, stderr, timed_out, status, error_has):
    lines = ["some text", json.dumps(result)] if result is not None else ["some text"]
    outcome = outpost.run_outcome(outpost.read_generic(lines), exit_code, stderr, timed_out=timed_out, now=T0)
    assert outcome.status == status
    if error_has is None:
        assert outcome.error is None
    else:
        assert outcome.error and error_has in outcome.error


@pytest.mark.parametrize(("exit_code", "timed_out"), [(0, False), (-15, False), (None, True), (1, True)])
def test_a_cancel_while_it_ran_wins_over_whatever_its_process_said(exit_code, timed_out):
    reading = outpost.read_generic([json.dumps({"status": "succeeded"})])
    outcome = outpost.run_outcome(reading, exit_code, "", timed_out=timed_out, cancelled=True, now=T0)
    assert (outcome.status, outcome.error, outcome.failure_kind) == (RunStatus.CANCELLED, "cancelled", None)
    assert outcome.reading is reading


def test_a_run_timeout_is_its_own_limit_capped_by_its_profile():
    capped = outpost.AgentProfile("capped", ("agent",), timeout_seconds=600)
    assert outpost.run_timeout_s(3600, capped) == 600
    assert outpost.run_timeout_s(300, capped) == 300
    assert outpost.run_timeout_s(3600, outpost.AgentProfile("free", ("agent",))) == 3600
    assert outpost.run_timeout_s(3600, None) == 3600


def test_failed_run_error_keeps_the_end_of_a_long_stderr():
    stderr = "x" * 10_000 + "\nthe real reason"
    error = outpost.run_outcome(outpost.read_generic([]), 1, stderr, now=T0).error
    assert error.endswith("the real reason")
    assert len(error) <= outpost.ERROR_TAIL_BYTES


@pytest.mark.parametrize(("lines", "expected"), [
    ([], None),
    (["plain text", "more text"], None),
    (['{"a": 1}', '{"b": 2}', "done"], {"b": 2}),
    (['{"a": 1}', "{not json", "  {\"c\": 3}  "], {"c": 3}),
    (['{"a": 1}', "[1, 2]", '"text"'], {"a": 1}),
    (['{"a": 1}', '{"b": 2} trailing'], {"a": 1}),
    (['{"status": "succeeded", "nested": {"x": [1, 2]}}'], {"status": "succeeded", "nested": {"x": [1, 2]}}),
])
def test_last_json_object(lines, expected):
    assert outpost.last_json_object(lines) == expected


@pytest.mark.parametrize(("notify", "status", "commits", "kinds"), [
    ("attention", RunStatus.SUCCEEDED, 0, []),
    ("attention", RunStatus.SUCCEEDED, 2, ["changes_returned"]),
    ("attention", RunStatus.FAILED, 0, ["failed"]),
    ("attention", RunStatus.NEEDS_YOU, 0, ["needs_you"]),
    ("attention", RunStatus.CANCELLED, 0, []),
    ("failures_only", RunStatus.SUCCEEDED, 0, []),
    ("failures_only", RunStatus.SUCCEEDED, 2, []),
    ("failures_only", RunStatus.FAILED, 1, ["failed"]),
    ("failures_only", RunStatus.NEEDS_YOU, 0, ["needs_you"]),
    ("always", RunStatus.SUCCEEDED, 0, ["succeeded"]),
    ("always", RunStatus.SUCCEEDED, 1, ["changes_returned"]),
    ("always", RunStatus.FAILED, 0, ["failed"]),
    ("always", RunStatus.NEEDS_YOU, 0, ["needs_you"]),
])
def test_attention_kinds_per_notify_policy(notify, status, commits, kinds):
    assert outpost.attention_kinds(notify, status, commits) == kinds


@pytest.mark.parametrize(("streak", "status", "expected"), [
    (0, RunStatus.FAILED, 1), (2, RunStatus.FAILED, 3), (2, RunStatus.SUCCEEDED, 0), (0, RunStatus.SUCCEEDED, 0),
    (2, RunStatus.NEEDS_YOU, 2), (2, RunStatus.CANCELLED, 2),
])
def test_next_failure_streak(streak, status, expected):
    kind = "agent" if status == RunStatus.FAILED else None
    assert outpost.next_failure_streak(streak, status, kind) == expected


@pytest.mark.parametrize("kind", ["interrupted", "limit", "auth"])
def test_failures_that_are_not_the_agents_own_do_not_feed_the_failure_streak(kind):
    """docs/schedules.md: a restart during a run, a limit or a login wall is not the agent's failure."""
    assert outpost.next_failure_streak(2, RunStatus.FAILED, kind) == 2
    assert outpost.next_failure_streak(2, RunStatus.FAILED, "no_result") == 3


def test_a_node_that_could_not_fetch_the_repository_url_does_not_feed_the_failure_streak():
    """docs/fleet.md: the fetch failed, the agent never ran."""
    fetch = "repository unavailable: cannot fetch https://git.example/o/r.git: fatal: unable to access"
    assert outpost.next_failure_streak(2, RunStatus.FAILED, "launch", fetch) == 2
    assert outpost.next_failure_streak(2, RunStatus.FAILED, "launch", "repository unavailable: /srv/r is gone") == 3


###############################################################################
# Launching an agent: command, environment, prompt
###############################################################################

@pytest.mark.parametrize(("template", "model", "argv"), [
    (["agent", "--model", "{model}", "--tag", "{run_id}"], "opus", ["agent", "--model", "opus", "--tag", "out_1"]),
    (["agent", "--model={model}", "{model}"], None, ["agent", "--model="]),   # a bare empty placeholder goes
    (["aider", "--message-file", "{prompt_file}"], None, ["aider", "--message-file", "/p/prompt.md"]),
    (["agent", "{session_id}"], None, ["agent"]),
    (["agent"], "opus", ["agent"]),
])
def test_fill_command(template, model, argv):
    assert outpost.fill_command(template, model=model, run_id="out_1", prompt_file="/p/prompt.md") == argv


PARENT_ENV = {"PATH": "/usr/bin", "HOME": "/home/u", "LANG": "C.UTF-8", "AWS_SECRET_ACCESS_KEY": "s3cr3t",
              "OUTPOST_API_TOKEN": "tok", "NOTIFY_SOCKET": "/run/systemd/notify", "WATCHDOG_USEC": "30000000",
              "WATCHDOG_PID": "1", "WATCHDOG_EXTRA": "1", "ANTHROPIC_API_KEY": "sk-ant"}


@pytest.mark.parametrize(("pass_env", "env", "expected"), [
    pytest.param(outpost.DEFAULT_PASS_ENV, (),
                 {"PATH": "/usr/bin", "HOME": "/home/u", "LANG": "C.UTF-8"}, id="default-allowlist"),
    pytest.param(("PATH", "ANTHROPIC_API_KEY"), (("MODE", "ci"),),
                 {"PATH": "/usr/bin", "ANTHROPIC_API_KEY": "sk-ant", "MODE": "ci"}, id="profile-pass-env-and-env"),
    pytest.param(("PATH", "OUTPOST_API_TOKEN", "NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "WATCHDOG_EXTRA"),
                 (("OUTPOST_API_TOKEN", "x"), ("WATCHDOG_FOO", "y"), ("NOTIFY_SOCKET", "z")),
                 {"PATH": "/usr/bin"}, id="secrets-never-even-when-named"),
    pytest.param((), (("OUTPOST_RUN_ID", "forged"),), {}, id="run-id-not-forgeable"),
])
def test_agent_env_holds_only_the_allowlist_the_profile_env_and_the_run_id(pass_env, env, expected):
    profile = outpost.AgentProfile("p", ("agent",), env=env, pass_env=pass_env)
    assert outpost.agent_env(profile, PARENT_ENV, "out_1") == {**expected, "OUTPOST_RUN_ID": "out_1"}


@pytest.mark.parametrize(("brief", "due", "timezone", "expected"), [
    ("Date: {{date}}", "2026-11-30T23:30:00", BERLIN, "Date: 2026-12-01"),            # already tomorrow there
    ("Date: {{date}}", "2026-11-30T23:30:00", NEW_YORK, "Date: 2026-11-30"),
    ("At {{datetime}}", "2026-11-30T23:30:00", BERLIN, "At 2026-12-01T00:30:00+01:00"),
    ("At {{ datetime }}", "2027-07-01T06:00:00", BERLIN, "At 2027-07-01T08:00:00+02:00"),
    ("Keep {{unknown}} and {single}", "2026-11-30T08:00:00", "UTC", "Keep {{unknown}} and {single}"),
])
def test_render_brief_resolves_dates_in_the_schedule_timezone(brief, due, timezone, expected):
    assert outpost.render_brief(brief, utc(due), ZoneInfo(timezone)) == expected


def test_render_brief_declared_variables():
    assert outpost.render_brief("Fix {{issue}} by {{date}}", T0, ZoneInfo("UTC"), {"issue": "#42"}) == \
        "Fix #42 by 2026-11-30"


###############################################################################
# Names, If-Match, Host
###############################################################################

@pytest.mark.parametrize(("name", "expected"), [
    ("nightly-deps", "nightly-deps"), ("Nightly Deps!", "nightly-deps"), ("  a__b  ", "a-b"), ("x" * 80, "x" * 60),
])
def test_slug_of_a_plain_name(name, expected):
    assert outpost.slug(name) == expected


@pytest.mark.parametrize("name", ["Größe", "日本語", "", "   ", "../../etc/passwd", "-x-", "a..b", "@{-1}", "x.lock",
                                  "refs/heads/main", "a" * 59 + "-b"])
def test_slug_is_always_one_safe_branch_name_component(name):
    s = outpost.slug(name)
    assert re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", s), s
    assert len(s) <= 60


@pytest.mark.parametrize(("name", "branch"), [
    ("Nightly Deps", "outpost/nightly-deps/out_01ABC"),
    (None, "outpost/dispatch/out_01ABC"),
])
def test_result_branch(name, branch):
    assert outpost.result_branch(name, "out_01ABC") == branch


@pytest.mark.parametrize(("header", "revision"), [('"3"', 3), ("3", 3), (' "12" ', 12), ('W/"4"', 4)])
def test_if_match_names_one_revision(header, revision):
    assert outpost.parse_if_match(header) == revision


@pytest.mark.parametrize("header", [None, "", "   ", "*", '"*"'])
def test_if_match_missing_or_wildcard_is_precondition_required(header):
    with pytest.raises(outpost.PreconditionRequired) as caught:
        outpost.parse_if_match(header)
    assert caught.value.problem()["status"] == 428
    assert caught.value.problem()["code"] == "precondition_required"


@pytest.mark.parametrize("header", ['"abc"', "three", '"3.5"'])
def test_if_match_that_names_no_revision_is_refused(header):
    with pytest.raises(outpost.OutpostError):
        outpost.parse_if_match(header)


@pytest.mark.parametrize(("host", "allowed", "ok"), [
    ("127.0.0.1", (), True), ("127.0.0.1:8321", (), True), ("localhost", (), True), ("localhost:8321", (), True),
    ("LocalHost:8321", (), True), ("[::1]", (), True), ("[::1]:8321", (), True),
    ("evil.com", (), False), ("evil.com:8321", (), False), ("localhost.evil.com", (), False),
    ("127.0.0.1.nip.io", (), False), ("", (), False), ("127.0.0.2", (), False),
    ("outpost.lan", ("outpost.lan",), True), ("outpost.lan:8321", ("outpost.lan",), True),
    ("OUTPOST.LAN", ("outpost.lan",), True), ("evil.com", ("outpost.lan",), False),
])
def test_host_allowed(host, allowed, ok):
    assert outpost.host_allowed(host, allowed) is ok


@pytest.mark.parametrize(("text", "lines", "shown"), [
    ("\x1b]0;pwned\x07\x1b[2Jdone", True, "\\x1b]0;pwned\\x07\\x1b[2Jdone"),
    ("plain, tabbed\there\r\nnext line é ✓\n", True, "plain, tabbed\there\r\nnext line é ✓\n"),
    ("over\rwritten \x9b31m \x7f \x00", True, "over\\x0dwritten \\x9b31m \\x7f \\x00"),
    ("two\nlines\r\n", False, "two\\x0alines\\x0d\\x0a"),
])
def test_what_an_agent_prints_is_shown_not_obeyed(text, lines, shown):
    assert outpost.visible(text, lines=lines) == shown


@pytest.mark.parametrize("value", ['"1', '1"', '"1\t\t\t', 'W/"1', '"1", "2"', '""', "*"])
def test_an_if_match_that_names_no_one_revision_is_refused_whatever_the_revision_is(value):
    """docs/http-api.md: If-Match is "N" (or W/"N", or N); a quote left open names nothing, so it
    can never match the schedule's revision by chance."""
    with pytest.raises(outpost.PreconditionRequired):
        outpost.parse_if_match(value)
