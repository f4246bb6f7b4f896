"""Shared fixtures for the runtime tests: tiny models, built once per session."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import pytest
import torch

from rlhfc.runtime.models.build import build_model

ARCHS = ("llama", "gpt2")


def tiny_spec(arch: str = "llama", head: str = "lm", vocab: int = 96, **overrides):
    spec = {
        "arch": arch,
        "layers": 2,
        "hidden": 32,
        "heads": 4,
        "kv_heads": 2 if arch == "llama" else 4,
        "ffn": 64,
        "vocab": vocab,
        "max_seq": 128,
        "head": head,
        "source": None,
    }
    spec.update(overrides)
    return spec


@pytest.fixture(scope="session")
def make_spec():
    """The tiny spec builder, as a fixture (test modules need no imports from here)."""
    return tiny_spec


@pytest.fixture(scope="session", params=ARCHS)
def arch(request):
    return request.param


@pytest.fixture(scope="session")
def policy(arch):
    return build_model(tiny_spec(arch), seed=0)


@pytest.fixture(scope="session")
def value_model(arch):
    return build_model(tiny_spec(arch, head="value"), seed=1)


@pytest.fixture(scope="session")
def score_model(arch):
    return build_model(tiny_spec(arch, head="score"), seed=2)


# Tiny models gain nothing from a second intra-op thread, and with another busy
# process on a 2-core machine OpenMP's spin-waiting makes them 10-50x slower.
torch.set_num_threads(1)
