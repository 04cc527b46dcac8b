"""The daemon's L3 tier: the attached backend, its write policies (``writes``), the audit of the
copies it counts on (``audit``), what it remembers of keys L2 lacks (``keymemory``) and the I/O
worker threads (``workers``) that keep stores off the control loop."""
