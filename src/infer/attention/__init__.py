from infer.attention.layer import Attention, allocate_kv_cache, set_attention_backend
from infer.attention.metadata import AttentionMetadata

__all__ = ["Attention", "AttentionMetadata", "allocate_kv_cache", "set_attention_backend"]
