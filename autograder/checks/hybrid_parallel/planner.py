"""``check_activation_bytes`` and ``check_fits``: the planner's formulas (Korthikanti et al. 2022, Table 2; the ZeRO
paper, Rajbhandari et al. 2020) restated as oracles, against drawn shapes, models and layouts.
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


def reference_fits(model, cluster, dp, tp, pp, zero_stage=0, micro_batch=1, recompute="none",
                   sequence_parallel=False) -> dict:
    """The memory terms of the notebook's planner."""
    psi = model.num_params / (tp * pp)
    m = model.global_batch // (dp * micro_batch)
    act = min(pp, m) * (model.num_layers / pp) * reference_activation_bytes(
        model.seq_len, micro_batch, model.hidden, model.heads, tp, sequence_parallel, recompute)
    state = _zero(psi, dp, zero_stage)
    return {"params_per_gpu": psi, "model_state": state, "activations": act, "total": state + act,
            "fits": state + act <= cluster.memory_bytes, "microbatches": m}


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


def check_fits(fits, activation_bytes=None):
    """Drawn models and layouts: the model-state (ZeRO) and activation terms, their sum, the verdict; ValueError.

    ``fits`` is graded on its own: given the student's ``activation_bytes``, activations computed from it count as
    right too (that function's mistakes cost exercise 4's points only).
    """
    from labsupport.lessons.hybrid_parallel import DGX_A100, GPT3_175B, NARAYANAN_TABLE1, Model

    seed = draw_seed()
    rng = random.Random(seed)
    cases = [(GPT3_175B, 1024, 16, 8, 8, 0, 1, "full", False), (GPT3_175B, 1024, 16, 8, 8, 0, 1, "none", False),
             (GPT3_175B, 1024, 16, 8, 8, 1, 1, "selective", True)]
    for row in NARAYANAN_TABLE1[:3]:
        cases.append((row["model"], row["gpus"], row["gpus"] // (row["t"] * row["p"]), row["t"], row["p"], 0, 1,
                      "full", False))
    for _ in range(30):
        a = rng.choice([16, 32, 64])
        tp, pp, dp = rng.choice([1, 2, 4, 8]), rng.choice([1, 2, 4, 8]), rng.choice([1, 2, 4, 8, 16])
        b = rng.choice([1, 2, 4])
        model = Model("drawn", pp * rng.randint(1, 6), a * rng.choice([64, 128]), a, rng.choice([1024, 2048]),
                      global_batch=dp * b * rng.choice([1, 2, 3, 8, 16]))
        cases.append((model, tp * pp * dp, dp, tp, pp, rng.randint(0, 3), b, rng.choice(["none", "selective", "full"]),
                      rng.random() < 0.5))
    for model, gpus, dp, tp, pp, stage, b, rc, sp in cases:
        cluster = DGX_A100(gpus)
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
        if not isinstance(step, (int, float)) or isinstance(step, bool) or not (0 < step < math.inf):
            raise AssertionError(f"{call}['step_time'] should be a positive number of seconds, got {short(step)}.")
    try:
        fits(GPT3_175B, DGX_A100(1024), 8, 8, 8, 0, 1, "full")
    except ValueError:
        return
    except Exception as exc:
        raise AssertionError(f"fits with dp·tp·pp = 512 on 1024 GPUs should raise ValueError, it raised "
                             f"{type(exc).__name__}: {exc}") from None
    raise AssertionError("fits with dp·tp·pp = 512 on 1024 GPUs should raise ValueError (every GPU has one place).")
