"""The checks of notebook 10 that run in one process: ``check_simulate_schedule`` (05's simulator with the
weight-gradient pass ``W``) and ``check_zero_bubble_schedule``."""

from __future__ import annotations

import math
import random

from .._common import draw_seed, short
from ..pipeline_parallel.reference import reference_1f1b, reference_gpipe
from .reference import (random_valid_schedule_w, reference_in_flight_w, reference_simulate_w,
                        reference_zero_bubble)


def _fmt(ops, limit: int = 14) -> str:
    text = " ".join(f"{op}{mb}" for op, mb in ops[:limit])
    return text + (" ..." if len(ops) > limit else "")


def _call(fn, what, *args):
    import copy

    before = copy.deepcopy(args)
    try:
        out = fn(*args)
    except NotImplementedError:
        name = getattr(fn, "__name__", what.split("(")[0].split()[0])
        raise AssertionError(f"{name} is not started: it still raises NotImplementedError.") from None
    except Exception as exc:  # noqa: BLE001
        raise AssertionError(f"{what} raised {type(exc).__name__}: {exc}") from None
    if args != before:
        raise AssertionError(f"{what} changed its input schedule; leave it untouched.")
    return out


def check_simulate_schedule(simulate_schedule) -> None:
    """Against the reference on ZB-H1, 1F1B and GPipe without W, and random valid orders with W, odd times."""
    seed = draw_seed()
    rng = random.Random(seed)
    cases = [("ZB-H1", reference_zero_bubble(4, 6), (1.0, 1.0, 1.0)),
             ("1F1B without W", reference_1f1b(3, 5), (1.0, 2.0, 0.7)),
             ("GPipe without W", reference_gpipe(2, 3), (1.3, 2.1, 0.5))]
    for _ in range(4):
        p, m = rng.randint(2, 5), rng.randint(1, 7)
        times = tuple(round(rng.uniform(0.3, 2.5), 2) for _ in range(3))
        cases.append((f"a random valid order with W (p={p}, m={m})", random_valid_schedule_w(p, m, rng), times))
    p, m = rng.randint(2, 5), rng.randint(2, 8)
    cases.append((f"ZB-H1 (p={p}, m={m})", reference_zero_bubble(p, m), (1.1, 0.9, 0.6)))
    late = reference_zero_bubble(4, 3)  # stage 1 puts off all its W's: it ends last, after stage 0 and stage 3
    late[1] = [op for op in late[1] if op[0] != "W"] + [("W", mb) for mb in range(3)]
    cases.append(("ZB-H1 (p=4, m=3) with stage 1's W's all at its end", late, (0.9, 1.1, 2.3)))
    for name, schedule, (tf, tb, tw) in cases:
        what = f"simulate_schedule on {name}, t_fwd={tf}, t_bwd={tb}, t_w={tw} (seed {seed})"
        got = _call(simulate_schedule, what, [list(ops) for ops in schedule], tf, tb, tw)
        ref = reference_simulate_w(schedule, tf, tb, tw)
        if not isinstance(got, dict) or not {"busy", "makespan", "bubble_fraction"} <= set(got):
            raise AssertionError(f"{what}: return a dict with 'busy', 'makespan' and 'bubble_fraction', "
                                 f"got {short(got)}")
        wrong = []  # the spans off their times: the earliest one (by its expected start) is where it goes wrong
        for s, (mine, theirs) in enumerate(zip(got["busy"], ref["busy"])):
            if len(mine) != len(theirs):
                raise AssertionError(f"{what}: stage {s} has {len(mine)} spans, expected one per operation "
                                     f"({len(theirs)}).")
            for (a, b, op, mb), (ea, eb, eop, emb) in zip(mine, theirs):
                if (op, mb) != (eop, emb):
                    raise AssertionError(f"{what}: stage {s}'s spans must follow its list: got {op}{mb}, "
                                         f"expected {eop}{emb}.")
                if not (math.isclose(a, ea, abs_tol=1e-9) and math.isclose(b, eb, abs_tol=1e-9)):
                    wrong.append((ea, s, a, b, op, mb, eb))
        if wrong:
            ea, s, a, b, op, mb, eb = min(wrong)
            hint = ""
            if op == "W" and math.isclose(b - a, tb, abs_tol=1e-9) and not math.isclose(tb, tw):
                hint = " A W takes t_w, not t_bwd."
            elif op == "W":
                hint = " A W waits only for the B of the same micro-batch on its own stage (and the stage)."
            elif op == "B" and s < len(schedule) - 1:
                hint = (" B of a micro-batch waits for B of it on the next stage: the gradient of the "
                        "input, not W, is what travels back.")
            raise AssertionError(f"{what}: stage {s}, {op}{mb} runs from {a:.4g} to {b:.4g}, expected "
                                 f"{ea:.4g} to {eb:.4g}.{hint}")
        if not math.isclose(got["makespan"], ref["makespan"], abs_tol=1e-9):
            ends = [spans[-1][1] for spans in ref["busy"] if spans]
            last = max(range(len(ends)), key=ends.__getitem__)
            same = [s for s, end in enumerate(ends) if math.isclose(got["makespan"], end, abs_tol=1e-9)]
            raise AssertionError(f"{what}: makespan {got['makespan']}, expected {ref['makespan']}: the makespan is "
                                 f"when the last operation of any stage ends (here stage {last}'s last)"
                                 + (f", not the end of stage {same[0]}" if same else "") + ".")
        if not math.isclose(got["bubble_fraction"], ref["bubble_fraction"], abs_tol=1e-9):
            raise AssertionError(f"{what}: bubble_fraction {got['bubble_fraction']}, expected "
                                 f"{ref['bubble_fraction']} (1 − busy time of all stages / (p · makespan)).")


def check_zero_bubble_schedule(zero_bubble_schedule) -> None:
    """Many (p, m), m < p included, fixed and drawn at grading time (p up to 16, m up to 64): every F, B, W once per
    stage, the dependencies valid, a bubble below 1F1B's and no larger than ZB-H1's, and at most 1F1B's peak of
    micro-batches in flight (F to W) on any stage."""
    seed = draw_seed()
    rng = random.Random(seed)
    sizes = [(p, m, "") for p, m in [(2, 1), (2, 4), (3, 3), (4, 8), (4, 2), (5, 7)]]
    drawn = [(rng.randint(2, 12), rng.randint(1, 40)) for _ in range(3)] + [(rng.randint(7, 16), rng.randint(11, 64))]
    for p, m, drawn_with in sizes + [(p, m, f" (seed {seed})") for p, m in drawn]:
        what = f"zero_bubble_schedule({p}, {m}){drawn_with}"
        got = _call(zero_bubble_schedule, what, p, m)
        if not isinstance(got, list) or len(got) != p:
            raise AssertionError(f"{what}: return one list per stage ({p}), got {short(got)}")
        for s, ops in enumerate(got):
            try:
                items = [(str(op), int(mb)) for op, mb in ops]
            except (TypeError, ValueError):
                raise AssertionError(f"{what}: stage {s}'s list must hold (op, micro-batch) pairs, got "
                                     f"{short(ops)}") from None
            want = sorted((op, mb) for op in "FBW" for mb in range(m))
            if sorted(items) != want:
                missing = sorted(set(want) - set(items))
                extra = sorted(set(items) - set(want)) or [x for x in items if items.count(x) > 1][:1]
                raise AssertionError(f"{what}: stage {s} must run F, B and W of every micro-batch 0..{m - 1} exactly "
                                     f"once; missing {missing[:4]}, extra or repeated {extra[:4]}: {_fmt(items)}")
            for op in "FBW":
                order = [mb for o, mb in items if o == op]
                if order != sorted(order):
                    raise AssertionError(f"{what}: stage {s} runs its {op}s out of micro-batch order: {_fmt(items)}")
            for mb in range(m):
                if items.index(("W", mb)) < items.index(("B", mb)) or items.index(("B", mb)) < items.index(("F", mb)):
                    raise AssertionError(f"{what}: on stage {s}, micro-batch {mb} must run F, then B (the input "
                                         f"gradient), then W (the weight gradient, which needs B's output "
                                         f"gradient): {_fmt(items)}")
        schedule = [[(op, int(mb)) for op, mb in ops] for ops in got]
        try:
            zb = reference_simulate_w(schedule, 1.0, 1.0, 1.0)
        except ValueError as exc:
            raise AssertionError(f"{what}: {exc}. F of a micro-batch waits for F on the stage before, B for B on "
                                 "the stage after.") from None
        limit = max(reference_in_flight_w(reference_1f1b(p, m)))
        flight = reference_in_flight_w(schedule)
        if max(flight) > limit:
            s = flight.index(max(flight))
            raise AssertionError(f"{what}: stage {s} keeps {max(flight)} micro-batches from F to W at once; 1F1B's "
                                 f"peak is {limit} (its first stage). Start fewer forwards before the first B, or "
                                 f"run W sooner: {_fmt(schedule[s])}")
        one = reference_simulate_w(reference_1f1b(p, m), 1.0, 2.0)     # 1F1B: B and W in one backward of 2
        zbh1 = reference_simulate_w(reference_zero_bubble(p, m), 1.0, 1.0, 1.0)
        if zb["makespan"] > zbh1["makespan"] + 1e-9:
            extra = (" (no better than 1F1B)" if zb["makespan"] >= one["makespan"] - 1e-9 else "") + (
                ": start each B as soon as its gradient arrives and let the W's wait, to fill the time a stage "
                "would otherwise spend idle")
            raise AssertionError(f"{what}: with t_F = t_B = t_W = 1 the step takes {zb['makespan']:g} (bubble "
                                 f"{zb['bubble_fraction']:.3f}), ZB-H1 takes {zbh1['makespan']:g} (bubble "
                                 f"{zbh1['bubble_fraction']:.3f}), 1F1B {one['makespan']:g}{extra}.")
