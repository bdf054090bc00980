"""Tensor-parallel process groups and the collectives layers use."""
