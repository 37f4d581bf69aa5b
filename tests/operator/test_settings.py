"""Settings from the environment and flags, and the client-side rate limiter."""

from __future__ import annotations

import time

import pytest

from kubeps.operator.kube.client import TokenBucket
from kubeps.operator.main import log_versions, settings_from_args
from kubeps.operator.controller.settings import DEFAULT_IMAGE, Settings
from kubeps.runtime.contract import VERSION


def test_defaults_are_cluster_wide():
    settings = Settings.from_env({})
    assert settings.clusterwide and settings.namespaces == ()
    assert settings.default_image == DEFAULT_IMAGE and settings.cluster_domain is None
    assert (settings.api_qps, settings.api_burst) == (100.0, 200)
    assert settings.watch_server_timeout < settings.watch_client_timeout < settings.watch_inactivity_timeout


def test_environment_is_read():
    env = {"KUBEPS_NAMESPACES": "a, b", "KUBEPS_DEFAULT_IMAGE": "reg/img:2", "KUBEPS_CLUSTER_DOMAIN": "c.local",
           "KUBEPS_API_QPS": "20", "KUBEPS_WATCH_INACTIVITY": "30", "KUBEPS_LOG_LEVEL": "debug"}
    settings = Settings.from_env(env)
    assert settings.namespaces == ("a", "b") and not settings.clusterwide
    assert (settings.default_image, settings.cluster_domain, settings.api_qps) == ("reg/img:2", "c.local", 20.0)
    assert settings.watch_inactivity_timeout == 30.0 and settings.log_level == "DEBUG"


@pytest.mark.parametrize("env,allowed", [
    ({"KUBEPS_API_QPS": "fast"}, "a finite number > 0"),
    ({"KUBEPS_API_QPS": "0"}, "a finite number > 0"),
    ({"KUBEPS_WORKERS": "0"}, "an integer >= 1"),
    ({"KUBEPS_WORKERS": "2.5"}, "an integer >= 1"),
    ({"KUBEPS_LIVENESS_PORT": "65536"}, "a port number in 1..65535, or 0"),
    ({"KUBEPS_PEERING_LIFETIME": "1"}, "an integer >= 2"),
    ({"KUBEPS_WATCH_INACTIVITY": "inf"}, "a number of seconds > 0"),
    ({"KUBEPS_NODE_LOST_AFTER": "soon"}, "a number of seconds"),
    ({"KUBEPS_KUEUE": "maybe"}, "one of auto, on, off"),
])
def test_bad_environment_names_the_variable_the_value_and_what_is_allowed(env, allowed):
    from kubeps.runtime.errors import RuntimeConfigError

    ((name, raw),) = env.items()
    with pytest.raises(RuntimeConfigError) as info:
        Settings.from_env(env)
    assert (info.value.field, info.value.value, info.value.allowed) == (name, raw, allowed)
    assert str(info.value) == f"'{name}' has invalid value {raw!r}: {allowed}"


def test_flags_override_the_environment():
    env = {"KUBEPS_NAMESPACES": "a", "KUBEPS_DEFAULT_IMAGE": "env/img"}
    settings = settings_from_args(["-n", "x", "--namespace", "y", "--default-image", "flag/img",
                                   "--cluster-domain", "cluster.local", "--metrics-port", "0",
                                   "--liveness-port", "9", "--log-level", "warning"], env)
    assert settings.namespaces == ("x", "y") and settings.default_image == "flag/img"
    assert settings.cluster_domain == "cluster.local" and settings.metrics_port == 0
    assert settings.liveness_port == 9 and settings.log_level == "WARNING"
    assert settings_from_args(["--all-namespaces"], env).clusterwide


def test_namespace_and_all_namespaces_exclude_each_other():
    with pytest.raises(SystemExit):
        settings_from_args(["-n", "a", "-A"], {})


def test_gang_scheduler_from_env_or_flag():
    assert Settings.from_env({}).gang_scheduler == "none"
    env = {"KUBEPS_GANG_SCHEDULER": "volcano", "KUBEPS_GANG_SCHEDULER_NAME": "vc"}
    assert (Settings.from_env(env).gang_scheduler, Settings.from_env(env).gang_scheduler_name) == ("volcano", "vc")
    flags = settings_from_args(["--gang-scheduler", "native"], env=env)
    assert (flags.gang_scheduler, flags.gang_scheduler_name) == ("native", "vc")
    with pytest.raises(ValueError, match="'KUBEPS_GANG_SCHEDULER' has invalid value 'kube-batch': one of none, native, "
                                         "volcano, scheduler-plugins"):
        Settings.from_env({"KUBEPS_GANG_SCHEDULER": "kube-batch"})
    with pytest.raises(SystemExit):
        settings_from_args(["--gang-scheduler", "kube-batch"], env={})


def test_token_bucket_allows_a_burst_then_paces():
    now = [0.0]
    slept = []

    def sleep(seconds):
        slept.append(seconds)
        now[0] += seconds

    bucket = TokenBucket(qps=10, burst=3, clock=lambda: now[0], sleep=sleep)
    waits = [bucket.acquire() for _ in range(5)]
    assert waits[:3] == [0, 0, 0]
    assert waits[3] == pytest.approx(0.1) and waits[4] == pytest.approx(0.1)
    now[0] += 10
    assert bucket.acquire() == 0


def test_peering_from_kopf_env_or_flag():
    from kubeps.operator.main import kopf_run_options, settings_from_args

    assert kopf_run_options(settings_from_args([], env={}))["standalone"] is True
    from_env = kopf_run_options(settings_from_args([], env={"KOPF_RUN_PEERING": "peers"}))
    assert from_env["standalone"] is False and from_env["peering_name"] == "peers"
    from_flag = kopf_run_options(settings_from_args(["--peering", "other", "-n", "a"], env={"KOPF_RUN_PEERING": "x"}))
    assert from_flag["peering_name"] == "other" and from_flag["namespaces"] == ("a",)
    assert from_flag["clusterwide"] is False


def test_kopf_settings_carry_peering_and_watching():
    """One place maps our settings to kopf's: main passes them to kopf.run, nothing overrides them later."""
    from kubeps.operator.main import kopf_run_options
    from kubeps.operator.controller.settings import kopf_settings

    options = kopf_run_options(settings_from_args(["--peering", "peers", "-n", "a", "--peering-lifetime", "7"], env={}))
    peering = options["settings"].peering
    assert (peering.standalone, peering.mandatory, peering.name, peering.lifetime) == (False, True, "peers", 7)
    assert peering.clusterwide is False and options["priority"] == peering.priority
    assert options["settings"].watching.server_timeout == 120 and options["settings"].posting.level == 30
    standalone = kopf_run_options(settings_from_args([], env={}))["settings"].peering
    assert standalone.standalone is True and standalone.mandatory is False

    # Each replica its own priority, the earlier started the higher; or the one asked for.
    earlier = kopf_settings(Settings(peering="p")).peering.priority
    time.sleep(0.01)
    later = kopf_settings(Settings(peering="p")).peering.priority
    assert earlier > later
    assert kopf_settings(Settings.from_env({"KOPF_RUN_PEERING": "p", "KOPF_RUN_PRIORITY": "5"})).peering.priority == 5


def test_kopf_run_module_keeps_kopf_peering_choice():
    """Under `kopf run -m`, kopf's CLI decides the peering; the rest of our settings still apply."""
    import kopf

    from kubeps.operator.controller.settings import kopf_settings

    theirs = kopf.OperatorSettings()
    theirs.peering.name, theirs.peering.mandatory = "from-cli", True
    kopf_settings(Settings(watch_server_timeout=60), target=theirs, peering=False)
    assert (theirs.peering.name, theirs.peering.mandatory, theirs.peering.standalone) == ("from-cli", True, False)
    assert theirs.watching.server_timeout == 60 and theirs.peering.lifetime == 10


def test_the_operator_logs_its_version_and_the_runtime_image_first(caplog):
    """The first line of the operator's log says what runs: its version, the runtime image pods get by default (the
    runtime's version unless --default-image names another), Python's and kopf's."""
    caplog.set_level("INFO", logger="kubeps.operator")
    log_versions(settings_from_args(["--default-image", "registry.example.com/rt:1.2.3"]), "1.45.2")
    (record,) = caplog.records
    assert record.getMessage().startswith(f"kubeps operator {VERSION} starting; pods that name no image run "
                                          "registry.example.com/rt:1.2.3; Python 3.")
    assert record.getMessage().endswith("kopf 1.45.2")


@pytest.mark.parametrize("raw,port", [("0", None), (" 9090 ", 9090), ("1", 1), ("65535", 65535)])
def test_a_task_and_the_operator_read_the_metrics_port_alike(raw, port):
    """One rule for KUBEPS_METRICS_PORT: 0 is off, else a port in 1..65535; only the unset default differs (a task
    serves no metrics, the operator serves them on 8080)."""
    from kubeps.runtime.settings import TaskSettings

    assert TaskSettings.from_env({"KUBEPS_METRICS_PORT": raw}).metrics_port == port
    assert Settings.from_env({"KUBEPS_METRICS_PORT": raw}).metrics_port == (port or 0)
    assert (TaskSettings.from_env({}).metrics_port, Settings.from_env({}).metrics_port) == (None, 8080)


@pytest.mark.parametrize("raw", ["70000", "-1", "x", "1.5", "nan"])
def test_a_task_and_the_operator_refuse_the_same_metrics_ports_in_the_same_words(raw):
    from kubeps.runtime.errors import RuntimeConfigError
    from kubeps.runtime.settings import TaskSettings

    refusals = []
    for read in (TaskSettings.from_env, Settings.from_env):
        with pytest.raises(RuntimeConfigError) as info:
            read({"KUBEPS_METRICS_PORT": raw})
        refusals.append(info.value)
    for err in refusals:
        assert (err.field, err.value) == ("KUBEPS_METRICS_PORT", raw)
        assert err.allowed.startswith("a port number in 1..65535, or 0 (no metrics)")
