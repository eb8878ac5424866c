"""TLS on the TCP path: `dockd serve --tls-cert/--tls-key`, clients with `tls=` / DOCKD_TLS_CA.

Real daemons on loopback with a self-signed cluster certificate made for the test (the
`cryptography` package when installed, else the `openssl` command). Samples cross two
warehouses over TLS; every mismatch (a client without TLS settings at a TLS dock, a TLS
client at a plain dock, the wrong CA, a warehouse whose TLS settings differ from its
controller's) fails at once with a message naming the address and what to set."""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import sys
import time

import pytest
import torch

import dockd
from dockd.errors import DockAuthError
from dockd.local import read_ready, spawn_node
from dockd.net.tls import TlsSocket

pytestmark = pytest.mark.timeout(180)


def make_cert(directory: pathlib.Path, name: str) -> tuple[str, str]:
    """A self-signed EC certificate and its key (PEM files) for CN=dockd-NAME."""
    cert, key = directory / f"{name}.pem", directory / f"{name}.key"
    try:
        import datetime

        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID
    except ImportError:
        if shutil.which("openssl") is None:
            pytest.skip("neither the cryptography package nor the openssl command is available")
        subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                        "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "2", "-subj", f"/CN=dockd-{name}"],
                       check=True, capture_output=True, timeout=60)
        return str(cert), str(key)
    pk = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"dockd-{name}")])
    now = datetime.datetime.now(datetime.timezone.utc)
    crt = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(pk.public_key())
           .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
           .not_valid_after(now + datetime.timedelta(days=2))
           .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True).sign(pk, hashes.SHA256()))
    cert.write_bytes(crt.public_bytes(serialization.Encoding.PEM))
    key.write_bytes(pk.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                     serialization.NoEncryption()))
    return str(cert), str(key)


def make_expired_cert(directory: pathlib.Path) -> tuple[str, str]:
    """A self-signed certificate valid only on 2020-01-01 (UTC), and its key."""
    cert, key = directory / "expired.pem", directory / "expired.key"
    try:
        import datetime

        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID
    except ImportError:
        if shutil.which("openssl") is None:
            pytest.skip("neither the cryptography package nor the openssl command is available")
        # (`openssl ca` takes explicit dates; `req -x509 -days` only days from now)
        (directory / "index.txt").write_text("")
        (directory / "serial").write_text("01\n")
        (directory / "ca.cnf").write_text(f"[ca]\ndefault_ca = d\n[d]\ndatabase = {directory}/index.txt\n"
                                          f"new_certs_dir = {directory}\nserial = {directory}/serial\n"
                                          "default_md = sha256\npolicy = p\n[p]\ncommonName = supplied\n")
        run = dict(check=True, capture_output=True, timeout=60)
        subprocess.run(["openssl", "req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                        "-keyout", str(key), "-out", str(directory / "expired.csr"), "-subj", "/CN=dockd-expired"], **run)
        subprocess.run(["openssl", "ca", "-batch", "-selfsign", "-config", str(directory / "ca.cnf"), "-keyfile", str(key),
                        "-in", str(directory / "expired.csr"), "-out", str(cert), "-notext",
                        "-startdate", "20200101000000Z", "-enddate", "20200102000000Z"], **run)
        return str(cert), str(key)
    pk = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "dockd-expired")])
    day = datetime.datetime(2020, 1, 1, tzinfo=datetime.timezone.utc)
    crt = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(pk.public_key())
           .serial_number(x509.random_serial_number()).not_valid_before(day)
           .not_valid_after(day + datetime.timedelta(days=1)).sign(pk, hashes.SHA256()))
    cert.write_bytes(crt.public_bytes(serialization.Encoding.PEM))
    key.write_bytes(pk.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                     serialization.NoEncryption()))
    return str(cert), str(key)


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    d = tmp_path_factory.mktemp("tls")
    return {"a": make_cert(d, "a"), "b": make_cert(d, "b")}


def _stop(*procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if p.stdout is not None:
            p.stdout.close()


@pytest.fixture(scope="module")
def tls_dock(certs):
    """A TLS controller (with its warehouse) and a second TLS warehouse that joined it over TLS."""
    cert, key = certs["a"]
    flags = ["--tls-cert", cert, "--tls-key", key]
    ctrl, ready = spawn_node(["--controller", "--port", "0", "--capacity", "64MiB", *flags])
    address = f"127.0.0.1:{ready['port']}"
    try:
        wh, _ = spawn_node(["--join", address, "--port", "0", "--capacity", "64MiB", *flags])
    except BaseException:
        _stop(ctrl)
        raise
    yield address, cert
    _stop(wh, ctrl)


@pytest.fixture(scope="module")
def plain_dock():
    ctrl, ready = spawn_node(["--controller", "--port", "0", "--capacity", "64MiB"])
    yield f"127.0.0.1:{ready['port']}"
    _stop(ctrl)


def test_put_get_over_tls_across_two_warehouses(tls_dock, monkeypatch):
    address, ca = tls_dock
    monkeypatch.setenv("DOCKD_TRANSPORT", "tcp")  # same host: without it, data would go by shared memory
    big = torch.randn(4, 1 << 16)  # 1 MiB
    for wid in (0, 1):
        with dockd.connect(address, tls=ca, warehouse=wid) as d:
            d.put({"x": big + wid, "s": [f"w{wid}-{i}" for i in range(4)]}, partition="tls")
    monkeypatch.setenv("DOCKD_TLS_CA", ca)  # the environment works as well as tls=
    with dockd.connect(address) as d:
        assert {w["state"] for w in d.stats()["warehouses"].values()} == {"joined"}
        got = d.get("c", ["x", "s"], 8, partition="tls", timeout=30)
        conn = d._router.ctrl.get()
        assert isinstance(conn.sock, TlsSocket) and conn.sock.version() in ("TLSv1.2", "TLSv1.3")
        d._router.ctrl.put(conn)
    rows = dict(zip(got["s"], got["x"]))
    for wid in (0, 1):
        for i in range(4):
            assert torch.equal(rows[f"w{wid}-{i}"], big[i] + wid)


def test_a_tcp_client_without_tls_is_told_at_once(tls_dock, monkeypatch):
    address, _ = tls_dock
    monkeypatch.delenv("DOCKD_TLS_CA", raising=False)
    monkeypatch.setenv("DOCKD_TRANSPORT", "tcp")  # (as from another host: the same-host socket is not for it)
    t0 = time.monotonic()
    with pytest.raises(DockAuthError, match=f"dockd at {address} uses TLS.*tls=.*DOCKD_TLS_CA"):
        dockd.connect(address, connect_timeout=10)
    assert time.monotonic() - t0 < 3  # no waiting for a handshake timeout


def test_a_same_host_client_needs_no_tls_settings(tls_dock, monkeypatch):
    """Finding 9: the README promised that same-host clients (shared memory and a Unix socket, which
    never leave the host) need no TLS, but such a client was refused for having no TLS settings."""
    address, _ = tls_dock
    monkeypatch.delenv("DOCKD_TLS_CA", raising=False)
    monkeypatch.delenv("DOCKD_TRANSPORT", raising=False)
    for wid in (0, 1):
        with dockd.connect(address, warehouse=wid, connect_timeout=10) as d:
            assert d._router.ctrl.transport == "shm"
            d.put({"x": torch.full((2, 1 << 16), float(wid))}, partition="same-host")  # 512 KiB: staged in shm
    with dockd.connect(address, connect_timeout=10) as d:
        got = d.get("c", ["x"], 4, partition="same-host", timeout=30)
        assert sorted(float(v[0]) for v in got["x"]) == [0.0, 0.0, 1.0, 1.0]
    out = subprocess.run([sys.executable, "-m", "dockd", "stats", address], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and json.loads(out.stdout)["partitions"]["same-host"]["samples"] == 4, out.stderr


def test_a_tls_client_refuses_a_dock_without_tls(plain_dock, certs):
    t0 = time.monotonic()
    with pytest.raises(DockAuthError, match=f"dockd at {plain_dock} does not use TLS.*--tls-cert"):
        dockd.connect(plain_dock, tls=certs["a"][0], connect_timeout=10)
    assert time.monotonic() - t0 < 3


def test_the_wrong_ca_is_refused(tls_dock, certs):
    address, _ = tls_dock
    t0 = time.monotonic()
    with pytest.raises(DockAuthError, match=f"certificate of dockd at {address} is not trusted by .*b.pem"):
        dockd.connect(address, tls=certs["b"][0], connect_timeout=10)
    assert time.monotonic() - t0 < 3


def test_a_warehouse_whose_tls_does_not_match_stops_with_the_reason(tls_dock, plain_dock, certs):
    address, _ = tls_dock
    cert, key = certs["a"]
    cases = [
        (["--join", address], "uses TLS"),                                                  # no TLS at a TLS dock
        (["--join", address, "--tls-cert", cert, "--tls-key", key, "--tls-ca", certs["b"][0]], "not trusted"),
        (["--join", plain_dock, "--tls-cert", cert, "--tls-key", key], "does not use TLS"),  # TLS at a plain dock
    ]
    for args, match in cases:
        out = subprocess.run([sys.executable, "-m", "dockd", "serve", "--port", "0", *args, "--join-timeout", "20"],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode != 0 and match in out.stderr, (args, out.stderr[-2000:])


def test_cli_takes_the_ca_and_serve_checks_its_flags(tls_dock, certs):
    address, ca = tls_dock
    out = subprocess.run([sys.executable, "-m", "dockd", "stats", address, "--tls-ca", ca],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "warehouses" in json.loads(out.stdout), out.stderr
    out = subprocess.run([sys.executable, "-m", "dockd", "serve", "--controller", "--port", "0", "--tls-cert", ca],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--tls-cert and --tls-key together" in out.stderr, out.stderr


def test_a_daemon_with_an_expired_certificate_says_so_at_start(tmp_path):
    """Finding 9: it started without a word, and every client then failed its TLS handshake."""
    cert, key = make_expired_cert(tmp_path)
    with open(tmp_path / "stderr", "wb") as err:
        proc = subprocess.Popen([sys.executable, "-m", "dockd", "serve", "--controller", "--port", "0",
                                 "--tls-cert", cert, "--tls-key", key], stdout=subprocess.PIPE, stderr=err,
                                stdin=subprocess.DEVNULL)
        try:
            ready = read_ready(proc)
            with pytest.raises(DockAuthError, match="certificate has expired"):  # as the warning says
                dockd.connect(f"127.0.0.1:{ready['port']}", tls=cert, transport="tcp", connect_timeout=10)
        finally:
            _stop(proc)
    logged = (tmp_path / "stderr").read_text()
    assert f"the certificate {cert} expired on 2020-01-02 00:00:00 UTC" in logged, logged
