"""What a pipeline sends: the bytes at each stage boundary per step, predicted, counted, and set against DP and TP.

Per training step, the boundary between stage ``s`` and stage ``s + 1`` carries each micro-batch's activation
forward and the gradient of that activation back: ``2 m`` messages of one activation each. For a transformer the
activation is ``(b, s, h)`` (b sequences of s tokens, hidden size h), so ``2 m b s h`` elements per boundary; for the
demo MLP it is ``(rows, width)``. The number of parameters Ψ and the number of stages p appear nowhere: a deeper
model, or more stages, changes how many boundaries there are, not what one boundary carries. A stage sends at most
``2 m b s h`` (the first and the last only half: they have one neighbour).

* ``activation_numel(shape)``, ``pp_boundary_bytes(m, shape)``, ``pp_stage_bytes(stage, p, m, shape)``: the formula.
* ``dp_bytes_per_rank(num_params, n)``: a ring all-reduce of the gradients, ``2 Ψ (N-1)/N`` (notebook 02);
  ``tp_bytes_per_rank(b, s, h, t, layers, m)``: Megatron's ``8 b s h (t-1)/t`` per layer and micro-batch
  (notebook 04, Narayanan et al. 2021 §3.2), times the layers and the micro-batches.
* ``gpt_params(layers, h)``, ``volume_table(models, ...)``: the three side by side for a few model sizes.
* ``gpipe_traffic(m, shape)``: inside a worker, the messages of one GPipe step (activation-shaped tensors, no
  arithmetic) inside a ``CommCounter``; ``traffic_report(summaries, m, shape)``: what was counted against the
  formula, per boundary and per stage, with every disagreement spelled out.

Example::

    from labsupport.lessons import pipeline_parallel as lesson
    summaries = labsupport.run(lesson.gpipe_traffic, 4, (2, 16, 32), world_size=4)
    report = lesson.traffic_report(summaries, 4, (2, 16, 32))
    assert not report["mismatches"], report["mismatches"]
"""

from __future__ import annotations

import math

from ...i18n import _

__all__ = [
    "activation_numel",
    "pp_boundary_bytes",
    "pp_stage_bytes",
    "dp_bytes_per_rank",
    "tp_bytes_per_rank",
    "gpt_params",
    "volume_table",
    "gpipe_traffic",
    "traffic_report",
]


def activation_numel(shape) -> int:
    """Elements of one micro-batch's activation: ``b * s * h`` for ``(b, s, h)``, ``rows * width`` for the MLP."""
    shape = tuple(int(d) for d in shape)
    if not shape or min(shape) < 1:
        raise ValueError(f"an activation shape needs positive sizes, got {shape}")
    return math.prod(shape)


def pp_boundary_bytes(m: int, shape, element_size: int = 4) -> int:
    """Bytes one stage boundary carries per step, both directions: ``2 m`` activations (m forward, m gradients back),
    ``2 m b s h`` elements for ``shape = (b, s, h)``."""
    return 2 * m * activation_numel(shape) * element_size


def pp_stage_bytes(stage: int, p: int, m: int, shape, element_size: int = 4) -> tuple[int, int]:
    """``(sent, received)`` bytes of stage ``stage`` of ``p`` in one step: every stage but the last sends ``m``
    activations forward, every stage but the first sends ``m`` gradients back, and receives the mirror image."""
    one = m * activation_numel(shape) * element_size
    sent = one * (stage < p - 1) + one * (stage > 0)
    return sent, sent  # what goes out to a neighbour comes back from it: same sizes, same count


def dp_bytes_per_rank(num_params: int, n: int, element_size: int = 4) -> float:
    """Bytes one data-parallel rank sends per step: a ring all-reduce of the ``Ψ`` gradients, ``2 Ψ (N-1)/N``."""
    return 2 * num_params * (n - 1) / n * element_size


def tp_bytes_per_rank(b: int, s: int, h: int, t: int, layers: int, m: int = 1, element_size: int = 4) -> float:
    """Bytes one tensor-parallel rank sends per step: notebook 04's ``narayanan_layer_bytes``, ``8 b s h (t-1)/t``
    elements per transformer layer and micro-batch (two all-reduces forward and two backward, each a ring's
    ``2 (t-1)/t``), for ``layers`` layers and ``m`` micro-batches."""
    from labsupport.lessons.tensor_parallel import narayanan_layer_bytes

    return narayanan_layer_bytes(b, s, h, t, element_size) * layers * m


def gpt_params(layers: int, h: int, vocab: int = 50257, context: int = 1024) -> int:
    """Parameters of a GPT-2-shaped model: per layer ``12 h^2 + 13 h`` (attention 4h^2 + 4h, MLP 8h^2 + 5h, two
    LayerNorms 4h), token and position embeddings, a final LayerNorm. ``gpt_params(12, 768)`` is GPT-2 small's
    124,439,808."""
    return layers * (12 * h * h + 13 * h) + (vocab + context) * h + 2 * h


def volume_table(models, m: int = 8, b: int = 4, s: int = 1024, n: int = 8, t: int = 8,
                 element_size: int = 2) -> list[dict]:
    """Per model ``(name, layers, h)``: Ψ and the bytes per step of each kind of parallelism, for a step of ``m``
    micro-batches of ``b`` sequences of ``s`` tokens: ``pp`` at one pipeline boundary, ``dp`` per rank of ``n``
    data-parallel replicas, ``tp`` per rank of a ``t``-way tensor-parallel model. ``element_size`` 2: 16-bit
    activations and gradients, as in mixed-precision training."""
    rows = []
    for name, layers, h in models:
        psi = gpt_params(layers, h)
        rows.append({"model": name, "layers": layers, "h": h, "params": psi,
                     "pp": pp_boundary_bytes(m, (b, s, h), element_size),
                     "dp": dp_bytes_per_rank(psi, n, element_size),
                     "tp": tp_bytes_per_rank(b, s, h, t, layers, m, element_size)})
    return rows


def gpipe_traffic(m: int, shape, dtype=None):
    """Inside a worker (rank = stage): the messages of one GPipe step, counted; returns the ``CommSummary``.

    Forward: for each micro-batch, receive its activation from the previous stage, send one to the next; backward:
    for each micro-batch, receive the gradient of the output from the next stage, send the gradient of the input to
    the previous one. The tensors have the activation's ``shape`` and ``dtype`` (float32 by default) but carry no
    computation: only what crosses the boundaries is measured, so this runs whether or not your ``run_pipeline``
    exists. Sends are ``isend`` (gloo's ``send`` waits for the receiver), all waited for before returning.
    """
    import torch
    import torch.distributed as dist

    from labsupport import CommCounter

    dtype = torch.float32 if dtype is None else dtype
    rank, p = dist.get_rank(), dist.get_world_size()
    shape = tuple(shape)
    pending = []
    dist.barrier()  # outside the counter: only the pipeline's messages are counted
    with CommCounter() as cc:
        for mb in range(m):                # the forwards, in micro-batch order
            if rank > 0:
                dist.recv(torch.empty(shape, dtype=dtype), src=rank - 1)
            if rank < p - 1:
                pending.append(dist.isend(torch.full(shape, float(mb), dtype=dtype), dst=rank + 1))
        for mb in range(m):                # then the backwards, in micro-batch order
            if rank < p - 1:
                dist.recv(torch.empty(shape, dtype=dtype), src=rank + 1)
            if rank > 0:
                pending.append(dist.isend(torch.full(shape, -float(mb), dtype=dtype), dst=rank - 1))
        for work in pending:
            work.wait()
    return cc.summary


def traffic_report(summaries, m: int, shape, element_size: int = 4, boundary_formula=pp_boundary_bytes) -> dict:
    """What each stage sent and received (``CommSummary`` per rank, in rank order) against the formula.

    Returns ``{"boundaries": [...], "stages": [...], "mismatches": [...]}``: per boundary ``s | s+1`` the bytes sent
    forward and back, their sum and ``boundary_formula(m, shape, element_size)``; per stage its bytes sent and
    received and ``pp_stage_bytes``; ``mismatches``, one sentence per disagreement (empty when all agree), including
    any call that is not a send or recv to a neighbouring stage.
    """
    p = len(summaries)
    mismatches = []
    sent_to = [{} for _ in range(p)]  # rank -> {peer: bytes sent to it}
    for rank, summary in enumerate(summaries):
        for call in summary.calls:
            if call.kind not in ("send", "recv"):
                mismatches.append(_("stage {stage} called {call}: a pipeline only sends to and receives from its "
                                    "neighbours").format(stage=rank, call=call.kind))
            elif call.peer not in (rank - 1, rank + 1):
                mismatches.append(_("stage {stage} made a {call} with rank {peer}, not a neighbouring stage").format(
                    stage=rank, call=call.kind, peer=call.peer))
            elif call.kind == "send":
                sent_to[rank][call.peer] = sent_to[rank].get(call.peer, 0) + call.nbytes
    boundaries = []
    for s in range(p - 1):
        forward, backward = sent_to[s].get(s + 1, 0), sent_to[s + 1].get(s, 0)
        formula = boundary_formula(m, shape, element_size)
        boundaries.append({"boundary": (s, s + 1), "forward": forward, "backward": backward,
                           "measured": forward + backward, "formula": formula})
        if forward + backward != formula:
            mismatches.append(_("boundary {boundary} carried {forward} B forward + {backward} B back = "
                                "{total} B; the formula says {formula} B").format(
                boundary=f"{s}|{s + 1}", forward=forward, backward=backward, total=forward + backward, formula=formula))
    stages = []
    for rank, summary in enumerate(summaries):
        want_sent, want_received = pp_stage_bytes(rank, p, m, shape, element_size)
        stages.append({"stage": rank, "sent": summary.bytes_sent, "received": summary.bytes_received,
                       "formula_sent": want_sent, "formula_received": want_received})
        for said, got, want in ((_("stage {stage} sent {got} B, expected {want} B"), summary.bytes_sent, want_sent),
                                (_("stage {stage} received {got} B, expected {want} B"), summary.bytes_received,
                                 want_received)):
            if got != want:
                mismatches.append(said.format(stage=rank, got=got, want=want))
    return {"boundaries": boundaries, "stages": stages, "mismatches": mismatches}
