"""PD disaggregation of the reference engine (``docs/pd.md``): a prefill process publishes
prompt pages through the node's hicached daemon, a decode process with its own radix cache asks
for only the delta. ``protocol.py`` (the bootstrap and front messages), ``prefill.py``,
``decode.py``, ``server.py`` (the processes: ``python -m hicached.engine.pd``)."""
