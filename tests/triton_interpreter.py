"""The Triton interpreter (``TRITON_INTERPRET=1``), faster for the tests.

The interpreter runs each program of a grid in Python. Before each kernel launch and each
call of a ``@triton.jit`` helper from inside a kernel, its ``_patch_builtin`` lists every
member of ``triton.language`` (and of its ``tensor`` and ``math``) with
``inspect.getmembers`` to find the builtins it wraps; the members are the same every time.
Our kernels call helpers once per program, so a 161-tensor step lists them tens of
thousands of times: up to a third of an interpreted test's time (test_triton_kernels:
47 s before, 31 s after).

``cache_builtin_lists()`` keeps each module's list of builtins from its first listing and
wraps, as before, those still unwrapped. What the kernels compute is the interpreter's as
before: every kernel test compares it with the references. Where the interpreter lacks the
function (another Triton), nothing is changed.

``cache_np_dtypes()`` keeps the NumPy dtype of each Triton dtype. The interpreter's
``_get_np_dtype`` builds its table of 19 dtypes anew at each call, and it is called for
most operations of every program: 8% of an interpreted test's time. The answers are the
table's, looked up once per dtype.
"""

from __future__ import annotations

import inspect
import os


def cache_builtin_lists() -> None:
    """Install the cached listing where the interpreter is on and its ``_patch_builtin``
    has the parameters this replacement keeps; elsewhere do nothing."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    try:
        from triton import language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
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


def cache_np_dtypes() -> None:
    """Install the kept lookup where the interpreter is on and has ``_get_np_dtype``;
    elsewhere do nothing."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    try:
        from triton import language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
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


def install() -> None:
    """Both: the kept listing of builtins and the kept NumPy dtypes."""
    cache_builtin_lists()
    cache_np_dtypes()
