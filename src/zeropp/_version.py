"""The package version, in a module of its own so that library code can read it without importing the
``zeropp`` package root (which imports ``api`` and so nearly everything: a cycle from below)."""
__version__ = "0.1.0"
