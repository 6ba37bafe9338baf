"""DeepSeek-V3.2 (DSA) inference model; talks to KV storage only through ``KVCache``."""
