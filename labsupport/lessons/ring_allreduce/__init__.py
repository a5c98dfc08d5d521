"""Notebook 02 (ring all-reduce): the network simulator, the timing harness and the plots.

* ``netsim``: the alpha-beta network simulator (schedules, topologies, ``simulate``, ``fit_alpha_beta``).
* ``harness``: timing on workers: ``timed`` (the fastest of several calls, each timed by its slowest rank),
  ``ping_pong_times``, ``p2p_bandwidth``, ``bandwidth_sweep``, ``scaling_point``. Your ring is passed in.
* ``plots``: ``plot_ring_steps``, ``plot_traffic``, ``plot_bus_bandwidth``, ``plot_measured_vs_predicted``.

Example::

    from labsupport.lessons import ring_allreduce as lesson
    lesson.plot_ring_steps(4)
    lesson.netsim.simulate(lesson.netsim.ring_allreduce(1024, 2**26), lesson.netsim.Uniform(20e-6, 1 / 2e9))
"""

from . import netsim
from .harness import bandwidth_sweep, p2p_bandwidth, ping_pong_times, scaling_point, timed
from .plots import plot_bus_bandwidth, plot_measured_vs_predicted, plot_ring_steps, plot_traffic, ring_states

__all__ = [
    "netsim",
    "timed", "ping_pong_times", "p2p_bandwidth", "bandwidth_sweep", "scaling_point",
    "plot_ring_steps", "plot_traffic", "plot_bus_bandwidth", "plot_measured_vs_predicted", "ring_states",
]
