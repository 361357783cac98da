"""Turn a benchmark JSON into a markdown table and a figure of speedups.

    pytest bench/ --benchmark-only --benchmark-json results.json
    python bench/report.py results.json --out bench/results/DIR

One row per case and mpgemm variant (``mpgemm``, and ``mpgemm_*`` such as FP32 operands
or the check alone): its median time, TFLOP/s (or GB/s), and its speedup over each
baseline (the other implementations) measured in the same run (above 1: mpgemm is
faster). The figure has one panel per group: ``mpgemm``'s speedup over each baseline,
case by case.
"""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict
from pathlib import Path

MPGEMM = "mpgemm"


def in_gemm_geomean(case: str) -> bool:
    """Whether a gemm case (``MxKxN``) counts in the target's geometric mean: every
    dimension at least 2048."""
    return min(map(int, case.split("x"))) >= 2048


def _is_ours(impl: str) -> bool:
    return impl.startswith(MPGEMM)


def add_derived_metrics(benchmarks: list[dict]) -> None:
    """Add ``tflops``, ``gb_per_s`` and, to each mpgemm variant's results, ``ratio_to``
    each baseline of the same group and case (baseline time / mpgemm time), and
    ``kernel_ratio_to`` likewise from the GPU times with the host's latency hidden
    (``kernel_ms``), where both have one."""
    cases: dict[tuple, dict[str, dict]] = defaultdict(dict)
    for bench in benchmarks:
        info = bench["extra_info"]
        median = bench["stats"]["median"]
        if info.get("flops"):
            info["tflops"] = info["flops"] / median / 1e12
        if info.get("bytes"):
            info["gb_per_s"] = info["bytes"] / median / 1e9
        cases[(bench["group"], info["case"])][info["impl"]] = bench
    for impls in cases.values():
        for name, ours in impls.items():
            if _is_ours(name):
                info = ours["extra_info"]
                info["ratio_to"] = {
                    impl: bench["stats"]["median"] / ours["stats"]["median"]
                    for impl, bench in impls.items()
                    if not _is_ours(impl)
                }
                if info.get("kernel_ms"):
                    info["kernel_ratio_to"] = {
                        impl: bench["extra_info"]["kernel_ms"] / info["kernel_ms"]
                        for impl, bench in impls.items()
                        if not _is_ours(impl) and bench["extra_info"].get("kernel_ms")
                    }


def _rows(benchmarks: list[dict], only_main: bool = False) -> dict[str, list[dict]]:
    """mpgemm's results by group (only ``mpgemm`` itself, or every variant)."""
    groups: dict[str, list[dict]] = defaultdict(list)
    for bench in benchmarks:
        impl = bench["extra_info"]["impl"]
        if impl == MPGEMM or (_is_ours(impl) and not only_main):
            groups[bench["group"]].append(bench)
    return groups


def _geomean(values: list[float]) -> float | None:
    return math.prod(values) ** (1 / len(values)) if values else None


def _ratio(by: dict, group: str, case: str, impl: str, baseline: str, kind: str = "ratio_to"):
    bench = by.get((group, case, impl))
    return None if bench is None else bench["extra_info"].get(kind, {}).get(baseline)


def targets(benchmarks: list[dict]) -> list[str]:
    """Issue 11's targets as this run measured them (speedups: baseline time / mpgemm
    time, above 1 is faster). Peak memory against autocast is ``mpgemm train``'s."""
    by = {(b["group"], b["extra_info"]["case"], b["extra_info"]["impl"]): b for b in benchmarks}
    large = [
        case
        for group, case, impl in by
        if group == "gemm" and impl == MPGEMM and in_gemm_geomean(case)
    ]

    def gemm_geomean(kind: str) -> float | None:
        ratios = [_ratio(by, "gemm", c, MPGEMM, "torch_fp16", kind) for c in large]
        return _geomean([r for r in ratios if r is not None])

    syncs = [
        b["extra_info"]["host_syncs"]
        for b in benchmarks
        if b["group"] == "step" and _is_ours(b["extra_info"]["impl"])
        if b["extra_info"].get("host_syncs") is not None
    ]
    rows = [
        (
            "FP16 GEMM, geomean over " + (", ".join(large) or "no case") + ", from an idle GPU",
            "torch_fp16",
            gemm_geomean("ratio_to"),
            ">= 1.0x",
        ),
        (
            "the same, kernel times (host latency hidden)",
            "torch_fp16",
            gemm_geomean("kernel_ratio_to"),
            ">= 1.0x",
        ),
        (
            "guide MLP step, eager",
            "autocast_fused",
            _ratio(by, "step", "guide", MPGEMM, "autocast_fused"),
            ">= 1.3x",
        ),
        (
            "guide MLP step, CUDA graph",
            "autocast_fused",
            _ratio(by, "step", "guide", "mpgemm_cuda_graph", "autocast_fused"),
            ">= 1.3x",
        ),
        ("small MLP step, eager", "fp32", _ratio(by, "step", "small", MPGEMM, "fp32"), ">= 1.0x"),
        (
            "small MLP step, CUDA graph",
            "fp32",
            _ratio(by, "step", "small", "mpgemm_cuda_graph", "fp32"),
            ">= 1.0x",
        ),
    ]
    for case in sorted(c for g, c, impl in by if g == "unscale" and impl == MPGEMM):
        rows += [
            (
                f"unscale + inf check, {case}",
                "torch",
                _ratio(by, "unscale", case, MPGEMM, "torch"),
                ">= 1.0x",
            ),
            (
                f"unscale + inf check, {case}: share of a copy's bandwidth",
                "device_copy",
                _ratio(by, "unscale", case, MPGEMM, "device_copy"),
                ">= 0.8",
            ),
        ]
    lines = ["### targets", "", "| target | baseline | measured | goal |", "|---|---|---|---|"]
    lines += [
        f"| {what} | {base} | {_cell(value, '.2f')} | {goal} |" for what, base, value, goal in rows
    ]
    most = max(syncs) if syncs else None
    lines += [f"| host synchronisations per mpgemm step (most) | - | {_cell(most, 'd')} | 0 |", ""]
    return lines


def markdown(data: dict) -> str:
    env = data["machine_info"].get("mpgemm", {})
    flush_ms = data["machine_info"].get("l2_flush_ms")
    lines = [
        "Device: " + ", ".join(f"{k} {v}" for k, v in env.items()),
        f"Run: {data.get('datetime', '?')}",
        *_flush_line(flush_ms),
        "",
        *targets(data["benchmarks"]),
    ]
    for group, rows in _rows(data["benchmarks"]).items():
        baselines = sorted({b for r in rows for b in r["extra_info"].get("ratio_to", {})})
        # GPU times with the host's latency hidden, and the host's, where the run
        # measured them.
        kernel = any("kernel_ms" in r["extra_info"] for r in rows)
        host = any("host_ms" in r["extra_info"] for r in rows)
        # What an idle round's time leaves unexplained (device-timed rows, with the
        # flush measured): neither the kernel nor the host's enqueue beyond the flush.
        rest = kernel and host and flush_ms is not None
        rate = "TFLOP/s" if any("tflops" in r["extra_info"] for r in rows) else "GB/s"
        headers = ["case", "impl", "ms", rate, "peak MiB", *(f"x {b}" for b in baselines)]
        if kernel:
            headers.append("kernel ms")
        if host:
            headers.append("host ms")
        if rest:
            headers.append("unexplained ms")
        if kernel:
            headers += [f"x {b} (kernel)" for b in baselines]
        lines += [f"### {group}", "", f"| {' | '.join(headers)} |", "|---" * len(headers) + "|"]
        for row in rows:
            info = row["extra_info"]
            value = info.get("tflops", info.get("gb_per_s"))
            cells = [
                info["case"],
                info["impl"],
                f"{row['stats']['median'] * 1e3:.3f}",
                _cell(value, ".3g"),
                _cell(info.get("peak_memory_mb"), ".0f"),
                *(_cell(info.get("ratio_to", {}).get(b), ".2f") for b in baselines),
            ]
            if kernel:
                cells.append(_cell(info.get("kernel_ms"), ".3f"))
            if host:
                cells.append(_cell(info.get("host_ms"), ".3f"))
            if rest:
                cells.append(_cell(_unexplained_ms(row, flush_ms), ".3f"))
            if kernel:
                cells += [_cell(info.get("kernel_ratio_to", {}).get(b), ".2f") for b in baselines]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
        lines += _counts(data["benchmarks"], group)
    lines += autotuned_lines(data.get("autotuned", []))
    return "\n".join(lines)


def autotuned_lines(chosen: list[dict]) -> list[str]:
    """The config each launch kind ran (``launches.chosen_configs``), where the run
    autotuned any, numbered; then, for the kinds whose configs the autotuner timed in
    the run, every config it timed, fastest first (the first is the one it chose), with
    its median and its time over the fastest's."""
    if not chosen:
        return []
    lines = ["### autotuned", "", "| # | kernel | kind | config |", "|---|---|---|---|"]
    for number, entry in enumerate(chosen, 1):
        kind = ", ".join(entry["kind"])
        lines.append(f"| {number} | {entry['kernel']} | {kind} | {entry['config']} |")
    timed = [(number, entry) for number, entry in enumerate(chosen, 1) if entry.get("timings")]
    if timed:
        lines += [
            "",
            "### autotuner timings",
            "",
            "| # | config | median ms | x fastest |",
            "|---|---|---|---|",
        ]
    for number, entry in timed:
        # A config that failed (no time) comes last.
        ranked = sorted(entry["timings"], key=lambda t: (t[1] is None, t[1] or 0.0))
        fastest = ranked[0][1]
        for text, ms in ranked:
            if ms is None:
                lines.append(f"| {number} | {text} | failed | |")
            else:
                ratio = f"{ms / fastest:.2f}" if fastest else ""
                lines.append(f"| {number} | {text} | {ms:.4f} | {ratio} |")
    return [*lines, ""]


def _flush_line(flush_ms: float | None) -> list[str]:
    """What the idle rounds' time and the host times read against: the flush before
    each idle round, which hides that much of the host's enqueue."""
    if flush_ms is None:
        return []
    return [
        f"L2 flush before each round: {flush_ms:.3f} ms of GPU time. A round from an idle "
        "GPU (ms) adds the host's enqueue (host ms) beyond it to the kernel's time "
        "(kernel ms); unexplained ms is what neither accounts for."
    ]


def _unexplained_ms(row: dict, flush_ms: float) -> float | None:
    """An idle round's median less what should make it up: the kernel's time and the
    host's enqueue beyond the flush (``_flush_line``). Near zero where host time
    explains the gap between the two clocks; more points at the device (or at an
    enqueue slower from an idle GPU than from a busy one)."""
    info = row["extra_info"]
    kernel, host = info.get("kernel_ms"), info.get("host_ms")
    if kernel is None or host is None:
        return None
    return row["stats"]["median"] * 1e3 - kernel - max(0.0, host - flush_ms)


def _cell(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _counts(benchmarks: list[dict], group: str) -> list[str]:
    """Per step, for every implementation of the group that measured them: kernels
    launched and the host's microseconds with triton's launch stubbed below mpgemm's
    (torch's ops run: bench/test_bench_step.py); no lines for a group without them."""
    rows = [
        b for b in benchmarks if b["group"] == group and b["extra_info"].get("launches") is not None
    ]
    if not rows:
        return []
    lines = [
        "| case | impl | launches per step | host us per step, triton's launch stubbed |",
        "|---|---|---|---|",
    ]
    for row in rows:
        info = row["extra_info"]
        host = info.get("host_us")
        lines.append(
            f"| {info['case']} | {info['impl']} | {info['launches']} | "
            + ("-" if host is None else f"{host:.0f}")
            + " |"
        )
    return [*lines, ""]


def figure(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = _rows(data["benchmarks"], only_main=True)
    fig, axes = plt.subplots(len(groups), 1, figsize=(10, 3.2 * len(groups)), squeeze=False)
    for ax, (group, rows) in zip(axes[:, 0], groups.items(), strict=True):
        names = [r["extra_info"]["case"] for r in rows]
        baselines = sorted({b for r in rows for b in r["extra_info"].get("ratio_to", {})})
        for baseline in baselines:
            ratios = [r["extra_info"].get("ratio_to", {}).get(baseline, float("nan")) for r in rows]
            ax.plot(names, ratios, "o-", label=f"vs {baseline}")
        ax.axhline(1.0, color="gray", linewidth=0.8)
        ax.set(title=group, ylabel="mpgemm speedup")
        ax.tick_params(axis="x", labelrotation=30, labelsize=8)
        ax.legend(fontsize=8)
    env = data["machine_info"].get("mpgemm", {})
    fig.suptitle(
        f"{env.get('gpu', env.get('device', '?'))}: speedup of mpgemm (baseline time / mpgemm time)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("json", type=Path, help="pytest-benchmark's --benchmark-json file")
    parser.add_argument("--out", type=Path, help="write report.md and speedup.png here")
    args = parser.parse_args(argv)
    data = json.loads(args.json.read_text())
    text = markdown(data)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "report.md").write_text(text)
        figure(data, args.out / "speedup.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
