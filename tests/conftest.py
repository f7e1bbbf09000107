import os
import sys

# tests/ on the path so test modules can import the shared helpers in tests/support/.
sys.path.insert(0, os.path.dirname(__file__))
