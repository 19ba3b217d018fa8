"""Run Triton kernels on CPU tensors through Triton's interpreter when no CUDA device is present.

Must be imported before anything imports a module that defines @triton.jit kernels (the interpreter is
chosen when a kernel is decorated). On a CUDA machine nothing is changed: the same tests then run the
compiled kernels on the GPU.
"""

from __future__ import annotations

import os

import torch

INTERPRET = not torch.cuda.is_available()
if INTERPRET:
    os.environ["TRITON_INTERPRET"] = "1"

DEVICE = torch.device("cpu") if INTERPRET else torch.device("cuda")


def _patch_interpreter_index() -> None:
    """Triton 3.6's interpreter turns loop bounds into ints with int(ndarray of shape (1,)), which
    numpy >= 2.4 rejects; take the single element explicitly instead."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    original = interpreter._patch_lang_tensor
    if getattr(original, "_deltaserve_patched", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._deltaserve_patched = True
    interpreter._patch_lang_tensor = patched


def _patch_interpreter_bf16_rounding() -> None:
    """The interpreter truncates fp32 -> bf16 in `.to(tl.bfloat16)`; the GPU rounds to nearest even (as
    torch does). Round like the GPU so bf16 results here match what the kernels compute there."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter._convert_float
    if getattr(original, "_deltaserve_patched", False):
        return

    def patched(data, src, dst, rounding_mode):
        if src == tl.float32 and dst == tl.bfloat16:
            t = torch.from_numpy(np.ascontiguousarray(data).view(np.float32).copy()).to(torch.bfloat16)
            return t.view(torch.int16).numpy().view(np.uint16)
        return original(data, src, dst, rounding_mode)

    patched._deltaserve_patched = True
    interpreter._convert_float = patched


def _patch_interpreter_fp8() -> None:
    """The interpreter converts to and from e4m3 (float8e4nv) by a generic bit shuffle that neither rounds to
    nearest even nor knows e4m3fn's range; convert as the GPU does (torch's conversions: round to nearest
    even; the kernels clamp before they narrow). The dot widens fp8 operands through this conversion."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter._convert_float
    if getattr(original, "_deltaserve_fp8", False):
        return
    wide = {tl.float32: (torch.float32, torch.int32, np.int32), tl.float16: (torch.float16, torch.int16, np.int16),
            tl.bfloat16: (torch.bfloat16, torch.int16, np.int16)}

    def patched(data, src, dst, rounding_mode):
        if dst == tl.float8e4nv and src in wide:
            bits = torch.from_numpy(np.ascontiguousarray(data).view(wide[src][2]).copy())
            return bits.view(wide[src][0]).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
        if src == tl.float8e4nv and dst in wide:
            t = torch.from_numpy(np.ascontiguousarray(data).view(np.uint8).copy()).view(torch.float8_e4m3fn)
            return t.to(wide[dst][0]).view(wide[dst][1]).numpy()
        return original(data, src, dst, rounding_mode)

    patched._deltaserve_fp8 = True
    patched._deltaserve_patched = getattr(original, "_deltaserve_patched", False)
    interpreter._convert_float = patched


def _patch_interpreter_bf16_dot() -> None:
    """The interpreter multiplies bf16 dot operands as their raw uint16 bit patterns; widen them to fp32
    first (exact), accumulating in fp32 as the GPU's tensor cores do."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    cls = interpreter.InterpreterBuilder
    original = cls.create_dot
    if getattr(original, "_deltaserve_patched", False):
        return

    def widen(h):
        if h.dtype.scalar == tl.bfloat16:
            bits = h.data.astype(np.uint32) << 16
            return interpreter.TensorHandle(bits.view(np.float32), tl.float32)
        return h

    def patched(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    patched._deltaserve_patched = True
    cls.create_dot = patched


def _patch_interpreter_speed() -> None:
    """The interpreter re-patches triton.language on every call of a @triton.jit helper (tl.sum, tl.where
    ... included), which dominates the run time of kernels with loops. Within one kernel launch the patch
    is the same every time: do it once per (launch, set of language modules)."""
    from triton.runtime import interpreter

    if getattr(interpreter._patch_lang, "_deltaserve_patched", False):
        return
    patch_lang = interpreter._patch_lang
    run_grid = interpreter.GridExecutor.__call__
    state = {"epoch": 0, "seen": set()}

    class _NoScope:
        def restore(self) -> None:
            pass

    def cached_patch_lang(fn):
        key = (state["epoch"], tuple(sorted(id(v) for v in fn.__globals__.values()
                                            if v is interpreter.tl or v is interpreter.tl.core)))
        if key in state["seen"]:
            return _NoScope()
        state["seen"].add(key)
        return patch_lang(fn)

    def grid_call(self, *args, **kwargs):
        state["epoch"] += 1
        state["seen"].clear()
        return run_grid(self, *args, **kwargs)

    cached_patch_lang._deltaserve_patched = True
    interpreter._patch_lang = cached_patch_lang
    interpreter.GridExecutor.__call__ = grid_call


if INTERPRET:
    _patch_interpreter_speed()
    _patch_interpreter_index()
    _patch_interpreter_bf16_rounding()
    _patch_interpreter_fp8()
    _patch_interpreter_bf16_dot()
