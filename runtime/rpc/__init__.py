"""Everything that crosses the network between tasks: the tensor frame (``wire``), the protocol (``protocol``:
service and method names, typed request and answer metadata), the check of a request and of an answer against
its declaration (``validation``), the job token (``security``), mutual TLS (``tls``), the gRPC client (``client``), the fan-out to
every parameter server (``transport``) and the result codec of scheduled functions (``codec``).

Rule: knows bytes, arrays and method names, never variables, optimizers or datasets. TLS, deadlines and message
limits belong here.
"""
