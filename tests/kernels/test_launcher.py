"""kernels/launcher.py on the CPU: how in-kernel timestamps become per-stage times, and the weight
layout the kernel takes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from megaserve.kernels.launcher import FINAL_STAGE, STAGES_PER_LAYER, StageTimes, check_weights, store_transposed
from megaserve.kernels.shape import KernelShape

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
    assert times.total == pytest.approx(2 * len(STAGES_PER_LAYER) * 0.010 + 0.005)


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


def test_late_repeat_tells_the_same_slow_ctas_from_a_random_tail():
    """20 CTAs, so the latest tenth is 2: the same two late at every layer repeat fully; late CTAs
    that move on every layer never do; one of two kept, half."""
    layers, grid = 3, 20
    stamps = [STEP_START + 10 * MS * b for b in range(layers * len(STAGES_PER_LAYER) + 1)]
    stamps.append(stamps[-1] + 5 * MS)
    late_by_kind = {
        "qkv": lambda layer: (18, 19),  # always the same two
        "attention": lambda layer: (2 * layer, 2 * layer + 1),  # other CTAs every layer
        "o_proj": lambda layer: (0, 5 + layer),  # CTA 0 every layer, the other one moves
        "mlp": lambda layer: (0, 5 + layer),
    }
    arrivals = []
    for barrier in range(layers * len(STAGES_PER_LAYER)):
        kind, layer = STAGES_PER_LAYER[barrier % len(STAGES_PER_LAYER)], barrier // len(STAGES_PER_LAYER)
        late = late_by_kind[kind](layer)
        arrivals.append([stamps[barrier] + (9 if cta in late else 5) * MS + cta for cta in range(grid)])
    repeat = StageTimes.from_stamps(stamps, arrivals).late_repeat
    assert repeat == pytest.approx({"qkv": 1.0, "attention": 0.0, "o_proj": 0.5, "mlp": 0.5})


def test_one_layer_has_no_late_repeat():
    barriers = len(STAGES_PER_LAYER)
    stamps = [STEP_START + 10 * MS * b for b in range(barriers + 2)]
    arrivals = [[stamps[b] + MS * (1 + cta) for cta in range(4)] for b in range(barriers)]
    assert StageTimes.from_stamps(stamps, arrivals).late_repeat == {}


SHAPE = KernelShape(hidden=256, heads=4, kv_heads=1, head_dim=64, intermediate=512, vocab=512, layers=2, qk_norm=False)


def decode_model(shape: KernelShape) -> SimpleNamespace:
    """A model as the launcher sees it (DecodeModel): bf16 weights in the checkpoint's layout."""

    def weight(*dims: int) -> torch.Tensor:
        return torch.randn(*dims).to(torch.bfloat16)

    h, i = shape.hidden, shape.intermediate
    layers = [
        SimpleNamespace(
            attn_norm=weight(h), wq=weight(shape.q_dim, h), wk=weight(shape.kv_dim, h), wv=weight(shape.kv_dim, h),
            q_norm=None, k_norm=None, wo=weight(h, shape.q_dim), mlp_norm=weight(h), w_gate=weight(i, h),
            w_up=weight(i, h), w_down=weight(h, i),
        )
        for _ in range(shape.layers)
    ]
    return SimpleNamespace(
        embed=weight(shape.vocab, h), final_norm=weight(h), lm_head=weight(shape.vocab, h), layers=layers,
        rope_inv_freq=torch.ones(shape.head_dim // 2),
    )


@pytest.mark.parametrize("name", ["wo", "w_down"])
def test_wo_and_down_are_stored_transposed_in_place_with_the_same_values(name):
    model = decode_model(SHAPE)
    row_major = [getattr(layer, name).clone() for layer in model.layers]
    store_transposed(model)
    for layer, before in zip(model.layers, row_major, strict=True):
        weight = getattr(layer, name)
        assert weight.shape == before.shape and torch.equal(weight, before)
        assert weight.t().is_contiguous() and not weight.is_contiguous()
        # what PyTorch code does with it is unchanged
        x = torch.randn(3, before.shape[1]).to(torch.bfloat16)
        assert torch.equal(F.linear(x, weight), F.linear(x, before))
    stored = [getattr(layer, name).data_ptr() for layer in model.layers]
    store_transposed(model)  # already in the kernel's layout: left as it is
    assert [getattr(layer, name).data_ptr() for layer in model.layers] == stored


@pytest.mark.parametrize("name", ["wo", "w_down"])
def test_the_launcher_refuses_wo_and_down_in_the_checkpoint_layout(name):
    model = decode_model(SHAPE)
    store_transposed(model)
    check_weights(model, SHAPE)  # the kernel's layout is accepted
    layer = model.layers[1]
    setattr(layer, name, getattr(layer, name).contiguous())
    with pytest.raises(ValueError, match=rf"layers\[1\]\.{name} must be stored transposed .* store_transposed"):
        check_weights(model, SHAPE)
    store_transposed(model)
    layer.wq = layer.wq.t().contiguous().t()
    with pytest.raises(ValueError, match=r"layers\[1\]\.wq must be contiguous"):
        check_weights(model, SHAPE)
