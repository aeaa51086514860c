"""The benchmark harness on the CPU: the runner end to end on tiny shapes for every backend (CSV
columns, rows, plot), the skip/OOM/error/budget rules with probe providers, timing statistics,
the ptxas report and scripts/gpu_check.sh in its CPU mode."""
import csv
import json
import math
import os
import subprocess
import sys
import time

import pytest
import torch

import hf_attention_backends  # noqa: F401  (imported at collection, not inside the first test's timing)
from benchmarks import (ab_csv, ptxas_report, race_sink_study, registry, report, run, sass_report, stieltjes_fused_start,
                        stieltjes_p_parts, stieltjes_real_rows, stieltjes_solver, timing)
from benchmarks.registry import Case, Provider
from hf_attention_backends import make_planes, race_attention
from hf_attention_backends.ops.stieltjes.reference import solve_lambda

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
K = 1024


def _run(tmp_path, *args, reps=2):
    out = tmp_path / "results.csv"
    rc = run.main(["--device", "cpu", "--quick", "--reps", str(reps), "--warmup", "1", "--out", str(out), *args])
    return rc, report.read_rows(str(out)) if out.exists() else []


def _header(path):
    with open(path) as f:
        return f.readline().strip().split(",")


@pytest.mark.parametrize("case_name", ["exact_d64_causal", "nystrom_wide", "stieltjes_causal", "race_causal"])
def test_runner_end_to_end_on_cpu(tmp_path, case_name):
    png = tmp_path / "plot.png"
    backend = case_name.split("_")[0]
    rc, rows = _run(tmp_path, "--backend", backend, "--cases", case_name, "--plot", str(png))
    assert rc == 0, [(r["provider"], r["mode"], r["status"], r["message"]) for r in rows if r["status"] != "ok"]
    assert _header(tmp_path / "results.csv") == report.COLUMNS
    expected = {(p, m, str(n)) for p in ("ours", "reference", "sdpa") for m in ("fwd", "fwd+bwd")
                for n in registry.TINY_SIZES}
    assert {(r["provider"], r["mode"], r["N"]) for r in rows} == expected and len(rows) == len(expected)
    for r in rows:
        assert r["status"] == "ok", r["message"]
        assert (r["backend"], r["case"], r["dtype"], r["gpu"], r["device"]) == (backend, case_name, "float32", "cpu",
                                                                                 "cpu")
        assert (r["B"], r["H"], r["Hkv"], r["D"]) == ("1", "2", "2", "16")
        assert 0 < float(r["p20_ms"]) <= float(r["median_ms"]) <= float(r["p80_ms"])
        assert r["reps"] == "2" and r["peak_mem_MB"] == "" and int(r["input_sets"]) >= 2
        assert r["torch"] == torch.__version__ and r["git_sha"] and r["date"]
    assert len({r["run_id"] for r in rows}) == 1
    assert png.read_bytes()[:8] == PNG_MAGIC


@pytest.mark.slow
def test_every_registered_case_runs_on_cpu(tmp_path):
    rc, rows = _run(tmp_path, "--modes", "fwd", "--providers", "ours,reference", reps=1)
    registry.load()
    assert {r["case"] for r in rows} == set(registry.CASES)
    assert rc == 0 and all(r["status"] == "ok" for r in rows), [(r["case"], r["provider"], r["status"], r["message"])
                                                                 for r in rows if r["status"] != "ok"]


# DESIGN.md "Benchmarks" and issues 4-7, written out here independently of benchmarks/bench_*.py
ANCHORS = {
    "nystrom_long": (torch.float16, 1, 4, 64, 64 * K, 2048 * K, {"num_landmarks": 32, "newton_iter": 6}),
    "nystrom_wide": (torch.float16, 4, 16, 128, 4 * K, 128 * K, {"num_landmarks": 64, "newton_iter": 6}),
    "stieltjes": (torch.bfloat16, 4, 8, 64, 2 * K, 8 * K, {"order": 4.0, "causal": False}),
    "stieltjes_causal": (torch.bfloat16, 4, 8, 64, 2 * K, 8 * K, {"order": 4.0, "causal": True}),
    "stieltjes_long": (torch.bfloat16, 1, 8, 64, 16 * K, 16 * K, {"order": 4.0, "causal": False}),
    "stieltjes_long_causal": (torch.bfloat16, 1, 8, 64, 16 * K, 16 * K, {"order": 4.0, "causal": True}),
    "race_causal": (torch.bfloat16, 1, 8, 64, 64 * K, 2048 * K, {"causal": True}),
    "race": (torch.bfloat16, 1, 8, 64, 64 * K, 2048 * K, {"causal": False}),
    "exact_d64_causal": (torch.float16, 1, 16, 64, 2 * K, 4 * K, {"causal": True}),
    "exact_d128_causal": (torch.float16, 1, 16, 128, 2 * K, 4 * K, {"causal": True}),
}


def test_registry_has_the_design_anchor_shapes():
    registry.load()
    for name, (dtype, b, h, d, n_min, n_max, options) in ANCHORS.items():
        c = registry.CASES[name]
        assert (c.dtype, c.batch, c.heads, c.hkv, c.head_dim) == (dtype, b, h, h, d), name
        assert (c.sizes[0], c.sizes[-1]) == (n_min, n_max), name
        assert set(c.quick_sizes) <= set(c.sizes) and c.options == options, name
    assert registry.CASES["stieltjes"].sizes == (2 * K, 4 * K, 8 * K)


def test_list_prints_every_case_and_provider(capsys):
    assert run.main(["--list"]) == 0
    text = capsys.readouterr().out
    for name in list(ANCHORS) + ["ours", "reference", "sdpa"]:
        assert name in text


def test_runs_append_to_one_csv_and_a_foreign_csv_is_refused(tmp_path):
    args = ("--cases", "exact_d64_causal", "--backend", "exact", "--providers", "sdpa", "--modes", "fwd")
    _run(tmp_path, *args)
    rc, rows = _run(tmp_path, *args)
    assert rc == 0 and len(rows) == 2 * len(registry.TINY_SIZES)
    assert len({r["run_id"] for r in rows}) == 2
    with open(tmp_path / "results.csv") as f:
        assert sum(line.startswith("date,") for line in f) == 1
    assert report.last_run(rows) == rows[len(registry.TINY_SIZES):]
    foreign = tmp_path / "foreign.csv"
    foreign.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="Use a new --out"):
        run.main(["--device", "cpu", "--reps", "1", "--out", str(foreign), *args])


class Probe:
    """A provider recording what it is handed; ``fail(n)`` returns an exception to raise at size n, or None."""

    def __init__(self, fail=lambda n: None, shape_ok=True):
        self.fail, self.shape_ok, self.calls = fail, shape_ok, []

    def __call__(self, case, q, k, v, tensors):
        err = self.fail(q.shape[2])
        if err is not None:
            raise err
        self.calls.append({"N": q.shape[2], "ptr": q.data_ptr(), "grad": q.requires_grad,
                           "w_grad": tensors["w"].requires_grad, "q_std": float(q.detach().float().std())})
        out = q * tensors["w"] + v.mean()
        return out if self.shape_ok else out.transpose(1, 2)


@pytest.fixture
def probe(monkeypatch):
    registry.load()
    case = Case(backend="exact", name="probe_case", dtype=torch.float16, batch=1, heads=4, head_dim=8,
                sizes=(8, 16, 32), quick_sizes=(8, 16, 32), tiny_sizes=(8, 16, 32),
                make_tensors=lambda c, device: {"w": torch.full((), 2.0, device=device)}, trainable=("w",))
    monkeypatch.setitem(registry.CASES, case.name, case)

    def install(p: Probe):
        monkeypatch.setitem(registry.PROVIDERS, "probe", Provider("probe", p, "test probe", frozenset({"exact"})))
        return p
    return install


def _probe_run(tmp_path, *args, modes="fwd,fwd+bwd"):
    return _run(tmp_path, "--backend", "exact", "--cases", "probe_case", "--providers", "probe", "--modes", modes,
                *args, reps=3)


def test_inputs_rotate_are_seeded_nonzero_and_get_gradients_in_fwd_bwd(tmp_path, probe):
    p = probe(Probe())
    rc, rows = _probe_run(tmp_path)
    assert rc == 0 and all(r["status"] == "ok" for r in rows)
    for r in rows:
        calls = [c for c in p.calls if c["N"] == int(r["N"]) and c["grad"] == (r["mode"] == "fwd+bwd")]
        assert len(calls) == 1 + 3  # warmup, then reps (no peak-memory call off CUDA)
        assert all(c["w_grad"] == c["grad"] for c in calls)
        assert len({c["ptr"] for c in calls}) == min(int(r["input_sets"]), len(calls)) > 1
        assert all(0.5 < c["q_std"] < 2.0 for c in calls)
    case = registry.CASES["probe_case"].tiny()
    a, b = (run.make_inputs(case, 16, torch.device("cpu"), seed=3, count=2) for _ in range(2))
    assert torch.equal(a[0]["q"], b[0]["q"]) and not torch.equal(a[0]["q"], a[1]["q"])
    assert not torch.equal(a[0]["q"], a[0]["k"])


def test_oom_records_and_skips_the_larger_sizes(tmp_path, probe):
    probe(Probe(fail=lambda n: torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB") if n >= 16
                else None))
    rc, rows = _probe_run(tmp_path, modes="fwd")
    assert rc == 0
    assert [(r["N"], r["status"]) for r in rows] == [("8", "ok"), ("16", "oom"), ("32", "skipped")]
    assert "Tried to allocate" in rows[1]["message"] and rows[2]["message"] == "after OOM at N=16"


def test_not_implemented_is_skipped_and_other_errors_are_errors(tmp_path, probe):
    probe(Probe(fail=lambda n: NotImplementedError("hfab::x has no CUDA kernel") if n == 8
                else TypeError("bad kwarg") if n == 16 else None))
    rc, rows = _probe_run(tmp_path, modes="fwd")
    assert rc == 1
    assert [(r["N"], r["status"]) for r in rows] == [("8", "skipped"), ("16", "error"), ("32", "ok")]
    assert rows[0]["message"] == "NotImplementedError: hfab::x has no CUDA kernel"
    assert rows[1]["message"] == "TypeError: bad kwarg"
    assert rows[0]["median_ms"] == "" and rows[1]["median_ms"] == ""


def test_a_wrong_output_shape_is_an_error(tmp_path, probe):
    probe(Probe(shape_ok=False))
    rc, rows = _probe_run(tmp_path, modes="fwd")
    assert rc == 1 and all(r["status"] == "error" and "expected (B, H, N, D)" in r["message"] for r in rows)


def test_size_budget_skips_the_sweep_and_time_budget_skips_everything(tmp_path, probe):
    p = probe(Probe())
    rc, rows = _probe_run(tmp_path, "--size-budget", "1e-9", modes="fwd")
    assert rc == 0 and [r["status"] for r in rows] == ["skipped"] * 3
    assert "> budget" in rows[0]["message"] and "--size-budget" in rows[0]["message"]
    assert rows[1]["message"].startswith("N=8 was over budget") and "larger sizes skipped" in rows[2]["message"]
    assert len(p.calls) == 1  # the warm-up call only
    rc, rows = _probe_run(tmp_path, "--time-budget", "0", modes="fwd")
    assert [r["status"] for r in rows[3:]] == ["skipped"] * 3 and len(p.calls) == 1
    assert all("--time-budget 0 s exhausted" in r["message"] for r in rows[3:])


def test_cli_rejects_bad_arguments(tmp_path):
    with pytest.raises(SystemExit):
        run.main(["--device", "cpu", "--modes", "bwd"])
    with pytest.raises(SystemExit):
        run.main(["--device", "cuda", "--reps", "5"])  # no CUDA here, or fewer than 20 reps on CUDA
    with pytest.raises(ValueError, match="--backend 'softmax'"):
        run.main(["--device", "cpu", "--backend", "softmax", "--out", str(tmp_path / "x.csv")])
    with pytest.raises(ValueError, match="--providers"):
        run.main(["--device", "cpu", "--providers", "flash", "--out", str(tmp_path / "x.csv")])


def test_summarize_percentiles():
    # 1..10: median 5.5; linear interpolation at rank 0.2*9 = 1.8 -> 2.8 and 0.8*9 = 7.2 -> 8.2
    assert timing.summarize([float(x) for x in (7, 1, 10, 3, 2, 9, 4, 5, 8, 6)]) == pytest.approx((5.5, 2.8, 8.2))


def test_measure_counts_calls_and_stops_over_budget():
    calls = []
    m = timing.measure(calls.append, torch.device("cpu"), warmup=2, reps=5, budget_s=60)
    assert calls == list(range(7)) and m.reps == 5 and m.peak_mem_mb is None and m.median_ms >= 0
    calls.clear()
    with pytest.raises(timing.OverBudget):
        timing.measure(lambda i: (calls.append(i), time.sleep(0.01)), torch.device("cpu"),
                       warmup=1, reps=20, budget_s=0.05)
    assert calls == [0]


def test_is_oom():
    assert timing.is_oom(torch.OutOfMemoryError("CUDA out of memory"))
    assert timing.is_oom(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 GB"))
    assert not timing.is_oom(ValueError("out of memory"))
    assert not timing.is_oom(RuntimeError("shape mismatch"))


def test_input_set_count_spans_four_caches():
    registry.load()
    case = registry.CASES["exact_d64_causal"]
    cpu = torch.device("cpu")  # nominal cache 32 MiB: the sets must span 128 MiB
    # one set (q, k, v, dout), B=1, H=16, D=64, fp16: 4 * 16 * N * 64 * 2 B = 8 KiB * N
    assert run.input_set_count(case, 32, cpu) == run.MAX_INPUT_SETS
    assert run.input_set_count(case, 4096, cpu) == 4
    assert run.input_set_count(case, 6000, cpu) == 3
    assert run.input_set_count(case, 16384, cpu) == 1
    assert run.input_set_count(case, 1 << 20, cpu) == 1


def test_format_table_reports_ratio_and_messages():
    base = dict.fromkeys(report.COLUMNS, "")
    rows = [dict(base, case="c", N="8", mode="fwd", provider="ours", status="ok", median_ms="2.0"),
            dict(base, case="c", N="8", mode="fwd", provider="sdpa", status="ok", median_ms="3.0"),
            dict(base, case="c", N="8", mode="fwd", provider="reference", status="oom", message="boom")]
    text = report.format_table(rows)
    lines = text.splitlines()
    assert lines[0].split() == ["case", "N", "mode", "ours", "ms", "sdpa", "ms", "reference", "ms", "sdpa/ours"]
    assert lines[1].split() == ["c", "8", "fwd", "2.000", "3.000", "oom", "1.50"]
    assert lines[2].strip() == "oom: c N=8 reference fwd: boom"


def test_crossover_is_the_first_n_from_which_ours_stays_faster():
    base = dict.fromkeys(report.COLUMNS, "")

    def rows(case, mode, times):
        return [dict(base, case=case, N=str(n), mode=mode, provider=p, status="ok", median_ms=str(ms))
                for n, (ours, sdpa) in times.items() for p, ms in (("ours", ours), ("sdpa", sdpa))]

    table = (rows("a", "fwd", {1024: (2.0, 1.0), 2048: (1.0, 1.5), 4096: (2.0, 1.9), 8192: (3.0, 9.0)})
             + rows("a", "fwd+bwd", {1024: (1.0, 2.0), 2048: (2.0, 5.0)})
             + rows("b", "fwd", {1024: (1.0, 2.0), 2048: (5.0, 2.0)}))
    assert report.crossovers(table) == [
        "  crossover: a fwd: ours at least as fast as sdpa from N 8192 on, slower at N 4096 (measured N 1024..8192)",
        "  crossover: a fwd+bwd: ours at least as fast as sdpa at every N (measured N 1024..2048)",
        "  crossover: b fwd: ours slower than sdpa at N 2048 (measured N 1024..2048)"]
    assert report.crossovers(rows("c", "fwd", {1024: (1.0, 2.0)})) == []
    assert "crossover: a fwd+bwd" in report.format_table(table)
    registry.load()
    short = registry.CASES["nystrom_crossover"]  # issue 4: the crossover at B=4, H=16, D=128, target <= 2,048
    assert (short.batch, short.heads, short.head_dim, short.options["num_landmarks"]) == (4, 16, 128, 64)
    assert short.sizes[0] < 2 * K < short.sizes[-1]


PTXAS_LOG = """\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function '_Z14exact_fwd_kernelPf' for 'sm_90'
ptxas info    : Function properties for _Z14exact_fwd_kernelPf
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 96 registers, used 1 barriers, 400 bytes cmem[0]
ptxas info    : Compiling entry function '_Z14exact_bwd_kernelPf' for 'sm_80'
ptxas info    : Function properties for _Z14exact_bwd_kernelPf
    48 bytes stack frame, 40 bytes spill stores, 36 bytes spill loads
ptxas info    : Used 255 registers, 400 bytes cmem[0]
"""
SERIALISED_LOG = """\
ptxas info    : (C7520) Potential Performance Loss: wgmma.mma_async instructions are serialized due to program \
dependence on compiler-inserted WG.AR in divergent path in the function '_Z9kv_kernelPf'
ptxas info    : Compiling entry function '_Z9kv_kernelPf' for 'sm_90a'
ptxas info    : Function properties for _Z9kv_kernelPf
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 218 registers, used 1 barriers
"""


def test_ptxas_report_parses_registers_and_spills(tmp_path, capsys):
    kernels = ptxas_report.parse(PTXAS_LOG)
    assert [(k.name, k.arch, k.registers, k.stack, k.spill_stores, k.spill_loads) for k in kernels] == [
        ("_Z14exact_fwd_kernelPf", "sm_90", 96, 0, 0, 0), ("_Z14exact_bwd_kernelPf", "sm_80", 255, 48, 40, 36)]
    log = tmp_path / "build.log"
    log.write_text(PTXAS_LOG)
    assert ptxas_report.main([str(log), "--spills"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "ptxas: 2 kernel x arch entries, 1 with spills, 0 with wgmma serialised"
    assert len(out) == 2 and "sm_80" in out[1] and "255 regs" in out[1] and "40/36" in out[1]
    assert ptxas_report.main([str(log), "--strict"]) == 1  # the spill
    capsys.readouterr()


def test_ptxas_report_flags_serialised_wgmma(tmp_path, capsys):
    assert ptxas_report.serialised(SERIALISED_LOG) == {
        "_Z9kv_kernelPf": "program dependence on compiler-inserted WG.AR in divergent path"}
    log = tmp_path / "build.log"
    log.write_text(SERIALISED_LOG)
    assert ptxas_report.main([str(log), "--spills"]) == 0
    assert ptxas_report.main([str(log), "--spills", "--strict"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[-2] == "ptxas: 1 kernel x arch entries, 0 with spills, 1 with wgmma serialised"
    assert out[-1].startswith("wgmma serialised (program dependence on compiler-inserted WG.AR") and "kv_kernel" in out[-1]
    log.write_text(SERIALISED_LOG.split("\n", 1)[1])  # the same kernel without the remark
    assert ptxas_report.main([str(log), "--strict"]) == 0
    assert capsys.readouterr().out.startswith("ptxas: 1 kernel x arch entries, 0 with spills, 0 with wgmma serialised")


KERNEL_SOURCE = """\
// a helper
__device__ __forceinline__ float helper(float x) {
  return x * 2.f;
}

template <int D>
__global__ void __launch_bounds__(128, 1) my_kernel(const float* p) {
  const float y = helper(p[0]);
}
"""


def kernel_sass(path):
    return f"""\
.text._Z5otherv:
        /*0000*/                   EXIT ;
.text._Z9my_kernelILi64EEvPKf:
\t//## File "{path}", line 8
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/                   S2R R0, SR_TID.X ;
\t//## File "{path}", line 3 inlined at "{path}", line 9
\t//## File "{path}", line 9
        /*0020*/                   FADD R2, R0, R0 ;
        /*0030*/              @!P0 FMUL.FTZ R2, R2, 2 ;
\t//## File "{path}", line 9
        /*0040*/                   STG.E desc[UR4][R4.64], R2 ;
.text._Z5afterv:
        /*0000*/                   EXIT ;
"""


def test_sass_report_counts_instructions_by_innermost_function(tmp_path, capsys):
    src = tmp_path / "kernels.cuh"
    src.write_text(KERNEL_SOURCE)
    assert sass_report.function_starts(KERNEL_SOURCE) == [(2, "helper"), (7, "my_kernel")]
    positions = sass_report.kernel_positions(kernel_sass(src), "my_kernel")
    assert [(line, op, offset) for _, line, op, offset in positions] == [
        (8, "LDC", 0x00), (8, "S2R", 0x10), (3, "FADD", 0x20), (3, "FMUL", 0x30), (9, "STG", 0x40)]
    assert sass_report.count(positions) == {"kernels.cuh:my_kernel": 3, "kernels.cuh:helper": 2}
    assert sass_report.count(positions, by_line=True) == {"kernels.cuh:8": 2, "kernels.cuh:3": 2, "kernels.cuh:9": 1}
    sass = tmp_path / "k.sass"
    sass.write_text(kernel_sass(src))
    sass_report.main([str(sass), "my_kernel"])
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "my_kernel: 5 instructions with a source position"
    assert out[1].split() == ["3", "kernels.cuh:my_kernel"] and out[2].split() == ["2", "kernels.cuh:helper"]
    with pytest.raises(ValueError, match="no .text section"):
        sass_report.kernel_positions(kernel_sass(src), "missing_kernel")


def test_sass_report_lists_register_copy_runs(tmp_path, capsys):
    src = tmp_path / "kernels.cuh"
    sass_text = f"""\
.text._Z9my_kernelv:
\t//## File "{src}", line 8
        /*0000*/                   MOV R1, R2 ;
        /*0010*/                   IMAD.MOV.U32 R3, RZ, RZ, R4 ;
        /*0020*/              @!P0 MOV R5, R6 ;
        /*0030*/                   FADD R2, R0, R0 ;
\t//## File "{src}", line 3
        /*0040*/                   MOV R7, R8 ;
        /*0050*/                   IMAD.SHL.U32 R9, R9, 0x2, RZ ;
        /*0060*/                   IMAD.MOV.U32 R3, RZ, RZ, R4 ;
        /*0070*/                   MOV R1, R2 ;
"""
    positions = sass_report.kernel_positions(sass_text, "my_kernel", full_opcode=True)
    assert [op for *_, op, _ in positions][:3] == ["MOV", "IMAD.MOV.U32", "MOV"]
    assert sass_report.copy_runs(positions, 2) == [(3, 0x00, "kernels.cuh:8"), (2, 0x60, "kernels.cuh:3")]
    assert sass_report.copy_runs(positions, 3) == [(3, 0x00, "kernels.cuh:8")]
    sass = tmp_path / "k.sass"
    sass.write_text(sass_text)
    sass_report.main([str(sass), "my_kernel", "--copies", "2"])
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "my_kernel: 2 runs of 2 or more register copies, 5 instructions"
    assert out[1].split() == ["3", "at", "0x0000", "kernels.cuh:8"]


def source_page_csv(rows_by_kernel):
    """An ``ncu --page source --csv --print-source sass`` export: per kernel its name row, a header, then one row
    per instruction (address, source, stall samples, executed)."""
    lines = []
    for name, rows in rows_by_kernel:
        lines.append(f'"Kernel Name","{name}",')
        lines.append('"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed"')
        lines += [f'"{hex(0x7f0000 + 16 * i)}","{src}","{stalls}","{executed}"' for i, (src, stalls, executed)
                  in enumerate(rows)]
    return "\n".join(lines) + "\n"


def test_sass_report_weights_rows_by_a_profile(tmp_path, capsys):
    src = tmp_path / "kernels.cuh"
    src.write_text(KERNEL_SOURCE)
    sass = tmp_path / "k.sass"
    sass.write_text(kernel_sass(src))
    page = tmp_path / "sass.csv"
    page.write_text(source_page_csv([
        ("void other()", [("EXIT", 99, 99)]),
        ("void my_kernel<64>(const float *)", [("LDC R1, c[0x0][0x28]", 1, 10), ("S2R R0, SR_TID.X", 0, 10),
                                                ("FADD R2, R0, R0", 6, 40), ("@!P0 FMUL.FTZ R2, R2, 2", 2, 40),
                                                ("STG.E desc[UR4][R4.64], R2", 1, 0)])]))
    profile = sass_report.read_source_page(str(page), "my_kernel")
    assert profile == {0x00: (10, 1), 0x10: (10, 0), 0x20: (40, 6), 0x30: (40, 2), 0x40: (0, 1)}
    positions = sass_report.kernel_positions(sass.read_text(), "my_kernel")
    keys = sass_report.row_keys(positions)
    assert sass_report.measured(positions, keys, profile) == {
        "kernels.cuh:my_kernel": (0.2, 0.2), "kernels.cuh:helper": (0.8, 0.8)}
    sass_report.main([str(sass), "my_kernel", "--lines", "--ncu", str(page)])
    out = capsys.readouterr().out.splitlines()
    assert [line.split() for line in out[2:5]] == [["2", "80.0", "80.0", "kernels.cuh:3"],
                                                   ["2", "20.0", "10.0", "kernels.cuh:8"],
                                                   ["1", "0.0", "10.0", "kernels.cuh:9"]]
    with pytest.raises(ValueError, match="not in the profile"):
        sass_report.read_source_page(str(page), "missing_kernel")
    # --ncu-kernel: the profile's (demangled) name where the SASS section's substring does not match it
    sass_report.main([str(sass), "my_kernel", "--lines", "--ncu", str(page), "--ncu-kernel", "my_kernel<64>(const"])
    assert capsys.readouterr().out.splitlines()[2:5] == out[2:5]
    with pytest.raises(ValueError, match="'my_kernel<32>': not in the profile"):
        sass_report.main([str(sass), "my_kernel", "--ncu", str(page), "--ncu-kernel", "my_kernel<32>"])


@pytest.mark.parametrize("script", sorted(f for f in os.listdir(os.path.join(ROOT, "scripts")) if f.endswith(".sh")))
def test_scripts_are_valid_bash(script):
    subprocess.run(["bash", "-n", os.path.join(ROOT, "scripts", script)], check=True)


@pytest.mark.parametrize("missing, env", [
    ("OUT", {}),
    ("BASE", {"OUT": "x"}),
    ("CASES", {"OUT": "x", "BASE": "HEAD"}),
])
def test_ab_profile_names_what_it_needs(tmp_path, missing, env):
    env = {k: str(tmp_path / v) if k == "OUT" else v for k, v in env.items()}
    base = {k: v for k, v in os.environ.items() if k not in ("OUT", "BASE", "CASES")}
    proc = subprocess.run(["bash", os.path.join(ROOT, "scripts", "ab_profile.sh")], env={**base, **env},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and f"{missing}:" in proc.stderr


def test_ab_profile_rejects_an_unknown_commit(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path / "out"), BASE="no-such-commit", CASES="race:4096:fwd", PHASES="build")
    proc = subprocess.run(["bash", os.path.join(ROOT, "scripts", "ab_profile.sh")], env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and "ab_profile: no commit no-such-commit" in proc.stdout


AB_TXT = """== round 1, tree work: stieltjes 4096 fwd+bwd
extension /x/_C.so
stieltjes N=4096 fwd+bwd ours: 4.617 ms of GPU time per call, 4.621 ms between CUDA events (median; ...)
      1.725 ms  37.4%  x1    void hfab::stieltjes::stieltjes_fwd_kernel<__nv_bfloat16, 64, 4>(hfab::stieltjes::Params)
      2.892 ms  62.6%  x2    void hfab::stieltjes::stieltjes_dq_kernel<__half, 32, 2>(hfab::stieltjes::Params)
== round 1, tree 22807bc: stieltjes 4096 fwd+bwd
Traceback (most recent call last):
ImportError: no extension
== round 2, tree 22807bc: race 65536 fwd
race N=65536 fwd ours: 0.747 ms of GPU time per call
      0.411 ms  55.0%  x1    race_scan_fwd_kernel
"""


def test_ab_csv_rows_of_an_ab_profile_run(tmp_path):
    runs = ab_csv.parse(AB_TXT)  # the failed run (no total) is left out
    assert [(r["round"], r["tree"], r["case"], r["n"], r["mode"], r["gpu_ms"], r["event_ms"]) for r in runs] == [
        (1, "work", "stieltjes", 4096, "fwd+bwd", 4.617, 4.621), (2, "22807bc", "race", 65536, "fwd", 0.747, None)]
    assert runs[0]["kernels"] == [("stieltjes_fwd_kernel<__nv_bfloat16, 64, 4>", 1.725),
                                  ("stieltjes_dq_kernel<__half, 32, 2>", 2.892)]
    src = tmp_path / "ab.txt"
    src.write_text(AB_TXT)
    assert ab_csv.main([str(src), "--sha", "work=abc1234", "--gpu", "G", "--torch", "2.0", "--cuda", "13.0",
                        "--date", "2026-12-04"]) == 0
    with open(tmp_path / "ab.csv") as f:
        got = list(csv.DictReader(f))
    assert [(r["git_sha"], r["case"], r["round"], r["gpu_ms_per_call"], r["event_ms_per_call"]) for r in got] == [
        ("abc1234", "stieltjes", "1", "4.617", "4.621"), ("22807bc", "race", "2", "0.747", "")]
    assert got[0]["gpu"] == "G" and got[0]["date"] == "2026-12-04" and got[1]["kernels"] == "race_scan_fwd_kernel=0.411"


def test_ab_csv_rejects_bad_input(tmp_path, capsys):
    src = tmp_path / "ab.txt"
    src.write_text("== round 1, tree work: race 64 fwd\nTraceback\n")
    assert ab_csv.main([str(src)]) == 1 and "no profiled run" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ab_csv.main([str(src), "--sha", "eeca75f"])
    assert "expected NAME=SHA" in capsys.readouterr().err


@pytest.mark.slow
def test_gpu_check_script_cpu_mode(tmp_path):
    out, results = tmp_path / "out", tmp_path / "results"
    env = dict(os.environ, OUT=str(out), BUILD="0", RUN_TESTS="0", BENCH="exact", BENCH_CASES="exact_d64_causal",
               BENCH_MODES="fwd", BENCH_DEVICE="cpu", BENCH_RESULTS_DIR=str(results), PYTHON=sys.executable)
    proc = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu_check.sh")], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sorted(os.listdir(out)) == ["bench.log", "build.log", "cpu.csv", "cpu.png", "env.log", "pytest.log"]
    assert "benchmarks: ok" in proc.stdout and "sdpa/ours" in proc.stdout
    rows = report.read_rows(str(results / "cpu.csv"))
    assert len(rows) == 3 * len(registry.TINY_SIZES) and all(r["status"] == "ok" for r in rows)
    assert rows[0]["run_id"].startswith("gpu_check-")
    assert (out / "cpu.png").read_bytes()[:8] == PNG_MAGIC


def test_profiled_counts_operators_per_call():
    from torch.profiler import ProfilerActivity

    from benchmarks.profile import profiled

    a = torch.randn(64, 64)
    rows = profiled(lambda i: [torch.mm(a, a) for _ in range(3)], 4, ProfilerActivity.CPU,
                    lambda e: e.self_cpu_time_total)
    by_name = {name: (ms, count) for name, ms, count in rows}
    assert by_name["aten::mm"][1] == 3 and by_name["aten::mm"][0] > 0
    assert [ms for _, ms, _ in rows] == sorted((ms for _, ms, _ in rows), reverse=True)


def test_host_probe_times_every_backend_three_ways(capsys):
    from benchmarks import host_probe

    host_probe.main(["--device", "cpu", "--tiny", "--calls", "1"])
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
    timed = {" ".join(r[:-2]): (float(r[-2]), float(r[-1])) for r in rows}
    for backend in ("exact", "stieltjes", "race", "nystrom"):
        for how in ("fwd no_grad", "fwd with grad", "fwd+bwd"):
            enqueued, wall = timed[f"{backend} {how}"]
            assert 0 < enqueued <= wall


@pytest.mark.cuda
def test_profile_lists_the_kernels_of_a_call():
    from benchmarks.profile import kernel_table

    rows = kernel_table("exact_d64_causal", 256, "fwd+bwd", "ours", calls=2)
    names = " ".join(name for name, _, _ in rows)
    assert "exact_attn_fwd_kernel" in names and "exact_dkv_bwd_kernel" in names, names
    assert all(ms > 0 and count >= 1 for _, ms, count in rows)


@pytest.mark.parametrize("provider", ["sdpa", "race"])
def test_decode_benchmark_steps_give_the_full_forward_greedy_tokens(provider):
    """The static-buffer decode step of benchmarks.bench_decode (what the CUDA graph replays) against greedy
    decoding by full forwards over the whole sequence."""
    import hf_attention_backends as hfab
    from benchmarks import bench_decode

    model = bench_decode.tiny_llama("cpu", torch.float32)
    got = []
    res = bench_decode.run_provider(model, provider, batch=2, context=13, steps=5, graphs=False, tokens=got)
    assert res["reps"] == 5 and res["tokens_per_s"] > 0
    seq = torch.randint(0, model.config.vocab_size, (2, 13), generator=torch.Generator().manual_seed(0))
    if provider == "race":
        hfab.enable_backend(model, "race")
    expected = []
    with torch.no_grad():
        for _ in range(6):
            nxt = model(input_ids=seq).logits[:, -1].argmax(-1)
            expected.append(nxt)
            seq = torch.cat([seq, nxt[:, None]], dim=1)
    assert torch.equal(torch.stack(got), torch.stack(expected[1:]))


def test_decode_benchmark_state_constant_in_context_for_race_only():
    from benchmarks import bench_decode

    model = bench_decode.tiny_llama("cpu", torch.float32)
    state = {(p, n): bench_decode.run_provider(model, p, batch=1, context=n, steps=1, graphs=False)
             ["state_bytes_per_seq"] for p in ("sdpa", "race") for n in (16, 64)}
    assert state["race", 16] == state["race", 64] > 0
    assert state["sdpa", 64] > state["sdpa", 16] > 0


def test_race_calibration_sweep_reports_each_shape(capsys):
    from benchmarks import race_calibration_sweep as sweep

    assert sweep.main(["--model", "tiny_llama", "--shapes", "2x2", "3x1", "--rows", "2", "--seq-len", "32"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["P"], r["L"], r["S"]) for r in lines] == [(2, 2, 8), (3, 1, 8)]
    for r in lines:  # the default grid holds the conversion's beta (D**-0.5), so the grid cannot do worse
        assert r["layers"] > 0 and 0 < r["sum_after"] <= r["sum_before"] + 1e-9
    with pytest.raises(SystemExit):
        sweep.main(["--shapes", "4by4"])


def test_environment_names_the_kernel_switches_that_are_set(monkeypatch):
    for name in report.KERNEL_SWITCHES:
        monkeypatch.delenv(name, raising=False)
    plain = report.environment(torch.device("cpu"))["extension"]
    assert plain in ("loaded", "absent")
    monkeypatch.setenv("HFAB_RACE_PHI_TILE", "1")
    assert report.environment(torch.device("cpu"))["extension"] == f"{plain} HFAB_RACE_PHI_TILE=1"


def test_stieltjes_solver_study_roots_and_safeguard():
    x, v = stieltjes_solver.score_rows(3.0, 512, 8, 32, seed=1)
    for order in (1.0, 4.0):
        root = stieltjes_solver.root_by_bisection(x, order)
        f = (root[:, None] - x).pow(-order).sum(dim=-1)
        assert torch.allclose(f, torch.ones_like(f), rtol=1e-12)  # the oracle solves the pole equation
        errors = [stieltjes_solver.output_error(x, v, order, stieltjes_solver.halley(x, order, k), root)
                  for k in range(3)]
        assert errors[2] < 1e-9 and errors[2] <= errors[1] <= errors[0]
        lam = stieltjes_solver.halley(x, order, 1)  # inside [1, n^(1/order)]: the safeguard's interval
        assert bool((lam >= 1).all()) and bool((lam <= 512 ** (1 / order)).all())


def test_stieltjes_solver_study_prints_a_row_per_case(capsys):
    stieltjes_solver.main(["--n", "64", "--rows", "2", "--dim", "16", "--max-steps", "1"])
    out = capsys.readouterr().out.splitlines()
    assert out[1].split() == ["order", "scale", "newton0", "newton1", "halley0", "halley1"]
    assert len(out) == 2 + 4 * 7 and all(len(line.split()) == 6 for line in out[2:])


def test_stieltjes_fused_start_study_takes_the_libraries_step():
    """The study's steps are solve_lambda's: one clamped Halley step from the library's start gives the library's
    one-step lambda, and the study's Jensen start (the library's before start_lambda) lies at or below that start."""
    x, _ = stieltjes_solver.score_rows(2.0, 333, 4, 32, seed=2)
    allowed = torch.ones_like(x, dtype=torch.bool)
    start = solve_lambda(x, allowed, 4.0, 0)
    ours = stieltjes_fused_start.reference_step(x, start, 4.0)
    assert torch.allclose(ours, solve_lambda(x, allowed, 4.0, 1), rtol=1e-12, atol=0)
    assert (stieltjes_fused_start.jensen_start(x, 4.0) <= start).all()


def test_stieltjes_fused_start_laplace_start_is_nearer_the_root_on_heavy_tails():
    """The study's lead: on heavy-tailed rows (scale 2, N 2049) the start from two exp sums lies nearer the root
    than the Jensen start, and one step from it is within 1e-3 of the exact output where one from Jensen is not."""
    x, v = stieltjes_solver.score_rows(2.0, 2049, 8, 64, seed=0)
    root = stieltjes_solver.root_by_bisection(x, 4.0)
    jensen = stieltjes_fused_start.jensen_start(x, 4.0)
    laplace = torch.maximum(jensen, stieltjes_fused_start.laplace_start(x, 4.0))
    assert (laplace - root).abs().max() < (jensen - root).abs().max()
    errors = [stieltjes_solver.output_error(x, v, 4.0, stieltjes_fused_start.reference_step(x, lam, 4.0), root)
              for lam in (jensen, laplace)]
    assert errors[1] < 1e-3 < errors[0]


def test_stieltjes_real_rows_study_on_smollm2(capsys):
    """The real-rows study on one short article: its q, k, v hooks reproduce the layer's output (checked inside), and
    on 128-token rows two Halley steps are far inside 1e-3 from either start (start_lambda's nearer), one step is
    not, and the library's default (one step, then extra ones where the error estimate asks) is."""
    stieltjes_real_rows.main(["--tokens", "128", "--articles", "1", "--layers", "0", "--stride", "32", "--orders", "4",
                              "--blocks"])
    out = capsys.readouterr().out
    shares = next(line for line in out.splitlines() if line.startswith("order 4, the adaptive default:")).split()
    rows, blocks = float(shares[5]), float(shares[10])
    assert 0.0 <= rows <= blocks <= 1.0 and (rows == 0.0) == (blocks == 0.0)
    row = next(line for line in out.splitlines() if line.startswith("| all |"))
    cells = [cell.strip() for cell in row.strip("|").split("|")][1:]
    assert len(cells) == len(stieltjes_real_rows.SCHEME_NAMES)
    err = {name: float(cell.split()[0]) for name, cell in zip(stieltjes_real_rows.SCHEME_NAMES, cells)}
    assert err["ref2"] < err["jensen2"] < 1e-5 < 1e-3 < err["ref1"] and err["default"] < 1e-3


def test_stieltjes_solver_steps_needed_grows_as_the_order_falls():
    low = stieltjes_solver.newton_steps_needed(1.5, 1e-4, scales=(5,), sizes=(333,), rows=8)
    high = stieltjes_solver.newton_steps_needed(4.0, 1e-4, scales=(5,), sizes=(333,), rows=8)
    assert low[1:] == (5, 333) and low[0] >= 4 and high[0] < low[0]  # order 1.5's heavy tail: slow from the start


def test_stieltjes_extra_steps_study_sends_only_hard_rows_to_another_sweep():
    """Gaussian rows at order 4, N 4,096: at scale 1 (the benchmarks' inputs) no row takes an extra step, at scale 2
    many do; the adaptive default stays within 1e-3 of the exact-root output in both."""
    easy, hard = stieltjes_solver.extra_steps_study(orders=(4.0,), scales=(1.0, 2.0), sizes=(4096,), rows=128)
    assert easy[:3] == (4.0, 1.0, 4096) and easy[3] == easy[4] == 0.0
    assert 0.1 < hard[3] <= hard[4] == 1.0 and max(easy[5], hard[5]) < 1e-3


def test_stieltjes_solver_bimodal_study():
    """Two-cluster rows at order 4: the default's one Halley step, fixed, misses 1e-3 from either start at N 16K (from
    start_lambda by less than from Jensen's), and so does a second; the library's adaptive default reaches them."""
    worst = stieltjes_solver.bimodal_study(4.0)
    assert 1e-3 < worst["one more"][0] < worst["fixed"][0] < worst["jensen"][0]
    assert worst["adaptive"][0] < 1e-3
    assert worst["rows"] == 108 and worst["fixed worse than jensen"] < 0.1 * worst["rows"]


def test_race_sink_study_kernel_matrix_gives_the_reference_output():
    """The study's explicit N x N kernel matrix (num / den) against the library's chunked causal reference op."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 150, 16, generator=g, dtype=torch.float64) for _ in range(3))
    planes = make_planes(2, 3, 16, seed=1, dtype=torch.float64)
    num, den = race_sink_study.race_num_den(q, k, v, planes, 0.7)
    ref = race_attention(q, k, v, planes=planes, beta=torch.tensor(0.7, dtype=torch.float64), causal=True)
    torch.testing.assert_close(num / den, ref, rtol=1e-12, atol=1e-12)


def test_race_sink_study_sink_term_fits_a_sink_head():
    """A head that puts ~92% of each row on token 0, whose value row is 0: its outputs are short, RACE without a sink
    gives about the mean of v (error far above 1), and the sink term brings the error near 0. GQA: both q heads read
    the one kv head."""
    g = torch.Generator().manual_seed(0)
    q = torch.zeros(1, 2, 64, 16, dtype=torch.float64)
    q[..., 0] = 4.0
    k = 0.3 * torch.randn(1, 1, 64, 16, generator=g, dtype=torch.float64)
    k[:, :, 0, 0] = 6.0
    v = 1.0 + 0.1 * torch.randn(1, 1, 64, 16, generator=g, dtype=torch.float64)
    v[:, :, 0] = 0.0
    stats = race_sink_study.head_study(q, k, v, make_planes(2, 3, 16, seed=0, dtype=torch.float64), skip_rows=8)
    assert all(x.shape == (2,) for x in stats.values())
    assert bool((stats["sink_share"] > 0.9).all()) and bool((stats["out_to_v"] < 0.01).all())
    assert bool((stats["plain"] > 10).all()) and bool((stats["sink"] < 1e-2).all())
    assert bool((stats["scale"] <= stats["plain"]).all())  # the least-squares constant beats the constant 1
    no_sink = race_sink_study.head_study(q, k, v, make_planes(2, 3, 16, seed=0, dtype=torch.float64), skip_rows=8,
                                         sink_factors=(0.0,))
    torch.testing.assert_close(no_sink["sink"], stats["plain"], rtol=0, atol=0)


def _tiny_llama(scale_qk: float = 8.0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, intermediate_size=128, vocab_size=97,
                                         attn_implementation="sdpa")).eval()
    with torch.no_grad():  # peaked softmax rows, which RACE's kernel does not follow
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(scale_qk)
            layer.self_attn.k_proj.weight.mul_(scale_qk)
    return model



def test_race_sink_study_output_factors_never_raise_a_layers_error():
    """scale_outputs picks per layer the o_proj factor of least teacher-forced error, the softmax teacher keeping the
    original weights: measured that way, no layer's error rises (1 is in the grid), the weights end as the chosen
    factor times the original and keep their requires_grad. (A teacher scaled with the student, which is what a
    TeacherForcing entered after the scaling gives, makes the errors nearly scale-free and the choice arbitrary.)"""
    from hf_attention_backends import convert
    from hf_attention_backends.calibrate import TeacherForcing, converted_layers, forward_kwargs, layer_errors

    model = convert(_tiny_llama(), "race", num_planes=3, num_tables=2, per_head_beta=True)
    modules = dict(converted_layers(model))
    for module in modules.values():
        module.o_proj.weight.requires_grad_(False)
    batches = [{"input_ids": torch.randint(0, 97, (2, 40)), "attention_mask": torch.ones(2, 40, dtype=torch.long)}]
    before = layer_errors(model, batches)
    weights = {idx: m.o_proj.weight.detach().clone() for idx, m in modules.items()}
    factors = race_sink_study.scale_outputs(model, batches, factors=(0.25, 0.5, 0.8, 0.9, 1.0, 1.1, 1.25, 2.0))
    assert set(factors) == set(before)
    for idx, module in modules.items():
        torch.testing.assert_close(module.o_proj.weight, weights[idx] * factors[idx], rtol=0, atol=0)
        assert not module.o_proj.weight.requires_grad
    with torch.no_grad():
        for idx, module in modules.items():
            module.o_proj.weight.copy_(weights[idx]).requires_grad_(True)
        with TeacherForcing(model) as forcing:  # snapshot of the originals for the teacher
            for idx, module in modules.items():
                module.o_proj.weight.mul_(factors[idx])
            forcing.token_mask, forcing.terms = batches[0]["attention_mask"], {}
            model(**forward_kwargs(model, batches[0]))
            after = {idx: float(err) / float(ref) for idx, (err, ref, _) in forcing.terms.items()}
    assert all(after[idx] <= before[idx] * (1 + 1e-6) for idx in before)
    ppl = race_sink_study.perplexity(model, batches[0], rows_per_forward=1)
    assert math.isfinite(ppl) and ppl > 1


def test_race_transfer_study_capture_teacher_and_student_match_the_model():
    """The captured inputs and softmax_rows rebuild the layer's sdpa output; the untrained LayerStudent gives what the
    library's converted layer (the same planes and beta, the chunked reference op) gives on those inputs."""
    from hf_attention_backends import convert, make_planes

    from benchmarks import race_transfer_study as rts

    model = _tiny_llama()
    batch = {"input_ids": torch.randint(0, 97, (3, 70)), "attention_mask": torch.ones(3, 70, dtype=torch.long)}
    data = rts.capture_layer(model, batch, 1)
    module = model.model.layers[1].self_attn
    rows = rts.softmax_rows(module, data["hidden"], data["cos"], data["sin"])
    v = module.v_proj(data["hidden"]).view(3, 70, 2, 16).transpose(1, 2).repeat_interleave(2, 1)
    torch.testing.assert_close(module.o_proj((rows @ v).transpose(1, 2).flatten(2)), data["out"], rtol=1e-4, atol=1e-5)
    student = rts.LayerStudent(module, make_planes(2, 3, 16, seed=1), beta=0.5)
    converted = convert(model, "race", layers=[1], num_planes=3, num_tables=2, per_head_beta=True)
    with torch.no_grad():
        converted.model.layers[1].self_attn.hfab_beta.fill_(0.5)
    ours = rts.capture_layer(converted, batch, 1)
    torch.testing.assert_close(ours["hidden"], data["hidden"])  # layer 0 stays softmax
    with torch.no_grad():
        out, race_rows = student(data["hidden"], data["cos"], data["sin"])
    torch.testing.assert_close(out, ours["out"], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(race_rows.sum(-1), torch.ones(3, 4, 70))


@pytest.mark.parametrize("objective", ["mse", "kl", "mse+o"])
def test_race_transfer_study_training_lowers_the_error(objective):
    from benchmarks import race_transfer_study as rts

    model = _tiny_llama()
    batch = {"input_ids": torch.randint(0, 97, (8, 48)), "attention_mask": torch.ones(8, 48, dtype=torch.long)}
    data = rts.capture_layer(model, batch, 0)
    curve = rts.transfer(model.model.layers[0].self_attn, data, 0, objective, steps=40, lr=3e-3,
                         train_rows=torch.arange(6), test_rows=torch.arange(6, 8), planes_per_table=3, tables=2,
                         every=20)
    assert [c["step"] for c in curve] == [0, 20, 40]
    assert curve[-1]["train"] < 0.8 * curve[0]["train"]
    with pytest.raises(ValueError, match="objective='l1' is not supported"):
        rts.transfer(model.model.layers[0].self_attn, data, 0, "l1", 1, 1e-3, torch.arange(6), torch.arange(6, 8))


def test_stieltjes_p_parts_study_two_parts_keep_the_output_at_its_rounding():
    e = stieltjes_p_parts.errors(1024, 1.0, rows=64)
    assert e["two"] < 1e-4 < e["one"]  # the residual part carries P's bits past bf16's 8
    assert e["two rounded"] <= e["rounding"] * (1 + 1e-6) < e["one rounded"]
