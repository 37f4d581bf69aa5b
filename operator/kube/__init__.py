"""Kubernetes plumbing: what talks to the API server.

* :mod:`.client`: the operator's API requests (aiohttp on kopf's event loop, one token bucket) and its login;
* :mod:`.watch`: list, then watch, one kind of object in one scope;
* :mod:`.peering`: whether this replica may act in a scope, read from kopf's peering object.

Rule: I/O only, no decisions about jobs: nothing here reads a job's spec or plans (that is
:mod:`kubeps.operator.core`), and nothing imports the shell above (:mod:`kubeps.operator.controller`). It may
import :mod:`kubeps.operator.api` (the group, version and plural of the jobs' paths).
"""
