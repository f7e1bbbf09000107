"""Helpers shared by the test layers."""
