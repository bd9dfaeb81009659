from infer.attention.backend import AttentionBackend, make_attention_backend
from infer.attention.graph_metadata import GraphMetadata
from infer.attention.layer import Attention, allocate_kv_cache, set_attention_backend
from infer.attention.metadata import AttentionMetadata

__all__ = ["Attention", "AttentionBackend", "AttentionMetadata", "GraphMetadata",
           "allocate_kv_cache", "make_attention_backend", "set_attention_backend"]
