"""A fix for a race in kopf's namespace patterns (kopf 1.45): a namespace created at the operator's start could be
missed for good.

With ``--namespace`` patterns (``team-*``), kopf lists the namespaces once, then starts a watch of them; that watch
lists them again first and hands each listed one on as an event of type None, which kopf's handler of namespace
events ignores. A namespace created between the two listings is therefore in neither the first listing nor any
later watch event: kopf never watches the jobs in it, until the namespace itself changes (a label, an annotation)
or the operator restarts. A namespace made while the operator starts (a CI job that installs the operator and then
creates its test namespace, as tests/operator did: the first job there was never reconciled) hits that window.

:func:`install` wraps kopf's handler so that the watch's listed namespaces are revised as the first listing's are
(kopf's own ``revise_namespaces``, which reads type-None events as "exists"). It is applied when the handlers
module is imported, before kopf starts its observers; if kopf's internals no longer look as expected, it changes
nothing and says so in the log. tests/operator/test_kopf_namespaces.py shows kopf's handler still ignores such
events (drop this module when it fails) and that the wrapped one does not.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("kubeps.operator")

_MARK = "_kubeps_lists_namespaces"


def install() -> bool:
    """Wrap kopf's namespace-event handler (once); returns whether it is wrapped."""
    try:
        from kopf._core.reactor import observation  # noqa: PLC0415 - kopf's internals, looked at once
    except ImportError:  # pragma: no cover - kopf moved it: leave kopf as it is
        log.warning("kopf's namespace observer was not found: namespaces made while the operator starts may be "
                    "missed until they change")
        return False
    original = getattr(observation, "process_discovered_namespace_event", None)
    revise = getattr(observation, "revise_namespaces", None)
    if original is None or revise is None:  # pragma: no cover - as above
        log.warning("kopf's namespace observer has changed: namespaces made while the operator starts may be "
                    "missed until they change")
        return False
    if getattr(original, _MARK, False):
        return True

    async def process_discovered_namespace_event(*, raw_event: Any, namespaces: Any, insights: Any,
                                                 **kwargs: Any) -> None:
        if raw_event["type"] is None:  # listed by the watch: it exists now, whatever the first listing saw
            async with insights.revised:
                revise(raw_events=[raw_event], insights=insights, namespaces=namespaces)
                insights.revised.notify_all()
            return
        await original(raw_event=raw_event, namespaces=namespaces, insights=insights, **kwargs)

    setattr(process_discovered_namespace_event, _MARK, True)
    setattr(process_discovered_namespace_event, "__wrapped_original__", original)
    observation.process_discovered_namespace_event = process_discovered_namespace_event
    return True
