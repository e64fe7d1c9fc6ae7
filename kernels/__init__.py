"""Triton kernels (import name `quantkit.kernels`).

Every kernel has a pure-torch reference and is tested against it through the Triton interpreter on CPU
(TRITON_INTERPRET=1). Interpreter facts (triton 3.9): bf16 `tl.dot` is wrong there (cast tiles to fp32),
fp8 `tl.dot` is right, `tl.dot_scaled` misreads E4M3 scales.
"""
