"""labsupport.lessons.ring_allreduce.netsim: the simulator reproduces the closed-form alpha-beta costs, scales to 1024 ranks, and fits."""

import math
import random

import numpy as np
import pytest

import labsupport
from autograder.checks.ring_allreduce import reference_alpha_beta_cost, reference_ring_all_reduce
from labsupport.lessons.ring_allreduce import netsim


@pytest.mark.parametrize("algorithm", ["ring", "naive", "recursive_doubling"])
def test_simulation_reproduces_the_formula_exactly(algorithm):
    rng = random.Random(0)
    for _ in range(50):
        p = rng.randint(1, 300)
        n = rng.randint(1, 2**30)
        a, b = 10 ** rng.uniform(-7, -3), 10 ** rng.uniform(-12, -8)
        sim = netsim.simulate(netsim.ALGORITHMS[algorithm](p, n), netsim.Uniform(a, b))
        assert math.isclose(sim, reference_alpha_beta_cost(algorithm, p, n, a, b), rel_tol=1e-9, abs_tol=1e-15)
        assert math.isclose(sim, reference_alpha_beta_cost(algorithm, p, n, a, b), rel_tol=1e-9, abs_tol=1e-15)


def _replay_sums(schedule):
    """Run a recursive-doubling schedule on data: rank r starts with the one-hot vector e_r; a fold or an exchange
    adds what arrives, a send-back overwrites. Returns every rank's vector at the end."""
    p = schedule.world_size
    held = [np.eye(p)[r] for r in range(p)]
    for step in schedule.steps:
        sent = {int(s): held[int(s)].copy() for s in step.src}
        for s, d in zip(step.src, step.dst):
            if step.label == "send back":
                held[int(d)] = sent[int(s)]
            else:
                held[int(d)] = held[int(d)] + sent[int(s)]
    return held


def test_recursive_doubling_takes_floor_log2_plus_2_steps_unless_p_is_a_power_of_two():
    """The step count of notebook 02's table, computed: a schedule that really all-reduces (replayed on data)
    needs log2 p steps for a power of two and floor(log2 p) + 2 otherwise (5 ranks: 4, where ceil(log2 5) = 3)."""
    for p in range(1, 70):
        schedule = netsim.recursive_doubling_allreduce(p, 1.0)
        for r, vector in enumerate(_replay_sums(schedule)):
            assert np.array_equal(vector, np.ones(p)), f"p={p}: rank {r} ends with {vector}"
        power_of_two = p & (p - 1) == 0
        expected = int(math.log2(p)) if power_of_two else math.floor(math.log2(p)) + 2
        assert len(schedule.steps) == expected, (p, len(schedule.steps))
        assert reference_alpha_beta_cost("recursive_doubling", p, 1e6, 1.0, 0.0) == expected
        sim = netsim.simulate(schedule, netsim.Uniform(1e-5, 1e-9))
        assert math.isclose(sim, reference_alpha_beta_cost("recursive_doubling", p, 1.0, 1e-5, 1e-9), rel_tol=1e-12)
    assert len(netsim.recursive_doubling_allreduce(5, 1.0).steps) == 4 > math.ceil(math.log2(5))


class _NoLoop(np.ndarray):
    """An array of ranks that refuses to be walked message by message (``simulate``'s per-message path)."""

    def tolist(self):
        raise AssertionError("a step where every rank sends and receives at most one message was simulated "
                             "message by message")

    __iter__ = tolist


def test_1024_ranks_are_simulated_a_step_at_a_time():
    """What makes 1024 ranks take milliseconds (``benchmarks/netsim.py`` prints how many): every step of a ring or
    of recursive doubling is one-to-one, and ``simulate`` does such a step with numpy in one go, never walking its
    messages in Python; and the ring's 2(p-1) steps are two shared objects, not 2046 built one by one. Counted, not
    timed: a regression to a per-message loop fails here on any machine."""
    for make in (netsim.ring_allreduce, netsim.recursive_doubling_allreduce):
        for p in (1024, 1000):
            sched = make(p, 2**26)
            assert all(st.one_to_one for st in sched.steps), (make.__name__, p)
            for st in {id(st): st for st in sched.steps}.values():
                st.src, st.dst = st.src.view(_NoLoop), st.dst.view(_NoLoop)
            for topo in (netsim.Uniform(2e-5, 5e-10), netsim.Hierarchical(8, 1e-6, 1e-10, 1e-5, 1e-9)):
                assert netsim.simulate(sched, topo) > 0
    ring = netsim.ring_allreduce(1024, 2**26)
    assert len(ring.steps) == 2 * 1023 and len({id(st) for st in ring.steps}) == 2
    sim = netsim.simulate(ring, netsim.Uniform(2e-5, 5e-10))
    assert math.isclose(sim, reference_alpha_beta_cost("ring", 1024, 2**26, 2e-5, 5e-10), rel_tol=1e-9)


def test_bytes_per_rank():
    p, n = 8, 8000
    ring = netsim.ring_allreduce(p, n)
    assert np.allclose(ring.bytes_sent, 2 * (p - 1) / p * n)
    assert np.allclose(ring.bytes_received, 2 * (p - 1) / p * n)
    ps = netsim.parameter_server_allreduce(p, n)
    assert ps.bytes_sent[0] == (p - 1) * n and ps.bytes_received[0] == (p - 1) * n
    assert np.all(ps.bytes_sent[1:] == n) and np.all(ps.bytes_received[1:] == n)
    assert netsim.simulate(ps, netsim.Uniform(0, 1)) == reference_alpha_beta_cost("naive", p, n, 0, 1)


def test_topologies():
    p, n = 8, 1e6
    # a ring whose ranks sit 4 per node: every step waits for the slow inter-node link
    h = netsim.Hierarchical(4, 1e-6, 1e-11, 1e-5, 1e-9)
    assert math.isclose(netsim.simulate(netsim.ring_allreduce(p, n), h), reference_alpha_beta_cost("ring", p, n, 1e-5, 1e-9))
    # one node: all links fast
    assert math.isclose(
        netsim.simulate(netsim.ring_allreduce(4, n), h), reference_alpha_beta_cost("ring", 4, n, 1e-6, 1e-11)
    )
    # 8 ranks on 2 cores: 8 messages in flight need 16 cores' worth of copying, so everything is 8 times slower
    s = netsim.SharedHost(1e-5, 1e-9, cores=2)
    ring = reference_alpha_beta_cost("ring", p, n, 1e-5, 1e-9)
    assert math.isclose(netsim.simulate(netsim.ring_allreduce(p, n), s), 8 * ring)
    assert math.isclose(netsim.simulate(netsim.ring_allreduce(p, n), netsim.SharedHost(1e-5, 1e-9, cores=16)), ring)
    # the parameter server's messages queue at the root's ports: one at a time, no slowdown
    assert math.isclose(netsim.simulate(netsim.naive_allreduce(p, n), s), reference_alpha_beta_cost("naive", p, n, 1e-5, 1e-9))


def test_per_rank_finish_times():
    t = netsim.simulate(netsim.naive_allreduce(4, 100), netsim.Uniform(1, 0), per_rank=True)
    assert list(t) == [6, 4, 5, 6]  # the root finishes last; rank 1 gets the result first


def test_fit_alpha_beta_never_gives_an_infinite_bandwidth():
    """Noise on a busy machine (small messages slower than large ones) makes the fitted slope negative; beta is then
    the largest message's time per byte, so 1 / beta (the bandwidth the notebook prints) exists."""
    sizes = [4, 64, 1024, 16384]
    a, b = netsim.fit_alpha_beta(sizes, [9e-5, 7e-5, 6e-5, 5e-5])
    assert a >= 0 and b == 5e-5 / 16384


def test_fit_alpha_beta_recovers_a_line():
    rng = np.random.default_rng(0)
    sizes = np.logspace(2, 24, 20, base=2)
    times = (30e-6 + sizes * 4e-10) * rng.uniform(0.97, 1.03, size=sizes.shape)
    a, b = netsim.fit_alpha_beta(sizes, times)
    assert 25e-6 < a < 35e-6 and 3.7e-10 < b < 4.3e-10


def _traced_ring(numel):
    import torch

    x = torch.ones(numel)
    with labsupport.CommCounter() as cc:
        reference_ring_all_reduce(x)
    return cc.summary


def test_schedule_from_a_real_ring():
    summaries = labsupport.run(_traced_ring, 3000, world_size=3)
    sched = netsim.from_comm(summaries)
    assert len(sched.steps) == 4
    assert np.allclose(sched.bytes_sent, 2 * 2 / 3 * 3000 * 4)
    sim = netsim.simulate(sched, netsim.Uniform(1e-5, 1e-9))
    assert math.isclose(sim, reference_alpha_beta_cost("ring", 3, 12000, 1e-5, 1e-9))


def test_errors():
    with pytest.raises(ValueError, match="unknown algorithm"):
        reference_alpha_beta_cost("tree", 4, 10, 1, 1)
    with pytest.raises(ValueError, match="positive integer"):
        netsim.ring_allreduce(0, 10)
    with pytest.raises(ValueError, match="nbytes"):
        netsim.naive_allreduce(4, -1)
    with pytest.raises(ValueError, match="at least two"):
        netsim.fit_alpha_beta([1], [1])
    with pytest.raises(ValueError, match="as many destinations"):
        netsim.Step([0, 1], [1], 10)
