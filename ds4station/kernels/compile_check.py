"""Ahead-of-time compile of every Triton kernel for the GPUs ds4station targets, without those GPUs.

`triton.compile(ASTSource(...), target=GPUTarget(...))` runs the whole compiler on a CPU-only machine: PTX
and a cubin (via the ptxas that ships with Triton) for NVIDIA, AMDGCN assembly and an hsaco for AMD. For
each kernel and target this builds exactly the tiles the dispatcher would pick for that target at DS4's real
decode / prefill shapes (dispatch.py is the one place those live) and reports:
- registers (NVIDIA regs; AMD VGPR / SGPR), spills (NVIDIA local memory; AMD scratch), shared memory / LDS;
- for gfx906, whether a kernel that should use packed fp16 dots (`v_dot2_f32_f16`) does, and whether any
  bf16 instruction slipped in (Vega20 has no bf16).
`problems()` lists what must fail CI: compile errors, bf16 in a gfx906 build, spills in decode matvecs.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from ds4station.kernels import dispatch
from ds4station.kernels.dispatch import COMPILE_TARGETS, CompileTarget


@dataclass
class KernelSpec:
    """One kernel instance to compile: its JIT function, argument types and constexpr values."""

    name: str
    fn: object  # triton JITFunction
    signature: dict[str, str]  # every parameter: "*fp16", "i32", "fp32", ... or "constexpr"
    constexprs: dict[str, object]
    aligned: tuple[str, ...]  # parameters known divisible by 16 (pointers, K, strides at real shapes)
    num_warps: int
    num_stages: int
    decode: bool = False  # decode matvec: spills are a failure
    wants_dot: bool = False  # inner loop is a tl.dot (gfx906: expect v_dot2_f32_f16)


@dataclass
class Report:
    kernel: str
    target: str
    ok: bool
    error: str = ""
    regs: int | None = None  # NVIDIA registers per thread, AMD VGPRs
    sgprs: int | None = None
    spill_bytes: int | None = None  # NVIDIA local memory per thread; AMD scratch bytes
    shared_bytes: int | None = None  # shared memory / LDS per program
    dot2: bool | None = None  # gfx906: v_dot2_f32_f16 present
    bf16_instr: int | None = None  # instructions naming bf16 in AMD assembly
    decode: bool = False
    wants_dot: bool = False
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


def _specs(target: CompileTarget) -> list[KernelSpec]:
    """Every kernel at the tiles dispatch picks for `target` at DS4's real shapes."""
    from ds4station.kernels import act_quant, attention, hc, moe_prefill, norm, q8_0, router

    backend = target.kernel_backend
    specs: list[KernelSpec] = []
    i32, ptr16, ptr32 = "i32", "*fp16", "*fp32"
    # Q8_0 decode matvec at every DS4 shape (identical tile choices compile once), 1 and 4 rows
    for label, n, k, groups in (("attn_output_a", 8192, 4096, 8), ("output_head", 129280, 4096, 1),
                                ("attn_q_a", 1024, 4096, 1), ("attn_q_b", 32768, 1024, 1), ("attn_kv", 512, 4096, 1),
                                ("shexp_gate_up", 2048, 4096, 1)):
        for m in (1, 4):
            t = dispatch.matvec_tiles("q8_0", n, k, m, backend, n // groups)
            specs.append(KernelSpec(
                f"q8_0_matvec {label} m{m}", q8_0._q8_0_matvec_kernel,
                {"x_ptr": ptr16, "qs_ptr": "*i32", "d_ptr": ptr16, "y_ptr": ptr32, "N": i32, "K": i32,
                 "rows_per_group": i32, "stride_xm": i32, "stride_xg": i32, "stride_ym": i32,
                 "M": "constexpr", "M_PAD": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr"},
                {"M": m, "M_PAD": _pow2(m), "BLOCK_N": t.block_n, "BLOCK_K": t.block_k},
                ("x_ptr", "qs_ptr", "d_ptr", "y_ptr", "K", "rows_per_group", "stride_xm", "stride_xg", "stride_ym"),
                t.num_warps, t.num_stages, decode=True))
    # Q8_0 matmul: a prefill chunk, and a 4-row step (split-K, counted in the launch, where the backend splits)
    for label, m in (("prefill 2048x4096x8192", 2048), ("4 rows 4096x8192", 4)):
        mt = dispatch.matmul_tiles("q8_0", m, 4096, 8192, backend)
        specs.append(KernelSpec(
            f"q8_0_matmul {label}", q8_0._q8_0_matmul_kernel,
            {"x_ptr": ptr16, "qs_ptr": "*i32", "d_ptr": ptr16, "y_ptr": ptr16, "part_ptr": ptr32, "cnt_ptr": "*i32",
             "M": i32, "N": i32, "K": i32, "rows_per_group": i32, "stride_xm": i32, "stride_ym": i32,
             "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr", "GROUP_M": "constexpr",
             "W_AS_A": "constexpr", "SPLIT_K": "constexpr"},
            {"BLOCK_M": mt.block_m, "BLOCK_N": mt.block_n, "BLOCK_K": mt.block_k, "GROUP_M": mt.group_m,
             "W_AS_A": mt.w_as_a, "SPLIT_K": mt.split_k > 1},
            ("x_ptr", "qs_ptr", "d_ptr", "y_ptr", "part_ptr", "cnt_ptr", "N", "K", "rows_per_group", "stride_xm",
             "stride_ym"),
            mt.num_warps, mt.num_stages, wants_dot=True))
    ptrs = {"iq2_xxs": ("*i64", ptr16, ptr16, ptr16), "q2_k": ("*i32", "*u8", "*i32", "*i32"),
            "q4_k": ("*i32", "*u8", "*u8", "*i32"), "q8_0": ("*i32", ptr16, ptr16, ptr16)}
    specs.append(_rows_matvec_spec("iq2_xxs_matvec expert 2048x4096", "iq2_xxs", 2048, 4096, ptrs["iq2_xxs"], ptr16,
                                   backend))
    specs.append(_rows_matvec_spec("q2_k_matvec expert 4096x2048", "q2_k", 4096, 2048, ptrs["q2_k"], ptr16, backend))
    mo = dispatch.moe_tiles("iq2_xxs", "q2_k", 4096, 2048, 6, backend)
    # the fused MoE decode per expert type: the q2 file's IQ2_XXS gate/up and Q2_K down, the q2-q4 / q4 files'
    # Q4_K, some conversions' Q8_0 (the kernels' four weight pointers; the ones a type does not use repeat)
    for qtype in ("iq2_xxs", "q4_k", "q8_0"):
        specs.append(_moe_spec("gate_up", qtype, ptrs[qtype], dispatch.moe_tiles(qtype, qtype, 4096, 2048, 6, backend)))
    for qtype in ("q2_k", "q4_k"):
        specs.append(_moe_spec("down", qtype, ptrs[qtype], dispatch.moe_tiles(qtype, qtype, 4096, 2048, 6, backend)))
    rt = dispatch.row_tiles(4096 // 32, backend)
    for quant in ("q2_k", "act16"):
        q1 = "*i32" if quant == "act16" else ptr32
        specs.append(KernelSpec(
            f"act_quant {quant} 4096", act_quant._quant_kernel,
            {"x_ptr": ptr32, "q0_ptr": "*i32", "q1_ptr": q1, "q2_ptr": ptr32, "K": i32, "stride_xm": i32,
             "QUANT": "constexpr", "LAYOUT": "constexpr", "BLOCK_G": "constexpr"},
            {**act_quant.quant_flags(quant), "BLOCK_G": min(rt.block, 32)},
            ("x_ptr", "q0_ptr", "q1_ptr", "q2_ptr", "K", "stride_xm"), rt.num_warps, 1))
    pt = dispatch.moe_prefill_tiles(2048 * 6, backend)
    common = {"F": i32, "D": i32}
    specs.append(KernelSpec(
        "moe_prefill_gate_up iq2_xxs 2048x4096", moe_prefill._moe_prefill_gate_up_kernel,
        {"x_ptr": ptr16, "order_ptr": "*i32", "t_exp_ptr": "*i32", "t_start_ptr": "*i32", "t_end_ptr": "*i32",
         "wts_ptr": ptr32, "h_ptr": ptr16, "grid_ptr": "*i64", "g0": "*i64", "g1": ptr16, "g2": ptr16,
         "g3": ptr16, "u0": "*i64", "u1": ptr16, "u2": ptr16, "u3": ptr16, **common, "stride_xt": i32,
         "clamp": "fp32", "S": "constexpr", "QT": "constexpr", "CLAMP": "constexpr", "BLOCK_M": "constexpr",
         "BLOCK_N": "constexpr", "BLOCK_K": "constexpr"},
        {"S": 6, "QT": 0, "CLAMP": True, "BLOCK_M": pt.block_m, "BLOCK_N": pt.block_n, "BLOCK_K": pt.block_k},
        ("x_ptr", "h_ptr", "grid_ptr", "g0", "g1", "g2", "u0", "u1", "u2", "F", "D", "stride_xt"),
        pt.num_warps, pt.num_stages, wants_dot=True))
    q4_bytes = {"0": "*u8", "1": "*u8", "2": "*u8", "3": "*i32"}  # the prefill tile reads the quants as bytes
    specs.append(KernelSpec(
        "moe_prefill_gate_up q4_k 2048x4096", moe_prefill._moe_prefill_gate_up_kernel,
        {"x_ptr": ptr16, "order_ptr": "*i32", "t_exp_ptr": "*i32", "t_start_ptr": "*i32", "t_end_ptr": "*i32",
         "wts_ptr": ptr32, "h_ptr": ptr16, "grid_ptr": "*i64", **{f"g{i}": t for i, t in q4_bytes.items()},
         **{f"u{i}": t for i, t in q4_bytes.items()}, **common, "stride_xt": i32, "clamp": "fp32",
         "S": "constexpr", "QT": "constexpr", "CLAMP": "constexpr", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr",
         "BLOCK_K": "constexpr"},
        {"S": 6, "QT": 2, "CLAMP": True, "BLOCK_M": pt.block_m, "BLOCK_N": pt.block_n, "BLOCK_K": pt.block_k},
        ("x_ptr", "h_ptr", "grid_ptr", "g0", "g1", "g2", "g3", "u0", "u1", "u2", "u3", "F", "D", "stride_xt"),
        pt.num_warps, pt.num_stages, wants_dot=True))
    specs.append(KernelSpec(
        "moe_prefill_down q2_k 4096x2048", moe_prefill._moe_prefill_down_kernel,
        {"h_ptr": ptr16, "order_ptr": "*i32", "t_exp_ptr": "*i32", "t_start_ptr": "*i32", "t_end_ptr": "*i32",
         "y_ptr": ptr32, "grid_ptr": ptr16, "d0": "*u8", "d1": "*u8", "d2": "*i32", "d3": "*i32", **common,
         "QT": "constexpr", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr"},
        {"QT": 1, "BLOCK_M": pt.block_m, "BLOCK_N": pt.block_n, "BLOCK_K": pt.block_k},
        ("h_ptr", "y_ptr", "grid_ptr", "d0", "d1", "d2", "F", "D"), pt.num_warps, pt.num_stages, wants_dot=True))
    # the norms outside hc_pre: 4,096 wide (the MTP layer's input norms), the q_a norm quantised for q_b
    for width, qa, qb in ((4096, None, None), (1024, "act16", None)):
        rt = dispatch.row_tiles(width, backend)
        a, b = _q_ptrs(qa), _q_ptrs(qb)
        fb = act_quant.quant_flags(qb)
        specs.append(KernelSpec(
            f"rms_norm {width}{''.join(f' + {q}' for q in (qa, qb) if q)}", norm._rms_norm_kernel,
            {"x_ptr": ptr32, "w_ptr": ptr32, "y_ptr": ptr32, "a0_ptr": a[0], "a1_ptr": a[1], "a2_ptr": a[2],
             "b0_ptr": b[0], "b1_ptr": b[1], "b2_ptr": b[2], "N": i32, "stride_x": i32, "stride_y": i32,
             "eps": "fp32", "HAS_WEIGHT": "constexpr", "BLOCK": "constexpr", "QUANT": "constexpr",
             "LAYOUT": "constexpr", "QUANT_B": "constexpr", "LAYOUT_B": "constexpr"},
            {"HAS_WEIGHT": True, "BLOCK": rt.block, **act_quant.quant_flags(qa), "QUANT_B": fb["QUANT"],
             "LAYOUT_B": fb["LAYOUT"]},
            ("x_ptr", "w_ptr", "y_ptr", "a0_ptr", "a1_ptr", "a2_ptr", "b0_ptr", "b1_ptr", "b2_ptr", "N", "stride_x",
             "stride_y"), rt.num_warps, 1))
    specs.append(KernelSpec(
        "rope 64 heads x 512 (last 64)", norm._rope_kernel,
        {"x_ptr": ptr32, "pos_ptr": "*i64", "f_ptr": ptr32, "D": i32, "stride_x": i32, "heads": i32, "sign": "fp32",
         "HALF": "constexpr", "BLOCK_H": "constexpr"},
        {"HALF": 32, "BLOCK_H": 32}, ("x_ptr", "pos_ptr", "f_ptr", "D", "stride_x", "heads"), 1, 1))
    if dispatch.use_int_dot(backend):
        # the integer-dot Q8_0 matvec at every projection the engine routes to it (1-2 rows; the head to 3)
        for label, n, k in (("attn_q_a+kv", 1536, 4096), ("attn_q_b", 32768, 1024), ("attn_output_a", 8192, 4096),
                            ("attn_output_b", 4096, 8192), ("shexp_gate_up", 4096, 4096), ("shexp_down", 4096, 2048),
                            ("output_head", 129280, 4096)):
            for m in (1, 2, 3) if label == "output_head" else (1, 2):
                t = dispatch.q8_0_int_dot_tiles(n, k, m)
                specs.append(KernelSpec(
                    f"q8_0_matvec_i8 {label} m{m}", q8_0._q8_0_matvec_i8_kernel,
                    {"hi_ptr": "*i32", "lo_ptr": "*i32", "xs_ptr": ptr32, "qs_ptr": "*i32", "d_ptr": ptr16,
                     "y_ptr": ptr32, "N": i32, "K": i32, "rows_per_group": i32, "stride_xm": i32, "stride_ym": i32,
                     "M": "constexpr", "M_PAD": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr"},
                    {"M": m, "M_PAD": _pow2(m), "BLOCK_N": t.block_n, "BLOCK_K": t.block_k},
                    ("hi_ptr", "lo_ptr", "xs_ptr", "qs_ptr", "d_ptr", "y_ptr", "K", "rows_per_group", "stride_xm",
                     "stride_ym"),
                    t.num_warps, t.num_stages, decode=True))
        if target.backend == "cuda" and int(target.arch) >= 90:  # its tensor-descriptor form where dispatch picks it
            t = dispatch.q8_0_int_dot_tiles(32768, 1024, 1, tma=True)
            kb = t.block_k
            specs.append(KernelSpec(
                "q8_0_matvec_tma attn_q_b m1", q8_0._q8_0_matvec_tma_kernel,
                {"hi_ptr": "*i32", "lo_ptr": "*i32", "xs_ptr": ptr32,
                 "w_desc": f"tensordesc<i32[{t.block_n}, {kb // 4}]>",
                 "d_desc": f"tensordesc<fp16[{t.block_n}, {kb // 32}]>",
                 "y_ptr": ptr32, "N": i32, "K": i32, "rows_per_group": i32, "stride_xm": i32, "stride_ym": i32,
                 "M": "constexpr", "M_PAD": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr",
                 "STAGES": "constexpr"},
                {"M": 1, "M_PAD": 1, "BLOCK_N": t.block_n, "BLOCK_K": kb, "STAGES": t.num_stages},
                ("hi_ptr", "lo_ptr", "xs_ptr", "y_ptr", "K", "rows_per_group", "stride_xm", "stride_ym"),
                t.num_warps, t.num_stages, decode=True))
        specs += _moe_i8_specs("iq2_xxs", "q2_k", ptrs, mo)
        specs += _moe_i8_specs("q4_k", "q4_k", ptrs, dispatch.moe_tiles("q4_k", "q4_k", 4096, 2048, 6, backend))
    specs += _hc_specs(hc, backend)
    specs += _router_specs(router, backend)
    specs += _attention_specs(attention, backend, target.shared_limit)
    specs += _row_specs(backend)
    return specs


def _row_specs(backend: dispatch.Backend) -> list[KernelSpec]:
    """Row finishing (kernels/rows.py), the compressor update (kernels/compressor.py) and the shared expert's
    SwiGLU at DS4's shapes: q heads of 512, the KV row with its FP8 round trip into the ring, indexer queries
    of 128 with Hadamard + FP4; ratio-4 (attention and indexer) and ratio-128 compressors, decode and prefill."""
    from ds4station.kernels import compressor, norm, rows

    p32, i32 = "*fp32", "i32"
    out = []
    for label, d, norm_, rope, had, rt, nope, ring, slots in (
            ("q heads 512", 512, True, True, False, 0, 0, False, False),
            ("kv 512 fp8 ring", 512, True, True, False, 1, 448, True, False),
            ("kv 512 fp8 ring, batched slots", 512, True, True, False, 1, 448, True, True),
            ("index q 128 fp4", 128, False, True, True, 2, 0, False, False)):
        t = dispatch.row_tiles(d, backend)
        out.append(KernelSpec(
            f"finish_rows {label}", rows._finish_rows_kernel,
            {"x_ptr": p32, "pos_ptr": "*i64", "slot_ptr": "*i64", "w_ptr": p32, "f_ptr": p32, "y_ptr": p32, "D": i32,
             "heads": i32, "stride_x": i32, "stride_y": i32, "stride_slot": i32, "ring_len": i32, "eps": "fp32",
             "sign": "fp32", "NORM": "constexpr", "HAS_W": "constexpr", "HALF": "constexpr", "HADAMARD": "constexpr",
             "RT": "constexpr", "NOPE": "constexpr", "RING": "constexpr", "SLOTS": "constexpr", "BLOCK_D": "constexpr",
             "LOG_D": "constexpr"},
            {"NORM": norm_, "HAS_W": ring, "HALF": 32 if rope else 0, "HADAMARD": had, "RT": rt, "NOPE": nope,
             "RING": ring, "SLOTS": slots, "BLOCK_D": max(64, d), "LOG_D": max(64, d).bit_length() - 1},
            ("x_ptr", "w_ptr", "f_ptr", "y_ptr", "D", "stride_x", "stride_y"), t.num_warps, 1, decode=True))
    for label, d, ratio, had, rt, nope in (("r4 kv 512 fp8", 512, 4, False, 1, 448),
                                           ("r128 kv 512 fp8", 512, 128, False, 1, 448),
                                           ("r4 index 128 fp4", 128, 4, True, 2, 0)):
        coff = 2 if ratio == 4 else 1
        t = dispatch.compressor_tiles(d, coff * ratio, backend)
        for mode, form, slots in ((1, "decode", False), (1, "decode, pool slots", True), (0, "prefill", False),
                                  (2, "short prefill, pool slots", True)):
            out.append(KernelSpec(
                f"compress {label} {form}", compressor._compress_kernel,
                {"kv_ptr": p32, "sc_ptr": p32, "ape_ptr": p32, "pos_ptr": "*i64", "slot_ptr": "*i64", "fkv_ptr": p32,
                 "fsc_ptr": p32, "rows_ptr": p32, "w_ptr": p32, "f_ptr": p32, "b0": i32, "Rf": i32, "W": i32, "d": i32,
                 "eps": "fp32", "stride_kv": i32, "stride_sf": i32, "stride_sr": i32,
                 "R": "constexpr", "COFF": "constexpr", "MODE": "constexpr", "HALF": "constexpr",
                 "HADAMARD": "constexpr", "RT": "constexpr", "NOPE": "constexpr", "BLOCK_D": "constexpr",
                 "LOG_D": "constexpr", "BLOCK_J": "constexpr", "SLOTS": "constexpr"},
                {"R": ratio, "COFF": coff, "MODE": mode, "HALF": 32, "HADAMARD": had, "RT": rt, "NOPE": nope,
                 "BLOCK_D": d, "LOG_D": d.bit_length() - 1, "BLOCK_J": t.block_j, "SLOTS": slots},
                ("kv_ptr", "sc_ptr", "ape_ptr", "fkv_ptr", "fsc_ptr", "rows_ptr", "w_ptr", "W", "d"), t.num_warps, 1,
                decode=mode != 0))
    from ds4station.kernels import f16, q4_k

    q4m = {"x_ptr": p32, "qs_ptr": "*u8", "sc_ptr": "*u8", "mn_ptr": "*u8", "dm_ptr": "*i32", "y_ptr": p32}
    out.append(_rows_matvec_spec("q4_k_matvec 4096x4096 m1", "q4_k", 4096, 4096, ("*i32", "*u8", "*u8", "*i32"), p32,
                                 backend))
    mt = dispatch.matmul_tiles("q4_k", 2048, 4096, 4096, backend)
    out.append(KernelSpec(
        "q4_k_matmul prefill 2048x4096x4096", q4_k._q4_k_matmul_kernel,
        {**q4m, "M": i32, "N": i32, "K": i32, "stride_xm": i32, "stride_ym": i32, "BLOCK_M": "constexpr",
         "BLOCK_N": "constexpr", "BLOCK_K": "constexpr"},
        {"BLOCK_M": mt.block_m, "BLOCK_N": mt.block_n, "BLOCK_K": mt.block_k},
        ("x_ptr", "qs_ptr", "sc_ptr", "mn_ptr", "dm_ptr", "y_ptr", "K", "stride_xm", "stride_ym"), mt.num_warps,
        mt.num_stages, wants_dot=True))

    for label, n, k in (("stacked compressor/indexer", 2624, 4096), ("indexer q_b", 8192, 1024), ("router", 256, 4096)):
        t = dispatch.f16_matvec_tiles(n, k, 1, backend)
        out.append(KernelSpec(
            f"f16_matvec {label} {n}x{k}", f16._f16_matvec_kernel,
            {"x_ptr": p32, "w_ptr": "*fp16", "y_ptr": p32, "N": i32, "K": i32, "stride_xm": i32, "stride_wn": i32,
             "stride_ym": i32, "M": "constexpr", "M_PAD": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr"},
            {"M": 1, "M_PAD": 1, "BLOCK_N": t.block_n, "BLOCK_K": t.block_k},
            ("x_ptr", "w_ptr", "y_ptr", "K", "stride_xm", "stride_wn", "stride_ym"), t.num_warps, t.num_stages,
            decode=True))
    # the few-row tensor-core form (CUDA's route at a few rows; its CUDA tiles, compiled for every target)
    mt = dispatch.f16_matmul_tiles(2624, 4096, 4)
    out.append(KernelSpec(
        "f16_matmul 4 rows 2624x4096", f16._f16_matmul_kernel,
        {"x_ptr": p32, "w_ptr": "*fp16", "y_ptr": p32, "part_ptr": p32, "cnt_ptr": "*i32", "M": i32, "N": i32,
         "K": i32, "stride_xm": i32, "stride_wn": i32, "stride_ym": i32, "BLOCK_M": "constexpr",
         "BLOCK_N": "constexpr", "BLOCK_K": "constexpr", "SPLIT_K": "constexpr"},
        {"BLOCK_M": mt.block_m, "BLOCK_N": mt.block_n, "BLOCK_K": mt.block_k, "SPLIT_K": mt.split_k > 1},
        ("x_ptr", "w_ptr", "y_ptr", "part_ptr", "cnt_ptr", "K", "stride_xm", "stride_wn", "stride_ym"),
        mt.num_warps, mt.num_stages, wants_dot=True))
    from ds4station.kernels import indexer

    for label, t_, n_keys, slots in (("decode 8K blocks", 1, 8192, False), ("batched decode 8K blocks", 1, 8192, True),
                                     ("prefill 2K x 8K blocks", 2048, 8192, False)):
        t = dispatch.indexer_tiles(t_, n_keys, 64, 128, backend)
        out.append(KernelSpec(
            f"indexer scores {label}", indexer._indexer_kernel,
            {"q_ptr": p32, "w_ptr": p32, "k_ptr": p32, "pos_ptr": "*i64", "slot_ptr": "*i64", "out_ptr": "*i64",
             "T": i32, "IH": i32, "D": i32, "n0": i32, "n1": i32, "col0": i32, "stride_qt": i32, "stride_qh": i32,
             "stride_wt": i32, "stride_k": i32, "stride_ot": i32, "stride_sk": i32, "ratio": i32, "w_scale": "fp32",
             "BLOCK_T": "constexpr", "BLOCK_H": "constexpr", "BLOCK_N": "constexpr", "BLOCK_D": "constexpr",
             "USE_DOT": "constexpr", "DOT_FP16": "constexpr", "SLOTS": "constexpr"},
            {"BLOCK_T": t.block_t, "BLOCK_H": t.block_h, "BLOCK_N": t.block_n, "BLOCK_D": t.block_d,
             "USE_DOT": t.dot, "DOT_FP16": True, "SLOTS": slots},
            ("q_ptr", "w_ptr", "k_ptr", "out_ptr", "D", "stride_qt", "stride_qh", "stride_wt", "stride_k", "stride_ot"),
            t.num_warps, t.num_stages, decode=t_ == 1))
    top = dispatch.select_max(backend)
    for n_keys, keys_out in ((2048, False), (top, False), (top, True)):
        st = dispatch.select_tiles(n_keys, backend)
        assert st is not None
        out.append(KernelSpec(
            f"indexer top-512 select of {n_keys} keys" + (" (first stage)" if keys_out else ""),
            indexer._select_kernel,
            {"buf_ptr": "*i64", "stride_b": i32, "col0": i32, "n": i32, "blk0": i32, "pos_ptr": "*i64", "ratio": i32,
             "ids_ptr": "*i64", "valid_ptr": "*i1", "out_ptr": "*i64", "stride_o": i32, "K": i32,
             "CHUNK": "constexpr", "BLOCK": "constexpr", "KEYS_OUT": "constexpr"},
            {"CHUNK": st.block, "BLOCK": st.block, "KEYS_OUT": keys_out},
            ("buf_ptr", "ids_ptr", "valid_ptr", "out_ptr"), st.num_warps, 1, decode=True))
    t = dispatch.row_tiles(1024, backend)
    out.append(KernelSpec(
        "swiglu shared expert 2048", norm._swiglu_kernel,
        {"gu_ptr": p32, "y_ptr": p32, "hi_ptr": "*i32", "lo_ptr": "*i32", "xs_ptr": p32, "F": i32, "stride_gu": i32,
         "stride_y": i32, "clamp": "fp32", "CLAMP": "constexpr", "BLOCK": "constexpr", "ACT16": "constexpr"},
        {"CLAMP": True, "BLOCK": t.block, "ACT16": True},  # quantised for the down projection, as decode runs it
        ("gu_ptr", "y_ptr", "hi_ptr", "lo_ptr", "xs_ptr", "F", "stride_gu", "stride_y"), t.num_warps, 1,
        decode=True))
    return out


def _rows_matvec_spec(name: str, qtype: str, n: int, k: int, ptrs: tuple[str, ...], x_type: str,
                      backend: str) -> KernelSpec:
    """moe.rows_matvec's kernel over one dense weight of `qtype` [n, k], one activation row."""
    from ds4station.kernels import moe

    t = dispatch.matvec_tiles(qtype, n, k, 1, backend)
    weights = {f"p{i}": p for i, p in enumerate(ptrs)}
    return KernelSpec(
        name, moe._rows_matvec_kernel,
        {"xt_ptr": x_type, **weights, "grid_ptr": "*i64", "y_ptr": "*fp32", "N": "i32", "K": "i32", "stride_ym": "i32",
         "QT": "constexpr", "M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_U": "constexpr"},
        {"QT": moe._QT_CODE[qtype], "M": 1, "BLOCK_N": t.block_n, "BLOCK_U": t.block_k // moe._UNIT[qtype]},
        ("xt_ptr", *weights, "grid_ptr", "y_ptr", "N", "K", "stride_ym"), t.num_warps, t.num_stages, decode=True)


def _moe_spec(part: str, qtype: str, ptrs: tuple[str, ...], tiles: dispatch.MoeTiles) -> KernelSpec:
    """A fused MoE decode launch (fp32 math) for one expert weight type, at the Flash shape (6 slots)."""
    from ds4station.kernels import moe

    ptr16, ptr32, i32 = "*fp16", "*fp32", "i32"
    unit = moe._UNIT[qtype]
    qt = {"S": 6, "QT": moe._QT_CODE[qtype]}
    tail = {"S": "constexpr", "QT": "constexpr", "BLOCK_N": "constexpr", "BLOCK_U": "constexpr"}
    if part == "gate_up":
        t = tiles.gate_up
        weights = {f"{w}{i}": p for w in "gu" for i, p in enumerate(ptrs)}
        return KernelSpec(
            f"moe_gate_up {qtype} 6x2048x4096", moe._moe_gate_up_kernel,
            {"xt_ptr": ptr16, "ids_ptr": "*i32", "wts_ptr": ptr32, "ht_ptr": ptr32, "grid_ptr": "*i64", **weights,
             "F": i32, "D": i32, "clamp": "fp32", **tail, "H_SUB": "constexpr", "CLAMP": "constexpr"},
            {**qt, "H_SUB": unit, "CLAMP": True, "BLOCK_N": t.block_n, "BLOCK_U": t.block_k // unit},
            ("xt_ptr", "ht_ptr", "grid_ptr", *weights, "F", "D"), t.num_warps, t.num_stages, decode=True)
    t = tiles.down
    weights = {f"d{i}": p for i, p in enumerate(ptrs)}
    return KernelSpec(
        f"moe_down {qtype} 6x4096x2048", moe._moe_down_kernel,
        {"ht_ptr": ptr32, "ids_ptr": "*i32", "y_ptr": ptr32, "grid_ptr": "*i64", **weights, "F": i32, "D": i32,
         "stride_yt": i32, **tail},
        {**qt, "BLOCK_N": t.block_n, "BLOCK_U": t.block_k // unit},
        ("ht_ptr", "y_ptr", "grid_ptr", *weights, "F", "D", "stride_yt"), t.num_warps, t.num_stages, decode=True)


def _moe_i8_specs(gate_qtype: str, down_qtype: str, ptrs: dict[str, tuple[str, ...]],
                  tiles: dispatch.MoeTiles) -> list[KernelSpec]:
    """The fused MoE's integer-dot launches (CUDA) for one pair of expert types, at the Flash shape (6 slots)."""
    from ds4station.kernels import moe

    ptr32 = "*fp32"
    act = {"xq_ptr": "*i32", "xs_ptr": ptr32, "xsum_ptr": ptr32, "ids_ptr": "*i32"}
    tail = {"S": "constexpr", "QT": "constexpr", "BLOCK_N": "constexpr", "BLOCK_U": "constexpr",
            "PADDED": "constexpr"}
    gate = {f"{w}{i}": p for w in "gu" for i, p in enumerate(ptrs[gate_qtype])}
    down = {f"d{i}": p for i, p in enumerate(ptrs[down_qtype])}
    gu, dn = tiles.gate_up, tiles.down
    return [
        KernelSpec(
            f"moe_gate_up_i8 {gate_qtype} 6x2048x4096", moe._moe_gate_up_i8_kernel,
            {**act, "wts_ptr": ptr32, "h_ptr": ptr32, "grid_ptr": "*i32", **gate, "last_ptr": "*i64",
             "F": "i32", "D": "i32", "clamp": "fp32", **tail, "CLAMP": "constexpr"},
            {"S": 6, "QT": moe._QT_CODE[gate_qtype], "CLAMP": True, "BLOCK_N": gu.block_n,
             "BLOCK_U": gu.block_k // moe._I8_UNIT[gate_qtype], "PADDED": False},
            ("xq_ptr", "xs_ptr", "xsum_ptr", "h_ptr", "grid_ptr", *gate, "F", "D"),
            gu.num_warps, gu.num_stages, decode=True),
        KernelSpec(
            f"moe_down_i8 {down_qtype} 6x4096x2048", moe._moe_down_i8_kernel,
            {**act, "y_ptr": ptr32, "grid_ptr": "*i32", **down, "last_ptr": "*i64", "F": "i32", "D": "i32",
             "stride_yt": "i32", **tail},
            {"S": 6, "QT": moe._QT_CODE[down_qtype], "BLOCK_N": dn.block_n,
             "BLOCK_U": dn.block_k // moe._I8_UNIT[down_qtype], "PADDED": False},
            ("xq_ptr", "xs_ptr", "xsum_ptr", "y_ptr", "grid_ptr", *down, "F", "D", "stride_yt"),
            dn.num_warps, dn.num_stages, decode=True),
    ]


def _q_ptrs(quant: str | None) -> tuple[str, str, str]:
    """The three output pointer types of a quantised form (act_quant.quant_buffers), or unused fp32 ones."""
    return ("*i32", "*i32", "*fp32") if quant == "act16" else ("*i32", "*fp32", "*fp32") if quant else ("*fp32",) * 3


def _hc_specs(hc, backend: dispatch.Backend) -> list[KernelSpec]:  # type: ignore[no-untyped-def]
    """Hyper-connection kernels (kernels/hc.py) at DS4's shape (4 streams x 4096): a decode step, a padded static
    step of 16 rows and a 2048-row prefill chunk (static steps: hc_post computes the next mix partials)."""
    from ds4station.kernels import act_quant

    C, dim = 4, 4096
    k, m = C * dim, (2 + C) * C
    i32, p32 = "i32", "*fp32"
    out = []
    for t in (1, 16, 2048):
        tl_ = dispatch.hc_tiles(k, m, dim, t, backend)
        static = t <= 16
        nblk = -(-k // tl_.chunk_k)
        out.append(KernelSpec(
            f"hc_mix_partial T{t}", hc._hc_mix_partial_kernel,
            {"x_ptr": p32, "fn_ptr": p32, "part_ptr": p32, "K": i32, "M": i32, "CHUNK": i32, "stride_xt": i32,
             "stride_fn": i32, "BLOCK_M": "constexpr", "BLOCK_K": "constexpr"},
            {"BLOCK_M": _pow2(m + 1), "BLOCK_K": tl_.block_k},
            ("x_ptr", "fn_ptr", "part_ptr", "K", "CHUNK", "stride_xt", "stride_fn"), tl_.num_warps, 1,
            decode=t == 1))
        # the RMSNorm after it quantised as the engine's consumers read it at these rows: attn_norm for
        # q_kv (act16), ffn_norm for the shared expert (act16) and the routed experts (a layout), the head's norm
        forms = [(False, None, None), (False, "act16", None), (False, "act16", "iq2_xxs"), (True, "act16", None)]
        for head, qa, qb in forms if t == 1 else [(False, None, None), (True, None, None)]:
            a, b = _q_ptrs(qa), _q_ptrs(qb)
            fb = act_quant.quant_flags(qb)
            out.append(KernelSpec(
                f"hc_finalize{' head' if head else ''} T{t}{''.join(f' + {q}' for q in (qa, qb) if q)}",
                hc._hc_finalize_kernel,
                {"part_ptr": p32, "x_ptr": p32, "scale_ptr": p32, "base_ptr": p32, "w_ptr": p32, "y_ptr": p32,
                 "post_ptr": p32, "comb_ptr": p32, "a0_ptr": a[0], "a1_ptr": a[1], "a2_ptr": a[2], "b0_ptr": b[0],
                 "b1_ptr": b[1], "b2_ptr": b[2], "NBLK": i32, "K": i32, "DIM": i32, "stride_xt": i32,
                 "stride_xc": i32, "stride_yt": i32, "rms_eps": "fp32", "hc_eps": "fp32", "iters": i32,
                 "C": "constexpr", "CP": "constexpr", "NBLK_P": "constexpr",
                 "BLOCK_D": "constexpr", "HEAD": "constexpr", "QUANT": "constexpr",
                 "LAYOUT": "constexpr", "QUANT_B": "constexpr", "LAYOUT_B": "constexpr"},
                # a static step's hc_pre reads the partials hc_post computed (C * dim / block_dm), the rest their own
                {"C": C, "CP": C, "NBLK_P": _pow2(C * -(-dim // tl_.block_dm) if static and not head else nblk),
                 "BLOCK_D": _pow2(dim), "HEAD": head, **act_quant.quant_flags(qa),
                 "QUANT_B": fb["QUANT"], "LAYOUT_B": fb["LAYOUT"]},
                ("x_ptr", "y_ptr", "w_ptr", "a0_ptr", "a1_ptr", "a2_ptr", "b0_ptr", "b1_ptr", "b2_ptr", "DIM",
                 "stride_xt", "stride_xc", "stride_yt"), tl_.num_warps_n, 1, decode=t == 1))
        out.append(KernelSpec(
            # the FFN's form: routed + shared experts summed in it; in a static step the next hc_pre's mix partials
            # computed, and a padded one's rows after the last real one reading its out (LAST)
            f"hc_post T{t}", hc._hc_post_kernel,
            {"o_ptr": p32, "e_ptr": p32, "x_ptr": p32, "post_ptr": p32, "comb_ptr": p32, "y_ptr": p32, "fn_ptr": p32,
             "part_ptr": p32, "last_ptr": "*i64", "DIM": i32, "M": i32, "stride_ot": i32, "stride_et": i32,
             "stride_xt": i32, "stride_xc": i32, "stride_yt": i32, "stride_yc": i32, "stride_fn": i32,
             "C": "constexpr", "CP": "constexpr", "BLOCK_D": "constexpr", "EXTRA": "constexpr", "MIX": "constexpr",
             "BLOCK_M": "constexpr", "LAST": "constexpr"},
            {"C": C, "CP": C, "BLOCK_D": tl_.block_dm if static else tl_.block_d, "EXTRA": True, "MIX": static,
             "BLOCK_M": _pow2(m + 1), "LAST": static and t > 1},
            ("o_ptr", "e_ptr", "x_ptr", "y_ptr", "fn_ptr", "part_ptr", "DIM", "stride_ot", "stride_et", "stride_xt",
             "stride_xc", "stride_yt", "stride_yc", "stride_fn"),
            tl_.num_warps_m if static else tl_.num_warps_d, 1, decode=t == 1))
    return out


def _router_specs(router, backend: dispatch.Backend) -> list[KernelSpec]:  # type: ignore[no-untyped-def]
    """MoE router (kernels/router.py) at DS4's shape: 256 experts, top-6, biased and hash layers."""
    E, k = 256, 6
    rt = dispatch.router_tiles(E, backend)
    out = []
    for hashed in (False, True):
        out.append(KernelSpec(
            f"router E{E} k{k}{' hash' if hashed else ''}", router._router_kernel,
            {"logits_ptr": "*fp32", "bias_ptr": "*fp32", "tid2eid_ptr": "*i64", "tokens_ptr": "*i64",
             "ids_ptr": "*i64", "wts_ptr": "*fp32", "E": "i32", "stride_lt": "i32", "stride_tid": "i32",
             "scale": "fp32", "K": "constexpr", "K_P": "constexpr", "BLOCK_E": "constexpr", "HAS_BIAS": "constexpr",
             "HASH": "constexpr", "NORM": "constexpr"},
            {"K": k, "K_P": _pow2(k), "BLOCK_E": rt.block_e, "HAS_BIAS": not hashed, "HASH": hashed, "NORM": True},
            ("logits_ptr", "bias_ptr", "tid2eid_ptr", "tokens_ptr", "ids_ptr", "wts_ptr", "E", "stride_lt"),
            rt.num_warps, 1, decode=True))
    return out


def _attention_specs(attention, backend: dispatch.Backend, shared: int) -> list[KernelSpec]:  # type: ignore[no-untyped-def]
    """Decode attention (kernels/attention.py) at DS4's shape, 64 heads x 512: window only (128 keys), an
    indexed ratio-4 layer (128 + 512 gathered rows) and a ratio-128 layer at 1M context (128 + 8192 rows);
    fp32 and fp16 KV."""
    H, D = 64, 512
    out = []
    for label, nc, indexed in (("window", 0, False), ("indexed r4", 512, True), ("r128 1M", 8192, False)):
        t = dispatch.attention_tiles(H, D, 128 + nc, backend)
        for kv in ("fp32", "fp16", "fp16 batched slots"):
            slots = kv.endswith("slots")
            kv = kv.split()[0]
            sig = {"q_ptr": "*fp32", "kw_ptr": f"*{kv}", "mw_ptr": "*i1", "kc_ptr": f"*{kv}", "mc_ptr": "*i1",
                   "ids_ptr": "*i64", "pos_ptr": "*i64", "m_ptr": "*fp32", "l_ptr": "*fp32", "acc_ptr": "*fp32",
                   "slot_ptr": "*i64", "H": "i32", "D": "i32", "NW": "i32", "NC": "i32", "ring_len": "i32",
                   "stride_q": "i32", "stride_kw": "i32", "stride_kc": "i32", "stride_qt": "i32", "stride_it": "i32",
                   "stride_skw": "i32", "stride_skc": "i32", "scale": "fp32", "INDEXED": "constexpr",
                   "RING": "constexpr", "RATIO": "constexpr", "SLOTS": "constexpr", "BLOCK_H": "constexpr",
                   "BLOCK_N": "constexpr"}
            consts = {"INDEXED": indexed, "RING": True, "RATIO": 128 if nc == 8192 else 0, "SLOTS": slots,
                      "BLOCK_H": t.block_h, "BLOCK_N": t.block_n}
            aligned = ("q_ptr", "kw_ptr", "kc_ptr", "ids_ptr", "m_ptr", "l_ptr", "acc_ptr", "D", "stride_q",
                       "stride_kw", "stride_kc")
            if t.block_dv:  # the tl.dot form (all heads per program)
                sig.update({"BLOCK_K": "constexpr", "BLOCK_DV": "constexpr", "PRECISION": "constexpr",
                            "F16": "constexpr"})
                consts.update({"BLOCK_K": t.block_d, "BLOCK_DV": t.block_dv, **attention.dot_consts(t)})
                fn = attention._attn_split_dot_kernel
            else:
                sig["BLOCK_D"] = "constexpr"
                consts["BLOCK_D"] = t.block_d
                fn = attention._attn_split_kernel
            out.append(KernelSpec(f"attn_split {label} {kv}{' batched' if slots else ''}", fn, sig, consts, aligned,
                                  t.num_warps, 1, decode=True))
        tp = dispatch.attention_prefill_tiles(H, D, backend, shared)
        out.append(KernelSpec(
            f"attn_prefill {label}", attention._attn_prefill_kernel,
            {"q_ptr": "*fp32", "kw_ptr": "*fp32", "kc_ptr": "*fp32", "mc_ptr": "*i1", "ids_ptr": "*i64",
             "pos_ptr": "*i64", "sinks_ptr": "*fp32", "out_ptr": "*fp32", "H": "i32", "D": "i32", "NW": "i32",
             "NC": "i32", "ring_len": "i32", "stride_qt": "i32", "stride_qh": "i32", "stride_kw": "i32",
             "stride_kc": "i32", "stride_it": "i32", "stride_ot": "i32", "stride_oh": "i32", "scale": "fp32",
             "INDEXED": "constexpr", "RATIO": "constexpr", "BLOCK_H": "constexpr", "BLOCK_N": "constexpr",
             "BLOCK_K": "constexpr", "BLOCK_DV": "constexpr", "PRECISION": "constexpr", "F16": "constexpr",
             "Q_ONCE": "constexpr"},
            {"INDEXED": indexed, "RATIO": 0 if indexed else 128, "BLOCK_H": tp.block_h, "BLOCK_N": tp.block_n,
             "BLOCK_K": tp.block_d, "BLOCK_DV": tp.block_dv, "Q_ONCE": tp.block_d >= D,
             **attention.dot_consts(tp)},
            ("q_ptr", "kw_ptr", "kc_ptr", "out_ptr", "D", "stride_qt", "stride_qh", "stride_kw", "stride_kc",
             "stride_ot", "stride_oh"), tp.num_warps, 1))
        out.append(KernelSpec(
            f"attn_combine {label}", attention._attn_combine_kernel,
            {"m_ptr": "*fp32", "l_ptr": "*fp32", "acc_ptr": "*fp32", "sinks_ptr": "*fp32", "out_ptr": "*fp32",
             "pos_ptr": "*i64", "f_ptr": "*fp32", "hi_ptr": "*i32", "lo_ptr": "*i32", "xs_ptr": "*fp32", "S": "i32",
             "H": "i32", "D": "i32", "stride_o": "i32", "stride_ot": "i32", "BLOCK_S": "constexpr",
             "BLOCK_DC": "constexpr", "HALF": "constexpr", "ACT16": "constexpr"},
            # the decode step's: RoPE undone in it, the output quantised for out_a where whole 32-groups
            {"BLOCK_S": t.block_s, "BLOCK_DC": t.block_dc, "HALF": 32, "ACT16": t.block_dc % 32 == 0},
            ("m_ptr", "l_ptr", "acc_ptr", "sinks_ptr", "out_ptr", "hi_ptr", "lo_ptr", "xs_ptr", "D", "stride_o"),
            t.num_warps_c, 1, decode=True))
    return out


def _pow2(v: int) -> int:
    return 1 << (v - 1).bit_length()


def _cuda_resources(cubin: bytes) -> dict[str, int]:
    """REG / SHARED / LOCAL from `cuobjdump --dump-resource-usage` (shipped with Triton's NVIDIA backend)."""
    import triton

    exe = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(exe):
        exe = shutil.which("cuobjdump") or ""
    if not exe:
        return {}
    with tempfile.NamedTemporaryFile(suffix=".cubin") as fh:
        fh.write(cubin)
        fh.flush()
        text = subprocess.run([exe, "--dump-resource-usage", fh.name], capture_output=True, text=True,
                              timeout=60).stdout
    found = {k: int(v) for k, v in re.findall(r"\b(REG|SHARED|LOCAL|STACK):(\d+)", text)}
    return found


def _amd_resources(asm: str) -> dict[str, int]:
    """VGPR / SGPR / scratch / LDS from the AMDGCN assembly's metadata."""
    out: dict[str, int] = {}
    for key, pat in (("vgpr", r"\.vgpr_count:\s+(\d+)"), ("sgpr", r"\.sgpr_count:\s+(\d+)"),
                     ("scratch", r"\.private_segment_fixed_size:\s+(\d+)"),
                     ("lds", r"\.group_segment_fixed_size:\s+(\d+)")):
        m = re.search(pat, asm)
        if m:
            out[key] = int(m.group(1))
    return out


_BF16_RE = re.compile(r"^\s*v_\w*bf16\w*", re.MULTILINE)


def compile_one(spec: KernelSpec, target: CompileTarget) -> Report:
    """Compile one kernel for one target and read its resources; never raises on compiler errors."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    rep = Report(spec.name, target.name, ok=False, decode=spec.decode, wants_dot=spec.wants_dot)
    signature, constexprs = dict(spec.signature), dict(spec.constexprs)
    if "PDL" in spec.fn.arg_names:  # built as pdl.pdl() launches it there: with the grid-dependency wait on sm_90+
        signature["PDL"], constexprs["PDL"] = "constexpr", pdl_target(target)
    names = list(signature)
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in spec.aligned}
    try:
        src = ASTSource(fn=spec.fn, signature=signature, constexprs=constexprs, attrs=attrs)
        kernel = triton.compile(src, target=GPUTarget(target.backend, target.arch, target.warp_size),
                                options={"num_warps": spec.num_warps, "num_stages": spec.num_stages})
    except Exception as exc:  # the compiler's message is the report
        rep.error = f"{type(exc).__name__}: {exc}".strip()[:2000]
        return rep
    rep.ok = True
    rep.shared_bytes = int(getattr(kernel.metadata, "shared", 0) or 0)
    if target.backend == "cuda":
        rep.extra["pdl"] = pdl_order(kernel.asm["ptx"]) if constexprs.get("PDL") else "off"
        res = _cuda_resources(kernel.asm["cubin"])
        rep.regs = res.get("REG")
        rep.spill_bytes = res.get("LOCAL")
        if "SHARED" in res:
            rep.shared_bytes = max(rep.shared_bytes, res["SHARED"])
    else:
        asm = kernel.asm["amdgcn"]
        res = _amd_resources(asm)
        rep.regs, rep.sgprs = res.get("vgpr"), res.get("sgpr")
        rep.spill_bytes = res.get("scratch")
        rep.shared_bytes = max(rep.shared_bytes, res.get("lds", 0))  # Triton's LDS is dynamic: metadata.shared
        rep.bf16_instr = len(_BF16_RE.findall(asm))
        if target.arch == "gfx906":
            rep.dot2 = "v_dot2_f32_f16" in asm
    return rep


def pdl_target(target: CompileTarget) -> bool:
    """Whether kernels run with programmatic dependent launch on this target (kernels/pdl.py: sm_90+)."""
    return target.backend == "cuda" and int(target.arch) >= 90


_GLOBAL_ACCESS = re.compile(r"\b(?:(?:ld|st|atom|red)\.global|cp\.async|prefetch\.global)")


def pdl_order(ptx: str) -> str:
    """Where a PDL kernel's grid-dependency wait sits in its PTX: "first" when it comes before every global
    memory access but weight loads (`ld.global.L1::evict_first`: pdl.py, weights are no kernel's output) and
    before the launch of dependents, "late" when some other access comes first (a race with the previous
    kernel), "missing" without it."""
    wait = ptx.find("griddepcontrol.wait")
    go = ptx.find("griddepcontrol.launch_dependents")
    if wait < 0 or go < 0:
        return "missing"
    early = [m for m in _GLOBAL_ACCESS.finditer(ptx, 0, wait)
             if not ptx.startswith("ld.global.L1::evict_first", m.start())]
    return "first" if not early and go > wait else "late"


def compile_all(targets: list[str] | None = None, only: str | tuple[str, ...] = "",
                progress: Callable[[Report], None] | None = None) -> list[Report]:
    """Compile every kernel for every (or the named) target; one report per (kernel, target).

    only: keep kernels whose name contains this text (or any of these texts)."""
    if dispatch.interpreting():
        raise RuntimeError("TRITON_INTERPRET is set: kernels are interpreter functions and cannot be compiled; "
                           "run the compile check in a process without it (see main())")
    wanted = (only,) if isinstance(only, str) else only
    chosen = [t for t in COMPILE_TARGETS if targets is None or t.name in targets]
    unknown = set(targets or ()) - {t.name for t in COMPILE_TARGETS}
    if unknown:
        raise ValueError(f"unknown targets {sorted(unknown)}; have {[t.name for t in COMPILE_TARGETS]}")
    reports = []
    for target in chosen:
        seen: set[tuple] = set()
        for spec in _specs(target):
            if any(wanted) and not any(w in spec.name for w in wanted):
                continue
            key = (spec.fn, tuple(sorted(spec.constexprs.items())), tuple(spec.signature.items()), spec.num_warps,
                   spec.num_stages)
            if key in seen:  # same binary as a spec already compiled (shapes differ only in runtime ints)
                continue
            seen.add(key)
            rep = compile_one(spec, target)
            reports.append(rep)
            if progress:
                progress(rep)
    return reports


def problems(reports: list[Report]) -> list[str]:
    """What CI rejects: a compile error, bf16 in a gfx906 build, spills in a decode matvec, a PDL kernel that
    touches memory before its grid-dependency wait, more shared memory than the target gives a program."""
    out = []
    for r in reports:
        if not r.ok:
            out.append(f"{r.kernel} on {r.target}: compile failed: {r.error.splitlines()[0] if r.error else ''}")
            continue
        if r.target == "gfx906" and r.bf16_instr:
            out.append(f"{r.kernel} on gfx906: {r.bf16_instr} bf16 instructions (Vega20 has no bf16)")
        if r.extra.get("pdl") in ("late", "missing"):
            out.append(f"{r.kernel} on {r.target}: launched early (PDL), its grid-dependency wait is {r.extra['pdl']}")
        if r.decode and r.spill_bytes:
            out.append(f"{r.kernel} on {r.target}: {r.spill_bytes} bytes of register spills / scratch")
        limit = next((t.shared_limit for t in dispatch.COMPILE_TARGETS if t.name == r.target), None)
        if limit is not None and (r.shared_bytes or 0) > limit:
            out.append(f"{r.kernel} on {r.target}: {r.shared_bytes} bytes of shared memory, over the {limit} a "
                       "program may use there (it would not launch)")
    return out


def format_table(reports: list[Report]) -> str:
    lines = ["| kernel | target | compiled | regs (VGPR) | SGPR | spills / scratch B | shared / LDS B | "
             "gfx906 v_dot2_f32_f16 | bf16 instr |",
             "|---|---|---|---|---|---|---|---|---|"]

    def f(v: object) -> str:
        return "" if v is None else str(v)

    for r in reports:
        status = "yes" if r.ok else "ERROR: " + (r.error.splitlines()[0][:80] if r.error else "")
        dot = "" if r.dot2 is None else ("yes" if r.dot2 else ("NO" if r.wants_dot else "no (no dot)"))
        lines.append(f"| {r.kernel} | {r.target} | {status} | {f(r.regs)} | {f(r.sgprs)} | {f(r.spill_bytes)} | "
                     f"{f(r.shared_bytes)} | {dot} | {f(r.bf16_instr)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """`python -m ds4station.kernels.compile_check [--only NAME ...] [--targets a,b] [--json PATH]`: the same
    as `ds4station bench compile`, usable from tests that must leave their own process interpreted."""
    import argparse
    import json

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", default=[])
    parser.add_argument("--targets", default="")
    parser.add_argument("--json", default="")
    args = parser.parse_args(argv)
    reports = compile_all(targets=[t for t in args.targets.split(",") if t] or None, only=tuple(args.only))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump([r.as_dict() for r in reports], fh, indent=1)
    print(format_table(reports))
    return 1 if problems(reports) else 0


if __name__ == "__main__":
    raise SystemExit(main())
