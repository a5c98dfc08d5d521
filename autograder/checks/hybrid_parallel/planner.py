"""``check_activation_bytes`` and ``check_fits``: the planner's formulas (Korthikanti et al. 2022, Table 2; the ZeRO
paper, Rajbhandari et al. 2020; the training FLOPs of Narayanan et al. 2021, eq. 3, and notebook 02's α-β cost of a
ring all-reduce) restated as oracles, against drawn shapes, models, layouts and clusters.
"""

from __future__ import annotations

import math
import random

from .._common import draw_seed, short


# ---------------------------------------------------------------------------------------------------------------
# the planner


def reference_activation_bytes(seq_len, micro_batch, hidden, heads, tp=1, sequence_parallel=False, recompute="none"):
    """Korthikanti et al. 2022, Table 2: activation bytes per transformer layer per GPU (16-bit activations)."""
    s, b, h, a, t = seq_len, micro_batch, hidden, heads, tp
    if recompute == "full":
        return 2.0 * s * b * h
    attention = 5 * a * s / (h * t) if recompute == "none" else 0.0
    if recompute not in ("none", "selective"):
        raise ValueError(recompute)
    rest = 34 / t if sequence_parallel else 10 + 24 / t
    return s * b * h * (rest + attention)


def _zero(psi, n, stage, k=12):
    return {0: (4 + k) * psi, 1: 4 * psi + k * psi / n, 2: 2 * psi + (2 + k) * psi / n, 3: (4 + k) * psi / n}[stage]


def reference_step_time(model, cluster, dp, tp, pp, zero_stage=0, micro_batch=1, recompute="none") -> dict:
    """The step-time model of the notebook's planner, term by term (seconds), and ``"step_time"``, their sum.

    ``compute``: Narayanan et al. 2021's eq. 3 FLOPs (96 with full recomputation, else 72) at efficiency × peak on
    every GPU; ``bubble``: (pp - 1)/m of it; ``tp``: per micro-batch and per layer of a stage, 4 ring all-reduces
    (6 with full recomputation) of a 16-bit (b, s, h) activation over the tp ranks, on NVLink while tp fits in a
    node; ``pp``: 2 transfers of that activation per micro-batch between nodes; ``dp``: a ring all-reduce of the
    2Ψ bytes of 16-bit gradients over the dp ranks (× 1.5 for ZeRO-3), inside a node only when the whole layout is."""
    l, h, s, V, B = model.num_layers, model.hidden, model.seq_len, model.vocab, model.global_batch
    m = B // (dp * micro_batch)
    psi = model.num_params / (tp * pp)
    flops = (96 if recompute == "full" else 72) * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))
    compute = flops / (cluster.num_gpus * cluster.peak_flops * cluster.efficiency)

    def ring(n, nbytes, bw):
        return 2 * (n - 1) * cluster.alpha + 2 * (n - 1) / n * nbytes / bw if n > 1 else 0.0

    node = cluster.gpus_per_node
    activation = 2 * s * micro_batch * h
    per_layer = 6 if recompute == "full" else 4
    terms = {
        "compute": compute,
        "bubble": compute * (pp - 1) / m,
        "tp": m * (l / pp) * per_layer * ring(tp, activation, cluster.intra_bw if tp <= node else cluster.inter_bw),
        "pp": 2 * m * (cluster.alpha + activation / cluster.inter_bw) if pp > 1 else 0.0,
        "dp": ring(dp, 2 * psi, cluster.intra_bw if tp * dp <= node and pp == 1 else cluster.inter_bw)
        * (1.5 if zero_stage == 3 else 1.0),
    }
    return dict(terms, step_time=sum(terms.values()))


def reference_fits(model, cluster, dp, tp, pp, zero_stage=0, micro_batch=1, recompute="none",
                   sequence_parallel=False) -> dict:
    """The notebook's planner: the memory terms, the verdict, the step time and its terms (``"time"``)."""
    psi = model.num_params / (tp * pp)
    m = model.global_batch // (dp * micro_batch)
    act = min(pp, m) * (model.num_layers / pp) * reference_activation_bytes(
        model.seq_len, micro_batch, model.hidden, model.heads, tp, sequence_parallel, recompute)
    state = _zero(psi, dp, zero_stage)
    time = reference_step_time(model, cluster, dp, tp, pp, zero_stage, micro_batch, recompute)
    return {"params_per_gpu": psi, "model_state": state, "activations": act, "total": state + act,
            "fits": state + act <= cluster.memory_bytes, "microbatches": m, "step_time": time.pop("step_time"),
            "time": time}


def _close(a, b):
    return isinstance(a, (int, float)) and not isinstance(a, bool) and math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-6)


def check_activation_bytes(activation_bytes):
    """Drawn shapes, t, sequence parallelism and recomputation against Table 2 of Korthikanti et al. 2022."""
    seed = draw_seed()
    rng = random.Random(seed)
    cases = [(2048, 1, 12288, 96, 8, sp, rc) for sp in (False, True) for rc in ("none", "selective", "full")]
    cases += [(2048, 1, 12288, 96, 1, False, "none")]
    for _ in range(40):
        a = rng.choice([8, 16, 32, 64, 96])
        cases.append((rng.choice([512, 1024, 2048, 4096]), rng.randint(1, 8), a * rng.choice([64, 128]), a,
                      rng.choice([1, 2, 4, 8]), rng.random() < 0.5, rng.choice(["none", "selective", "full"])))
    names = {"none": "no recomputation", "selective": "selective recomputation", "full": "full recomputation"}
    for s, b, h, a, t, sp, rc in cases:
        try:
            got = activation_bytes(s, b, h, a, tp=t, sequence_parallel=sp, recompute=rc)
        except NotImplementedError:
            raise AssertionError("activation_bytes is not started: it still raises NotImplementedError.") from None
        except Exception as exc:
            raise AssertionError(f"activation_bytes(s={s}, b={b}, h={h}, a={a}, tp={t}, sequence_parallel={sp}, "
                                 f"recompute={rc!r}) raised {type(exc).__name__}: {exc}") from None
        expected = reference_activation_bytes(s, b, h, a, t, sp, rc)
        if not _close(got, expected):
            hint = {"none": "sbh(10 + 24/t + 5as/(ht)), or sbh(34/t + 5as/(ht)) with sequence parallelism",
                    "selective": "the same without the 5as/(ht) term",
                    "full": "2sbh: only each layer's input is kept"}[rc]
            ratio = f" ({got / expected:.3g}× the expected value)" if isinstance(got, (int, float)) and expected else ""
            raise AssertionError(
                f"activation_bytes(s={s}, b={b}, h={h}, a={a}, tp={t}, sequence_parallel={sp}, recompute={rc!r}) "
                f"= {short(got)}, expected {expected:.6g}{ratio}. With {names[rc]}: {hint} (Korthikanti et al. "
                "2022, Table 2). Every term but the 2sbh of full recomputation is divided among the t ranks."
            )
    try:
        activation_bytes(2048, 1, 1024, 16, recompute="sometimes")
    except ValueError:
        pass
    except Exception as exc:
        raise AssertionError(f"activation_bytes(..., recompute='sometimes') should raise ValueError, it raised "
                             f"{type(exc).__name__}: {exc}") from None
    else:
        raise AssertionError("activation_bytes(..., recompute='sometimes') should raise ValueError.")


def _layer_bytes(activation_bytes, *args):
    """What the student's ``activation_bytes`` gives for one layer, or None when it fails or is not a number."""
    if activation_bytes is None:
        return None
    try:
        value = activation_bytes(*args)
    except Exception:
        return None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _is_bool(value) -> bool:
    """True or False, as Python's bool or numpy's (a comparison of numpy numbers gives a numpy bool)."""
    return isinstance(value, bool) or (type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_"))


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _same_time(a, b) -> bool:
    return _number(a) and math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-12)


def _step_of(fits, model, cluster, args):
    """The student's step time for ``cluster``, or None when the call fails or gives no number."""
    try:
        value = fits(model, cluster, *args[:6], sequence_parallel=args[6]).get("step_time")
    except Exception:
        return None
    return float(value) if _number(value) and math.isfinite(value) else None


def _step_hint(fits, model, cluster, args, step, ref) -> str:
    """Which part of the step-time model is off, found by asking ``fits`` about the same layout on the same cluster
    with free communication (bandwidth ∞, α = 0) and with free compute (peak ∞)."""
    import dataclasses

    t = ref["time"]
    busy = t["compute"] + t["bubble"]
    comm = t["tp"] + t["pp"] + t["dp"]
    no_comm = _step_of(fits, model, dataclasses.replace(cluster, intra_bw=math.inf, inter_bw=math.inf, alpha=0.0),
                       args)
    no_compute = _step_of(fits, model, dataclasses.replace(cluster, peak_flops=math.inf), args)
    if no_comm == step and no_compute == step:
        return ("it stays the same with infinitely fast links and with infinitely fast GPUs: compute it from the "
                "model, the layout and the cluster, as the exercise says")
    factor = 96 if args[5] == "full" else 72
    if no_comm is not None and not _same_time(no_comm, busy):
        if _same_time(no_comm, t["compute"]) and t["bubble"]:
            return (f"with free communication it gives {no_comm:.4g} s, the compute alone: add the bubble, "
                    "(pp − 1)/m of it")
        return (f"with free communication (bandwidth ∞, α = 0) it gives {no_comm:.4g} s, expected compute "
                f"{t['compute']:.4g} s + bubble {t['bubble']:.4g} s: {factor}·B·s·l·h²·(1 + s/(6h) + "
                "V/(16·l·h)) FLOPs at num_gpus·peak_flops·efficiency, the bubble (pp − 1)/m of it")
    parts = f"tensor parallel {t['tp']:.4g} s + pipeline {t['pp']:.4g} s + data parallel {t['dp']:.4g} s"
    if no_compute is not None:
        if comm and _same_time(no_compute, 0.0):
            return f"it leaves out communication: expected {parts}"
        for name, term in (("tensor-parallel all-reduces", "tp"), ("pipeline transfers", "pp"),
                           ("data-parallel all-reduce", "dp")):
            if t[term] and _same_time(no_compute, comm - t[term]):
                return f"the {name} ({t[term]:.4g} s) are missing: expected {parts}"
        return f"with free compute (peak ∞) it gives {no_compute:.4g} s of communication, expected {parts}"
    return f"expected compute {t['compute']:.4g} s + bubble {t['bubble']:.4g} s + {parts}"


def _drawn_cluster(rng, gpus: int):
    """A cluster drawn around a DGX A100: other FLOP/s, efficiency, links, latency, node size and memory."""
    from labsupport.lessons.hybrid_parallel import Cluster

    return Cluster("drawn", gpus, gpus_per_node=rng.choice([4, 8, 16]), memory_bytes=rng.choice([40e9, 80e9, 141e9]),
                   peak_flops=312e12 * rng.uniform(0.25, 4), efficiency=rng.uniform(0.3, 0.7),
                   intra_bw=300e9 * rng.uniform(0.2, 3), inter_bw=25e9 * rng.uniform(0.2, 3),
                   alpha=rng.uniform(1e-6, 50e-6))


def _cluster_words(cluster) -> str:
    return (f"{cluster.gpus_per_node} GPUs a node of {cluster.memory_bytes / 1e9:g} GB, peak "
            f"{cluster.peak_flops:.4g} FLOP/s × {cluster.efficiency:.3g}, intra_bw {cluster.intra_bw:.4g}, inter_bw "
            f"{cluster.inter_bw:.4g} B/s, alpha {cluster.alpha:.3g} s")


def check_fits(fits, activation_bytes=None):
    """Drawn models, layouts and clusters: the model-state (ZeRO) and activation terms, their sum, the verdict, the
    step time against the notebook's model (compute, bubble, tensor-parallel, pipeline and data-parallel
    communication; how it changes with the cluster's FLOP/s and links is what drawing the clusters checks);
    ValueError.

    ``fits`` is graded on its own: given the student's ``activation_bytes``, activations computed from it count as
    right too (that function's mistakes cost exercise 4's points only).
    """
    from labsupport.lessons.hybrid_parallel import DGX_A100, GPT3_175B, NARAYANAN_TABLE1, Model

    seed = draw_seed()
    rng = random.Random(seed)
    cases = [(GPT3_175B, DGX_A100(1024), 16, 8, 8, 0, 1, "full", False),
             (GPT3_175B, DGX_A100(1024), 16, 8, 8, 0, 1, "none", False),
             (GPT3_175B, DGX_A100(1024), 16, 8, 8, 1, 1, "selective", True)]
    for row in NARAYANAN_TABLE1[:3]:
        cases.append((row["model"], DGX_A100(row["gpus"]), row["gpus"] // (row["t"] * row["p"]), row["t"], row["p"],
                      0, 1, "full", False))
    for index in range(30):
        a = rng.choice([16, 32, 64])
        tp, pp, dp = rng.choice([1, 2, 4, 8]), rng.choice([1, 2, 4, 8]), rng.choice([1, 2, 4, 8, 16])
        if index < 3:  # a layout that fits in one node (its data parallelism on NVLink), whatever else is drawn
            tp, pp, dp = rng.choice([1, 2]), 1, rng.choice([2, 4])
        b = rng.choice([1, 2, 4])
        l, h, s = pp * rng.randint(1, 6), a * rng.choice([64, 128]), rng.choice([1024, 2048])
        V, B = rng.choice([32000, 50304, 51200, 128256]), dp * b * rng.choice([1, 2, 3, 8, 16])
        model = Model(f"l={l}, h={h}, a={a}, s={s}, V={V}, B={B} (seed {seed})", l, h, a, s, V, global_batch=B)
        cluster = DGX_A100(tp * pp * dp) if index % 3 == 0 else _drawn_cluster(rng, tp * pp * dp)
        cases.append((model, cluster, dp, tp, pp, rng.randint(0, 3), b, rng.choice(["none", "selective", "full"]),
                      rng.random() < 0.5))
    for model, cluster, dp, tp, pp, stage, b, rc, sp in cases:
        gpus = cluster.num_gpus
        call = (f"fits({model.name}, {gpus} GPUs, dp={dp}, tp={tp}, pp={pp}, zero_stage={stage}, micro_batch={b}, "
                f"recompute={rc!r}, sequence_parallel={sp})")
        try:
            got = fits(model, cluster, dp, tp, pp, stage, b, rc, sequence_parallel=sp)
        except NotImplementedError:
            layer_args = (model.seq_len, b, model.hidden, model.heads, tp, sp, rc)
            if activation_bytes is not None and _layer_bytes(activation_bytes, *layer_args) is None:
                raise AssertionError("fits raised NotImplementedError: it is not started, or it calls "
                                     "activation_bytes (exercise 4), which is not started either.") from None
            raise AssertionError("fits is not started: it still raises NotImplementedError.") from None
        except Exception as exc:
            raise AssertionError(f"{call} raised {type(exc).__name__}: {exc}") from None
        expected = reference_fits(model, cluster, dp, tp, pp, stage, b, rc, sp)
        if isinstance(got, dict) and "activations" in got and not _close(got["activations"], expected["activations"]):
            # the student's own activation_bytes, used the way the exercise says, is right here too
            layer = _layer_bytes(activation_bytes, model.seq_len, b, model.hidden, model.heads, tp, sp, rc)
            if layer is not None:
                theirs = min(pp, expected["microbatches"]) * (model.num_layers / pp) * layer
                if _close(got["activations"], theirs):
                    expected = dict(expected, activations=theirs, total=expected["model_state"] + theirs,
                                    fits=expected["model_state"] + theirs <= cluster.memory_bytes)
        if not isinstance(got, dict):
            raise AssertionError(f"{call} should return a dict, got {short(got)}.")
        hints = {
            "model_state": f"ZeRO stage {stage} over dp={dp} of Ψ = num_params/(tp·pp) = {expected['params_per_gpu']:.4g} "
                           "parameters per GPU, K = 12",
            "activations": f"min(pp, m) = {min(pp, expected['microbatches'])} micro-batches in flight × "
                           f"num_layers/pp = {model.num_layers / pp:g} layers × activation_bytes(...)",
            "total": "model_state + activations",
        }
        for key in ("model_state", "activations", "total"):
            if key not in got or not _close(got[key], expected[key]):
                raise AssertionError(f"{call}[{key!r}] = {short(got.get(key))}, expected {expected[key]:.6g}: "
                                     f"{hints[key]}.")
        verdict = got.get("fits")
        if not _is_bool(verdict):
            raise AssertionError(f"{call}['fits'] should be True or False, got {short(verdict)}.")
        if bool(verdict) != bool(expected["fits"]):
            raise AssertionError(f"{call}['fits'] = {short(verdict)}, expected {bool(expected['fits'])} (total "
                                 f"{expected['total'] / 1e9:.1f} GB against {cluster.memory_bytes / 1e9:.0f} GB).")
        step = got.get("step_time")
        if not _number(step) or not (0 < step < math.inf):
            raise AssertionError(f"{call}['step_time'] should be a positive number of seconds, got {short(step)}.")
        if not _same_time(step, expected["step_time"]):
            hint = _step_hint(fits, model, cluster, (dp, tp, pp, stage, b, rc, sp), float(step), expected)
            where = _cluster_words(cluster) if cluster.name == "drawn" else f"{cluster.name} in DGX A100 nodes"
            raise AssertionError(f"{call}['step_time'] = {float(step):.4g} s, expected {expected['step_time']:.4g} s: "
                                 f"{hint} (on {where}).")
    try:
        fits(GPT3_175B, DGX_A100(1024), 8, 8, 8, 0, 1, "full")
    except ValueError:
        return
    except Exception as exc:
        raise AssertionError(f"fits with dp·tp·pp = 512 on 1024 GPUs should raise ValueError, it raised "
                             f"{type(exc).__name__}: {exc}") from None
    raise AssertionError("fits with dp·tp·pp = 512 on 1024 GPUs should raise ValueError (every GPU has one place).")
