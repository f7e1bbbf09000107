import os
import sys

import torch

# tests/ on the path so test modules can import the shared helpers in tests/support/.
sys.path.insert(0, os.path.dirname(__file__))

# tests/gpu needs a CUDA device (`make test-gpu`); without one, `pytest tests` leaves it out rather than stop
collect_ignore = [] if torch.cuda.is_available() else ["gpu"]
