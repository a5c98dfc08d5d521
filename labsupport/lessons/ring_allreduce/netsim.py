"""A small network simulator for collective algorithms: how long does an all-reduce take on P ranks?

The model is the alpha-beta (latency-bandwidth) model, applied message by message:

* A **schedule** is a list of steps; a step is a set of messages ``(src, dst, nbytes)``. A rank takes part in a step
  once it has finished everything it sent and received in its previous steps (in a ring, what a rank sends in step
  k is what it received in step k-1).
* A **topology** gives every link ``src -> dst`` a latency ``alpha`` (seconds per message) and an inverse bandwidth
  ``beta`` (seconds per byte): a message of n bytes occupies its link for ``alpha + n * beta``.
* Each rank has one send port and one receive port (full duplex, "single-port" model): two messages leaving the
  same rank, or arriving at the same rank, go one after the other. This is what makes a parameter server slow.

With one uniform link this reproduces the textbook formulas exactly (your ``alpha_beta_cost``), e.g. the ring's
``2(p-1)alpha + 2(p-1)/p * n * beta``. Steps where every rank sends and receives at most one message (ring,
recursive doubling) are simulated with numpy in one go, so 1024 ranks take milliseconds.

Example::

    from labsupport.lessons.ring_allreduce import netsim
    topo = netsim.Uniform(alpha=20e-6, beta=1 / 2e9)            # 20 us per message, 2 GB/s
    netsim.simulate(netsim.ring_allreduce(1024, 2**26), topo)   # seconds for 64 MiB on 1024 ranks

    alpha, beta = netsim.fit_alpha_beta(sizes, times)           # from a measured ping-pong
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = [
    "Step",
    "Schedule",
    "Uniform",
    "Hierarchical",
    "SharedHost",
    "simulate",
    "ring_allreduce",
    "naive_allreduce",
    "recursive_doubling_allreduce",
    "parameter_server_allreduce",
    "from_comm",
    "fit_alpha_beta",
    "ALGORITHMS",
]


# ----------------------------------------------------------------------------------------------------------------
# Schedules


@dataclass
class Step:
    """One step of a schedule: message i goes from ``src[i]`` to ``dst[i]`` and carries ``nbytes[i]`` bytes."""

    src: np.ndarray
    dst: np.ndarray
    nbytes: np.ndarray
    label: str = ""
    _one_to_one: bool | None = field(default=None, repr=False, compare=False)

    def __post_init__(self):
        self.src = np.asarray(self.src, dtype=np.int64).reshape(-1)
        self.dst = np.asarray(self.dst, dtype=np.int64).reshape(-1)
        self.nbytes = np.broadcast_to(np.asarray(self.nbytes, dtype=np.float64), self.src.shape).copy()
        if self.src.shape != self.dst.shape:
            raise ValueError("a step needs as many destinations as sources")

    def __len__(self) -> int:
        return len(self.src)

    @property
    def one_to_one(self) -> bool:
        """True when no rank sends, or receives, more than one message in this step."""
        if self._one_to_one is None:
            self._one_to_one = bool(
                len(self.src) == 0
                or (np.bincount(self.src).max() <= 1 and np.bincount(self.dst).max() <= 1)
            )
        return self._one_to_one


@dataclass
class Schedule:
    """An algorithm as a list of ``Step``s on ``world_size`` ranks."""

    name: str
    world_size: int
    steps: list

    @property
    def bytes_sent(self) -> np.ndarray:
        """Bytes each rank sends over the whole schedule."""
        out = np.zeros(self.world_size)
        for st in self.steps:
            np.add.at(out, st.src, st.nbytes)
        return out

    @property
    def bytes_received(self) -> np.ndarray:
        """Bytes each rank receives over the whole schedule."""
        out = np.zeros(self.world_size)
        for st in self.steps:
            np.add.at(out, st.dst, st.nbytes)
        return out


def _check(p: int, nbytes: float) -> None:
    if int(p) != p or p < 1:
        raise ValueError(f"world_size must be a positive integer, got {p!r}")
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes!r}")


def ring_allreduce(world_size: int, nbytes: float) -> Schedule:
    """Ring all-reduce: p-1 reduce-scatter steps then p-1 all-gather steps, each rank sends nbytes/p per step."""
    _check(world_size, nbytes)
    p = world_size
    ranks = np.arange(p)
    # every step moves the same messages, so the two phases share one Step object each
    rs = Step(ranks, (ranks + 1) % p, nbytes / p, "reduce-scatter")
    ag = Step(ranks, (ranks + 1) % p, nbytes / p, "all-gather")
    return Schedule("ring", p, [rs] * (p - 1) + [ag] * (p - 1))


def naive_allreduce(world_size: int, nbytes: float, root: int = 0) -> Schedule:
    """Reduce to a root, then broadcast from it: every other rank sends its whole tensor to the root, which
    receives them one after another, sums, and sends the result back to each rank one after another."""
    _check(world_size, nbytes)
    p = world_size
    others = np.array([r for r in range(p) if r != root], dtype=np.int64)
    if p == 1:
        return Schedule("naive", 1, [])
    return Schedule(
        "naive",
        p,
        [Step(others, np.full_like(others, root), nbytes, "reduce"), Step(np.full_like(others, root), others, nbytes, "broadcast")],
    )


def parameter_server_allreduce(world_size: int, nbytes: float) -> Schedule:
    """A parameter server on rank 0: the same messages as ``naive_allreduce``."""
    sched = naive_allreduce(world_size, nbytes)
    sched.name = "parameter server"
    return sched


def recursive_doubling_allreduce(world_size: int, nbytes: float) -> Schedule:
    """Recursive doubling: in step k, rank r exchanges the whole tensor with rank ``r XOR 2^k``.

    For a power of two that is log2(p) steps. For other p, the ranks above the largest power of two first fold
    their data into a partner and get the result back at the end, as MPICH does: floor(log2 p) + 2 steps, two
    more than ``ceil(log2 p)`` would count.
    """
    _check(world_size, nbytes)
    p = world_size
    q = 1 << (p.bit_length() - 1)  # largest power of two <= p
    extra = np.arange(q, p)
    steps = []
    if len(extra):
        steps.append(Step(extra, extra - q, nbytes, "fold in"))
    ranks = np.arange(q)
    k = 1
    while k < q:
        steps.append(Step(ranks, ranks ^ k, nbytes, f"exchange with rank xor {k}"))
        k <<= 1
    if len(extra):
        steps.append(Step(extra - q, extra, nbytes, "send back"))
    return Schedule("recursive_doubling", p, steps)


def from_comm(summaries, name: str = "measured") -> Schedule:
    """A schedule built from what ranks really did: ``CommCounter`` summaries, one per rank in rank order.

    Step k holds every rank's k-th send (its peer and byte count), which is exact for algorithms that send one
    message per step, like the ring.
    """
    sends = [[c for c in s.calls if c.kind == "send"] for s in summaries]
    steps = []
    for k in range(max((len(x) for x in sends), default=0)):
        msgs = [(r, x[k].peer, x[k].nbytes) for r, x in enumerate(sends) if k < len(x)]
        src, dst, nb = zip(*msgs)
        steps.append(Step(src, dst, nb, f"send {k + 1}"))
    return Schedule(name, len(summaries), steps)


ALGORITHMS = {
    "ring": ring_allreduce,
    "naive": naive_allreduce,
    "recursive_doubling": recursive_doubling_allreduce,
    "parameter_server": parameter_server_allreduce,
}


# ----------------------------------------------------------------------------------------------------------------
# Topologies


@dataclass
class Uniform:
    """Every pair of ranks has its own link with the same ``alpha`` (s/message) and ``beta`` (s/byte)."""

    alpha: float
    beta: float

    def links(self, src: np.ndarray, dst: np.ndarray, world_size: int):
        return np.full(src.shape, float(self.alpha)), np.full(src.shape, float(self.beta))


@dataclass
class Hierarchical:
    """Nodes of ``ranks_per_node`` consecutive ranks: a fast link inside a node, a slower one between nodes."""

    ranks_per_node: int
    alpha_intra: float
    beta_intra: float
    alpha_inter: float
    beta_inter: float

    def links(self, src, dst, world_size):
        same = (src // self.ranks_per_node) == (dst // self.ranks_per_node)
        return (
            np.where(same, self.alpha_intra, self.alpha_inter).astype(float),
            np.where(same, self.beta_intra, self.beta_inter).astype(float),
        )


@dataclass
class SharedHost:
    """All ranks on one host with ``cores`` CPU cores, talking over loopback (this course's laptop setting).

    On loopback a "link" is the CPU copying bytes: into the kernel on the sending side and out of it on the
    receiving side, so every message keeps about two cores busy (``copies_per_message``). ``alpha`` and ``beta``
    are what a two-rank ping-pong measures, one message at a time. When a step has k messages in flight at once,
    they need ``copies_per_message * k`` cores; with fewer cores they take turns, and every message of the step
    costs ``alpha + n beta`` times ``max(1, copies_per_message * k / cores)``.
    """

    alpha: float
    beta: float
    cores: int
    copies_per_message: float = 2.0

    def links(self, src, dst, world_size):
        # messages through one rank's port run one after another: count the ones that can run at the same time
        concurrent = min(len(np.unique(src)), len(np.unique(dst)))
        slow = max(1.0, self.copies_per_message * concurrent / self.cores)
        return np.full(src.shape, self.alpha * slow), np.full(src.shape, self.beta * slow)


# ----------------------------------------------------------------------------------------------------------------
# The simulation


def simulate(schedule: Schedule, topology, per_rank: bool = False):
    """Completion time (seconds) of ``schedule`` on ``topology``.

    Each message starts when its sender and its receiver have both finished their previous steps and their ports
    are free, and takes ``alpha + nbytes * beta`` of its link. Returns the time the last rank finishes, or with
    ``per_rank=True`` an array of each rank's finishing time.
    """
    p = schedule.world_size
    ready = np.zeros(p)  # when each rank finished its previous step
    for st in schedule.steps:
        if len(st) == 0:
            continue
        a, b = topology.links(st.src, st.dst, p)
        cost = a + st.nbytes * b
        send_free = ready.copy()
        recv_free = ready.copy()
        done = ready.copy()
        if st.one_to_one:
            # every rank sends at most one and receives at most one message: all in parallel
            end = np.maximum(ready[st.src], ready[st.dst]) + cost
            done[st.src] = np.maximum(done[st.src], end)
            done[st.dst] = np.maximum(done[st.dst], end)
        else:
            # shared ports: messages through the same port go one after another, in the order listed
            for s, d, c in zip(st.src.tolist(), st.dst.tolist(), cost.tolist()):
                start = max(send_free[s], recv_free[d])
                end = start + c
                send_free[s] = recv_free[d] = end
                done[s] = max(done[s], end)
                done[d] = max(done[d], end)
        ready = done
    return ready if per_rank else float(ready.max(initial=0.0))


# ----------------------------------------------------------------------------------------------------------------
# Fitting to measurements


def fit_alpha_beta(sizes, times) -> tuple[float, float]:
    """Least-squares fit of ``time = alpha + size * beta`` to measured (bytes, seconds) pairs.

    The fit minimises the *relative* error, so that 4-byte and 16-MiB messages count alike. ``alpha`` is clipped at
    zero; ``beta`` never is zero (a link of infinite bandwidth): when noise on a busy machine makes the fitted slope
    zero or negative, it is the largest message's time per byte, an upper bound.
    """
    n = np.asarray(sizes, dtype=float)
    t = np.asarray(times, dtype=float)
    if n.shape != t.shape or len(n) < 2:
        raise ValueError("fit_alpha_beta needs at least two (size, time) pairs of the same length")
    a = np.stack([np.ones_like(n), n], axis=1) / t[:, None]
    (alpha, beta), *_ = np.linalg.lstsq(a, np.ones_like(t), rcond=None)
    if not beta > 0:
        beta = t[int(np.argmax(n))] / n.max()
    return max(float(alpha), 0.0), float(beta)
