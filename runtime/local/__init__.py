"""``kubeps local``: a whole cluster of processes on one machine (``launcher``), restarted as the operator would
restart pods (``restarting``, with the pure decision table in ``policy``).

Rule: starts processes and reads their exit statuses; imports the runtime only for the TF_CONFIG model, the pod
contract and a health ``Ping``.
"""
