"""status.progress from the chief's metrics and status.membershipAck from its membership ack: the reading (pure), and
the reader's passes against a real HTTP server serving a chief's exposition and its ack: what it writes, when it
does not write, how it spaces writes, the PSImbalance Event, a malformed ack."""

from __future__ import annotations

import asyncio
import threading
import time
from datetime import datetime, timedelta, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from prometheus_client import REGISTRY

from kubeps.operator.controller.cache import Cache
from kubeps.runtime.cluster import MembershipAck
from kubeps.runtime.contract import MEMBERSHIP_ACK_PATH

from kubeps.operator.controller.progress import ProgressReader, chief_ack_url, chief_metrics_url
from kubeps.operator.controller.recorder import Recorder
from kubeps.operator.core.progress import ChiefReading, progress, read_chief

CHIEF = """# HELP kubeps_train_step The training step the chief last reported
# TYPE kubeps_train_step gauge
kubeps_train_step {step}.0
# TYPE kubeps_train_examples_total counter
kubeps_train_examples_total {examples}
# TYPE kubeps_checkpoint_step gauge
kubeps_checkpoint_step {ckpt}.0
# TYPE kubeps_ps_imbalanced gauge
{hot}"""


def chief_text(step: int, examples: float, ckpt: int = 0, hot: str = "") -> str:
    return CHIEF.format(step=step, examples=examples, ckpt=ckpt, hot=hot)


def test_read_chief_and_progress():
    first = read_chief(chief_text(100, 51200.0), at=10.0)
    assert first == ChiefReading(at=10.0, step=100, examples=51200.0, checkpoint_step=0, hot=())
    hot = 'kubeps_ps_imbalanced{ps="0",variable="emb/part_0"} 1.0\n'
    second = read_chief(chief_text(300, 153600.0, ckpt=200, hot=hot), at=20.0)
    assert second.hot == (("0", "emb/part_0"),)
    assert progress(None, first, "t") == {"step": 100, "lastUpdateTime": "t"}  # no rate from one reading
    assert progress(first, second, "t") == {"step": 300, "lastCheckpointStep": 200, "examplesPerSecond": "10240",
                                            "lastUpdateTime": "t"}
    restarted = read_chief(chief_text(310, 512.0, ckpt=200), at=30.0)
    assert "examplesPerSecond" not in progress(second, restarted, "t")  # the counter went back: no rate
    assert progress(None, read_chief("# nothing yet\n", at=1.0), "t") is None


def test_chief_metrics_url_follows_the_template_port_and_the_domain():
    job = {"metadata": {"name": "ctr", "namespace": "team"}, "spec": {"replicaSpecs": {"Chief": {"template": {}}}}}
    assert chief_metrics_url(job, None) == "http://ctr-chief-0.team.svc:9090/metrics"
    job["spec"]["replicaSpecs"]["Chief"]["template"] = {
        "spec": {"containers": [{"ports": [{"name": "metrics", "containerPort": 9400}]}]}}
    assert chief_metrics_url(job, "cluster.local") == "http://ctr-chief-0.team.svc.cluster.local:9400/metrics"
    assert chief_metrics_url(job, None, "http://127.0.0.1:8001/{namespace}/{job}:{port}{domain}") == \
        "http://127.0.0.1:8001/team/ctr:9400"


def test_the_ack_is_served_on_the_metrics_host_and_port():
    assert chief_ack_url("http://ctr-chief-0.team.svc:9090/metrics") == "http://ctr-chief-0.team.svc:9090" + \
        MEMBERSHIP_ACK_PATH
    assert chief_ack_url("http://127.0.0.1:8001/proxy/team/ctr/metrics?x=1") == \
        "http://127.0.0.1:8001/proxy/team/ctr/kubeps/membership"
    assert chief_ack_url("http://127.0.0.1:8001/team/ctr:9400") == "http://127.0.0.1:8001/team/ctr:9400/kubeps/membership"


class _Chiefs:
    """An HTTP server answering ``/<job>/metrics`` with the text set for that job, and ``/<job>/kubeps/membership``
    with the ack set for it (a :class:`MembershipAck`'s JSON, or any text)."""

    def __init__(self) -> None:
        self.texts: dict[str, str] = {}
        self.acks: dict[str, str] = {}
        texts, acks = self.texts, self.acks

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                job, _, path = self.path[1:].partition("/")
                text = (acks if "/" + path == MEMBERSHIP_ACK_PATH else texts).get(job)
                if text is None:
                    self.send_error(404)
                    return
                body = text.encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def url(self, job) -> str:
        return f"http://127.0.0.1:{self.server.server_port}/{job['metadata']['name']}/metrics"


@pytest.fixture
def chiefs():
    served = _Chiefs()
    yield served
    served.server.shutdown()


def _job(name: str, phase: str = "Running", progress_now: dict | None = None) -> dict:
    status = {"conditions": [{"type": "Created", "status": "True"}, {"type": phase, "status": "True"}]}
    if progress_now:
        status["progress"] = progress_now
    return {"metadata": {"name": name, "namespace": "ns", "uid": f"uid-{name}"}, "status": status}


def test_the_reader_writes_progress_only_when_it_moved_and_spaces_its_writes(chiefs, monkeypatch):
    cache = Cache()
    writes: list[tuple[str, dict, float]] = []
    events: list[tuple[str, str, str]] = []
    monkeypatch.setattr(Recorder, "event", staticmethod(
        lambda job, etype, reason, message: events.append((job["metadata"]["name"], reason, message))))

    async def patch(namespace, name, body):
        writes.append((name, body["status"]["progress"], time.monotonic()))
        return {}

    names = [f"j{i}" for i in range(5)]
    for name in names:
        cache.jobs[("ns", name)] = _job(name)
        chiefs.texts[name] = chief_text(100, 51200.0)
    cache.jobs[("ns", "done")] = _job("done", phase="Succeeded")
    chiefs.texts["done"] = chief_text(5, 10.0)
    reader = ProgressReader(cache, Recorder(), patch, writes_per_second=10.0, url=chiefs.url)

    async def scenario() -> None:
        await reader.read_all()
        assert sorted(w[0] for w in writes) == names  # the finished job is not read
        times = sorted(w[2] for w in writes)
        assert times[-1] - times[0] >= 4 * 0.1 * 0.9  # 5 writes at most 10 a second
        for name in names:  # as the API server would now show them
            cache.jobs[("ns", name)]["status"]["progress"] = next(w[1] for w in writes if w[0] == name)
        writes.clear()
        await reader.read_all()
        assert writes == []  # nothing moved: nothing written
        hot = 'kubeps_ps_imbalanced{ps="1",variable="emb/part_1"} 1.0\n'
        chiefs.texts["j0"] = chief_text(300, 51200.0 + 20 * 512 * 200, ckpt=200, hot=hot)
        await reader.read_all()
        cache.jobs[("ns", "j0")]["status"]["progress"] = writes[-1][1]
        await reader.read_all()  # the same step and the same hot ps again: no write, no second Event
        await reader.close()

    asyncio.run(scenario())
    (name, written, _), = writes
    assert name == "j0" and written["step"] == 300 and written["lastCheckpointStep"] == 200
    assert float(written["examplesPerSecond"]) > 0
    assert events == [("j0", "PSImbalance", "ps 1 serves more than twice the mean of the other ps; its busiest "
                       "variable shard is 'emb/part_1'. Remedy: more shards than ps, or hash the ids "
                       "(docs/observability.md)")]


def test_the_time_to_the_first_step_is_observed_once_per_job_when_its_chief_shows_a_step(chiefs):
    def count_and_over_30s() -> tuple[float, float]:
        value = REGISTRY.get_sample_value
        total = value("kubeps_job_time_to_first_step_seconds_count") or 0.0
        return total, total - (value("kubeps_job_time_to_first_step_seconds_bucket", {"le": "30.0"}) or 0.0)

    cache = Cache()
    job = _job("first")
    job["metadata"]["creationTimestamp"] = (datetime.now(timezone.utc) - timedelta(seconds=45)).strftime(
        "%Y-%m-%dT%H:%M:%SZ")
    cache.jobs[("ns", "first")] = job

    async def patch(namespace, name, body):
        job["status"]["progress"] = body["status"]["progress"]  # as the API server would show it

    reader = ProgressReader(cache, Recorder(), patch, url=chiefs.url)
    before = count_and_over_30s()

    async def scenario() -> list[tuple[float, float]]:
        seen = []
        for step in (0, 3, 10):  # the chief serves step 0 before its first step
            chiefs.texts["first"] = chief_text(step, 512.0 * step)
            await reader.read_all()
            seen.append(count_and_over_30s())
        await reader.close()
        return seen

    after_0, after_3, after_10 = asyncio.run(scenario())
    assert after_0 == before  # step 0 is not a first step
    assert after_3 == (before[0] + 1, before[1] + 1)  # the job's age, about 45 s: over 30 s
    assert after_10 == after_3  # once per job


def test_a_chief_that_does_not_answer_is_skipped(chiefs):
    cache = Cache()
    cache.jobs[("ns", "mute")] = _job("mute")
    writes: list = []

    async def patch(namespace, name, body):
        writes.append(name)

    async def scenario() -> None:
        reader = ProgressReader(cache, Recorder(), patch, url=chiefs.url)  # 404 for an unknown job
        await reader.read_all()
        dead = ProgressReader(cache, Recorder(), patch, url=lambda job: "http://127.0.0.1:9/metrics")
        await dead.read_all()
        await reader.close()
        await dead.close()

    asyncio.run(scenario())
    assert writes == []


def _ack(checkpoint: int = 0, draining: tuple[int, ...] = ()) -> str:
    return MembershipAck(generation=2, workers=[0], draining=list(draining), checkpoint=checkpoint).model_dump_json()


def test_a_chief_asked_for_a_checkpoint_is_read_every_second_until_it_reports_it_served(chiefs):
    """A ps count change waits for the chief's checkpoint: its chief is read every WAITING_INTERVAL_S, not every
    ``interval``, until its membership ack says the request was served; the other jobs keep the interval."""
    cache = Cache()
    for name in ("asked", "other"):
        cache.jobs[("ns", name)] = _job(name)
        chiefs.texts[name] = chief_text(10, 5120.0)
        chiefs.acks[name] = _ack()
    cache.jobs[("ns", "asked")]["status"]["checkpointRequest"] = 2
    writes: list[tuple[str, dict]] = []

    async def patch(namespace, name, body):
        writes.append((name, body["status"]))
        cache.jobs[("ns", name)]["status"].update(body["status"])

    reader = ProgressReader(cache, Recorder(), patch, interval=60.0, url=chiefs.url)

    async def scenario() -> None:
        reader.start()
        await asyncio.sleep(0.5)  # the first full pass
        assert sorted(name for name, _ in writes) == ["asked", "other"]
        chiefs.acks["asked"] = _ack(checkpoint=2)
        chiefs.texts["other"] = chief_text(20, 10240.0)
        await asyncio.sleep(1.5)
        await reader.close()

    asyncio.run(scenario())
    asked = [status for name, status in writes if name == "asked"]
    assert [s["membershipAck"]["checkpoint"] for s in asked] == [0, 2]  # what the planner decides from
    assert [s["progress"]["checkpointRequest"] for s in asked] == [0, 2]  # what people are shown
    assert [s["progress"]["step"] for name, s in writes if name == "other"] == [10]  # not read again meanwhile


@pytest.mark.parametrize("answer", [None, "not json", '{"generation": "x", "workers": []}', '{"workers": [0]}'])
def test_an_absent_or_malformed_ack_is_logged_and_changes_nothing(chiefs, caplog, answer):
    cache = Cache()
    cache.jobs[("ns", "j")] = _job("j", progress_now={"step": 10, "lastUpdateTime": "t"})
    cache.jobs[("ns", "j")]["status"]["membershipAck"] = MembershipAck(generation=1, workers=[0]).model_dump(
        mode="json")
    chiefs.texts["j"] = chief_text(10, 5120.0)
    if answer is not None:
        chiefs.acks["j"] = answer
    writes: list = []

    async def patch(namespace, name, body):
        writes.append(body)

    async def scenario() -> None:
        reader = ProgressReader(cache, Recorder(), patch, url=chiefs.url)
        await reader.read_all()
        await reader.close()

    asyncio.run(scenario())
    assert writes == []
    if answer is not None:
        assert "membership ack is malformed" in caplog.text


def test_the_ack_is_read_even_from_a_chief_whose_metrics_do_not_answer(chiefs):
    cache = Cache()
    cache.jobs[("ns", "j")] = _job("j", progress_now={"step": 10, "lastUpdateTime": "t"})
    chiefs.acks["j"] = _ack(draining=(1, 2))
    writes: list = []

    async def patch(namespace, name, body):
        writes.append(body["status"])

    async def scenario() -> None:
        reader = ProgressReader(cache, Recorder(), patch, url=chiefs.url)
        await reader.read_all()
        await reader.close()

    asyncio.run(scenario())
    [status] = writes
    assert MembershipAck.model_validate(status["membershipAck"]).draining == [1, 2]
    assert status["progress"]["step"] == 10 and status["progress"]["workersDraining"] == 2
