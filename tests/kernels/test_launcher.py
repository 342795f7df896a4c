"""kernels/launcher.py on the CPU: how in-kernel timestamps become per-stage times."""

from __future__ import annotations

import pytest

from megaserve.kernels.launcher import FINAL_STAGE, STAGES_PER_LAYER, StageTimes

MS = 1_000_000  # nanoseconds
STEP_START = 1_000 * MS  # %globaltimer counts from an arbitrary origin, never zero here


def two_layer_step() -> tuple[list[int], list[list[int]]]:
    """Stamps of a 2-layer step on a 5-CTA grid: every stage takes 10 ms from CTA 0's view; one CTA
    has no work and arrives at once, the others 6, 7, 8 and 9 ms after the stage began (median 7,
    tail 2 ms, release 1 ms); the LM head takes 5 ms."""
    barriers = 2 * len(STAGES_PER_LAYER)
    stamps = [STEP_START + 10 * MS * b for b in range(barriers + 1)]
    stamps.append(stamps[-1] + 5 * MS)
    arrivals = [[stamps[b] + offset * MS for offset in (7, 0, 9, 6, 8)] for b in range(barriers)]
    return stamps, arrivals


def test_each_stage_splits_into_arrival_tail_and_barrier_release():
    times = StageTimes.from_stamps(*two_layer_step())
    for kind in STAGES_PER_LAYER:  # two layers each
        assert times.seconds[kind] == pytest.approx(0.020)
        assert times.tail[kind] == pytest.approx(0.004)  # from the median, not the idle CTA's arrival
        assert times.release[kind] == pytest.approx(0.002)
    assert times.seconds[FINAL_STAGE] == pytest.approx(0.005)
    assert FINAL_STAGE not in times.release  # the LM head ends without a barrier
    assert times.total == pytest.approx(0.105)


def test_an_unrecorded_arrival_is_an_error_not_a_time():
    stamps, arrivals = two_layer_step()
    arrivals[3][2] = 0
    with pytest.raises(ValueError, match="CTA 2 recorded no arrival at barrier 3"):
        StageTimes.from_stamps(stamps, arrivals)


def test_stamps_and_arrivals_must_describe_whole_layers():
    stamps, arrivals = two_layer_step()
    with pytest.raises(ValueError, match="whole layers"):
        StageTimes.from_stamps(stamps, arrivals[:-1])
    with pytest.raises(ValueError, match="whole layers"):
        StageTimes.from_stamps(stamps[:-1], arrivals[:-1])


def test_a_head_that_finishes_qkv_after_cta_0_starts_attention_makes_its_release_negative():
    """QKV ends at per-KV-head counts: CTA 0 starts attention once its own head's rows are written,
    so a CTA of another head may arrive later, and the release is measured from that last arrival."""
    stamps, arrivals = two_layer_step()
    qkv_barriers = range(0, len(arrivals), len(STAGES_PER_LAYER))
    for barrier in qkv_barriers:
        arrivals[barrier][4] = stamps[barrier + 1] + 3 * MS  # 3 ms after CTA 0 passed its wait
    times = StageTimes.from_stamps(stamps, arrivals)
    assert times.release["qkv"] == pytest.approx(-0.006)  # two layers, -3 ms each
    assert times.tail["qkv"] == pytest.approx(0.012)  # median 7 ms to the late arrival at 13, twice
    assert times.release["attention"] == pytest.approx(0.002)  # the grid barriers are unchanged
