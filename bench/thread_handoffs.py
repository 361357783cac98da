"""Where a profiled step's host work passes from one thread to another: autograd hands a
GPU's backward to its worker thread of the device and wakes the caller at the end
(unless the backward runs on the calling thread: ``LossScaleOptimizer.backward``).

From a torch.profiler chrome trace: the host-side events (ops, annotations, CUDA
runtime and driver calls) in start order; at each change of thread, the gap from the
last event the previous thread ended to the new thread's first event, with both
events' names. A gap holds the handoff and whatever ran unprofiled between (a few
Python calls, at these two points of a step).

    python3 bench/thread_handoffs.py TRACE.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import NamedTuple

HOST_CATEGORIES = {"cpu_op", "user_annotation", "cuda_runtime", "cuda_driver"}


class Handoff(NamedTuple):
    gap_us: float
    before: str  # the previous thread's last event to end
    after: str  # the new thread's first event


def handoffs(events: list[dict]) -> list[Handoff]:
    """The handoffs between host threads in ``events`` (a chrome trace's
    ``traceEvents``), in time order."""
    host = sorted(
        (e for e in events if e.get("ph") == "X" and e.get("cat") in HOST_CATEGORIES),
        key=lambda e: e["ts"],
    )
    found: list[Handoff] = []
    ended: dict[object, tuple[float, str]] = {}  # thread: (latest end, its event's name)
    thread = None
    for e in host:
        if thread is not None and e["tid"] != thread:
            end, name = ended[thread]
            found.append(Handoff(e["ts"] - end, name, e["name"]))
        thread = e["tid"]
        end = e["ts"] + e["dur"]
        if end >= ended.get(thread, (float("-inf"), ""))[0]:
            ended[thread] = (end, e["name"])
    return found


def summary(events: list[dict]) -> str:
    """One line: how many handoffs, and each gap (us) with the events on either side."""
    found = handoffs(events)
    if not found:
        return "host thread handoffs: none"
    gaps = "; ".join(f"{h.gap_us:.0f} ({h.before[:40]} -> {h.after[:40]})" for h in found)
    return f"host thread handoffs: {len(found)}, gaps in us: {gaps}"


def main(argv: list[str]) -> None:
    events = json.loads(Path(argv[0]).read_text())["traceEvents"]
    for h in handoffs(events):
        print(f"{h.gap_us:8.1f} us  {h.before[:60]}  ->  {h.after[:60]}")


if __name__ == "__main__":
    main(sys.argv[1:])
