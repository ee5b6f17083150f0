"""Update-codec throughput and compression (fedclinic.codecs) on MiniLM-sized weight deltas.

Workloads (22.7 M float32 parameters, the size of MiniLM-L6's trainable tensors):

- ``dense``: i.i.d. normal (sd 1e-3), the worst case for sparsification;
- ``sparse-ish``: a realistic fine-tuning delta: the word-embedding matrix (30522 x 384) changed only in the
  rows of tokens the site saw (3 %), everything else heavy-tailed (Student-t, 3 dof, scale 1e-4).

Per codec and workload, one line: encode and decode-into throughput in GB/s of float32 input (best of
``--repeat``), decode-into against the physical floor measured in the same run (``acc += x`` over the same
bytes), and the compression ratio against fp32 (payload + params JSON). ``EF`` lines time
``ErrorFeedback.encode`` (encode, decode, residual update). The ``RESULT`` line states issue #6's target for
the codec library, >= 100x uplink compression with top-1 % + int8 + error feedback, and whether it is met on
both workloads (ratio of ``topk:0.01+int8:block=128`` with its varint index encoding).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from fedclinic.codecs import ErrorFeedback, count_bytes, decode_into, parse_codec

N = 22_700_000
VOCAB, HIDDEN = 30522, 384
SPECS = ["fp32", "fp16", "bf16", "int8:block=128", "int8:block=128,rounding=nearest", "int8:block=64,scale=fp16",
         "int4:block=64", "topk:0.01", "topk:0.01+int8:block=128", "topk:0.01+int4:block=64",
         "topk:0.01,idx=delta+int8:block=128", "topk:0.01,idx=raw+int8:block=128", "topk:0.001+int8:block=128"]
TARGET_SPEC = "topk:0.01+int8:block=128"


def workloads(n: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    dense = rng.standard_normal(n, dtype=np.float32) * np.float32(1e-3)
    sparse = (rng.standard_t(3, n) * 1e-4).astype(np.float32)
    emb = min(n, VOCAB * HIDDEN)
    rows = emb // HIDDEN
    untouched = rng.random(rows) >= 0.03
    sparse[:rows * HIDDEN].reshape(rows, HIDDEN)[untouched] = 0
    return {"dense": dense, "sparse-ish": sparse}


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=N, help="parameters (default: 22.7 M, MiniLM-sized)")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    n = args.n
    gb = 4 * n / 1e9
    acc = np.zeros(n, np.float32)
    data = workloads(n, args.seed)
    floor = best(lambda: np.add(acc, data["dense"], out=acc), args.repeat + 1)
    print(f"codecs: {n} float32 parameters ({gb * 1e3:.1f} MB); floor acc += x: {gb / floor:.2f} GB/s")
    ratios: dict[tuple[str, str], float] = {}
    for wname, x in data.items():
        for spec in SPECS:
            codec = parse_codec(spec)
            enc = codec.encode(x, rng=np.random.default_rng(1))
            t_enc = best(lambda: codec.encode(x, rng=np.random.default_rng(1)), args.repeat)
            t_dec = best(lambda: decode_into(acc, enc.payload, enc.params, 0.25), args.repeat)
            ratio = count_bytes(enc).ratio
            ratios[(wname, spec)] = ratio
            print(f"{wname:10s} {spec:40s} encode={gb / t_enc:6.3f} GB/s decode_into={gb / t_dec:6.3f} GB/s "
                  f"(floor x{t_dec / floor:5.1f}) ratio={ratio:8.2f}x bytes={count_bytes(enc).encoded_bytes}")
        ef = ErrorFeedback(TARGET_SPEC)
        ef.encode("w", x, rng=np.random.default_rng(1))
        ef.commit()
        t_ef = best(lambda: ef.encode("w", x, rng=np.random.default_rng(2)), args.repeat)
        print(f"{wname:10s} {'EF ' + TARGET_SPEC:40s} encode={gb / t_ef:6.3f} GB/s (encode + decode + residual)")
    dense_ratio, sparse_ratio = ratios[("dense", TARGET_SPEC)], ratios[("sparse-ish", TARGET_SPEC)]
    met = "yes" if min(dense_ratio, sparse_ratio) >= 100 else "no"
    print(f"RESULT codecs topk1_int8_ratio_dense={dense_ratio:.1f} topk1_int8_ratio_sparse={sparse_ratio:.1f} "
          f"int8_ratio={ratios[('dense', 'int8:block=128')]:.2f} floor_gbs={gb / floor:.2f} "
          f"target=ratio>=100x_uplink_for_topk:0.01+int8+EF(issue#6;accuracy_cost_is_bench/communication.py) "
          f"met={met}")


if __name__ == "__main__":
    main()
