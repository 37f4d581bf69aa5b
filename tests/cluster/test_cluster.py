"""The shared TF_CONFIG model: what TensorFlow's TFConfigClusterResolver accepts, and clear errors otherwise."""

import json

import pytest

from kubeps.runtime.cluster import (
    ClusterSpec,
    TFConfig,
    TFConfigClusterResolver,
    TFConfigError,
    parse_address,
)

CLUSTER = {
    "chief": ["job-chief-0.ns.svc:2222"],
    "ps": ["job-ps-0.ns.svc:2222", "job-ps-1.ns.svc:2222"],
    "worker": ["job-worker-0.ns.svc:2222", "job-worker-1.ns.svc:2222"],
    "evaluator": ["job-evaluator-0.ns.svc:2222"],
}


def test_parse_tensorflow_shape_and_ignore_unknown_keys():
    text = json.dumps(
        {
            "cluster": {"chief": ["c:1"], "ps": ["p:2"], "worker": ["w:3"]},
            "task": {"type": "worker", "index": 0},
            "rpc_layer": "grpc",
            "environment": "cloud",
            "something_tf_ignores": 1,
        }
    )
    config = TFConfig.parse(text)
    assert config.task_type == "worker" and config.task_index == 0
    assert config.rpc_layer == "grpc" and config.environment == "cloud"
    assert config.address() == "w:3"


@pytest.mark.parametrize("empty", [None, "", "   "])
def test_empty_tf_config_is_a_local_run(empty):
    config = TFConfig.parse(empty)
    assert config.cluster == {} and config.task is None
    resolver = TFConfigClusterResolver(tf_config=config)
    assert not resolver.cluster_spec()
    assert resolver.master() == ""


def test_for_task_keeps_evaluator_out_of_the_training_cluster():
    chief = TFConfig.for_task(CLUSTER, "chief", 0)
    assert set(chief.cluster) == {"chief", "ps", "worker"}
    evaluator = TFConfig.for_task(CLUSTER, "evaluator", 0)
    assert evaluator.cluster == {"evaluator": CLUSTER["evaluator"]}
    assert evaluator.task_type == "evaluator"
    # The JSON round-trips through the parser unchanged.
    assert TFConfig.parse(chief.to_json()) == chief


def test_for_task_drops_empty_roles():
    config = TFConfig.for_task({"chief": ["c:1"], "ps": ["p:1"], "worker": ["w:1"], "evaluator": []}, "ps", 0)
    assert "evaluator" not in config.cluster


@pytest.mark.parametrize(
    "text, field, fragment",
    [
        ("{", "TF_CONFIG", "JSON object"),
        ("[1, 2]", "TF_CONFIG", "JSON object"),
        ('{"cluster": {"master": ["a:1"]}}', "cluster.master", "allowed task types are chief, ps, worker, evaluator"),
        ('{"cluster": {"ps": "a:1"}}', "cluster.ps", "list of 'host:port'"),
        ('{"cluster": {"ps": ["a:1", "a:1"]}}', "cluster.ps[1]", "duplicate address"),
        ('{"cluster": {"ps": ["a:1"], "worker": ["a:1"]}}', "cluster.worker[0]", "already used by cluster.ps[0]"),
        ('{"cluster": {"chief": ["a:1", "b:1"]}}', "cluster.chief", "at most one chief"),
        ('{"cluster": {"evaluator": ["a:1", "b:1"]}}', "cluster.evaluator", "at most one evaluator"),
        ('{"cluster": {"ps": ["a:0"]}}', "cluster.ps[0]", "1..65535"),
        ('{"cluster": {"ps": ["a"]}}', "cluster.ps[0]", "host:port"),
        ('{"cluster": {"ps": ["bad host:1"]}}', "cluster.ps[0]", "neither an IP address nor a DNS name"),
        ('{"cluster": {"ps": ["a:1"]}, "task": {"type": "boss", "index": 0}}', "task.type", "allowed task types"),
        ('{"cluster": {"ps": ["a:1"]}, "task": {"type": "ps", "index": 1}}', "task.index", "must be in 0..0"),
        ('{"cluster": {"ps": ["a:1"]}, "task": {"type": "ps", "index": -1}}', "task.index", ">= 0"),
        ('{"cluster": {"ps": ["a:1"]}, "task": {"type": "worker", "index": 0}}', "task.type", "no 'worker' tasks"),
        ('{"cluster": {"ps": ["a:1"]}, "task": "ps"}', "task", '"type"'),
        ('{"cluster": {"ps": ["a:1"]}, "task": {"type": "ps", "index": "x"}}', "task.index", "integer"),
    ],
)
def test_malformed_tf_config_names_field_and_value(text, field, fragment):
    with pytest.raises(TFConfigError) as info:
        TFConfig.parse(text)
    assert info.value.field == field
    assert f"'{field}'" in str(info.value)
    assert fragment in str(info.value)


def test_error_from_environment(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", '{"cluster": {"ps": ["a:1"]}, "task": {"type": "ps", "index": 7}}')
    with pytest.raises(TFConfigError, match=r"'task.index' has invalid value 7"):
        TFConfigClusterResolver()


def test_resolver_reads_environment_and_overrides(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", TFConfig.for_task(CLUSTER, "worker", 1).to_json())
    resolver = TFConfigClusterResolver()
    assert (resolver.task_type, resolver.task_id, resolver.rpc_layer) == ("worker", 1, "grpc")
    assert resolver.master() == "grpc://job-worker-1.ns.svc:2222"
    assert resolver.master("ps", 0, rpc_layer="") == "job-ps-0.ns.svc:2222"
    spec = resolver.cluster_spec()
    assert spec.jobs == ["chief", "ps", "worker"]
    assert spec.num_tasks("ps") == 2 and spec.task_indices("worker") == [0, 1]
    assert spec.task_address("ps", 1) == "job-ps-1.ns.svc:2222"
    overridden = TFConfigClusterResolver(task_type="ps", task_id=0, rpc_layer="grpc+tls")
    assert overridden.master() == "grpc+tls://job-ps-0.ns.svc:2222"
    assert overridden.num_accelerators() in ({}, {"GPU": overridden.num_accelerators().get("GPU", 0)})


def test_cluster_spec_accepts_indexed_dicts_and_rejects_gaps():
    spec = ClusterSpec({"ps": {1: "b:1", 0: "a:1"}})
    assert spec.job_tasks("ps") == ["a:1", "b:1"]
    assert ClusterSpec(spec) == spec
    with pytest.raises(TFConfigError, match="without gaps"):
        ClusterSpec({"ps": {0: "a:1", 2: "b:1"}})
    with pytest.raises(ValueError, match=r"'job_name' has invalid value 'worker': a job of the cluster: one of \["):
        spec.job_tasks("worker")
    with pytest.raises(ValueError, match=r"'task_index' has invalid value 5: an integer in 0..1 \(job 'ps' has 2 task\(s\)\)"):
        spec.task_address("ps", 5)


@pytest.mark.parametrize(
    "address, expected",
    [("127.0.0.1:2222", ("127.0.0.1", 2222)), ("[::1]:80", ("::1", 80)), ("a-b.c.svc:1", ("a-b.c.svc", 1))],
)
def test_parse_address(address, expected):
    assert parse_address(address) == expected


@pytest.mark.parametrize("address", ["", "host", ":80", "[::1]80", "h:http", "-bad-:1"])
def test_parse_address_rejects(address):
    with pytest.raises(ValueError):
        parse_address(address)


def test_field_errors_survive_pickling_with_their_fields():
    """A closure's error travels back from a worker pickled; a 3-argument error must rebuild, message and all."""
    import pickle

    from kubeps.runtime.errors import FieldError, RuntimeConfigError
    from kubeps.runtime.rpc.wire import WireError

    for err in (TFConfigError("task.index", 7, "must be in 0..0"), RuntimeConfigError("steps", -1, "must be >= 1"),
                WireError("magic", b"xx", "must be b'KPS1'")):
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is type(err) and isinstance(back, FieldError)
        assert str(back) == str(err) and (back.field, back.value, back.allowed) == (err.field, err.value, err.allowed)
