"""Shared fixtures. Evaluation fixtures (issue 4) are prefixed `eval_`."""

import os

# Triton decides at its first import whether to interpret kernels on the CPU, and `import kvpack`
# can import it indirectly (transformers -> a peer -> torch.compile): set the switch before anything.
# KVPACK_TEST_DEVICE=cuda runs the Triton tests compiled on a GPU instead (tests/triton_device.py).
if os.environ.get("KVPACK_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _no_layer_left_pending():
    """Tests that drive a layer by hand (update with kvpack attention 'on', no attention call) leave it waiting
    on this thread; the next test's model must not inherit that."""
    yield
    from kvpack.cache.layer import PENDING

    PENDING.layer = None


@pytest.fixture(scope="session")
def eval_tiny():
    """(model, tokenizer): a 2-layer random Llama (hidden 64, 4 heads of dim 64, 2 kv heads) and a byte tokenizer."""
    from kvpack.models import tiny_random_model

    return tiny_random_model(seed=0)


@pytest.fixture(scope="session")
def eval_tiny_ids():
    """600 reproducible token ids in the tiny model's vocabulary."""
    return torch.randint(0, 256, (600,), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="session")
def eval_smollm2():
    """(model, tokenizer): the real default model, fp32 (converted once into the kvpack cache dir)."""
    from kvpack.models import load_model

    return load_model("smollm2-135m")
