"""Key agreement, share encryption and mask expansion (fedclinic.secagg.keys/share_crypto/masks)."""

import os
import threading

import numpy as np
import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from hypothesis import given, settings, strategies as st

from fedclinic.secagg import keys
from fedclinic.secagg.encoding import DOMAIN, encode
from fedclinic.secagg.errors import SecAggIntegrityError, SecAggRefusal
from fedclinic.secagg.masks import MIN_PIECE_WORDS, apply_masks, expand_mask
from fedclinic.secagg.share_crypto import SharePayload, decrypt_share, encrypt_share

SID = bytes(range(32))


def _pair():
    a, b = keys.generate_private_key(), keys.generate_private_key()
    return a, b, keys.public_bytes(a), keys.public_bytes(b)


def test_agreement_is_symmetric_and_matches_the_documented_hkdf():
    a, b, pa, pb = _pair()
    kab = keys.agree(a, pb, session_id=SID, purpose=keys.PAIRWISE_MASK, me="site-b", peer="site-a")
    kba = keys.agree(b, pa, session_id=SID, purpose=keys.PAIRWISE_MASK, me="site-a", peer="site-b")
    assert kab == kba and len(kab) == 32
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PublicKey
    z = a.exchange(X25519PublicKey.from_public_bytes(pb))
    ref = HKDF(hashes.SHA256(), 32, salt=SID, info=encode(DOMAIN, "pairwise-mask", "site-a", "site-b")).derive(z)
    assert kab == ref


def test_agreement_binds_purpose_session_and_ids():
    a, _, _, pb = _pair()
    base = dict(session_id=SID, purpose=keys.PAIRWISE_MASK, me="u", peer="v")
    k = keys.agree(a, pb, **base)
    assert k != keys.agree(a, pb, **{**base, "purpose": keys.SHARE_ENCRYPTION})
    assert k != keys.agree(a, pb, **{**base, "session_id": bytes(32)})
    assert k != keys.agree(a, pb, **{**base, "peer": "w"})
    # the length-prefixed encoding keeps ("ab","c") and ("a","bc") apart
    assert (keys.agree(a, pb, **{**base, "me": "ab", "peer": "c"})
            != keys.agree(a, pb, **{**base, "me": "a", "peer": "bc"}))


def test_low_order_public_key_is_refused():
    a = keys.generate_private_key()
    assert not keys.is_valid_public_key(bytes(32))
    assert not keys.is_valid_public_key(b"\x01" * 31)
    assert keys.is_valid_public_key(keys.public_bytes(a))
    with pytest.raises(SecAggRefusal, match="low-order"):
        keys.agree(a, bytes(32), session_id=SID, purpose=keys.PAIRWISE_MASK, me="u", peer="v")


def _ct():
    key = os.urandom(32)
    payload = SharePayload("site-a", "site-b", 2, 123456789, 2 ** 256 + 5)
    return key, payload, encrypt_share(key, payload, session_id=SID)


def test_share_round_trip():
    key, payload, ct = _ct()
    assert decrypt_share(key, ct, session_id=SID, sender="site-a", receiver="site-b", x=2) == payload


@settings(max_examples=50, deadline=None)
@given(data=st.data())
def test_any_flipped_bit_fails_authentication(data):
    key, _, ct = _ct()
    i = data.draw(st.integers(0, len(ct) - 1))
    bit = data.draw(st.integers(0, 7))
    bad = bytearray(ct)
    bad[i] ^= 1 << bit
    with pytest.raises(SecAggIntegrityError, match="failed authentication"):
        decrypt_share(key, bytes(bad), session_id=SID, sender="site-a", receiver="site-b", x=2)


@pytest.mark.parametrize("field,value", [("session_id", bytes(32)), ("sender", "site-c"), ("receiver", "site-c"),
                                         ("sender", "site-b")])
def test_wrong_associated_data_fails(field, value):
    key, _, ct = _ct()
    args = dict(session_id=SID, sender="site-a", receiver="site-b", x=2)
    args[field] = value
    with pytest.raises(SecAggIntegrityError, match="failed authentication"):
        decrypt_share(key, ct, **args)


def test_wrong_key_truncation_and_wrong_abscissa_fail():
    key, _, ct = _ct()
    with pytest.raises(SecAggIntegrityError, match="failed authentication"):
        decrypt_share(os.urandom(32), ct, session_id=SID, sender="site-a", receiver="site-b", x=2)
    with pytest.raises(SecAggIntegrityError, match="truncated"):
        decrypt_share(key, ct[:20], session_id=SID, sender="site-a", receiver="site-b", x=2)
    with pytest.raises(SecAggIntegrityError, match="x=3"):
        decrypt_share(key, ct, session_id=SID, sender="site-a", receiver="site-b", x=3)


def test_mask_is_the_documented_aes256_ctr_keystream():
    key = os.urandom(32)
    n = 70_001  # not a multiple of the chunk size
    ref = Cipher(algorithms.AES(key), modes.CTR(bytes(16))).encryptor().update(bytes(4 * n))
    assert np.array_equal(expand_mask(key, n), np.frombuffer(ref, dtype="<u4"))


@settings(max_examples=30, deadline=None)
@given(n=st.integers(0, 5000), chunk=st.integers(1, 3000), seed=st.integers(0, 2 ** 32 - 1))
def test_masks_are_chunking_independent_and_cancel(n, chunk, seed):
    rng = np.random.default_rng(seed)
    k1, k2 = rng.bytes(32), rng.bytes(32)
    x = rng.integers(0, 2 ** 32, n, dtype=np.uint32)
    y = x.copy()
    apply_masks(y, add=[k1, k2], subtract=[k2], chunk_words=chunk)
    assert np.array_equal(y, x + expand_mask(k1, n))  # uint32 arithmetic wraps mod 2^32
    apply_masks(y, subtract=[k1], chunk_words=max(1, chunk // 3))
    assert np.array_equal(y, x)


@pytest.mark.parametrize("n,workers,chunk", [(2 * MIN_PIECE_WORDS + 7, 2, 1 << 16),
                                             (5 * MIN_PIECE_WORDS + 1, 3, 40_001)])
def test_threaded_expansion_is_the_sequential_keystream(n, workers, chunk):
    """Long enough to be cut into pieces on worker threads: each piece starts at its block's counter, so
    the result is word for word the one-stream AES-256-CTR keystream; ``then`` sees every chunk exactly
    once, after all masks are applied to it."""
    rng = np.random.default_rng(n)
    k1, k2 = rng.bytes(32), rng.bytes(32)
    ks = [np.frombuffer(Cipher(algorithms.AES(k), modes.CTR(bytes(16))).encryptor().update(bytes(4 * n)), "<u4")
          for k in (k1, k2)]
    x = rng.integers(0, 2 ** 32, n, dtype=np.uint32)
    y = x.copy()
    seen: list[tuple[int, np.ndarray]] = []
    threads: set[int] = set()

    def then(start, part):
        threads.add(threading.get_ident())
        seen.append((start, part.copy()))

    apply_masks(y, add=[k1], subtract=[k2], workers=workers, chunk_words=chunk, then=then)
    assert threading.main_thread().ident not in threads  # the pieces ran on the worker threads
    assert np.array_equal(y, x + ks[0] - ks[1])
    seen.sort(key=lambda s: s[0])
    ends = [s + p.size for s, p in seen]
    assert [s for s, _ in seen] == [0] + ends[:-1] and ends[-1] == n  # disjoint, covering, no gap
    assert all(0 < p.size <= chunk and np.array_equal(p, y[s:s + p.size]) for s, p in seen)


def test_worker_errors_reach_the_caller():
    def boom(start, part):
        if start > 0:
            raise RuntimeError(f"consumer failed at {start}")
    with pytest.raises(RuntimeError, match="consumer failed"):
        apply_masks(np.zeros(3 * MIN_PIECE_WORDS, np.uint32), add=[bytes(32)], workers=2, then=boom)
    with pytest.raises(ValueError, match="workers"):
        apply_masks(np.zeros(4, np.uint32), add=[bytes(32)], workers=0)


def test_mask_words_look_uniform():
    """A fixed key, so deterministic: mean and top-bit frequency of 2^20 words within 6 sigma."""
    w = expand_mask(bytes(range(32)), 1 << 20).astype(np.float64)
    n = w.size
    assert abs(w.mean() / 2 ** 32 - 0.5) < 6 * (1 / np.sqrt(12 * n))
    assert abs((w >= 2 ** 31).mean() - 0.5) < 6 * 0.5 / np.sqrt(n)
    assert not np.array_equal(expand_mask(bytes(32), 64), expand_mask(bytes(31) + b"\x01", 64))


def test_apply_masks_rejects_wrong_vectors_and_keys():
    with pytest.raises(TypeError):
        apply_masks(np.zeros(4, np.int64), add=[bytes(32)])
    with pytest.raises(ValueError, match="32 bytes"):
        apply_masks(np.zeros(4, np.uint32), add=[bytes(16)])
    with pytest.raises(ValueError, match="contiguous"):
        apply_masks(np.zeros(8, np.uint32)[::2], add=[bytes(32)])
