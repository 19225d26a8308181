"""Reading Nsight Compute's raw CSV (benchmarks/ncu_attention.py) into page 12's 'what limits each kernel' table."""

import csv
import io

import numpy as np
import pytest

from lpfa.attention.ncu import BOUND_PCT, kernel_pass, limited_by, parse_ncu_csv
from lpfa.pages.kernels import ncu_passes, ncu_table, ncu_text

PIPE_TC = "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active"
PIPE_FMA = "sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active"
STALL = "smsp__average_warps_issue_stalled_{}_per_issue_active.ratio"


def ncu_csv(kernels, time_unit="nsecond"):
    """ncu --csv --page raw as it prints it: a header, a row of units, one row per launch, ==PROF== lines around."""
    cols = ["ID", "Process ID", "Kernel Name", "gpu__time_duration.sum",
            "sm__throughput.avg.pct_of_peak_sustained_elapsed",
            "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed",
            "sm__warps_active.avg.pct_of_peak_sustained_active",
            "launch__registers_per_thread", PIPE_TC, PIPE_FMA, STALL.format("long_scoreboard"), STALL.format("wait"),
            STALL.format("barrier"), STALL.format("math_pipe_throttle"), STALL.format("selected"), "inst_executed",
            "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active", "launch__occupancy_limit_registers",
            "launch__occupancy_limit_shared_mem", "sm__issue_active.avg.pct_of_peak_sustained_elapsed",
            "smsp__average_warp_latency_per_inst_issued.ratio"]
    units = ["", "", "", time_unit, "%", "%", "%", "register/thread", "%", "%", "", "", "", "", "", "inst", "%",
             "block", "block", "%", "cycle"]
    buf = io.StringIO()
    w = csv.writer(buf, quoting=csv.QUOTE_ALL)
    w.writerow(cols)
    w.writerow(units)
    for i, k in enumerate(kernels):
        w.writerow([str(i), "4242", k["name"], k["time"], k["sm"], k["mem"], k.get("occ", 30.0), k.get("regs", 168),
                    k.get("tc", 0.0), k.get("fma", 0.0), *k.get("stalls", (1.0, 2.0, 0.5, 0.1)), "1",
                    k.get("inst", "1,000,000"),
                    k.get("tc", 0.0), k.get("occ_regs", 2), k.get("occ_smem", 3), k["sm"], k.get("cpi", 4.0)])
    return "==PROF== Connected to process 4242\n" + buf.getvalue() + "==PROF== Disconnected from process 4242\n"


KERNELS = [
    {"name": "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128>>(Flash_fwd_params)",
     "time": "150,000", "sm": 70.0, "mem": 30.0, "tc": 65.0, "fma": 20.0, "inst": "50,000,000"},
    {"name": "_flash_fwd_kernel", "time": "200000", "sm": 45.0, "mem": 20.0, "fma": 44.0,
     "stalls": (3.5, 1.0, 2.0, 0.2), "inst": "75,000,000", "tc": 20.0, "occ_smem": 1},
    {"name": "_flash_fwd_kernel", "time": "3000", "sm": 1.0, "mem": 1.0},
    {"name": "_nonfinite_kernel", "time": "40000", "sm": 20.0, "mem": 85.0},
]


def test_parse_ncu_csv_reads_metrics_units_repeats_and_names():
    k = parse_ncu_csv(ncu_csv(KERNELS))
    assert list(k) == ["flash_fwd_kernel", "_flash_fwd_kernel", "_flash_fwd_kernel#2", "_nonfinite_kernel"]
    assert k["flash_fwd_kernel"]["duration_us"] == pytest.approx(150.0)  # "150,000" ns, thousands separator
    assert k["_flash_fwd_kernel#2"]["duration_us"] == pytest.approx(3.0)
    assert k["_flash_fwd_kernel"]["sm_pct"] == 45.0 and k["_flash_fwd_kernel"]["registers"] == 168
    # "selected" (one cycle per issued instruction by definition) is no stall reason
    assert k["_flash_fwd_kernel"]["stalls"] == {"long_scoreboard": 3.5, "barrier": 2.0, "wait": 1.0}
    assert k["_flash_fwd_kernel"]["instructions"] == 75e6 and k["_flash_fwd_kernel"]["tensor_pct"] == 20.0
    assert k["_flash_fwd_kernel"]["occupancy_limit"] == "shared_mem"
    assert k["flash_fwd_kernel"]["occupancy_limit"] == "registers"
    assert k["_flash_fwd_kernel"]["top_stall"] == "long_scoreboard"
    assert list(k["flash_fwd_kernel"]["pipes"]) == ["tensor_op_gmma", "tensor", "fma"]
    renamed = parse_ncu_csv(ncu_csv(KERNELS[:1]).replace('"launch__registers_per_thread"', '"other_metric"'))
    assert renamed["flash_fwd_kernel"]["registers"] is None  # a metric ncu did not print stays empty
    us = parse_ncu_csv(ncu_csv(KERNELS[:1], time_unit="usecond"))
    assert us["flash_fwd_kernel"]["duration_us"] == pytest.approx(150000.0)


def test_parse_ncu_csv_rejects_other_output_in_one_line():
    with pytest.raises(ValueError, match="no 'Kernel Name' column.*expected ncu --csv --page raw"):
        parse_ncu_csv("==PROF== Connected\nName,Value\nx,1\n")
    with pytest.raises(ValueError, match="first line: nothing but ==PROF== lines"):
        parse_ncu_csv("==PROF== only\n")


def test_limited_by_follows_the_speed_of_light_rule():
    assert limited_by({"sm_pct": 70.0, "mem_pct": 30.0, "pipes": {"tensor": 65.0}}) == "compute (tensor)"
    assert limited_by({"sm_pct": 20.0, "mem_pct": 85.0}) == "memory"
    assert limited_by({"sm_pct": BOUND_PCT - 0.1, "mem_pct": 10.0, "top_stall": "wait"}) == "latency (wait)"
    assert limited_by({"sm_pct": None, "mem_pct": None}) == "latency (stall unknown)"


def test_ncu_table_and_text():
    ncu = {"sdpa_flash": parse_ncu_csv(ncu_csv(KERNELS[:1])), "fa2": parse_ncu_csv(ncu_csv(KERNELS[1:]))}
    t = ncu_table(ncu)
    assert ("fa2", "_flash_fwd_kernel#2") not in t.index  # 3 µs: under min_us
    assert t.loc[("fa2", "_flash_fwd_kernel"), "limited by"] == "latency (long_scoreboard)"
    assert t.loc[("fa2", "_nonfinite_kernel"), "limited by"] == "memory"
    assert t.loc[("sdpa_flash", "flash_fwd_kernel"), "busiest pipe"] == "tensor_op_gmma 65%"
    assert t.loc[("fa2", "_nonfinite_kernel"), "pass"] == "other"
    assert t.loc[("fa2", "_flash_fwd_kernel"), "pass"] == "forward"
    p = ncu_passes(t)
    assert p.loc[("fa2", "forward"), "µs × sdpa_flash"] == pytest.approx(200 / 150, abs=0.01)
    assert p.loc[("fa2", "forward"), "M instructions × sdpa_flash"] == 1.5
    assert np.isnan(p.loc[("fa2", "other"), "µs × sdpa_flash"])  # SDPA has no 'other' kernel here
    text = ncu_text(t)
    assert text.startswith("`fa2`: forward 200 µs, 75M instructions (1.33× sdpa_flash's time, 1.50× its instructions). "
                           "Its longest kernel, `_flash_fwd_kernel` (200 µs), keeps the tensor pipe busy 20% "
                           "of the time")
    assert "occupancy (limited by shared_mem)" in text and text.endswith("latency (long_scoreboard).")
    assert ncu_text(ncu_table({"fa2": ncu["fa2"]})).startswith("`fa2`: forward 200 µs, 75M instructions. Its longest")


def test_kernel_pass_reads_fwd_and_bwd_from_names():
    assert [kernel_pass(n) for n in ("flash_fwd_kernel", "_bwd_dq_kernel", "flash_bwd_convert_dq_kernel",
                                     "elementwise_kernel")] \
        == ["forward", "backward", "backward", "other"]
