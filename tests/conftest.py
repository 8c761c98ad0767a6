import os

import pytest
import torch
from hypothesis import settings

settings.register_profile("ci", max_examples=25, deadline=None, derandomize=True)
settings.register_profile("dev", max_examples=10, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True)
def _seed_everything():
    torch.manual_seed(0)
    yield
