"""sglang-echo: lossless KV-cache offloading (ECHO) for DeepSeek Sparse Attention models."""

__version__ = "0.1.0"
