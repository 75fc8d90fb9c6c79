"""The project's own experiments: the figures the README quotes, and the test rig behind them.

Not part of the installed ``ember`` package. ``ember bench`` measures any
OpenAI-compatible server a user points it at; what lives here starts its own
servers or engines on this machine and compares configurations against the
targets and references the project's issues quote. Run from the repository
root (``make bench-*`` does)::

    python -m benchmarks tiers --threads 2

Modules: ``cli`` (the subcommands), ``servers`` (real ``ember`` processes on
free ports, also the tests' launcher), ``tls_cert`` (a throwaway self-signed
certificate), ``resources`` (``/proc`` CPU and ``ss`` byte counters),
``scenarios`` (session tiers, overload), ``transports``, ``fronts``,
``front_door``, ``engine_bench``, ``structured_bench``.
"""
