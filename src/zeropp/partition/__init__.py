"""Flat shard buffers and the arithmetic that places parameters in them."""
