"""An E2B-compatible API (docs/e2b.md): the stock ``e2b`` SDK drives orchestrator sandboxes
unchanged, with the API's URL as both its API URL and its sandbox URL.

- ``control.py``: the control plane (``/sandboxes``, ``/v2/sandboxes``): create, connect,
  list, get, kill, set the timeout;
- ``envd.py``: the sandbox plane the SDK calls "envd": processes and the filesystem over
  Connect RPC (``connect.py``), files over ``/files``;
- ``sandboxes.py``: what an E2B sandbox is here: an orchestrator rollout (source ``e2b``),
  with its isolation, admission, pools, reaper, metrics and trajectory;
- ``models.py``: the wire's shapes, both planes.
"""
