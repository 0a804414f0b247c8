"""Combine functions for row reductions: kernels write ``tl.reduce(x, 1, MAX)``, not ``tl.max(x, 1)``.

``tl.max``, ``tl.min``, ``tl.sum`` (and ``tl.zeros``) are themselves ``@triton.jit`` functions,
decorated when triton is first imported. If that import happened before
``TRITON_INTERPRET=1`` was set (a test harness that imports triton before the
backend sets it), the interpreter cannot call them. ``tl.reduce`` with these
combine functions is exactly what they do on a GPU, and the interpreter maps
these very functions to numpy without calling them, so the kernels run
whatever the import order.
"""
from triton.language.standard import _elementwise_max as MAX  # noqa: F401
from triton.language.standard import _elementwise_min as MIN  # noqa: F401
from triton.language.standard import _sum_combine as SUM  # noqa: F401
