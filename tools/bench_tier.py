"""kvfs-bench tier: cross-host reads through the shared tier vs ``rados bench`` on the same cluster.

Starts the test harness's Ceph cluster (tests/ceph_cluster.py: one mon, two memstore
OSDs, in a network namespace) and two kvfs hosts, A and B, each a daemon and a store
in a network namespace of its own. A writes N chunk files and publishes them; B,
with an empty store, reads each chunk by name (cold: its lookup fetches and verifies
the blocks from the tier), then reads them all again (local: 0 bytes from the tier,
checked). In the same run ``rados bench`` writes 1 MiB objects and reads them back
sequentially (the tier's objects are 1 MiB too), from the root namespace over the
same bridge. Prints one JSON object; everything is torn down at the end.
"""
from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

MiB = 1 << 20


def log(text):
    print(f"[kvfs-bench tier] {text}", file=sys.stderr, flush=True)


def _drop_caches(host):
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3")
    host.admin("drop-caches", host.mnt)


def _rados_bench(cluster, seconds, threads):
    base = ["rados", "-c", str(cluster.conf), "-k", str(cluster.admin_keyring), "-p", "kvpool"]
    write = subprocess.run(base + ["bench", str(seconds), "write", "-b", "1M", "-t", str(threads), "--no-cleanup"],
                           capture_output=True, text=True, timeout=120)
    seq = subprocess.run(base + ["bench", str(seconds), "seq", "-t", str(threads)],
                         capture_output=True, text=True, timeout=120)
    subprocess.run(base + ["cleanup"], capture_output=True, text=True, timeout=120)

    def bandwidth(out):
        m = re.search(r"Bandwidth \(MB/sec\):\s+([\d.]+)", out)
        return float(m.group(1)) * 1e6 / 1e9 if m else None      # rados prints MiB-based "MB"/s
    out = {"write_gb_s": bandwidth(write.stdout), "seq_read_gb_s": bandwidth(seq.stdout),
           "object_bytes": MiB, "threads": threads, "seconds": seconds}
    for name, proc in (("write", write), ("seq", seq)):
        if bandwidth(proc.stdout) is None:
            out[f"{name}_error"] = (proc.stderr.strip() or proc.stdout.strip())[-300:]
    return out


def run(*, chunks=8, chunk_bytes=32 * MiB, workdir="/tmp", rados_seconds=3, rados_threads=16, keep=False):
    from ceph_cluster import CephCluster, make_host, tenant_key, tier_options
    scratch = Path(tempfile.mkdtemp(prefix="kvfs-bench-tier-", dir=workdir))
    memstore = max(2048, (chunks * chunk_bytes * 2) // MiB + 1024)
    cluster = CephCluster(memstore_mib=memstore)
    hosts = []
    try:
        cluster.start()
        log(f"cluster up in {cluster.started_s:.1f} s")
        key = tenant_key(scratch, "bench")
        for name in ("a", "b"):
            ns = cluster.add_host(name)[0]
            host = make_host(scratch / name, ns, tier_options(cluster, "bench", key), size="4G")
            host.mount()
            hosts.append(host)
        a, b = hosts
        datas = [os.urandom(chunk_bytes) for _ in range(chunks)]
        t0 = time.monotonic()
        for i, data in enumerate(datas):
            with open(a.mnt / f"chunk-{i:04d}.bin", "wb") as f:
                f.write(data)
        write_s = time.monotonic() - t0
        while a.stats()["tier_published_files"] < chunks:
            if time.monotonic() - t0 > 300:
                raise RuntimeError(f"A published {a.stats()['tier_published_files']} of {chunks} in 300 s")
            time.sleep(0.05)
        publish_s = time.monotonic() - t0
        log(f"A wrote {chunks} x {chunk_bytes // MiB} MiB in {write_s:.2f} s, all published after {publish_s:.2f} s")
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
        opens, t0 = [], time.monotonic()
        for i, data in enumerate(datas):
            t1 = time.monotonic()
            with open(b.mnt / f"chunk-{i:04d}.bin", "rb") as f:
                opens.append(time.monotonic() - t1)
                got = f.read()
            if hashlib.blake2b(got).digest() != hashlib.blake2b(data).digest():
                raise RuntimeError(f"chunk {i} read on B differs from what A wrote")
        cold_s = time.monotonic() - t0
        fetched = b.stats()["tier_fetched_bytes"]
        _drop_caches(b)
        t0 = time.monotonic()
        for i in range(chunks):
            with open(b.mnt / f"chunk-{i:04d}.bin", "rb") as f:
                f.read()
        local_s = time.monotonic() - t0
        s = b.stats()
        if s["tier_fetched_bytes"] != fetched:
            raise RuntimeError("the second read on B fetched from the tier")
        log("rados bench ...")
        rados = _rados_bench(cluster, rados_seconds, rados_threads)
        total = chunks * chunk_bytes
        cold = total / cold_s / 1e9
        out = {
            "chunks": chunks, "chunk_bytes": chunk_bytes, "cluster_start_s": round(cluster.started_s, 2),
            "write_on_a_s": round(write_s, 3), "published_on_a_after_s": round(publish_s, 3),
            "cross_host_cold_read_gb_s": round(cold, 3),
            "cross_host_open_ms": {"first": round(opens[0] * 1000, 1),
                                   "median": round(sorted(opens)[len(opens) // 2] * 1000, 1),
                                   "max": round(max(opens) * 1000, 1)},
            "second_read_on_b_gb_s": round(total / local_s / 1e9, 3),
            "second_read_bytes_from_tier": s["tier_fetched_bytes"] - fetched,
            "tier_on_b": {k: s[k] for k in ("tier_hits", "tier_misses", "tier_fetched_bytes",
                                            "tier_verify_failures", "tier_latency_ms_mean", "tier_latency_ms_max")},
            "rados_bench": rados,
            "cold_vs_rados_seq": round(cold / rados["seq_read_gb_s"], 3) if rados["seq_read_gb_s"] else None,
            "goal_cold_vs_rados_seq": 0.5,
        }
        return out, 0
    finally:
        for host in hosts:
            try:
                host.umount()
            except Exception as exc:        # noqa: BLE001  (teardown goes on)
                log(f"unmount {host.mnt}: {exc}")
                subprocess.run(["fusermount3", "-uz", str(host.mnt)], capture_output=True)
        cluster.stop()
        if not keep:
            subprocess.run(["rm", "-rf", str(scratch)])
