"""Ember as a Ray Serve application (``pip install 'ember[ray]'``): replicas across a cluster.

- ``app``: ``build_app``, ``app_builder`` (for ``serve run``) and ``ember serve --ray``;
- ``ingress``: the HTTP entry point, which routes each request by its conversation;
- ``replica``: one engine per replica, serving the ``ember serve`` app;
- ``router`` / ``routing``: Ray Serve's request router over ``router/policy.py``;
- ``autoscale``: replicas from Ember's own load signals;
- ``config`` / ``cli``: the options.

Importing this package, ``config``, ``cli``, ``routing`` or ``autoscale`` does not import Ray.
"""
