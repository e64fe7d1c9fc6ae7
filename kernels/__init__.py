"""Triton kernels (import name `quantkit.kernels`).

Every kernel has a pure-torch reference and is tested against it through the Triton interpreter on CPU
(TRITON_INTERPRET=1); where the interpreter computes differently from a GPU, `interpreter_quirks` says how
and the kernels work around it. One module a job:

  fp_codes            device functions: float32 <-> E4M3 / E2M1 codes, bit-exact with quantkit.formats
  hadamard            device function: the online block Hadamard of a tile (rotated down_proj inputs)
  quantize_fp8        fused FP8 per-token activation quantizer (optionally through the online Hadamard)
  quantize_nvfp4      fused NVFP4 activation quantizer (per-token or static second stage; online Hadamard)
  gemm_tiles          what the GEMMs share: tiles (defaults by M), program -> tile mapping, epilogue, checks
  fp8_gemm            FP8 W8A8 GEMM: 128x128 block-scaled weights, per-token activations
  nvfp4_gemm          NVFP4 W4A4 GEMM for Hopper: E2M1 -> bf16 tiles, bf16 MMA, second stage in the epilogue
  expert_sort         MoE routing -> (token, slot) pairs sorted by expert, per-expert offsets; and back (torch)
  grouped_gemm        both GEMMs grouped over experts (rows sorted by expert, optional row gather), per-expert weights
  schemes             dispatch: each scheme of quantkit.formats.schemes -> its quantizer, GEMM and grouped GEMM
  interpreter_quirks  what triton 3.9's interpreter gets wrong (bf16 dot, bf16/fp8 casts) and the switch
"""
