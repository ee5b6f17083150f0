"""What signed secure-aggregation keys and the consistency round add per site and session (issue 17).

A site signs its keys ("secagg-keys"), checks the N-1 other entries of the key directory against the CA, signs
the survivor set ("secagg-survivors") and checks N-1 survivor signatures: real certificates of a fresh fedclinic
CA (P-256), fedclinic.pki.attestor.CertificateAttestor as the agents use it. Prints the times and the sizes of
one statement. Baseline, measured in the same run: the key agreements a site already did per session before
signing (two X25519 agreements with each of its N-1 peers: mask key and encryption key). The last line is
``RESULT secagg_keys ...``; the target is that signing adds at most 5 % of a plain demo round (6.78 s,
docs/results/secure-aggregation.md), i.e. 340 ms per site and session.
Usage: python bench/secagg_keys.py [N] (default 50). Figures: docs/results/secagg-keys.md.
"""
import sys
import tempfile
import time
from pathlib import Path

from fedclinic import pki
from fedclinic.pki.attestor import CertificateAttestor
from fedclinic.pki.signed_statement import Signer
from fedclinic.secagg import AdvertiseKeys, KEYS_PURPOSE, SURVIVORS_PURPOSE, keys_claim, survivors_claim
from fedclinic.secagg.keys import PAIRWISE_MASK, SHARE_ENCRYPTION, agree, generate_private_key, public_bytes

root = Path(tempfile.mkdtemp())
pki.init_ca(root / "ca")
N = int(sys.argv[1]) if len(sys.argv) > 1 else 50
sites = [f"site-{i:03d}" for i in range(N)]
att = {}
for s in sites:
    c = pki.issue(root / "ca", role="agent", name=s, out_dir=root / s, days=2)
    att[s] = CertificateAttestor(ca_path=root / "ca" / "ca.crt", signer=Signer(key_path=c.key_path, cert_path=c.cert_path))
sid = bytes(32)
adverts = [AdvertiseKeys(sid, s, public_bytes(generate_private_key()), public_bytes(generate_private_key())) for s in sites]
t0 = time.perf_counter()
sigs = {a.sender: att[a.sender].attest(KEYS_PURPOSE, keys_claim(a)) for a in adverts}
t1 = time.perf_counter()
me = att[sites[0]]
for a in adverts[1:]:
    me.check(KEYS_PURPOSE, keys_claim(a), sigs[a.sender], a.sender)
t2 = time.perf_counter()
claim = survivors_claim(sid, sites)
ssigs = {s: att[s].attest(SURVIVORS_PURPOSE, claim) for s in sites}
t3 = time.perf_counter()
for s in sites[1:]:
    me.check(SURVIVORS_PURPOSE, claim, ssigs[s], s)
t4 = time.perf_counter()
print(f"N={N}: sign keys {1e3*(t1-t0)/N:.2f} ms/site; verify {N-1} key entries {1e3*(t2-t1):.1f} ms "
      f"({1e3*(t2-t1)/(N-1):.2f} ms each); sign survivors {1e3*(t3-t2)/N:.2f} ms/site; verify {N-1} survivor signatures "
      f"{1e3*(t4-t3):.1f} ms; per site per session total ~{1e3*((t1-t0)/N + (t2-t1) + (t3-t2)/N + (t4-t3)):.1f} ms; "
      f"statement size {len(sigs[sites[0]])} B, survivors statement {len(ssigs[sites[0]])} B")

# baseline: the agreements one site did per session before issue 17 (mask and encryption key with every peer)
mine = generate_private_key()
t5 = time.perf_counter()
for a in adverts[1:]:
    agree(mine, a.mask_public_key, session_id=sid, purpose=PAIRWISE_MASK, me=sites[0], peer=a.sender)
    agree(mine, a.encryption_public_key, session_id=sid, purpose=SHARE_ENCRYPTION, me=sites[0], peer=a.sender)
t6 = time.perf_counter()
added_ms = 1e3 * ((t1 - t0) / N + (t2 - t1) + (t3 - t2) / N + (t4 - t3))
base_ms = 1e3 * (t6 - t5)
TARGET_MS = 340.0  # 5 % of a plain demo round (6.78 s)
print(f"baseline: {2 * (N - 1)} X25519 agreements {base_ms:.1f} ms per site and session")
print(f"RESULT secagg_keys sites={N} added_ms_per_site={added_ms:.1f} baseline_ms={base_ms:.1f} "
      f"ratio={added_ms / base_ms:.1f} target=added_ms_per_site<={TARGET_MS:g} met={'yes' if added_ms <= TARGET_MS else 'no'}")
