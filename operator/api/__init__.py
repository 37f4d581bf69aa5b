"""The PSTrainingJob API: its pydantic models and what is generated from them.

* :mod:`.models`: ``kubeps.dev/v1alpha1`` as pydantic models, the source of truth;
* :mod:`.crd`: the CustomResourceDefinition (``python -m kubeps.operator.api.crd``, committed under ``deploy/``
  and the chart);
* :mod:`.reference`: ``docs/crd-reference.md`` (``python -m kubeps.operator.api.reference``);
* :mod:`.validate`: ``kubeps validate``'s checks of manifests (the CRD's schema, unknown fields, its CEL rules), on
  texts given to it (jsonschema and cel-python loaded only there);
* :mod:`.kubectl_yaml`: a manifest file read as kubectl reads it (go-yaml's scalars, its alias budget, JSON's
  numbers, the API server's request limit): the JSON the API server would receive.

Rule: the bottom of the operator. Purely declarative: no I/O (the generators only print), no clock, and no import
of the rest of the operator, of kopf, of a Kubernetes client or of aiohttp; of the runtime, only the pod contract
(:mod:`kubeps.runtime.contract`).
"""
