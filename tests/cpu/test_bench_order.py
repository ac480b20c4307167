from bcg_bench.order import interleaved


def test_every_size_reps_times_in_alternating_passes():
    order = list(interleaved([16, 64, 256], 3))
    assert order == [16, 64, 256, 256, 64, 16, 16, 64, 256]
    assert {n: order.count(n) for n in (16, 64, 256)} == {16: 3, 64: 3, 256: 3}
    assert list(interleaved([16], 0)) == []
