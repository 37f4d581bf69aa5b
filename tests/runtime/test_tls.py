"""Mutual TLS between tasks, with real server processes on loopback: a server given the job's certificate accepts
only TLS connections that present a certificate of the job's CA -- every plaintext, certificate-less or foreign
connection attempt is refused, and none changes anything -- while the job token is still checked; clients refuse
a server of another CA; training runs over TLS; ``kubeps local`` makes and removes a throw-away CA."""

from __future__ import annotations

import json
import socket
import ssl
from pathlib import Path

import grpc
import numpy as np
import pytest

from kubeps.runtime import certs, cli
from kubeps.runtime.contract import TLS_CA_FILE_ENV, TLS_CERT_FILE_ENV, TLS_KEY_FILE_ENV
from kubeps.runtime.coordinator.cluster_coordinator import ClusterCoordinator
from kubeps.runtime.errors import RemoteError, RuntimeConfigError, UnauthenticatedError
from kubeps.runtime.ops.optimizers import SGD
from kubeps.runtime.rpc import wire
from kubeps.runtime.rpc.client import CHANNEL_OPTIONS
from kubeps.runtime.rpc.protocol import PS_SERVICE, UNARY_PREFIX
from kubeps.runtime.rpc.tls import TLSConfig, load_tls as _load_tls
from kubeps.runtime.settings import TaskSettings
from kubeps.runtime.variables.variable import Variable

from .conftest import TOKEN


def load_tls(env: dict[str, str]) -> TLSConfig | None:
    """The TLS files of the task whose environment is ``env``."""
    return _load_tls(TaskSettings.from_env(env))

pytestmark = pytest.mark.timeout(180)

ATTEMPTS = 25  # per kind of refused connection


def write_credentials(directory: Path, name: str, hosts=("127.0.0.1", "localhost")) -> dict[str, str]:
    """A job CA and task certificate as files; the KUBEPS_TLS_* variables naming them."""
    made = certs.issue_job_credentials(name, list(hosts))
    directory.mkdir(parents=True, exist_ok=True)
    env = {}
    for var, (filename, data) in {TLS_CA_FILE_ENV: ("ca.crt", made.ca_cert), TLS_CERT_FILE_ENV: ("tls.crt", made.cert),
                                  TLS_KEY_FILE_ENV: ("tls.key", made.key)}.items():
        (directory / filename).write_bytes(data)
        env[var] = str(directory / filename)
    return env


@pytest.fixture(scope="module")
def tls_job(tmp_path_factory):
    """1 ps + 1 worker serving mutual TLS, a variable ``v`` on the ps; and a foreign job's credentials."""
    from .conftest import LocalCluster

    base = tmp_path_factory.mktemp("tls")
    env = write_credentials(base / "job", "job")
    foreign = load_tls(write_credentials(base / "foreign", "other-job"))
    cluster = LocalCluster(1, 1, base, extra_env=env).start()
    client = cluster.client("ps", 0)
    client.call("CreateVariables", {"names": ["v"]},
                [np.arange(4, dtype=np.float32)])
    try:
        yield cluster, foreign
    finally:
        client.close()
        cluster.stop()


def _read_v(cluster) -> np.ndarray:
    client = cluster.client("ps", 0)
    try:
        _, (value,) = client.call("Read", {"names": ["v"]})
        return value
    finally:
        client.close()


def _assign_request() -> bytes:
    (chunk,) = wire.encode_chunks({"names": ["v"], "ops": ["assign"]}, [np.full(4, 99, dtype=np.float32)])
    return chunk


def _attempt(channel: grpc.Channel) -> grpc.StatusCode | None:
    """One Assign on a fresh channel (a new connection), with the right token; the status, None if it ran."""
    method = channel.unary_unary(f"/{PS_SERVICE}/{UNARY_PREFIX}Assign", request_serializer=lambda b: b,
                                 response_deserializer=lambda b: b)
    try:
        method(_assign_request(), timeout=5, metadata=(("x-kubeps-job-token", TOKEN),))
    except grpc.RpcError as err:
        return err.code()
    finally:
        channel.close()
    return None


def test_plaintext_uncertified_and_foreign_connections_are_all_refused(tls_job):
    cluster, foreign = tls_job
    address = cluster.cluster["ps"][0]
    ca = cluster.tls.ca
    kinds = {
        "plaintext": lambda: grpc.insecure_channel(address, options=CHANNEL_OPTIONS),
        "TLS without a client certificate": lambda: grpc.secure_channel(
            address, grpc.ssl_channel_credentials(root_certificates=ca), options=CHANNEL_OPTIONS),
        "client certificate of another job's CA": lambda: grpc.secure_channel(
            address, grpc.ssl_channel_credentials(root_certificates=ca, private_key=foreign.key,
                                                  certificate_chain=foreign.cert), options=CHANNEL_OPTIONS),
        "server checked against another CA": lambda: grpc.secure_channel(
            address, foreign.channel_credentials(), options=CHANNEL_OPTIONS),
    }
    before = _read_v(cluster)
    outcomes: dict[str, list] = {}
    for kind, make in kinds.items():
        outcomes[kind] = [_attempt(make()) for _ in range(ATTEMPTS)]
    for kind, codes in outcomes.items():
        assert None not in codes, f"{kind}: {codes.count(None)} of {ATTEMPTS} attempts ran"
        # refused at the handshake, before any RPC: never UNAUTHENTICATED (the token check) or an answer
        assert set(codes) == {grpc.StatusCode.UNAVAILABLE}, f"{kind}: {set(codes)}"
    np.testing.assert_array_equal(_read_v(cluster), before)  # nothing changed
    assert sum(len(c) for c in outcomes.values()) == 4 * ATTEMPTS


def test_raw_tcp_and_tls_without_a_certificate_get_no_http2_answer(tls_job):
    """Below gRPC: a plaintext HTTP/2 preface gets no HTTP/2 frame back, and a TLS handshake without a client
    certificate fails (the server requires one)."""
    cluster, _ = tls_job
    host, port = cluster.cluster["ps"][0].rsplit(":", 1)
    for _ in range(ATTEMPTS):
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")
            try:
                answer = sock.recv(64)
            except (ConnectionResetError, socket.timeout):
                answer = b""
            # a TLS server answers a non-TLS byte stream with a TLS alert (content type 0x15) or closes
            assert not answer or answer[0] == 0x15, answer[:16]
    context = ssl.create_default_context(cadata=cluster.tls.ca.decode())
    context.set_alpn_protocols(["h2"])
    answers = []
    for _ in range(ATTEMPTS):
        with socket.create_connection((host, int(port)), timeout=5) as raw:
            try:
                with context.wrap_socket(raw, server_hostname="localhost") as tls:
                    tls.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
                    # TLS 1.3: the server's refusal of the missing certificate arrives after the handshake
                    answers.append(tls.recv(64))
            except (ssl.SSLError, ConnectionResetError, BrokenPipeError) as err:
                answers.append(type(err).__name__)
    # never an HTTP/2 frame (a server that took the connection would send its SETTINGS): an error or a closed stream
    assert all(not isinstance(a, bytes) or a == b"" for a in answers), answers


def test_token_is_still_checked_over_tls(tls_job):
    cluster, _ = tls_job
    client = cluster.client("ps", 0, token="a-wrong-token-0123456789")
    try:
        with pytest.raises(UnauthenticatedError):
            client.call("Assign", {"names": ["v"], "ops": ["assign"]}, [np.full(4, 7, dtype=np.float32)])
    finally:
        client.close()
    client = cluster.client("ps", 0, token=None)
    try:
        with pytest.raises(UnauthenticatedError):
            client.call("Ping")
    finally:
        client.close()


def test_training_over_mutual_tls(tls_job):
    cluster, _ = tls_job
    strategy = cluster.strategy()
    assert strategy.tls is not None
    coordinator = ClusterCoordinator(strategy)
    try:
        with strategy.scope():
            w = Variable(np.zeros(3), name="w")
        opt = SGD(learning_rate=0.5)

        def step():
            opt.apply_gradients([(np.ones(3), w)])

        for _ in range(4):
            coordinator.schedule(step)
        coordinator.join()
        np.testing.assert_allclose(w.numpy(), -2.0 * np.ones(3))
    finally:
        coordinator.shutdown()
        strategy.close()


def test_a_plaintext_client_of_a_tls_job_fails_fast_with_unavailable(tls_job):
    cluster, _ = tls_job
    from kubeps.runtime.rpc.client import Client

    client = Client(cluster.cluster["ps"][0], PS_SERVICE, TOKEN, timeout=5)
    try:
        with pytest.raises(RemoteError) as err:
            client.call("Ping")
        assert err.value.code == "UNAVAILABLE"
    finally:
        client.close()


def test_load_tls_names_what_is_missing_or_unreadable(tmp_path):
    assert load_tls({}) is None
    assert load_tls({TLS_CA_FILE_ENV: "", TLS_CERT_FILE_ENV: "", TLS_KEY_FILE_ENV: ""}) is None
    env = write_credentials(tmp_path, "job")
    assert isinstance(load_tls(env), TLSConfig) and "key" not in repr(load_tls(env)).replace("<key>", "")
    with pytest.raises(RuntimeConfigError, match=TLS_KEY_FILE_ENV):
        load_tls({k: v for k, v in env.items() if k != TLS_KEY_FILE_ENV})
    with pytest.raises(RuntimeConfigError, match="readable PEM file"):
        load_tls({**env, TLS_CA_FILE_ENV: str(tmp_path / "missing.crt")})
    (tmp_path / "junk").write_bytes(b"not a certificate")
    with pytest.raises(RuntimeConfigError, match="PEM"):
        load_tls({**env, TLS_CERT_FILE_ENV: str(tmp_path / "junk")})


def test_certificate_names_and_usages():
    from cryptography import x509

    made = certs.issue_job_credentials("j", ["j-ps-0.ns.svc", "j-ps-0.ns.svc.cluster.local", "127.0.0.1"])
    cert = x509.load_pem_x509_certificate(made.cert)
    ca = x509.load_pem_x509_certificate(made.ca_cert)
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["j-ps-0.ns.svc", "j-ps-0.ns.svc.cluster.local"]
    assert [str(ip) for ip in san.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    cert.verify_directly_issued_by(ca)
    with pytest.raises(ValueError, match="hosts"):
        certs.issue_job_credentials("j", [])


TLS_SCRIPT = r'''
import json, os, sys, time
names = ("KUBEPS_TLS_CA_FILE", "KUBEPS_TLS_CERT_FILE", "KUBEPS_TLS_KEY_FILE")
paths = {n: os.environ.get(n, "") for n in names}
print("REPORT " + json.dumps({"paths": paths, "exist": [os.path.isfile(p) for p in paths.values() if p]}), flush=True)
task = json.loads(os.environ["TF_CONFIG"])["task"]
marks = sys.argv[1]
open(os.path.join(marks, f"{task['type']}-{task['index']}"), "w").close()
if task["type"] == "chief":  # every task has reported before the chief ends the run
    deadline = time.time() + 30
    while len(os.listdir(marks)) < 3 and time.time() < deadline:
        time.sleep(0.02)
else:
    time.sleep(60)
'''


@pytest.mark.parametrize("flag, tls", [((), True), (("--insecure-plaintext",), False)])
def test_kubeps_local_makes_a_throwaway_ca_and_removes_it(tmp_path, capsys, monkeypatch, flag, tls):
    for name in (TLS_CA_FILE_ENV, TLS_CERT_FILE_ENV, TLS_KEY_FILE_ENV):
        monkeypatch.delenv(name, raising=False)
    script = tmp_path / "task.py"
    script.write_text(TLS_SCRIPT)
    marks = tmp_path / "marks"
    marks.mkdir()
    code = cli.main(["local", str(script), "--ps", "1", "--workers", "1", *flag, "--", str(marks)])
    out = capsys.readouterr().out
    assert code == 0
    reports = [json.loads(line.split("REPORT ", 1)[1]) for line in out.splitlines() if "REPORT " in line]
    assert len(reports) == 3
    paths = {p for r in reports for p in r["paths"].values()}
    if not tls:
        assert paths == {""}
        return
    assert len(paths) == 3 and all(r["exist"] == [True, True, True] for r in reports)
    directory = Path(next(iter(paths))).parent
    assert not directory.exists()  # removed at exit
    assert "ca.key" not in {Path(p).name for p in paths}


def _failed_handshakes(address: str, count: int) -> None:
    """``count`` rounds of a plaintext byte stream and a TLS handshake without a client certificate."""
    host, port = address.rsplit(":", 1)
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    context.set_alpn_protocols(["h2"])
    for _ in range(count):
        with socket.create_connection((host, int(port)), timeout=5) as raw:
            raw.sendall(b"GET / HTTP/1.1\r\n\r\n")
            try:
                raw.recv(16)
            except OSError:
                pass
        with socket.create_connection((host, int(port)), timeout=5) as raw:
            try:
                with context.wrap_socket(raw) as tls:
                    tls.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
                    tls.recv(16)
            except (ssl.SSLError, OSError):
                pass


@pytest.mark.parametrize("verbosity", [None, "INFO"])
def test_failed_handshakes_write_nothing_to_the_log_unless_grpc_verbosity_asks(tmp_path, monkeypatch, verbosity):
    """gRPC's C core logs each failed handshake at INFO (~440 bytes): by default a task's log stays quiet however
    many an attacker makes (kubeps sets GRPC_VERBOSITY=ERROR unless the user set it); GRPC_VERBOSITY=INFO shows
    them, line by line."""
    from .conftest import LocalCluster

    env = write_credentials(tmp_path / "job", "job")
    monkeypatch.delenv("GRPC_VERBOSITY", raising=False)  # the task starts as a pod would, without it
    if verbosity:
        env["GRPC_VERBOSITY"] = verbosity
    cluster = LocalCluster(1, 0, tmp_path, extra_env=env).start()
    try:
        _failed_handshakes(cluster.cluster["ps"][0], 40)
        client = cluster.client("ps", 0)
        try:
            client.call("Ping")  # still serving
        finally:
            client.close()
        log = cluster.log_text("ps", 0)
    finally:
        cluster.stop()
    refused = [line for line in log.splitlines() if "Handshake failed" in line]
    if verbosity is None:
        assert refused == [], refused[:3]
        assert len(log) < 4096, log[-2000:]
    else:
        assert len(refused) >= 40, log[-2000:]
