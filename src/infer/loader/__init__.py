from infer.loader.errors import ModelLoadError
from infer.loader.model_loader import build_model, load_hf_dir

__all__ = ["ModelLoadError", "build_model", "load_hf_dir"]
