"""``kubeps local``: a whole cluster of processes on one machine (``launcher``), restarted as the operator would
restart pods (``restarting``, with the pure decision table in ``policy``), scaled while it runs (``scaling``: the
scale requests of ``kubeps local scale``).

Rule: starts processes and reads their exit statuses; imports the runtime only for the TF_CONFIG model, the pod
contract, a health ``Ping`` and the membership document's atomic write.
"""
