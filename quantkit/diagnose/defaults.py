"""Default settings of `quantkit diagnose`, in a module of their own so the command-line parser reads them
without importing torch (the CLI starts in well under a second)."""

DEFAULT_RECIPES = ("w8a8_fp8_block", "w4a4_nvfp4", "w4a4_nvfp4_static")
DEFAULT_NUM_SEQUENCES = 8  # x 512 tokens: Qwen2.5-Coder-0.5B in minutes on 2 cores (benchmarks/bench_trained.py)
DEFAULT_SEQ_LEN = 512
MASSIVE_RATIO = 100.0  # token is massive when max_j |h_tj| > 100 x median |h| of its sequence (Sun et al. 2024: ~1000)
