"""Programmatic dependent launch (PDL): a kernel starts while the one before it on the stream finishes.

Inside a CUDA graph every kernel still pays ~1-3 us between the end of one launch and the first useful
instruction of the next (KERNEL-NOTES.md), and a decode step runs ~1,500 of them. On sm_90+ a launch with
the programmatic-stream-serialization attribute (Triton's `launch_pdl=True`) may begin before its
predecessor has finished: its programs are scheduled once every program of the predecessor has signalled
`griddepcontrol.launch_dependents` (or exited), and each then waits in `griddepcontrol.wait` until the
predecessor has completed and its memory is visible. The launch, the program set-up and the ramp of one
kernel overlap the tail of the other; the data dependence is kept exactly.

The rule that makes it safe: a kernel launched with PDL waits before it reads or writes anything another
kernel touches. Every kernel of ds4station takes `PDL: tl.constexpr = False` and starts with `enter(PDL)`
(wait, then let the next kernel launch), and every launch passes `**pdl(t)`, which sets both or neither, so a
kernel is never launched early without its wait. Since each PDL kernel finishes only after its own wait
returned, a chain of them keeps every earlier kernel's results visible to every later one (transitively);
plain launches (torch's own kernels, copies) keep full stream order around them. Off on AMD, before sm_90,
in the CPU interpreter, and with DS4STATION_PDL=0.

One exception: a weight stream may be loaded before the wait, since no kernel of a step writes the model's
weights (they are written once, at load, in plain stream order). The matvecs (Q8_0 integer dot, F16) load
their first K step so, and their weight reads overlap the previous kernel's tail (H200, a chain of 4 MB fp16
matvecs in a graph: 2.72 -> 2.48 us each). Weight loads carry `eviction_policy="evict_first"` and nothing else
does; the compile check accepts only such loads before the wait in the PTX, and tests/test_kernels_pdl.py only
such loads (and index arithmetic) before `enter(PDL)` in the source.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ds4station.kernels import dispatch

ENV = "DS4STATION_PDL"
ON = os.environ.get(ENV, "1") != "0"  # read once: launches are hot (tests switch it here)

_ON = {"PDL": True, "launch_pdl": True}
_OFF: dict = {}


def enabled(device: torch.device) -> bool:
    """Whether launches on this device go out with PDL (CUDA sm_90+, not interpreted, not switched off)."""
    return ON and not dispatch.interpreting() and dispatch.hopper_or_newer(device)


def pdl(t: torch.Tensor) -> dict:
    """The launch arguments of a kernel whose tensors live where `t` does: the kernel's PDL constexpr and
    Triton's launch_pdl together, or nothing (the kernel's PDL defaults to False)."""
    return _ON if enabled(t.device) else _OFF


if dispatch.interpreting():
    @triton.jit
    def enter(PDL: tl.constexpr):
        """No grid dependencies in the interpreter: programs run one after another, launches in order."""
        pass
else:
    @triton.jit
    def enter(PDL: tl.constexpr):
        """A kernel's first statement: with PDL, wait until the previous kernel on the stream has completed
        (its writes visible), then allow the next one to launch. Nothing before it may touch memory but the
        weight loads the module docstring allows."""
        if PDL:
            tl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=tl.int32, is_pure=False,
                                      pack=1)
            tl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=tl.int32,
                                      is_pure=False, pack=1)
