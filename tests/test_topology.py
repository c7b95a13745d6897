"""dtx.comm.topology: every gossip graph's mixing matrix is doubly stochastic (the workers' mean is kept), messages
are one per nonzero shift, complete and exponential graphs reach exact consensus. Pure numpy, no devices."""
import numpy as np
import pytest

from dtx.comm import topology
from dtx.comm.topology import TOPOLOGIES, mixing_matrix, mixing_terms, neighbours, num_rounds

RING_WEIGHTS = (0.5, 0.25, 0.25)


@pytest.mark.parametrize("name", TOPOLOGIES)
@pytest.mark.parametrize("p", [2, 3, 5, 8])
def test_mixing_matrices_are_doubly_stochastic(name, p):
    for round_ in range(num_rounds(name, p)):
        W = mixing_matrix(name, RING_WEIGHTS, p, round_)
        assert (W >= 0).all()
        np.testing.assert_allclose(W.sum(axis=0), 1.0, rtol=0, atol=1e-12)
        np.testing.assert_allclose(W.sum(axis=1), 1.0, rtol=0, atol=1e-12)


def test_neighbours_are_one_message_per_nonzero_shift():
    assert neighbours(mixing_terms("ring", RING_WEIGHTS, 8)) == 2
    assert mixing_terms("ring", RING_WEIGHTS, 2) == ((0.5, 0), (0.5, 1))  # left and right are one peer on 2
    assert neighbours(mixing_terms("complete", (), 8)) == 7
    assert [mixing_terms("exponential", (), 8, r) for r in range(3)] == [((0.5, 0), (0.5, s),) for s in (1, 2, 4)]
    assert neighbours(mixing_terms("ring", (1.0, 0.0, 0.0), 8)) == 0  # zero weights send nothing


def test_complete_and_exponential_graphs_reach_exact_consensus():
    x = np.arange(8.0)
    np.testing.assert_allclose(mixing_matrix("complete", (), 8) @ x, np.full(8, x.mean()), rtol=0, atol=1e-12)
    assert num_rounds("exponential", 8) == 3
    for start in range(3):  # lg p consecutive rounds from any starting round
        mixed = x
        for r in range(start, start + 3):
            mixed = mixing_matrix("exponential", (), 8, r) @ mixed
        np.testing.assert_allclose(mixed, np.full(8, x.mean()), rtol=0, atol=1e-12)
    ring = mixing_matrix("ring", RING_WEIGHTS, 8) @ x  # the ring only shrinks the disagreement
    assert ring.mean() == pytest.approx(x.mean()) and np.ptp(ring) < np.ptp(x)


def test_unknown_topology_lists_the_choices():
    with pytest.raises(ValueError, match=r"unknown topology 'star'; choose one of \['ring', 'complete', 'exponential'\]"):
        topology.mixing_terms("star", (), 4)
