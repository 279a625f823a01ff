"""The Triton interpreter (``TRITON_INTERPRET=1``), faster for the tests.

The interpreter runs each program of a grid in Python. Before each kernel launch and each
call of a ``@triton.jit`` helper from inside a kernel, its ``_patch_builtin`` lists every
member of ``triton.language`` (and of its ``tensor`` and ``math``) with
``inspect.getmembers`` to find the builtins it wraps; the members are the same every time.
Our kernels call helpers once per program, so a 161-tensor step lists them tens of
thousands of times: up to a third of an interpreted test's time (test_triton_kernels:
47 s before, 31 s after).

``install()`` keeps each module's list of builtins from its first listing and wraps, as
before, those still unwrapped. It also keeps the NumPy dtype of each Triton dtype: the
interpreter's ``_get_np_dtype`` builds its table of 19 dtypes anew at each call, and most
operations of every program call it (test_triton_kernels: 57 s of CPU before, 50 s after).
What the kernels compute is the interpreter's as before: every kernel test compares it
with the references. Where the interpreter lacks either function (another Triton), that
one is left as it is.
"""

from __future__ import annotations

import inspect
import os
from typing import Any


def install() -> None:
    """Keep the interpreter's listings of builtins and its NumPy dtypes from one launch
    to the next, where the interpreter is on (``TRITON_INTERPRET=1``) and Triton imports;
    elsewhere do nothing."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    try:
        from triton import language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    _cache_builtin_lists(tl, interpreter)
    _cache_np_dtypes(tl, interpreter)


def _cache_builtin_lists(tl: Any, interpreter: Any) -> None:
    """The cached listing, where the interpreter's ``_patch_builtin`` has the parameters
    this replacement keeps."""
    original = getattr(interpreter, "_patch_builtin", None)
    if original is None or getattr(original, "cached_listing", False):
        return
    if list(inspect.signature(original).parameters) != ["pkg", "builder", "scope"]:
        return
    patch_attr = interpreter._patch_attr
    listed: dict[object, list[tuple[str, object]]] = {}  # modules and classes hash by identity

    def listing(pkg) -> list[tuple[str, object]]:
        if pkg not in listed:
            listed[pkg] = [(n, m) for n, m in inspect.getmembers(pkg) if tl.core.is_builtin(m)]
        return listed[pkg]

    # Listed now, before any launch has wrapped a builtin: the modules the interpreter
    # wraps (others are listed at their first launch).
    for pkg in (tl, tl.core, tl.tensor, tl.math, getattr(tl.core, "tensor_descriptor_base", None)):
        if pkg is not None:
            listing(pkg)

    def _patch_builtin(pkg, builder, scope) -> None:
        for name, member in listing(pkg):
            # A builtin an enclosing launch already wrapped is no longer one: the
            # interpreter's own listing skips it too.
            if getattr(pkg, name, None) is member:
                patch_attr(pkg, name, member, builder, scope)

    _patch_builtin.cached_listing = True  # type: ignore[attr-defined]
    interpreter._patch_builtin = _patch_builtin


def _cache_np_dtypes(tl: Any, interpreter: Any) -> None:
    """The kept lookup, where the interpreter has ``_get_np_dtype``."""
    original = getattr(interpreter, "_get_np_dtype", None)
    if original is None or getattr(original, "kept", False):
        return
    kept: dict[object, object] = {}

    def _get_np_dtype(tt_dtype):
        # A block's dtype is its element's, and a pointer's uint64, as in the original.
        if isinstance(tt_dtype, tl.block_type):
            tt_dtype = tt_dtype.element_ty
        if isinstance(tt_dtype, tl.pointer_type):
            return original(tt_dtype)
        found = kept.get(tt_dtype)
        if found is None:
            found = kept[tt_dtype] = original(tt_dtype)
        return found

    _get_np_dtype.kept = True  # type: ignore[attr-defined]
    interpreter._get_np_dtype = _get_np_dtype
