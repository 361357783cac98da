"""bench/report.py: speedups over the baselines of the same run, from the rounds timed
from an idle GPU and from the GPU times with the host's latency hidden."""

import pytest

from tests.bench_scripts import load


def _report():
    return load("report")


def _bench(impl, median_s, kernel_ms=None, case="2048x2048x2048", group="gemm", host_ms=None):
    info = {"case": case, "impl": impl, "flops": 1e9}
    if kernel_ms is not None:
        info["kernel_ms"] = kernel_ms
        info["host_ms"] = host_ms
    return {"group": group, "stats": {"median": median_s}, "extra_info": info}


def test_speedups_from_idle_rounds_and_from_kernel_times():
    report = _report()
    # Eager: 0.18 ms against cuBLAS's 0.03; the kernels: 0.036 ms against 0.03.
    ours, cublas, fp32 = (
        _bench("mpgemm", 180e-6, 0.036, host_ms=0.1),
        _bench("torch_fp16", 30e-6, 0.030, host_ms=0.021),
        _bench("fp32", 300e-6),  # a baseline without a kernel time: no kernel ratio
    )
    benchmarks = [ours, cublas, fp32]
    report.add_derived_metrics(benchmarks)
    info = ours["extra_info"]
    assert info["ratio_to"] == pytest.approx({"torch_fp16": 30 / 180, "fp32": 300 / 180})
    assert info["kernel_ratio_to"] == pytest.approx({"torch_fp16": 0.030 / 0.036})
    assert "ratio_to" not in cublas["extra_info"]  # baselines get no ratios
    run = {"machine_info": {"l2_flush_ms": 0.085}, "benchmarks": benchmarks}
    table = report.markdown(run).splitlines()
    assert table[2].startswith("L2 flush before each round: 0.085 ms of GPU time.")
    start = table.index("### gemm")
    header, _, row = table[start + 2 : start + 5]
    assert header.split(" | ")[-5:] == [
        "kernel ms",
        "host ms",
        "unexplained ms",
        "x fp32 (kernel)",
        "x torch_fp16 (kernel) |",
    ]
    # Of 0.180 ms from an idle GPU, the kernel takes 0.036 and the enqueue past the
    # flush 0.100 - 0.085: 0.129 is neither's.
    assert row.split(" | ")[-5:] == ["0.036", "0.100", "0.129", "-", "0.83 |"]
    # An enqueue that the flush hides explains nothing: the rest is the kernel's.
    pointer = _bench("mpgemm_pointer", 40e-6, 0.031, host_ms=0.05)
    report.add_derived_metrics([pointer, cublas])
    table = report.markdown({**run, "benchmarks": [pointer, cublas]}).splitlines()
    start = table.index("### gemm")
    columns = dict(zip(*(table[start + i].split(" | ") for i in (2, 4)), strict=True))
    assert columns["impl"] == "mpgemm_pointer" and columns["unexplained ms"] == "0.009"


def test_a_run_without_kernel_times_keeps_its_table():
    report = _report()
    benchmarks = [_bench("mpgemm", 180e-6), _bench("torch_fp16", 30e-6)]
    report.add_derived_metrics(benchmarks)
    assert "kernel_ratio_to" not in benchmarks[0]["extra_info"]
    table = report.markdown({"machine_info": {}, "benchmarks": benchmarks})
    gemm = table[table.index("### gemm") :]
    assert "kernel" not in gemm and "| 2048x2048x2048 | mpgemm | 0.180 |" in gemm
    assert "### autotuned" not in table  # (nothing autotuned: the CPU's path)


def test_the_autotuned_configs_close_the_report():
    report = _report()
    benchmarks = [_bench("mpgemm", 180e-6), _bench("torch_fp16", 30e-6)]
    report.add_derived_metrics(benchmarks)
    chosen = {"kernel": "_gemm_tma_kernel", "kind": ["8192", "torch.float16"], "config": "BM 128"}
    table = report.markdown({"machine_info": {}, "benchmarks": benchmarks, "autotuned": [chosen]})
    lines = table.splitlines()
    start = lines.index("### autotuned")
    assert lines[start + 4] == "| 1 | _gemm_tma_kernel | 8192, torch.float16 | BM 128 |"
    assert "### autotuner timings" not in table  # (none timed in the run)


def test_every_config_the_autotuner_timed_is_listed_fastest_first():
    report = _report()
    benchmarks = [_bench("mpgemm", 180e-6), _bench("torch_fp16", 30e-6)]
    report.add_derived_metrics(benchmarks)
    tuned = {
        "kernel": "_gemm_tma_kernel",
        "kind": ["4096", "1024"],
        "config": "BLOCK_M: 128",
        "timings": [["BM 128, BN 256", 0.125], ["BM 64, BN 256", None], ["BM 128, BN 128", 0.1]],
    }
    untimed = {"kernel": "_adam_kernel", "kind": ["2048"], "config": "BLOCK: 2048"}
    data = {"machine_info": {}, "benchmarks": benchmarks, "autotuned": [untimed, tuned]}
    lines = report.markdown(data).splitlines()
    start = lines.index("### autotuner timings")
    assert lines[start + 2 : start + 7] == [
        "| # | config | median ms | x fastest |",
        "|---|---|---|---|",
        "| 2 | BM 128, BN 128 | 0.1000 | 1.00 |",
        "| 2 | BM 128, BN 256 | 0.1250 | 1.25 |",
        "| 2 | BM 64, BN 256 | failed | |",
    ]
    assert lines[lines.index("### autotuned") + 5].startswith("| 2 | _gemm_tma_kernel |")


def test_a_steps_host_time_has_a_column_of_its_own():
    report = _report()
    # Whole steps: wall clock, and on a GPU the host's time to enqueue one; no kernel time.
    benchmarks = [_bench("mpgemm", 3.3e-3, case="guide", group="step"), _bench("fp32", 5e-3)]
    benchmarks[0]["extra_info"]["host_ms"] = 3.1
    benchmarks[1].update(group="step")
    benchmarks[1]["extra_info"]["case"] = "guide"
    report.add_derived_metrics(benchmarks)
    table = report.markdown({"machine_info": {}, "benchmarks": benchmarks}).splitlines()
    start = table.index("### step")
    header, _, row = table[start + 2 : start + 5]
    assert header.split(" | ")[-2:] == ["x fp32", "host ms |"]
    assert row.split(" | ")[-2:] == ["1.52", "3.100 |"]


def test_the_targets_read_from_the_same_run():
    report = _report()
    benchmarks = [
        # GEMM: the geometric mean over shapes with every dimension >= 2048 only.
        _bench("mpgemm", 4e-3, 1.0, case="2048x4096x8192"),
        _bench("torch_fp16", 1e-3, 0.5, case="2048x4096x8192"),
        _bench("mpgemm", 1e-3, 1.0, case="8192x8192x8192"),
        _bench("torch_fp16", 1e-3, 2.0, case="8192x8192x8192"),
        _bench("mpgemm", 9e-3, case="512x512x512"),
        _bench("torch_fp16", 1e-3, case="512x512x512"),
        _bench("mpgemm", 2e-3, case="guide", group="step"),
        _bench("autocast_fused", 3e-3, case="guide", group="step"),
    ]
    benchmarks[-2]["extra_info"]["host_syncs"] = 0
    report.add_derived_metrics(benchmarks)
    rows = {
        line.split(" | ")[0]: line.split(" | ")[2]
        for line in report.targets(benchmarks)
        if line.startswith("| ")
    }
    gemm = next(k for k in rows if k.startswith("| FP16 GEMM"))
    assert "2048x4096x8192, 8192x8192x8192," in gemm and "512x512x512" not in gemm
    assert rows[gemm] == "0.50"  # sqrt(1/4 x 1)
    assert rows["| the same, kernel times (host latency hidden)"] == "1.00"  # sqrt(0.5 x 2)
    assert rows["| guide MLP step, eager"] == "1.50"
    assert rows["| small MLP step, eager"] == "-"  # not in this run
    assert rows["| host synchronisations per mpgemm step (most)"] == "0"


def test_every_target_row_reads_its_own_case_and_baseline():
    """Each row of the targets table from its own implementation, case and baseline,
    each given a time of its own here (so that a row reading a neighbour's shows)."""
    report = _report()
    times = {  # (group, case, impl): median seconds
        ("step", "guide", "mpgemm"): 2.0,
        ("step", "guide", "mpgemm_cuda_graph"): 1.0,
        ("step", "guide", "autocast_fused"): 3.0,
        ("step", "small", "mpgemm"): 5.0,
        ("step", "small", "mpgemm_cuda_graph"): 4.0,
        ("step", "small", "fp32"): 7.0,
        ("step", "small", "autocast_fused"): 11.0,
        ("unscale", "200x1M", "mpgemm"): 2.0,
        ("unscale", "200x1M", "torch"): 3.0,
        ("unscale", "200x1M", "device_copy"): 1.8,
    }
    benchmarks = [
        _bench(impl, t, case=case, group=group) for (group, case, impl), t in times.items()
    ]
    for bench, syncs in zip(benchmarks[:2], (0, 2), strict=True):  # the most of mpgemm's steps
        bench["extra_info"]["host_syncs"] = syncs
    report.add_derived_metrics(benchmarks)
    rows = {
        line.split(" | ")[0]: line.split(" | ")[1:3]
        for line in report.targets(benchmarks)
        if line.startswith("| ")
    }
    assert rows["| guide MLP step, eager"] == ["autocast_fused", "1.50"]
    assert rows["| guide MLP step, CUDA graph"] == ["autocast_fused", "3.00"]
    assert rows["| small MLP step, eager"] == ["fp32", "1.40"]
    assert rows["| small MLP step, CUDA graph"] == ["fp32", "1.75"]
    assert rows["| unscale + inf check, 200x1M"] == ["torch", "1.50"]
    assert rows["| unscale + inf check, 200x1M: share of a copy's bandwidth"] == [
        "device_copy",
        "0.90",
    ]
    assert rows["| host synchronisations per mpgemm step (most)"] == ["-", "2"]


def test_rates_are_in_tflops_and_gb_per_second():
    report = _report()
    gemm = _bench("mpgemm", 2e-3)  # 1e9 FLOP in 2 ms
    copy = {"group": "unscale", "stats": {"median": 4e-3}}
    copy["extra_info"] = {"case": "x", "impl": "mpgemm", "bytes": 8e9}  # 8 GB in 4 ms
    report.add_derived_metrics([gemm, copy])
    assert gemm["extra_info"]["tflops"] == pytest.approx(0.5)
    assert copy["extra_info"]["gb_per_s"] == pytest.approx(2000)
