"""kernels/launcher.py on the CPU: how in-kernel timestamps become per-stage times."""

from __future__ import annotations

import pytest

from megaserve.kernels.launcher import FINAL_STAGE, STAGES_PER_LAYER, StageTimes

MS = 1_000_000  # nanoseconds


def two_layer_step() -> tuple[list[int], list[list[int]]]:
    """Stamps of a 2-layer step on a 3-CTA grid: every stage takes 10 ms from CTA 0's view, its CTAs
    arrive at 6, 7 and 8 ms after it began (spread 2 ms, release 2 ms); the LM head takes 5 ms."""
    barriers = 2 * len(STAGES_PER_LAYER)
    stamps = [10 * MS * b for b in range(barriers + 1)]
    stamps.append(stamps[-1] + 5 * MS)
    arrivals = [[stamps[b] + 7 * MS, stamps[b] + 6 * MS, stamps[b] + 8 * MS] for b in range(barriers)]
    return stamps, arrivals


def test_each_stage_splits_into_arrival_spread_and_barrier_release():
    times = StageTimes.from_stamps(*two_layer_step())
    for kind in STAGES_PER_LAYER:  # two layers each
        assert times.seconds[kind] == pytest.approx(0.020)
        assert times.spread[kind] == pytest.approx(0.004)
        assert times.release[kind] == pytest.approx(0.004)
    assert times.seconds[FINAL_STAGE] == pytest.approx(0.005)
    assert FINAL_STAGE not in times.release  # the LM head ends without a barrier
    assert times.total == pytest.approx(0.105)


def test_stamps_and_arrivals_must_describe_whole_layers():
    stamps, arrivals = two_layer_step()
    with pytest.raises(ValueError, match="whole layers"):
        StageTimes.from_stamps(stamps, arrivals[:-1])
    with pytest.raises(ValueError, match="whole layers"):
        StageTimes.from_stamps(stamps[:-1], arrivals[:-1])
