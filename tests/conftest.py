"""Shared fixtures: a tiny quantkit checkpoint built locally (no hub), offline settings for vLLM/HF.

TRITON_INTERPRET=1 is set before anything imports triton, so kernels run on CPU tensors.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from quantkit.serve.engine import offline_environment  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _offline(tmp_path_factory):
    offline_environment(cache_dir=tmp_path_factory.mktemp("caches"))


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """A random 2-layer quantkit model (float32) with a BPE tokenizer trained on stdlib docstrings."""
    from quantkit.models.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "model", seed=0)
