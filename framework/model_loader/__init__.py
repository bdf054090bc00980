"""Reading HF checkpoints and building models from them."""

from tokenmill.model_loader.loader import load_hf_config, load_model
from tokenmill.model_loader.weights import default_weight_loader, iter_weights

__all__ = ["default_weight_loader", "iter_weights", "load_hf_config", "load_model"]
