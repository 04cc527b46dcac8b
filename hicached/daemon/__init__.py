"""The daemon: its control loop (``server``), the controller of L2 (``controller``, ``index``,
``slabs``, ``leases``, ``quotas``, ``sessions``, ``flushing``) and the L3 tier (``l3``).

Nothing here imports ``hicached.client`` (``tests/test_layout.py`` holds that).
"""
