"""The plugin's GPU harness: sglang's own KV classes, run where sglang cannot be installed.

``standins`` lets sglang's pure-Python modules import on a machine that lacks some of its
dependencies; ``sglang_pack`` writes the archive of the sglang sources the harness loads.
"""
