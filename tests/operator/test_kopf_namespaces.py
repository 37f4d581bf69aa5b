"""The fix for kopf's namespace-pattern race (kubeps.operator.controller.kopf_namespaces): a namespace that only
the namespace watch's own listing shows (created between kopf's first listing and its watch) is watched."""

from __future__ import annotations

import asyncio

from kopf._cogs.structs import references
from kopf._core.reactor import observation

from kubeps.operator.controller import handlers, kopf_namespaces  # noqa: F401 - handlers installs the fix


def _listed(name: str) -> dict:
    return {"type": None, "object": {"metadata": {"name": name}}}


def _revise(process, event: dict) -> set:
    async def main():
        insights = references.Insights()
        await process(raw_event=event, namespaces=["kop-*"], insights=insights)
        return set(insights.namespaces)

    return asyncio.run(main())


def test_kopf_alone_ignores_a_namespace_its_watch_lists():
    original = observation.process_discovered_namespace_event.__wrapped_original__  # type: ignore[attr-defined]
    # kopf's own handler: if this fails, kopf fixed the race and kopf_namespaces can go
    assert _revise(original, _listed("kop-late")) == set()


def test_the_fix_watches_a_namespace_its_watch_lists_and_only_a_matching_one():
    process = observation.process_discovered_namespace_event
    assert getattr(process, kopf_namespaces._MARK)
    assert kopf_namespaces.install()  # once: installing again changes nothing
    assert observation.process_discovered_namespace_event is process
    assert _revise(process, _listed("kop-late")) == {"kop-late"}
    assert _revise(process, _listed("other")) == set()
    # events of a type are kopf's own handling, as before
    assert _revise(process, {"type": "ADDED", "object": {"metadata": {"name": "kop-new"}}}) == {"kop-new"}
