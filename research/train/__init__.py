"""Training a small DeepSeek-V3.2-architecture model (DSA recipe in spirit) on offline text.

data.py     corpus of Python sources found on this machine, content-hash split, batches
spec.py     model dimensions -> transformers / our config, deterministic initialization
forward.py  differentiable full-sequence forward: dense or top-k-masked MLA + indexer KL
loop.py     the two-phase training loop (dense warm-up, then sparse), timing, logging
export.py   Hugging Face checkpoint + tokenizer + model card
"""
