"""The test suite runs Triton kernels through the interpreter on CPU (conftest sets TRITON_INTERPRET=1)."""

import os


def test_interpreter_is_on():
    assert os.environ.get("TRITON_INTERPRET") == "1"
