"""vLLM's CPU backend as quantkit serves on it: what the plugin installs in every vLLM process on a CPU.

- `heap`: large tensors from malloc's heap instead of fresh mmaps (no page faults per forward pass);
- `linear`: unquantized bf16/fp16 Linears computed in float32 where that is the faster matmul, and the
  summation order the numerics floor switches (`SUMMATION_ENV`);
- `gdn`: batched prefill for the Gated DeltaNet's conv1d and delta rule on CPUs without AVX-512 BF16;
- `peer_kernels`: CPU emulation kernels for the peers' compressed-tensors FP8-block and NVFP4 checkpoints.
"""
