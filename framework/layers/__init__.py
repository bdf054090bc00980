"""Layers shared by models: linear (TP- and quantization-aware), norms, RoPE, attention."""
