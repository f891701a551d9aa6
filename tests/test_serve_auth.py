"""`lichen serve` off loopback: it refuses to start without --api-key, and with one it checks keys as SGLang does
(sglang-api.md §1.2): health endpoints open, 401 otherwise; an admin key guards the control endpoints."""

import subprocess
import sys

import pytest

from lichen.engines.server_process import call, launch

KEY, ADMIN = "s3cret-key", "admin-key"


@pytest.fixture(scope="module")
def server(tiny_ckpt, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("serve_auth") / "serve.log")
    proc = launch(tiny_ckpt, "--host", "0.0.0.0", "--api-key", KEY, "--admin-api-key", ADMIN,
                  "--num-threads", "1", log_path=log)  # clients reach 0.0.0.0 through 127.0.0.1
    yield proc
    proc.stop()


def bearer(key):
    return {"Authorization": f"Bearer {key}"}


GEN = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}}


def test_refuses_a_public_address_without_a_key(tiny_ckpt):
    r = subprocess.run([sys.executable, "-m", "lichen.cli", "serve", "--model", tiny_ckpt, "--host", "0.0.0.0",
                        "--port", "0"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--api-key" in r.stderr and "0.0.0.0" in r.stderr


def test_data_plane_needs_the_key(server):
    for headers in (None, bearer("wrong"), {"x-api-key": "wrong"}, {"Authorization": KEY}):
        st, body = call(server.url + "/generate", GEN, headers=headers)
        assert (st, body) == (401, {"error": "Unauthorized"}), headers
    assert call(server.url + "/model_info")[0] == 401
    assert call(server.url + "/v1/models")[0] == 401
    assert call(server.url + "/generate", GEN, headers=bearer(KEY))[0] == 200
    assert call(server.url + "/generate", GEN, headers={"x-api-key": KEY})[0] == 200
    assert call(server.url + "/model_info", headers=bearer(KEY))[0] == 200


def test_health_endpoints_are_open(server):
    assert call(server.url + "/health") == (200, None)
    assert call(server.url + "/health_generate") == (200, None)


def test_control_endpoints_take_only_the_admin_key(server):
    body = {"abort_all": True}
    assert call(server.url + "/abort_request", body)[0] == 401
    assert call(server.url + "/abort_request", body, headers=bearer(KEY))[0] == 401
    assert call(server.url + "/abort_request", body, headers=bearer(ADMIN))[0] == 200
    assert call(server.url + "/flush_cache", headers=bearer(KEY))[0] == 401
    assert call(server.url + "/flush_cache", headers=bearer(ADMIN))[0] == 200
