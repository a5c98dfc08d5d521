"""Notebook 00 (launch): where the ranks of a launch live, drawn, and a real two-node torchrun on this machine.

* ``plot_rank_layout(nnodes, nproc_per_node)``: nodes as boxes, one slot per process with its ``RANK``,
  ``LOCAL_RANK`` and ``NODE_RANK``, and the rendezvous address every process connects to.
* ``torchrun_two_fake_nodes(nproc_per_node=2)``: start two torchrun agents here, as node 0 and node 1 of one job,
  and return the environment every worker saw, in rank order.

Example::

    from labsupport.lessons import launch as lesson
    lesson.plot_rank_layout(nnodes=2, nproc_per_node=4)
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time

from .._ports import free_port
from ..display import shorten
from ..i18n import _

__all__ = ["plot_rank_layout", "torchrun_two_fake_nodes", "TORCHRUN_SCRIPT"]


def _colour(rank: int):
    import matplotlib

    return matplotlib.colormaps["tab10"](rank % 10)


# ----------------------------------------------------------------------------------------------------------------
# Launch layout


def plot_rank_layout(nnodes: int, nproc_per_node: int, master_addr: str = "10.0.0.1", master_port: int = 29500):
    """Draw ``nnodes`` machines with ``nproc_per_node`` processes each, labelled as torchrun numbers them.

    Each slot shows the process's ``RANK`` and ``LOCAL_RANK`` (its GPU on that node); each node its ``NODE_RANK``.
    Node 0 hosts the rendezvous at ``MASTER_ADDR:MASTER_PORT`` that every process connects to first.
    Returns the Figure (one axes).
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Rectangle

    for what, v in (("nnodes", nnodes), ("nproc_per_node", nproc_per_node)):
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 16:
            raise ValueError(f"{what} must be an int from 1 to 16 for a readable drawing, got {v!r}")
    world = nnodes * nproc_per_node
    slot_w, slot_h, gap = 1.7, 1.25, 0.15
    node_w = nproc_per_node * (slot_w + gap) + gap
    node_h = slot_h + 0.75
    step = node_h + 0.5
    box_x, box_w = node_w + 1.2, 4.0
    total_w, total_h = box_x + box_w + 0.2, nnodes * step + 0.2
    unit = 0.55  # inches per data unit
    fig, ax = plt.subplots(figsize=(unit * total_w, unit * total_h + 0.5))
    top = (nnodes - 1) * step
    rdv_y = top + node_h / 2
    for node in range(nnodes):
        y0 = (nnodes - 1 - node) * step
        ax.add_patch(
            FancyBboxPatch((0, y0), node_w, node_h, boxstyle="round,pad=0.05", facecolor="0.95", edgecolor="0.3")
        )
        host = f"{master_addr}, the master" if node == 0 else f"node{node}"
        ax.text(gap, y0 + node_h - 0.3, f"node {node}: NODE_RANK={node}  (host {host})", fontsize=9, va="center")
        for local in range(nproc_per_node):
            rank = node * nproc_per_node + local
            x0 = gap + local * (slot_w + gap)
            ax.add_patch(Rectangle((x0, y0 + 0.12), slot_w, slot_h, facecolor=_colour(rank), alpha=0.45))
            ax.text(
                x0 + slot_w / 2,
                y0 + 0.12 + slot_h / 2,
                f"GPU {local}\nRANK {rank}\nLOCAL_RANK {local}",
                ha="center",
                va="center",
                fontsize=7.5,
            )
        ax.add_patch(
            FancyArrowPatch(
                (node_w + 0.1, y0 + node_h / 2),
                (box_x - 0.05, rdv_y),
                arrowstyle="->",
                mutation_scale=12,
                color="0.35",
            )
        )
    ax.add_patch(
        FancyBboxPatch(
            (box_x, rdv_y - 0.7), box_w, 1.4, boxstyle="round,pad=0.05", facecolor="white", edgecolor="0.3", ls="--"
        )
    )
    ax.text(
        box_x + box_w / 2,
        rdv_y,
        f"rendezvous store on node 0\n{master_addr}:{master_port}\n(MASTER_ADDR:MASTER_PORT)",
        fontsize=8,
        ha="center",
        va="center",
    )
    ax.set_xlim(-0.1, total_w)
    ax.set_ylim(-0.1, total_h)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(
        f"{nnodes} node(s) x {nproc_per_node} process(es) per node: WORLD_SIZE = {world}", fontsize=10
    )
    fig.tight_layout()
    return fig

# ----------------------------------------------------------------------------------------------------------------
# A real torchrun with two nodes on one machine

#: The script every torchrun worker runs: ``labsupport.run`` under torchrun just calls the function in place.
TORCHRUN_SCRIPT = """
import json, os, sys
import labsupport

def show_env():
    keys = ["RANK", "LOCAL_RANK", "GROUP_RANK", "NODE_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR"]
    return {k: os.environ.get(k) for k in keys}

if __name__ == "__main__":
    (env,) = labsupport.run(show_env)    # under torchrun: calls show_env() right here
    # one write for the whole line: the workers share the agent's stdout, and with unbuffered output print()
    # would write the text and its newline separately, so two workers' lines could interleave
    sys.stdout.write("ENV " + json.dumps(env) + "\\n")
    sys.stdout.flush()
"""


def _agent_error(err: str) -> str:
    """What a failed agent wrote, kept short: a worker's own error comes first, the agent's summary of it last."""
    if len(err) <= 2400:
        return err
    return shorten(err, 1600) + "\n" + shorten(err[1600:], 800, end=True)


def _first_error(err: str) -> str | None:
    """The line that says what went wrong first: the first line that is not one of torch's own log lines
    (``E1127 12:00:00 ...``), or, where that starts a traceback, the traceback's exception."""
    lines = err.splitlines()
    for i, line in enumerate(lines):
        if not line.strip() or re.match(r"\[?[EWIF]\d{4} ", line.strip()):
            continue
        if line.startswith("Traceback (most recent call last)"):
            line = next((ln for ln in lines[i + 1:] if ln.strip() and not ln.startswith((" ", "\t"))), line)
        return line.strip()[:200]
    return None


def torchrun_two_fake_nodes(nproc_per_node: int = 2, timeout: float = 180) -> list:
    """Start two torchrun agents on this machine, as node 0 and node 1 of one job (printing their command
    lines), run ``TORCHRUN_SCRIPT`` in every worker, and return what each worker saw, in rank order.

    On a busy machine gloo's connections between the two nodes' workers now and then fail as the job starts
    ("Connection closed by peer"): the first agent that fails ends the job, which is then started once more, on a
    new port; a second failure, or a job still running after ``timeout`` seconds, raises ``RuntimeError`` with what
    the failing agent and its workers wrote."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    loopback = [name for _, name in socket.if_nameindex() if name in ("lo", "lo0")]
    if loopback:
        env.setdefault("GLOO_SOCKET_IFNAME", loopback[0])
    for attempt in (1, 2):
        try:
            return _two_nodes(env, nproc_per_node, timeout)
        except _JobFailed as exc:
            if attempt == 2 or exc.late:  # a job that ran out of time is not started again
                raise RuntimeError(str(exc)) from None
            print(_("(the job did not start: {cause}; starting it once more)").format(cause=exc.first_line))


class _JobFailed(Exception):
    def __init__(self, text: str, first_line: str, late: bool):
        super().__init__(text)
        self.first_line, self.late = first_line, late


def _two_nodes(env: dict, nproc_per_node: int, timeout: float) -> list:
    seen = []
    with tempfile.TemporaryDirectory(prefix="torchrun-demo-") as workdir:
        env = dict(env, TMPDIR=workdir)   # the agents' own temporary files (their log folders) go with it
        with open(os.path.join(workdir, "show_env.py"), "w") as fh:
            fh.write(TORCHRUN_SCRIPT)
        port, agents = free_port(), []   # one no other process is handed meanwhile
        logs = [(os.path.join(workdir, f"node{n}.out"), os.path.join(workdir, f"node{n}.err")) for n in (0, 1)]
        try:
            for node_rank in (0, 1):
                args = ["--nnodes", "2", "--nproc_per_node", str(nproc_per_node), "--node_rank", str(node_rank),
                        "--master_addr", "127.0.0.1", "--master_port", str(port), "show_env.py"]
                print("$ torchrun " + " ".join(args))
                with open(logs[node_rank][0], "w") as out, open(logs[node_rank][1], "w") as err:
                    agents.append(subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *args],
                                                   cwd=workdir, env=env, stdout=out, stderr=err, text=True))
            deadline, failed, late = time.monotonic() + timeout, None, False
            while any(agent.poll() is None for agent in agents):
                failed = next((agent for agent in agents if agent.returncode), None)
                if failed is not None:  # one agent failed: the job is over
                    break
                if time.monotonic() > deadline:
                    failed, late = next(agent for agent in agents if agent.returncode is None), True
                    break
                time.sleep(0.1)
            failed = failed or next((agent for agent in agents if agent.returncode), None)
            _stop(agents)
            if failed is not None:
                with open(logs[agents.index(failed)][1]) as fh:
                    err = fh.read()
                what = f"torchrun did not finish within {timeout:g} s" if late else \
                    f"torchrun exited with {failed.returncode}"
                raise _JobFailed(f"{what}:\n{_agent_error(err)}", _first_error(err) or what, late)
            for out_log, _err_log in logs:
                with open(out_log) as fh:
                    seen += [json.loads(line[4:]) for line in fh if line.startswith("ENV ")]
        finally:
            _stop(agents)
    return sorted(seen, key=lambda e: int(e["RANK"]))


def _stop(agents, wait: float = 10) -> None:
    """Stop the agents still running: SIGTERM first, on which an agent stops its workers (each leads a session of
    its own, which no signal to the agent reaches), then SIGKILL after ``wait`` seconds."""
    for agent in agents:
        if agent.poll() is None:
            agent.terminate()
    for agent in agents:
        try:
            agent.wait(wait)
        except subprocess.TimeoutExpired:
            agent.kill()
            agent.wait()
