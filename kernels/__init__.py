"""Triton kernels (copies, checksum) and their bit-exact CPU counterparts."""
