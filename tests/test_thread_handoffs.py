"""bench/thread_handoffs.py: the gaps where a profiled step's host work passes between
threads (autograd's worker thread of a GPU and the caller), read from a chrome trace."""

from tests.bench_scripts import load

thread_handoffs = load("thread_handoffs")


def _event(tid, ts, dur, name, cat="cpu_op"):
    return {"ph": "X", "cat": cat, "tid": tid, "ts": ts, "dur": dur, "name": name}


def test_gaps_at_each_change_of_thread_from_the_latest_end_before_it():
    events = [
        _event(1, 0.0, 100.0, "LinearFunction"),
        _event(1, 10.0, 5.0, "aten::empty"),  # nested: ends before its parent
        _event(1, 120.0, 8.0, "aten::expand_as"),
        # not host work: a kernel and a flow event between the threads
        {"ph": "X", "cat": "kernel", "tid": 7, "ts": 150.0, "dur": 50.0, "name": "gemm"},
        {"ph": "s", "cat": "ac2g", "tid": 2, "ts": 160.0, "name": "flow"},
        _event(2, 300.0, 60.0, "evaluate_function: CrossEntropyBackward"),
        _event(2, 345.0, 6.0, "cuLaunchKernelEx", cat="cuda_driver"),  # nested
        _event(1, 500.0, 20.0, "Optimizer.step", cat="user_annotation"),
        _event(1, 530.0, 1.0, "aten::detach"),
    ]
    found = thread_handoffs.handoffs(events)
    assert found == [
        (172.0, "aten::expand_as", "evaluate_function: CrossEntropyBackward"),
        (140.0, "evaluate_function: CrossEntropyBackward", "Optimizer.step"),
    ]
    assert thread_handoffs.summary(events).startswith("host thread handoffs: 2, gaps in us: 172 (")


def test_one_thread_has_no_handoffs():
    events = [_event(1, 0.0, 10.0, "a"), _event(1, 20.0, 10.0, "b")]
    assert thread_handoffs.handoffs(events) == []
    assert thread_handoffs.summary(events) == "host thread handoffs: none"
