"""What operators run and read: ``hicached serve`` (``serve``), the CLI (``cli``, ``adminctl``),
the admin HTTP API (``admin``), metrics, systemd's notify protocol and the daemon's config."""
