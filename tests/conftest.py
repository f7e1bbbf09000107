import os
import sys

import torch

# tests/ on the path so test modules can import the shared helpers in tests/support/.
sys.path.insert(0, os.path.dirname(__file__))

# tests/gpu needs a CUDA device (`make test-gpu`); without one, `pytest tests` leaves it out rather than stop
collect_ignore = [] if torch.cuda.is_available() else ["gpu"]


def pytest_collection_finish(session) -> None:
    """Tell the matrices (tests/support/matrix.py) whether this session runs their full products: worlds that
    compute every cell at once then compute all of them."""
    from support import matrix
    matrix.FULL["selected"] = any(item.get_closest_marker("full_matrix") for item in session.items)
