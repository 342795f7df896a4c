"""Device-side sampling: greedy, temperature, top-k, top-p, seeded reproducibility."""

from __future__ import annotations

import pytest
import torch

from megaserve.replicas.protocol import EngineError, SamplingParams
from megaserve.replicas.sampling import (
    TOP_K_GROUPS,
    SamplingRows,
    SamplingTable,
    _top_k,
    hash32,
    sample,
    seeded_uniform,
    token_logprobs,
)

VOCAB = 50
DRAWS = 20_000  # rows drawn at once for distribution checks
FREQUENCY_TOLERANCE = 0.015  # ~4 standard deviations of a frequency near 0.25 over DRAWS draws


def _logits(batch: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def _draw(logits: torch.Tensor, params: list[SamplingParams], positions: list[int], generator=None):
    rows = SamplingRows.build(params, VOCAB, "cpu")
    return sample(logits, rows, torch.tensor(positions), generator)


def test_greedy_rows_take_the_argmax():
    logits = _logits(4)
    tokens = _draw(logits, [SamplingParams(temperature=0)] * 4, [0] * 4)
    assert torch.equal(tokens, logits.argmax(-1))


def test_greedy_rows_of_a_batch_that_also_samples_take_the_argmax():
    # all_greedy is False here, so the greedy rows go through the sampling path and must be masked back
    # to the argmax; the sampled rows (one seeded, one not) leave it in some draws, so the batch does sample.
    repeats = 500
    base = _logits(4, seed=5) / 3  # spread enough that T=1.5 leaves the argmax often
    assert (base.argmax(-1) != 0).all()  # so an all -inf or all-equal row (token 0) cannot pass
    logits = base.repeat(repeats, 1)
    params = [
        p for i in range(repeats) for p in (
            SamplingParams(temperature=0), SamplingParams(temperature=1.5, seed=i),
            SamplingParams(temperature=0), SamplingParams(temperature=1.5),
        )
    ]
    rows = SamplingRows.build(params, VOCAB, "cpu")
    assert not rows.all_greedy and rows.any_seeded and rows.any_unseeded
    tokens = sample(logits, rows, torch.arange(4 * repeats), torch.Generator().manual_seed(4)).view(repeats, 4)
    argmax = base.argmax(-1).expand(repeats, 4)
    assert torch.equal(tokens[:, [0, 2]], argmax[:, [0, 2]])
    for sampled in (1, 3):
        assert (tokens[:, sampled] != argmax[:, sampled]).sum() > repeats // 10, sampled


def test_a_temperature_too_small_to_divide_by_is_greedy():
    """1e-300 is 0 in float32 and 1e-30 makes every logit infinite: both must be the argmax, as in vLLM."""
    logits = _logits(6)
    params = [SamplingParams(temperature=t, seed=s) for s, t in enumerate((1e-300, 1e-30, 1e-6) * 2)]
    assert all(p.greedy for p in params) and not SamplingParams(temperature=1e-4).greedy
    assert torch.equal(_draw(logits, params, list(range(6))), logits.argmax(-1))


def test_tiny_top_p_equals_greedy_through_the_filter():
    # temperature > 0 and a tiny top_p send the rows through the sort-and-mask path.
    logits = _logits(8)
    tiny_p = [SamplingParams(temperature=1.5, top_p=1e-6, seed=s) for s in range(8)]
    assert torch.equal(_draw(logits, tiny_p, list(range(8))), logits.argmax(-1))


def test_top_k_restricts_draws_to_the_k_most_likely():
    logits = _logits(1).expand(DRAWS, VOCAB)
    params = [SamplingParams(temperature=5.0, top_k=3, seed=i) for i in range(DRAWS)]
    tokens = _draw(logits, params, [0] * DRAWS)
    top3 = set(logits[0].topk(3).indices.tolist())
    assert set(tokens.tolist()) == top3  # all three appear at this temperature, nothing else


def test_top_k_keeps_every_token_tied_with_the_kth_largest():
    # bf16 logits tie often. As in vLLM (mask = logits < k-th largest), top_k=2 over 3, 2, 2, 2, 1 keeps the
    # three tokens tied at 2, not just the lowest id among them: softmax over 3, 2, 2, 2 is 0.475, 0.175 (x3).
    base = torch.tensor([3.0, 2.0, 2.0, 2.0, 1.0])
    logits = torch.full((DRAWS, VOCAB), -1e9)
    logits[:, :5] = base
    expected = torch.softmax(base[:4], -1)
    for top_p in (1.0, 0.9):  # alone, and with a top-p that keeps all four (mass before the last: 0.825)
        params = [SamplingParams(temperature=1.0, top_k=2, top_p=top_p, seed=i) for i in range(DRAWS)]
        frequency = torch.bincount(_draw(logits, params, [0] * DRAWS), minlength=VOCAB).float() / DRAWS
        assert frequency[4:].sum() == 0
        assert (frequency[:4] - expected).abs().max() < FREQUENCY_TOLERANCE, (top_p, frequency[:4], expected)


def test_top_p_that_rounds_to_zero_still_keeps_the_top_token():
    # The API accepts any top_p > 0; 1e-300 is 0.0 in float32, which must still keep the most likely
    # token (as vLLM does), alone or with top-k, for seeded and unseeded rows, not mask every token.
    logits = _logits(8)
    assert (logits.argmax(-1) != 0).all()  # so the argmax of an all -inf row (token 0) cannot pass
    # rows 0-3 seeded, 4-7 not; odd rows add top_k=3
    params = [SamplingParams(temperature=1.5, top_p=1e-300, top_k=3 * (i % 2), seed=i if i < 4 else None)
              for i in range(8)]
    assert SamplingRows.build(params, VOCAB, "cpu").top_p.eq(0).all()
    assert torch.equal(_draw(logits, params, list(range(8)), torch.Generator().manual_seed(3)), logits.argmax(-1))


@pytest.mark.parametrize("seeded_neighbour", [False, True], ids=["unseeded batch", "mixed batch"])
def test_an_unseeded_draw_of_exactly_zero_still_picks_a_token_the_filter_kept(monkeypatch, seeded_neighbour):
    # torch.rand draws from [0, 1): an exact 0 (2^-24 per draw on the CPU) is forced here for every
    # token. A nucleus of one token must still give that token, not token 0 of an all -inf row.
    logits = _logits(2)
    assert (logits.argmax(-1) != 0).all()
    monkeypatch.setattr(torch, "rand", lambda size, **kwargs: torch.zeros(size, device=kwargs.get("device")))
    params = [SamplingParams(temperature=1.0, top_p=1e-6), SamplingParams(temperature=1.0, top_p=1e-6,
                                                                          seed=5 if seeded_neighbour else None)]
    assert _draw(logits, params, [0, 0])[0] == logits[0].argmax()


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    # probabilities 0.5, 0.3, 0.15, 0.05: top_p=0.7 keeps the first two (0.5 < 0.7 <= 0.8).
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = torch.full((DRAWS, VOCAB), -1e9)
    logits[:, :4] = probs.log()
    params = [SamplingParams(temperature=1.0, top_p=0.7)] * DRAWS
    tokens = _draw(logits, params, [0] * DRAWS, torch.Generator().manual_seed(1))
    counts = torch.bincount(tokens, minlength=VOCAB).float() / DRAWS
    assert counts[2:].sum() == 0
    assert abs(counts[0] - 0.5 / 0.8) < FREQUENCY_TOLERANCE


def test_top_p_drops_the_token_whose_preceding_mass_is_exactly_p():
    # probabilities 0.5, 0.25, 0.125, 0.125 (exact in float32): the mass before the third token is
    # 0.75 exactly, not below top_p=0.75, so only the first two are kept.
    logits = torch.full((DRAWS, VOCAB), -1e9)
    logits[:, :4] = torch.tensor([0.5, 0.25, 0.125, 0.125]).log()
    params = [SamplingParams(temperature=1.0, top_p=0.75)] * DRAWS
    tokens = _draw(logits, params, [0] * DRAWS, torch.Generator().manual_seed(2))
    counts = torch.bincount(tokens, minlength=VOCAB)
    assert counts[2:].sum() == 0 and counts[0] > 0 and counts[1] > 0


def test_temperature_sampling_follows_softmax_for_seeded_and_unseeded_rows():
    base = torch.tensor([2.0, 1.0, 0.5, 0.0])
    logits = torch.full((DRAWS, VOCAB), -1e9)
    logits[:, :4] = base
    temperature = 1.7
    expected = torch.softmax(base / temperature, -1)
    seeded = [SamplingParams(temperature=temperature, seed=i) for i in range(DRAWS)]
    unseeded = [SamplingParams(temperature=temperature)] * DRAWS
    for params, generator in ((seeded, None), (unseeded, torch.Generator().manual_seed(2))):
        tokens = _draw(logits, params, [7] * DRAWS, generator)
        frequency = torch.bincount(tokens, minlength=VOCAB)[:4].float() / DRAWS
        assert (frequency - expected).abs().max() < FREQUENCY_TOLERANCE, (frequency, expected)


def test_seeded_rows_ignore_their_batch_neighbours():
    logits = _logits(6)
    params = [SamplingParams(temperature=1.0, seed=1234)] + [SamplingParams(temperature=1.0)] * 5
    alone = _draw(logits[:1], params[:1], [5])
    for neighbour_seed in range(5):
        generator = torch.Generator().manual_seed(neighbour_seed)
        together = _draw(logits, params, [5, 1, 2, 3, 4, 9], generator)
        assert together[0] == alone[0]
    # the same seed at another position draws other noise
    noise = seeded_uniform(torch.tensor([1234, 1234]), torch.tensor([0, 0]), torch.tensor([5, 6]), VOCAB)
    assert not torch.equal(noise[0], noise[1])


def test_seeded_noise_is_uniform_and_distinct_across_seeds():
    seeds = torch.arange(1000)
    noise = seeded_uniform(seeds, torch.zeros_like(seeds), torch.zeros_like(seeds), VOCAB)
    assert 0 < noise.min() and noise.max() < 1
    assert abs(noise.mean().item() - 0.5) < 0.01
    assert len(set(noise[:, 0].tolist())) > 990  # distinct seeds give distinct draws


def test_seeded_noise_never_reaches_one():
    # Seed 1234 at position 102 hashes vocabulary index 120,466 to the largest value: with 24 hash
    # bits that u rounded to 1.0 in float32 and made an infinite Gumbel draw.
    vocab = 128_256
    noise = seeded_uniform(torch.tensor([1234]), torch.tensor([0]), torch.tensor([102]), vocab)
    assert noise.max() < 1 and noise.min() > 0
    # ... which picked that token even where top-k had filtered it out
    logits = torch.full((1, vocab), -10.0)
    logits[0, 7] = 10.0
    rows = SamplingRows.build([SamplingParams(temperature=1.0, top_k=5, seed=1234)], vocab, "cpu")
    assert sample(logits, rows, torch.tensor([102])).item() == 7


def test_hash_stays_in_32_bits_for_extreme_inputs():
    x = torch.tensor([0, 1, 2**31, 2**32 - 1])
    h = hash32(x)
    assert (h >= 0).all() and (h < 2**32).all()
    assert len(set(h.tolist())) == 4


def test_a_seed_s_halves_are_those_of_its_64_bit_twos_complement():
    """A negative seed is its int64 bit pattern, so every signed 64-bit seed has halves of its own that fit
    the int64 tensors; the next test shows the high half changing the draws."""
    seeds = (-(2**63), -1, 2**63 - 1, 2**32 + 5)
    rows = SamplingRows.build([SamplingParams(temperature=1.0, seed=seed) for seed in seeds], VOCAB, "cpu")
    halves = list(zip(rows.seed_low.tolist(), rows.seed_high.tolist()))
    assert halves == [(0, 2**31), (2**32 - 1, 2**32 - 1), (2**32 - 1, 2**31 - 1), (5, 1)]


def test_the_high_32_bits_of_a_seed_change_its_draws():
    # Flat logits make every token equally likely: two seeds' draws over 64 positions tell their noises apart.
    positions = list(range(64))
    logits = torch.zeros(len(positions), VOCAB)

    def draws(seed: int) -> list[int]:
        return _draw(logits, [SamplingParams(temperature=1.0, seed=seed)] * len(positions), positions).tolist()

    assert draws(5) != draws(5 + 2**32)  # same low half
    # -(2**63) is 2**63 mod 2**64: low half 0 like seed 0; 2**63 - 1 has the other high bits set
    extremes = [draws(seed) for seed in (-(2**63), 2**63 - 1, 0)]
    assert len({tuple(d) for d in extremes}) == 3


def test_table_gathers_the_rows_of_admitted_slots():
    table = SamplingTable(num_slots=4, vocab_size=VOCAB, device="cpu")
    table.assign(2, SamplingParams(temperature=0.5, top_k=7, seed=3))
    rows = table.gather([2, 0], torch.tensor([2, 0]))
    assert rows.temperature.tolist() == [0.5, 1.0]
    assert rows.top_k.tolist() == [7, VOCAB]
    assert rows.greedy.tolist() == [False, True]
    assert rows.any_seeded and not rows.any_unseeded and rows.needs_filter and not rows.all_greedy
    assert table.gather([0, 1], torch.tensor([0, 1])).all_greedy


@pytest.mark.parametrize(("field", "value", "message"), [
    ("temperature", float("nan"), "temperature must be a finite number >= 0, got nan"),
    ("temperature", float("inf"), "temperature must be a finite number >= 0, got inf"),
    ("temperature", -1.0, "temperature must be a finite number >= 0, got -1.0"),
    ("top_p", float("nan"), r"top_p must be in \(0, 1\], got nan"),
    ("top_p", float("inf"), r"top_p must be in \(0, 1\], got inf"),
])
def test_a_temperature_or_top_p_that_is_not_a_finite_number_in_range_is_refused(field, value, message):
    """NaN compares false with everything, so `temperature < 0` let it through, to sample token 0 forever."""
    with pytest.raises(EngineError, match=f"^{message}$"):
        SamplingParams(**{field: value})


def test_a_seed_is_a_64_bit_integer_on_every_tier():
    """The range SGLang's sampling_seed takes (test_sglang_api.py), refused up front for every tier."""
    assert SamplingParams(seed=2**63 - 1).seed == 2**63 - 1 and SamplingParams(seed=-(2**63)).seed == -(2**63)
    for seed in (2**63, -(2**63) - 1):
        with pytest.raises(EngineError, match="seed must be in"):
            SamplingParams(seed=seed)


@pytest.mark.parametrize(("field", "value", "message"), [
    ("max_tokens", 2.5, "max_tokens must be an integer, got 2.5"),
    ("max_tokens", True, "max_tokens must be an integer, got True"),
    ("top_k", 3.0, "top_k must be an integer, got 3.0"),
    ("seed", 1.5, "seed must be an integer, got 1.5"),
    ("seed", False, "seed must be an integer, got False"),
    ("temperature", "0.7", "temperature must be a number, got '0.7'"),
    ("temperature", True, "temperature must be a number, got True"),
    ("top_p", None, "top_p must be a number, got None"),
    ("stop_token_ids", (2, 3.0), "stop token id 3.0 is not an integer"),
    ("stop_token_ids", (True,), "stop token id True is not an integer"),
    ("logprobs", 2.0, "logprobs must be an integer, got 2.0"),
    ("logprobs", -1, r"logprobs must be in \[0, 20\], got -1"),
    ("logprobs", 21, r"logprobs must be in \[0, 20\], got 21"),
])
def test_a_parameter_of_the_wrong_type_is_refused(field, value, message):
    """Not only where a range check would raise TypeError: a float seed or top_k passes its range
    check and fails later, on the engine's step thread (`seed & MASK32`). A bool is an int to Python,
    but no client means `true` as a count, an id or a seed."""
    with pytest.raises(EngineError, match=f"^{message}$"):
        SamplingParams(**{field: value})


def test_integral_temperatures_and_top_ps_are_numbers():
    assert SamplingParams(temperature=1, top_p=1) == SamplingParams(temperature=1.0, top_p=1.0)


def test_token_logprobs_are_each_asking_rows_log_softmax_and_its_most_likely_tokens():
    logits = _logits(3, seed=5).to(torch.bfloat16)  # as the megakernel's: computed in float32
    tokens = torch.tensor([4, 9, 17], dtype=torch.int32)
    out = token_logprobs(logits, tokens, [2, None, 0])
    expected = torch.log_softmax(logits.float(), dim=-1)
    assert out[1] is None  # that row's request asked for none
    assert out[0].logprob == pytest.approx(expected[0, 4].item(), abs=1e-6)
    assert out[2].logprob == pytest.approx(expected[2, 17].item(), abs=1e-6) and out[2].top == ()
    values, ids = expected[0].topk(2)
    assert [token for token, _ in out[0].top] == ids.tolist()
    assert [value for _, value in out[0].top] == pytest.approx(values.tolist(), abs=1e-6)
    assert token_logprobs(logits, tokens, [None] * 3) == [None] * 3


@pytest.mark.parametrize("vocab, k", [(TOP_K_GROUPS * 40, 20), (TOP_K_GROUPS * 40, 1), (TOP_K_GROUPS * 40 + 7, 5),
                                      (VOCAB, 3)],
                         ids=["split", "split, one", "not a multiple of the groups", "too small to split"])
def test_the_grouped_top_k_is_torch_s(vocab, k):
    values = torch.randn(3, vocab, generator=torch.Generator().manual_seed(vocab + k))
    values[1, -1] = 100.0  # the largest in the last group's last column
    values[2, : vocab - 2] = float("-inf")  # a row with fewer finite values than k
    (got_values, got_ids), (expected_values, expected_ids) = _top_k(values, k), values.topk(k, dim=-1)
    assert torch.equal(got_values, expected_values)
    # the ids name those values, each once (among tied -infs either may come first, as in torch's)
    assert torch.equal(values.gather(-1, got_ids), got_values)
    assert all(len(set(row)) == k for row in got_ids.tolist())
    finite = expected_values.isfinite()
    assert torch.equal(got_ids[finite], expected_ids[finite])
