"""The reference engine: real hybrid models on CPU (or GPU), cached through hicached.

A request's path, one module per step:

1. ``models.py``     a tiny seeded Qwen3-Next (attention KV + gated-delta-net states) or
                     DeepSeek-V3.2 (MLA KV + DSA indexer), loaded through ``from_pretrained``
2. ``engine.py``     arrival: page keys (``hicached.keys``), radix match, load-back of what
                     hicached holds past the device match (``hicache.py`` -> ``storage.py``)
3. ``radix.py``      the hybrid radix cache: KV at every node, states at some, two LRUs
4. ``pools.py``      device pools and allocators (KV pages, indexer pages, state slots)
5. ``cache_io.py``   pools <-> the request's ``transformers`` cache (copy-on-write of states)
6. ``engine.py``     page-chunked prefill, snapshots at track points and branching points,
                     decode; finished requests give their pages back
7. ``hicache.py``    write policy (through / selective / back) into the daemon
8. ``demo.py``       ``hicached demo``; ``tools/bench_engine.py`` the benchmark
"""
