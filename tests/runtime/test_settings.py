"""``TaskSettings``: every variable of the pod contract parsed once, in one dialect, with errors that name the
variable, the value and what is allowed; rendered back by ``to_env`` without loss."""

from __future__ import annotations

import pytest

from kubeps.runtime import contract
from kubeps.runtime.errors import RuntimeConfigError
from kubeps.runtime.settings import TaskSettings

TOKEN = "a-job-token-of-some-length"

#: variable -> (a valid value, the field it sets, the value parsed), (an invalid value, words of what is allowed)
TABLE = {
    contract.TF_CONFIG_ENV: (('{"cluster": {}}', "tf_config", '{"cluster": {}}'), None),
    contract.JOB_TOKEN_ENV: ((TOKEN, "job_token", TOKEN), None),
    contract.JOB_TOKEN_FILE_ENV: (("/run/token", "job_token_file", "/run/token"), None),
    contract.TLS_CA_FILE_ENV: (("/tls/ca.crt", "tls_ca_file", "/tls/ca.crt"), None),
    contract.TLS_CERT_FILE_ENV: (("/tls/tls.crt", "tls_cert_file", "/tls/tls.crt"), None),
    contract.TLS_KEY_FILE_ENV: (("/tls/tls.key", "tls_key_file", "/tls/tls.key"), None),
    contract.BIND_HOST_ENV: (("127.0.0.1", "bind_host", "127.0.0.1"), None),
    contract.CPUS_ENV: ((" 3 ", "cpus", 3), ("0", "a whole number of CPUs >= 1")),
    contract.DEVICE_ENV: ((" GPU ", "device", "gpu"), ("tpu", "'cpu', 'gpu' or unset (auto)")),
    contract.GPU_TASKS_ENV: (("4", "gpu_tasks", 4), ("0", "an integer >= 1")),
    contract.CHUNK_BYTES_ENV: (("65536", "chunk_bytes", 65536), ("-5", "an integer >= 1 (bytes), or unset")),
    contract.LOG_LEVEL_ENV: (("WARNING", "log_level", "WARNING"), ("info", "a logging level name: CRITICAL")),
    contract.LOGDIR_ENV: (("s3://bucket/logs", "logdir", "s3://bucket/logs"), None),
    contract.METRICS_PORT_ENV: (("9090", "metrics_port", 9090), ("70000", "a port number in 1..65535, or 0 (no metrics), or unset")),
    contract.HOTSPOT_INTERVAL_ENV: (("2.5", "hotspot_interval_s", 2.5), ("0", "a number of seconds > 0")),
    contract.LOG_FORMAT_ENV: ((" JSON ", "log_format", "json"), ("xml", "'text' (the default) or 'json'")),
    contract.SERVER_EXTENSIONS_ENV: (("a.b, c ,", "server_extensions", ("a.b", "c")), None),
    contract.STREAM_IDLE_TIMEOUT_ENV: (("2.5", "stream_idle_timeout_s", 2.5), ("nan", "a number of seconds > 0")),
    contract.REQUEST_TIMEOUT_ENV: (("60", "request_timeout_s", 60.0), ("inf", "a number of seconds > 0")),
    contract.MAX_CALLS_PER_CLIENT_ENV: (("4", "max_calls_per_client", 4), ("0", "an integer >= 1")),
    contract.MAX_REQUEST_BYTES_ENV: (("1048576", "max_request_bytes", 1 << 20), ("1.5", "an integer >= 1")),
    contract.MAX_ANSWER_BYTES_ENV: (("8388608", "max_answer_bytes", 8 << 20), ("lots", "an integer >= 1")),
    contract.PARKED_ANSWER_TTL_ENV: (("1", "parked_answer_ttl_s", 1.0), ("-1", "a number of seconds > 0")),
    contract.MAX_PARKED_BYTES_ENV: (("1024", "max_parked_bytes", 1024), ("0", "an integer >= 1")),
    contract.MAX_SLOT_SETS_ENV: (("3", "max_slot_sets", 3), ("-2", "an integer >= 1")),
    contract.MAX_HEADER_BYTES_ENV: (("65536", "max_header_bytes", 65536), ("0", "an integer >= 1")),
    contract.MAX_VARIABLES_ENV: (("10", "max_variables", 10), ("-1", "an integer >= 1")),
    contract.MAX_TENSORS_ENV: (("64", "max_tensors", 64), ("0", "an integer >= 1")),
    contract.MAX_TABLES_ENV: (("2", "max_tables", 2), ("x", "an integer >= 1")),
    contract.MAX_TABLE_DIM_ENV: (("64", "max_table_dim", 64), ("0", "an integer >= 1")),
    contract.MAX_BLOOM_COUNTERS_ENV: (("100", "max_bloom_counters", 100), ("1e3", "an integer >= 1")),
    contract.MAX_READ_IDS_ENV: (("1000", "max_read_ids", 1000), ("0", "an integer >= 1")),
    contract.MAX_CLIENT_ANSWER_BYTES_ENV: (("4096", "max_client_answer_bytes", 4096), ("0", "an integer >= 1")),
    contract.MIN_REQUEST_RATE_ENV: (("1024", "min_request_bytes_per_s", 1024), ("-3", "an integer >= 1")),
    contract.NONFINITE_GRADIENTS_ENV: (("allow", "nonfinite_gradients", "allow"), ("sometimes", "'refuse'")),
    contract.CHECKPOINT_ROOT_ENV: (("/ckpt, s3://b/x,", "checkpoint_root", ("/ckpt", "s3://b/x")), None),
    contract.CHECKPOINT_DIR_ENV: (("/ckpt/run", "checkpoint_dir", "/ckpt/run"), None),
    contract.MEMBERSHIP_FILE_ENV: (("/run/membership.json", "membership_file", "/run/membership.json"), None),
    contract.MEMBERSHIP_ACK_FILE_ENV: (("/run/ack.json", "membership_ack_file", "/run/ack.json"), None),
    contract.PS_PROCESSES_ENV: (("3", "ps_processes", 3), ("0", "a whole number of processes per ps task >= 1")),
    contract.PS_TASK_PID_ENV: (("4242", "ps_task_pid", 4242), ("-1", "a process id >= 1")),
}


def test_every_variable_of_the_contract_is_a_setting():
    declared = {getattr(contract, name) for name in contract.__all__ if name.endswith("_ENV")}
    assert set(TaskSettings.variables().values()) == declared == set(TABLE)


@pytest.mark.parametrize("name", sorted(TABLE))
def test_a_valid_value_sets_its_field(name):
    (raw, field, parsed), _ = TABLE[name]
    settings = TaskSettings.from_env({name: raw, "UNRELATED": "x"})
    assert getattr(settings, field) == parsed
    others = TaskSettings.from_env({})
    assert {f for f in TaskSettings.model_fields if getattr(settings, f) != getattr(others, f)} == {field}


@pytest.mark.parametrize("name", sorted(n for n, (_, bad) in TABLE.items() if bad))
def test_an_invalid_value_names_the_variable_the_value_and_what_is_allowed(name):
    _, (raw, allowed) = TABLE[name]
    with pytest.raises(RuntimeConfigError) as info:
        TaskSettings.from_env({name: raw})
    assert (info.value.field, info.value.value) == (name, raw)
    assert str(info.value).startswith(f"'{name}' has invalid value {raw!r}: ") and allowed in str(info.value)


def test_blank_is_unset_and_unset_is_the_default():
    blank = TaskSettings.from_env({name: " " for name in TABLE})
    assert blank == TaskSettings.from_env({}) == TaskSettings()
    assert (blank.max_slot_sets, blank.log_level, blank.nonfinite_gradients, blank.checkpoint_root) == (
        8, "INFO", "refuse", ())


def test_the_process_environment_is_the_default(monkeypatch):
    monkeypatch.setenv(contract.MAX_SLOT_SETS_ENV, "5")
    assert TaskSettings.from_env().max_slot_sets == 5


def test_the_token_is_never_shown():
    settings = TaskSettings.from_env({contract.JOB_TOKEN_ENV: TOKEN})
    assert TOKEN not in repr(settings) and TOKEN not in str(settings)


def test_frozen():
    with pytest.raises(ValueError, match="frozen"):
        TaskSettings().max_slot_sets = 2  # type: ignore[misc]


@pytest.mark.parametrize("environ", [
    {},
    {name: valid[0] for name, (valid, _) in TABLE.items()},
    {contract.CHECKPOINT_ROOT_ENV: "/a,/b", contract.REQUEST_TIMEOUT_ENV: "0.25", contract.CPUS_ENV: "7"},
])
def test_rendering_round_trip(environ):
    settings = TaskSettings.from_env(environ)
    rendered = settings.to_env()
    assert TaskSettings.from_env(rendered) == settings
    assert all(isinstance(v, str) for v in rendered.values())
    assert set(rendered) == set(environ)  # every value above differs from its default: each is rendered


def test_settings_in_code_render_as_a_task_reads_them():
    settings = TaskSettings(checkpoint_root=("/a,/b", " /c "), server_extensions=["m"], max_slot_sets=3)
    assert settings.checkpoint_root == ("/a", "/b", "/c") and settings.server_extensions == ("m",)
    assert settings.to_env() == {contract.SERVER_EXTENSIONS_ENV: "m", contract.MAX_SLOT_SETS_ENV: "3",
                                 contract.CHECKPOINT_ROOT_ENV: "/a,/b,/c"}
    assert TaskSettings.from_env(settings.to_env()) == settings
