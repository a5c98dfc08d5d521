"""labsupport.Timeline: asynchronous spans (track, collectives, finish) and overlap measures (covered,
hidden_fraction), on real gloo workers."""

import pickle
import time

import pytest
import torch
import torch.distributed as dist

import labsupport
from labsupport import CommCounter, Timeline
from labsupport.timeline import Event


def ev(name, kind, start, end):
    return Event(name, kind, start, end)


# ---------------------------------------------------------------------------------------------------------------
# pure measures


def test_covered_merges_overlapping_spans():
    events = [ev("a", "comm", 0.0, 2.0), ev("b", "comm", 1.0, 3.0), ev("c", "comm", 5.0, 6.0),
              ev("x", "compute", 0.0, 10.0)]
    assert Timeline.covered(events) == pytest.approx(4.0)
    assert Timeline.covered(events, "compute") == pytest.approx(10.0)
    assert Timeline.covered(events, names={"c"}) == pytest.approx(1.0)


def test_hidden_fraction_counts_union_not_pairs():
    # two comm spans in flight together over one compute span: overlap() double counts, hidden_fraction does not
    events = [ev("a", "comm", 0.0, 2.0), ev("b", "comm", 0.0, 2.0), ev("bwd", "compute", 1.0, 3.0)]
    assert Timeline.overlap(events) == pytest.approx(2.0)
    assert Timeline.hidden_fraction(events) == pytest.approx(0.5)


def test_hidden_fraction_ignores_waits_and_filters_names():
    events = [ev("ar", "comm", 2.0, 4.0), ev("backward", "compute", 0.0, 3.0), ev("finish", "wait", 3.0, 4.0),
              ev("step", "compute", 3.5, 4.0)]
    assert Timeline.hidden_fraction(events) == pytest.approx(0.75)
    assert Timeline.hidden_fraction(events, names_b={"backward"}) == pytest.approx(0.5)
    assert Timeline.hidden_fraction([ev("backward", "compute", 0, 1)]) == 0.0


def test_timeline_pickles_without_its_lock():
    tl = Timeline()
    with tl.span("forward"):
        pass
    copy = pickle.loads(pickle.dumps(tl))
    assert [e.name for e in copy.events] == ["forward"]
    with copy.span("again"):  # the lock was rebuilt
        pass


# ---------------------------------------------------------------------------------------------------------------
# on workers


def track_one():
    tl = Timeline()
    x = torch.ones(1 << 16)
    work = tl.track(dist.all_reduce(x, async_op=True), "grad")
    assert work is not None
    with tl.span("compute"):
        time.sleep(0.01)
    work.wait()
    events = tl.finish()
    return [(e.name, e.kind, e.start, e.end) for e in events], x[0].item()


def test_track_records_issue_to_completion():
    for events, value in labsupport.run(track_one, world_size=2):
        assert value == 2.0
        comm = [e for e in events if e[1] == "comm"]
        assert len(comm) == 1 and comm[0][0] == "grad"
        assert 0 <= comm[0][2] <= comm[0][3]
        compute = [e for e in events if e[1] == "compute"][0]
        assert comm[0][2] <= compute[2]  # issued before the compute span began


def record_collectives(order):
    """All-reduces issued by anyone inside tl.collectives() are recorded; nesting with CommCounter either way."""
    from labsupport import tap

    tl = Timeline()
    grads = [torch.ones(10), torch.ones(1000)]
    listening = tap.observers()  # the worker's own observers (the call board)
    if order == "timeline-outside":
        with tl.collectives():
            with CommCounter() as cc:
                works = [dist.all_reduce(g, async_op=True) for g in grads]
                dist.broadcast(torch.zeros(3), 0)  # not an all-reduce: not recorded with the default kinds
            for w in works:
                w.wait()
    else:
        with CommCounter() as cc:
            with tl.collectives(kinds=None):
                works = [dist.all_reduce(g, async_op=True) for g in grads]
                dist.broadcast(torch.zeros(3), 0)
                for w in works:
                    w.wait()
    # after both contexts: nothing recorded any more (only the worker's own observers listen to the tap), calls work
    dist.all_reduce(torch.ones(2))
    left = [type(o).__name__ for o in tap.observers() if o not in listening]
    return sorted(e.name for e in tl.events), cc.count("all_reduce"), left, grads[1][0].item()


@pytest.mark.parametrize("order", ["timeline-outside", "counter-outside"])
def test_collectives_records_every_all_reduce(order):
    for names, counted, patched, value in labsupport.run(record_collectives, order, world_size=2):
        assert value == 2.0
        assert counted == 2
        expected = ["all_reduce 40 B", "all_reduce 4000 B"]
        if order == "counter-outside":
            expected = sorted(expected + ["broadcast 12 B"])
        assert names == expected
        assert patched == []  # both unsubscribed from the tap


def timeline_inside_counter_exit_order():
    """The counter leaves while the timeline is still recording: the timeline goes on recording (both are
    subscribers of the one tap), and nothing is recorded after it left."""
    tl = Timeline()
    cc = CommCounter()
    cc.__enter__()
    with tl.collectives():
        cc.__exit__(None, None, None)
        dist.all_reduce(torch.ones(4))
    dist.all_reduce(torch.ones(4))
    return len(tl.events)


def test_collectives_survives_counter_leaving_first():
    assert labsupport.run(timeline_inside_counter_exit_order, world_size=2) == [1, 1]


class _NoFuture:
    """A work handle from a backend without futures."""

    def __init__(self):
        self.waited = False

    def get_future(self):
        raise RuntimeError("not supported by this backend")

    def wait(self):
        self.waited = True
        return True


def test_track_without_a_future_closes_at_finish_without_delay(monkeypatch):
    """A call without a future is closed by finish() itself, once its wait returns: finish() never waits for a
    completion callback that cannot come (it would poll for a second). Its sleeps are counted, not timed."""
    from labsupport import timeline

    tl = Timeline()
    work = _NoFuture()
    assert tl.track(work, "old backend") is work
    slept = []
    monkeypatch.setattr(timeline.time, "sleep", slept.append)
    events = tl.finish()
    monkeypatch.undo()
    assert slept == [], f"finish() waited {len(slept)} times for a callback"
    assert work.waited and [(e.name, e.kind) for e in events] == [("old backend", "comm")]


def test_chrome_trace_has_a_process_per_rank_and_keeps_the_spans(tmp_path):
    ranks = [[ev("backward", "compute", 0.0, 0.004), ev("all_reduce 4000 B", "comm", 0.001, 0.003)],
             [ev("backward", "compute", 0.0005, 0.005), ev("finish", "wait", 0.005, 0.006)]]
    path = tmp_path / "t.json"
    trace = Timeline.chrome_trace(ranks, path)
    import json

    assert json.loads(path.read_text()) == trace
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert names == {0: "rank 0", 1: "rank 1"}
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert [(e["pid"], e["tid"], e["name"]) for e in spans] == [
        (0, 0, "backward"), (0, 1, "all_reduce 4000 B"), (1, 0, "backward"), (1, 0, "finish")]
    assert spans[1]["ts"] == pytest.approx(1000.0) and spans[1]["dur"] == pytest.approx(2000.0)
    # read back, the spans give the same hidden share as the events they came from
    back = [Event(e["name"], e["cat"], e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6) for e in spans if e["pid"] == 0]
    assert Timeline.hidden_fraction(back) == pytest.approx(Timeline.hidden_fraction(ranks[0]))
