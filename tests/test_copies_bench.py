"""The copy benchmarks: copies.py's pure parts, how rounds are summarised (the host's load drifts
between rounds, up to 55% on a lent H100 host, so each round's copy is set against the raw TCP
yardstick measured just before it in that round, not one from another round); lanes_loopback.py
run small."""

from __future__ import annotations

import pytest

from benchmarks.copies import Round, median_of_found, median_tables, paired_ratios


def _round(h2d: float, d2h: float, sender: float, receiver: float, other_config_sender: float) -> Round:
    return Round(
        results={"rgpu-lanes": {"h2d_pinned_256MiB_GBps": h2d, "d2h_pinned_256MiB_GBps": d2h}},
        one_side_before={"rgpu-lanes": {256: {"sender": sender, "receiver": receiver, "both": 1.0}},
                         "rgpu-lanes-landing": {256: {"sender": other_config_sender, "receiver": 99.0, "both": 1.0}}})


def test_each_round_is_set_against_its_own_configs_yardstick_by_the_copys_direction() -> None:
    rounds = [_round(h2d=12.0, d2h=9.0, sender=15.0, receiver=10.0, other_config_sender=30.0),
              _round(h2d=6.0, d2h=14.0, sender=8.0, receiver=14.0, other_config_sender=1.0)]

    assert paired_ratios(rounds, "rgpu-lanes", "h2d_pinned_256MiB_GBps") == [12.0 / 15.0, 6.0 / 8.0]
    assert paired_ratios(rounds, "rgpu-lanes", "d2h_pinned_256MiB_GBps") == [9.0 / 10.0, 14.0 / 14.0]


def test_medians_are_taken_key_by_key_over_the_rounds() -> None:
    tables = [{"a": 1.0, "b": 10.0}, {"a": 3.0, "b": 30.0}, {"a": 2.0, "b": 20.0}]

    assert median_tables(tables) == {"a": 2.0, "b": 20.0}


def test_a_round_without_ucxs_own_figure_leaves_the_others_median() -> None:
    assert median_of_found([4.0, None, 6.0]) == 5.0
    assert median_of_found([None, None]) is None


@pytest.mark.integration   # builds raw TCP's program and rgpu's worker library, opens loopback sockets
def test_the_lanes_alone_benchmark_moves_a_copy_and_prints_it_beside_raw_tcp(capsys) -> None:  # type: ignore[no-untyped-def]
    from benchmarks.lanes_loopback import main

    assert main(["--lanes", "2", "--mib", "4", "--reps", "1", "--chunk-bytes", str(1 << 20)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("lanes.c alone vs raw loopback TCP, 4 MiB") and lines[1].startswith(" 2 lanes: lanes.c ")
