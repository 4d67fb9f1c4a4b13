"""Property tests (hypothesis) of the service's privacy- and crypto-relevant pure parts: a request
signature covers every signed field (any change is refused), a nonce passes once, an upload is
summed only when it is exactly the model's length, finite and within the clip norm, and a
SecAgg round setup survives its wire encoding exactly (same setup hash) while any truncation or
extension is refused."""

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import given, settings
from hypothesis import strategies as st

from dpfleet.edge.clipping import norm64
from dpfleet.edge.wire.auth import AuthError, sign_request
from dpfleet.secagg.errors import ProtocolViolationError
from dpfleet.secagg.params import plan_round
from dpfleet.secagg.setup_wire import decode_setup, encode_setup
from dpfleet.service.auth import NonceCache, verify_request
from dpfleet.service.uploads import UploadError, parse_update

KEY = Ed25519PrivateKey.generate()
PUB = KEY.public_key().public_bytes_raw()
paths = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789/?=&", min_size=1, max_size=40)


@settings(max_examples=60, deadline=None)
@given(method=st.sampled_from(["GET", "POST"]), path=paths, body=st.binary(max_size=64),
       field=st.sampled_from(["method", "path", "body", "time", "nonce", "device"]))
def test_any_change_to_a_signed_field_is_refused(method, path, body, field):
    headers = sign_request(KEY, "dev", method, "/" + path, body)
    assert verify_request(headers, method, "/" + path, body, PUB, NonceCache(not_before=0)) == "dev"
    m, p, b, h = method, "/" + path, body, dict(headers)
    if field == "method":
        m = "PUT"
    elif field == "path":
        p = p + "x"
    elif field == "body":
        b = body + b"\0"
    elif field == "time":
        h["X-Dpfleet-Time"] = repr(float(h["X-Dpfleet-Time"]) + 1e-3)
    elif field == "nonce":
        h["X-Dpfleet-Nonce"] = ("0" if h["X-Dpfleet-Nonce"][0] != "0" else "1") + h["X-Dpfleet-Nonce"][1:]
    else:
        h["X-Dpfleet-Device"] = "other"  # the key is looked up by the claimed id: another key
    with pytest.raises(AuthError):
        verify_request(h, m, p, b, PUB if field != "device" else
                       Ed25519PrivateKey.generate().public_key().public_bytes_raw(),
                       NonceCache(not_before=0))


@settings(max_examples=30, deadline=None)
@given(st.integers(min_value=1, max_value=5))
def test_a_nonce_passes_once(tries):
    nonces = NonceCache(not_before=0)
    headers = sign_request(KEY, "dev", "POST", "/v1/checkin", b"{}")
    verify_request(headers, "POST", "/v1/checkin", b"{}", PUB, nonces)
    for _ in range(tries):
        with pytest.raises(AuthError, match="replayed"):
            verify_request(headers, "POST", "/v1/checkin", b"{}", PUB, nonces)


@settings(max_examples=80, deadline=None)
@given(vec=st.lists(st.floats(allow_nan=True, allow_infinity=True, width=32), min_size=1,
                    max_size=32),
       clip=st.floats(min_value=1e-3, max_value=10.0), length_delta=st.integers(-1, 1))
def test_only_finite_in_norm_exact_length_uploads_are_accepted(vec, clip, length_delta):
    arr = np.asarray(vec, dtype="<f4")
    length = arr.size + length_delta
    body = arr.tobytes()
    with np.errstate(over="ignore", invalid="ignore"):
        norm = norm64(arr)
    ok = length_delta == 0 and bool(np.isfinite(arr).all()) and norm <= clip
    if length < 1:
        return
    if ok:
        np.testing.assert_array_equal(parse_update(body, length, clip), arr)
    else:
        with pytest.raises(UploadError):
            parse_update(body, length, clip)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(3, 12), length=st.integers(1, 5000), bits=st.sampled_from([16, 24, 32]),
       signed=st.booleans(), cut=st.integers(1, 40),
       terms=st.sampled_from([b""]) | st.binary(min_size=32, max_size=32))
def test_a_setup_survives_its_encoding_and_nothing_else_decodes(n, length, bits, signed, cut,
                                                                terms):
    setup, _, _ = plan_round(n, length, bits, signed=signed, terms=terms)
    data = encode_setup(setup)
    assert decode_setup(data).setup_hash == setup.setup_hash
    assert decode_setup(data).terms == terms  # the inputs' meaning (count_bit) is kept
    for broken in (data[:-min(cut, len(data))], data + b"\0" * cut):
        with pytest.raises(ProtocolViolationError):
            decode_setup(broken)
