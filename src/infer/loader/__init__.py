from infer.loader.errors import ModelLoadError
from infer.loader.gguf_metadata import gguf_config
from infer.loader.model_loader import build_model, load_gguf, load_hf_dir
from infer.loader.tokenizer import Tokenizer

__all__ = ["ModelLoadError", "Tokenizer", "build_model", "gguf_config", "load_gguf", "load_hf_dir"]
