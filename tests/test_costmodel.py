"""dtx.comm.costmodel: the α-β-γ terms of each allreduce against hand-computed values, times consistent with them,
and the traffic of the other collectives. Pure Python, no devices."""
import pytest

from dtx.comm import costmodel
from dtx.comm.algorithms import ALGORITHMS, CollectiveError
from dtx.comm.costmodel import CostTerms, Traffic


# (algorithm, n bytes, p, inner) -> the table's terms worked by hand for n = 1000.
HAND = [
    ("ring", 4, None, CostTerms(6, 2 * 3 / 4 * 1000, 3 / 4 * 1000)),  # 2(p-1), 2(p-1)/p n, (p-1)/p n
    ("psum", 4, None, CostTerms(6, 1500, 750)),  # modelled as the ring
    # p=6: q=4, k=2, r=2 folded ranks: 2k+2 rounds; 2(q-1)/q n + 2n; (q-1)/q n + n
    ("halving_doubling", 6, None, CostTerms(6, 1500 + 2000, 750 + 1000)),
    ("recursive_doubling", 6, None, CostTerms(4, 4000, 3000)),  # k + 2 rounds of n; k + 1 reductions
    ("tree", 5, None, CostTerms(6, 6000, 3000)),  # L = ceil(lg 5) = 3: 2L rounds of n, L reductions
    # 2 x 4: inner ring 2*3 rounds on n, outer ring 2*1 rounds on n/4
    ("hierarchical", 8, 4, CostTerms(8, 2 * 3 / 4 * 1000 + 2 * 1 / 2 * 250, 3 / 4 * 1000 + 1 / 2 * 250)),
]


@pytest.mark.parametrize("algorithm, p, inner, terms", HAND)
def test_cost_terms_are_the_tables_formulas(algorithm, p, inner, terms):
    got = costmodel.cost_terms(algorithm, 1000, p, inner)
    assert got == pytest.approx(terms)
    alpha, beta, gamma = 1e-6, 1e-9, 1e-10
    assert costmodel.predict_time(algorithm, 1000, p, alpha, beta, gamma, inner) == pytest.approx(
        terms.rounds * alpha + terms.path_bytes * beta + terms.reduced_bytes * gamma)


def test_traffic_of_the_other_collectives():
    assert costmodel.expected_traffic("ring", 10, 4) == Traffic(6, 18)  # 10 bytes pad to 4 chunks of 3
    assert costmodel.all_gather_traffic(10, 4) == Traffic(3, 30)
    assert costmodel.all_to_all_traffic(10, 4) == Traffic(3, 30)
    assert costmodel.neighbour_traffic(10, 2) == Traffic(2, 20)
    assert costmodel.add_traffic(Traffic(1, 2), Traffic(3, 4)) == Traffic(4, 6)
    assert costmodel.all_gather_traffic(10, 1) == costmodel.neighbour_traffic(0, 3) == Traffic(0, 0)


def test_bad_sizes_name_the_fix():
    with pytest.raises(CollectiveError, match=r"p must be a positive integer, got 0"):
        costmodel.cost_terms("ring", 8, 0)
    with pytest.raises(CollectiveError, match=r"message size must be >= 0 bytes"):
        costmodel.cost_terms("ring", -1, 4)


def test_predict_time_consistent_with_formulas():
    alpha, beta, gamma = 5e-6, 1 / 1.25e9, 1e-10
    sizes = [4 << 10 << (2 * i) for i in range(8)]  # 4 KiB .. 64 MiB
    for p in (2, 3, 6, 8, 16):
        for algorithm in ALGORITHMS:
            inner = (2 if p % 2 == 0 else p) if algorithm == "hierarchical" else None
            times = [costmodel.predict_time(algorithm, n, p, alpha, beta, gamma, inner) for n in sizes]
            assert all(a < b for a, b in zip(times, times[1:])), (algorithm, p)  # monotone in bytes
            for n in sizes:
                terms = costmodel.cost_terms(algorithm, n, p, inner)
                assert costmodel.predict_time(algorithm, n, p, 1.0, 0.0, 0.0, inner) == terms.rounds
                t = costmodel.predict_time(algorithm, n, p, alpha, beta, gamma, inner)
                assert t == pytest.approx(terms.rounds * alpha + terms.path_bytes * beta + terms.reduced_bytes * gamma)
                # Nothing beats the bandwidth bound; ring and 2D meet it (plus latency).
                assert t >= costmodel.bandwidth_lower_bound(n, p, beta)
            ring = costmodel.predict_time("ring", sizes[-1], p, 0.0, beta)
            assert ring == pytest.approx(costmodel.bandwidth_lower_bound(sizes[-1], p, beta))
    # Thakur et al.'s point: latency-bound small messages favour recursive doubling,
    # bandwidth-bound large ones favour the ring.
    small, large = 1 << 10, 64 << 20
    assert costmodel.predict_time("recursive_doubling", small, 8, alpha, beta) < costmodel.predict_time("ring", small, 8, alpha, beta)
    assert costmodel.predict_time("ring", large, 8, alpha, beta) < costmodel.predict_time("recursive_doubling", large, 8, alpha, beta)
    assert costmodel.predict_time("ring", 0, 1, alpha, beta) == 0.0
