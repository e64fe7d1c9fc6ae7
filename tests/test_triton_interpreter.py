"""A Triton kernel runs through the interpreter on CPU and matches its torch reference bit for bit."""

import os

import pytest
import torch

from quantkit.kernels.rowwise_absmax import rowwise_absmax, rowwise_absmax_reference


def test_interpreter_is_on():
    assert os.environ.get("TRITON_INTERPRET") == "1"


@pytest.mark.parametrize("shape", [(1, 7), (3, 1024), (5, 1500), (2, 4096)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rowwise_absmax_matches_torch(shape, dtype):
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(shape[1])) * 3).to(dtype)
    x[0, shape[1] // 2] = -1000.0  # the max is a negative entry: abs must be taken
    got = rowwise_absmax(x)
    assert got.dtype == torch.float32 and got.shape == (shape[0],)
    assert torch.equal(got, rowwise_absmax_reference(x))
    assert got[0].item() == 1000.0


def test_rowwise_absmax_zeros_nan_and_bad_shapes():
    x = torch.zeros(2, 300)
    x[1, 299] = float("nan")
    got = rowwise_absmax(x)
    assert got[0].item() == 0.0 and torch.isnan(got[1])
    with pytest.raises(ValueError, match="2-D"):
        rowwise_absmax(torch.zeros(4))
