"""Ray tests: every Ray process of theirs stays on loopback.

Ray reads these when it is first imported, in this process (the live tests'
driver) and in the ``ember serve --ray`` process it starts (which sets the same
for any local instance). A driver that connects to a cluster by its address
authenticates only when told to: the local instance has token authentication
on (Ray's default), its token in ~/.ray/auth_token.
"""

import os

from ember.ray.app import LOCAL_INSTANCE_ENV

# Not the throughput-optimized data path: in a driver it allows handle calls from async code only.
for _name in ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_worker_niceness"):
    os.environ.setdefault(_name, LOCAL_INSTANCE_ENV[_name])
os.environ.setdefault("RAY_AUTH_MODE", "token")
