"""Eviction policies: which L2 pages go next (``interface.py``: the hooks, the index's read view;
``registry.py``: the ``--eviction`` names; ``lru``, ``prefix``, ``hybrid`` with ``keytree``)."""
