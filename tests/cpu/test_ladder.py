import pytest

from bcg_plugin import BcgConfigError, choose_bucket, reference_ladder, resolve_buckets
from bcg_plugin.ladder import PREFILL_BUCKET_FLOOR, bucket_step


@pytest.mark.parametrize("top, count", [(2048, 40), (8192, 56)])
def test_reference_bucket_counts(top, count):
    assert len(reference_ladder(top)) == count


@pytest.mark.parametrize("top", [1, 15, 16, 17, 100, 512, 1000, 2048, 3000, 8192, 16384])
def test_ladder_is_strictly_increasing_and_clamped_to_top(top):
    ladder = reference_ladder(top)
    assert all(a < b for a, b in zip(ladder, ladder[1:]))
    assert ladder[-1] == top
    assert all(b <= top for b in ladder)
    assert ladder[0] == min(PREFILL_BUCKET_FLOOR, top)


@pytest.mark.parametrize("top", [2048, 8192, 3000])
def test_padding_bound_for_every_token_count(top):
    ladder = reference_ladder(top)
    for n in range(1, top + 1):
        b = choose_bucket(ladder, n)
        assert b is not None and b >= n
        if n > 128:
            assert (b - n) / n <= 0.125, (n, b)
        else:
            assert b - n < PREFILL_BUCKET_FLOOR, (n, b)


def test_step_rule():
    assert bucket_step(16) == 16
    assert bucket_step(256) == 32
    assert bucket_step(1024) == 128
    assert bucket_step(8192) == 512  # capped
    assert bucket_step(100_000) == 512


def test_choose_bucket_smallest_at_or_above_and_eager_above_top():
    ladder = [16, 32, 64]
    assert choose_bucket(ladder, 1) == 16
    assert choose_bucket(ladder, 16) == 16
    assert choose_bucket(ladder, 17) == 32
    assert choose_bucket(ladder, 64) == 64
    assert choose_bucket(ladder, 65) is None
    assert choose_bucket(ladder, 0) is None


def test_choose_bucket_is_monotone():
    ladder = reference_ladder(2048)
    chosen = [choose_bucket(ladder, n) for n in range(1, 2049)]
    assert all(a <= b for a, b in zip(chosen, chosen[1:]))


def test_explicit_sizes_sorted_and_validated():
    assert resolve_buckets(128, [64, 16, 32]) == [16, 32, 64]
    with pytest.raises(BcgConfigError, match="exceed max_tokens"):
        resolve_buckets(64, [16, 128])


@pytest.mark.parametrize("bad", [0, -5, 2.5, "16", True])
def test_ladder_rejects_bad_top(bad):
    with pytest.raises(BcgConfigError, match="max_tokens"):
        reference_ladder(bad)


def test_buckets_rounded_to_a_multiple_cover_every_step_the_ladder_covered_within_the_top():
    from bcg_plugin.ladder import buckets_multiple_of

    ladder = reference_ladder(1000)
    rounded = buckets_multiple_of(ladder, 24, 1000)
    assert all(b % 24 == 0 for b in rounded) and rounded[-1] == 984
    # a step the ladder served is served by a bucket at most one multiple larger, up to the top
    for n in range(1, 985):
        assert choose_bucket(rounded, n) - choose_bucket(ladder, n) < 24
    assert choose_bucket(rounded, 985) is None  # padded past the chunk: eager
    assert buckets_multiple_of([16, 17, 32], 16, 64) == [16, 32]
    assert buckets_multiple_of([16], 32, 31) == []


def test_sharded_buckets_leave_an_unsplit_hosts_buckets_alone():
    from bcg_plugin.ladder import sharded_buckets

    assert sharded_buckets(1000, None, 1) is None and sharded_buckets(1000, [10, 20], 1) is None
    assert sharded_buckets(100, [10, 20, 50, 100], 3) == [12, 21, 51, 99]
    assert sharded_buckets(64, None, 2) == reference_ladder(64)  # the ladder's steps are already even
    with pytest.raises(BcgConfigError, match="max_tokens=24 holds no bucket: .* multiple of 32"):
        sharded_buckets(24, None, 32)
