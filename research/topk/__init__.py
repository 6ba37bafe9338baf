"""Decode-time top-k traces of our model and what ECHO's caches and predictors make of them.

driver.py     teacher-forced (or greedy) prefill + batched decode over PlainKVCache
tracer.py     hooks on the model's indexer and attention: per layer and step, the selected
              positions, k-th score, EMA threshold prediction, histogram threshold bins,
              and the recall of dense attention's top-k
cache_sim.py  exact LRU simulations: ECHO's shared per-layer cache, per-request buffers
stats.py      summary metrics from the traces
plots.py      figures
"""
