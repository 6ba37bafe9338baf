"""The pivot decode top-k: research, not the product.

Each layer kept, per request row, the last step's k-th score as a pivot and selected in one
pass when it still split the row; the radix select (kernels/topk.py, its ``fallback``
hook) served the rows it missed. Exact (the same tensor as the radix select), but measured
slower than the radix select in every served setting on the H200 (batch 1 and the study's
batches), so it left the package; ``kernel.py`` keeps it, with its tests in
tests/repo/test_kernel_topk_pivot.py, for whoever revisits one-pass selection.
"""
