"""The online bound (kvtier.replay.bound) on hand-made traces with hand-derived values."""

from __future__ import annotations

import json

import pytest

from kvtier.cli import main
from kvtier.errors import ConfigError
from kvtier.replay.bound import online_bound, parse_features
from kvtier.replay.trace import Request, Trace

C = 512


def trace(rows: list[list[str]]) -> Trace:
    reqs = tuple(Request(float(i), tuple(r), len(r) * C + 1, len(r) * C) for i, r in enumerate(rows))
    return Trace("hand", reqs, len({h for r in rows for h in r}), sum(map(len, rows)),
                 sum(len(r) * C for r in rows))


# accesses: a@0 (next use in 2 requests), b@1 (3), a@2, c@3, b@4 (none: they may be held
# for the 2, 1, 0 requests left); one chunk of cache = 1 x (5 - 1) chunk-intervals
HAND = trace([["a"], ["b"], ["a"], ["c"], ["b"]])


def test_no_features_is_one_time_to_live_for_all() -> None:
    # tau = 2: 1 hit for 2+2+2+1+0 = 7 intervals; tau = 3: 2 hits for 2+3+2+1+0 = 8.
    # Budget 4: min over lambda of max(0, 1 - 7l, 2 - 8l) + 4l = 1 (l = 1/4): 1 of 5 accesses
    b = online_bound(HAND, 1, (), C)
    assert b.classes == 1
    assert b.in_sample == pytest.approx(20.0)


def test_sightings_separate_first_sightings_from_the_rest() -> None:
    # first sightings a@0, b@1, c@3: tau = 3 gives 2 hits for 2 + 3 + 1 = 6 intervals; the seen
    # class (a@2, b@4) never comes back. Budget 4: 2 - 6l + 4l is least at l = 1/3: 4/3 hits
    b = online_bound(HAND, 1, ("sightings",), C)
    assert b.classes == 2
    assert b.in_sample == pytest.approx(100 * (4 / 3) / 5)


def test_room_for_every_reuse_gives_every_reuse() -> None:
    # a, a, a: two reuses one request apart; one chunk of cache holds it throughout
    b = online_bound(trace([["a"], ["a"], ["a"]]), 1, (), C)
    assert b.in_sample == pytest.approx(100 * 2 / 3)
    # cross-fitted: the even requests (a@0 gap 1, a@2 none) afford tau = 1 (1 interval of their
    # 4/3), which hits a@1; the odd one (a@1, 1 interval of 2/3) affords nothing: (100 + 0) / 2
    assert b.cross_fitted == pytest.approx(50.0)


def test_more_capacity_never_lowers_the_bound_and_features_never_lower_it() -> None:
    rows = [["s", f"u{i}", f"v{i}"] if i % 3 else ["s", f"u{i - 1}", f"w{i}"] for i in range(1, 60)]
    t = trace(rows)
    by_cap = [online_bound(t, cap, (), C).in_sample for cap in (1, 4, 16, 64)]
    assert by_cap == sorted(by_cap)
    coarse = online_bound(t, 4, ("sightings",), C).in_sample
    fine = online_bound(t, 4, ("sightings", "position", "length"), C).in_sample
    assert online_bound(t, 4, (), C).in_sample <= coarse + 1e-9 <= fine + 2e-9


def test_feature_names_are_checked() -> None:
    assert parse_features("none") == ()
    assert parse_features("sightings, position") == ("sightings", "position")
    with pytest.raises(ConfigError, match="unknown colour; use 'none' or a comma list of: sightings"):
        parse_features("sightings,colour")


def test_replay_prints_and_returns_the_bound(tmp_path, capsys) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps({"timestamp": i, "input_length": 600, "hash_ids": [h]})
                              for i, h in enumerate([1, 2, 1, 3, 2])))
    # llama-3-8b: one group, 3 unique chunks, cpu=34% of them = 1 chunk: HAND's figures
    rc = main(["replay", str(path), "--geometry", "llama-3-8b", "--tier", "cpu=34%",
               "--online-bound", "none", "--online-bound", "sightings", "--json"])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    got = {tuple(b["features"]): (b["capacity_chunks"], b["in_sample_pct"]) for b in doc["online_bounds"]}
    assert got == {("none",): (1, 20.0), ("sightings",): (1, 26.67)}
    assert main(["replay", str(path), "--geometry", "llama-3-8b", "--online-bound", "age"]) == 2
    assert "online-bound features 'age': unknown age" in capsys.readouterr().err
