"""tests/gpu runs only where a CUDA device is present (`make test-gpu`); `make test` leaves it out."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))  # tests/support

if not torch.cuda.is_available():
    pytest.exit("tests/gpu needs a CUDA device; run `make test` on a machine without one", returncode=2)
