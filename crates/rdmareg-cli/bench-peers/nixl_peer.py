#!/usr/bin/env python3
"""NIXL READ and WRITE latency and bandwidth, for `rdmareg bench --peers nixl`.

Two NIXL agents in two processes over NIXL's UCX backend:

- the *owner* (`nixl_peer.py owner SIZE`) registers one DRAM buffer of SIZE
  bytes, filled with a known pattern, prints its agent metadata and the
  buffer's address on stdout, and serves until its stdin closes;
- the *reader* (`nixl_peer.py reader`, the default) starts the owner as a
  child, adds it as a remote agent from that metadata (exchanged over the
  child's pipes, no network listener), and measures NIXL READs from the
  owner's buffer into its own registered buffers.

The reader reads a JSON plan on stdin:

    {"sizes": [{"size": 8, "window": 16,
                "latency_iterations": 1000, "bandwidth_iterations": 1600}]}

and prints one JSON object per line on stdout: first
`{"kind": "info", ...}` (versions, UCX settings), then per size
`{"kind": "row", "size": ..., "latency_p50_us": ..., "latency_p99_us": ...,
"bandwidth_mib_s": ..., "request_window_mib_s": ...,
"notice_latency_p50_us": ..., "notice_bandwidth_mib_s": ...}`. Errors go to
stderr with a non-zero exit.

Latency is one READ outstanding: one prepared request of one descriptor,
posted again after each completion (median of per-READ times).
`bandwidth_mib_s` posts the window as one prepared request of `window`
descriptors, again and again (NIXL's own batched form);
`request_window_mib_s` keeps `window` single-descriptor requests
outstanding, re-posting each as it completes (perftest's `-O` shape).
The `notice_` figures are the latency and batched forms again with a
notification (`notif_msg`) on each request, which NIXL delivers to the
owner after the READ; the owner takes its notifications as they come.

The UCX transport is whatever the environment says (`UCX_TLS`,
`UCX_NET_DEVICES`, ...); the bench sets the same values it gives
`ucx_perftest`. Needs only `nixl_cu12` (or `nixl`) and numpy.
"""

import json
import os
import subprocess
import sys
import threading
import time

import numpy as np

try:
    import nixl_cu12 as nixl
    NIXL_MODULE = "nixl_cu12"
except ImportError:  # pragma: no cover - the plain `nixl` package
    import nixl
    NIXL_MODULE = "nixl"

PATTERN_SEED = 42

# The stream results are written to (set up in `main`).
RESULTS = None


def pattern(size):
    """The owner's bytes: cheap to make, different at every offset."""
    return (np.arange(size, dtype=np.uint64) * 2654435761 + PATTERN_SEED).astype(np.uint8)


def make_agent(name):
    config = nixl.nixl_agent_config(backends=["UCX"])
    agent = nixl.nixl_agent(name, config)
    if "UCX" not in agent.backends:
        raise RuntimeError("NIXL has no UCX backend (plugin missing or failed to load)")
    return agent


def send_line(stream, obj):
    stream.write(json.dumps(obj) + "\n")
    stream.flush()


def run_owner(size):
    agent = make_agent("rdmareg-bench-nixl-owner")
    buffer = pattern(size)
    registered = agent.register_memory([(buffer.ctypes.data, size, 0, "")], "DRAM")
    send_line(
        RESULTS,
        {
            "metadata": agent.get_agent_metadata().hex(),
            "address": buffer.ctypes.data,
            "size": size,
        },
    )
    # Serve (NIXL's progress thread answers the reads) until the reader is
    # done, taking notifications as they arrive, as an owner that frees
    # memory on them would.
    done = threading.Event()

    def wait_for_the_reader():
        sys.stdin.read()
        done.set()

    threading.Thread(target=wait_for_the_reader, daemon=True).start()
    while not done.wait(0.001):
        agent.get_new_notifs()
    agent.deregister_memory(registered)
    return 0


def wait_done(agent, handle):
    while True:
        state = agent.check_xfer_state(handle)
        if state == "DONE":
            return
        if state != "PROC":
            raise RuntimeError(f"NIXL READ failed ({state})")


def post(agent, handle):
    state = agent.transfer(handle)
    if state == "ERR":
        raise RuntimeError("NIXL refused to post a READ")
    return state


def percentile(sorted_values, fraction):
    index = min(len(sorted_values) - 1, int(round(fraction * (len(sorted_values) - 1))))
    return sorted_values[index]


def latency_samples(agent, handle, iterations):
    """Per-READ times of `handle` posted again and again, sorted."""
    for _ in range(max(10, iterations // 10)):
        post(agent, handle)
        wait_done(agent, handle)
    samples = []
    for _ in range(iterations):
        started = time.perf_counter_ns()
        post(agent, handle)
        wait_done(agent, handle)
        samples.append(time.perf_counter_ns() - started)
    samples.sort()
    return samples


def seconds_of_rounds(agent, handle, rounds):
    """Seconds `rounds` posts of `handle` take, after a tenth as warm-up."""
    for _ in range(max(1, rounds // 10)):
        post(agent, handle)
        wait_done(agent, handle)
    started = time.perf_counter()
    for _ in range(rounds):
        post(agent, handle)
        wait_done(agent, handle)
    return time.perf_counter() - started


def measure(agent, owner_name, remote_address, local, spec):
    size = spec["size"]
    window = max(1, spec["window"])
    latency_iterations = max(1, spec["latency_iterations"])
    bandwidth_iterations = max(window, spec["bandwidth_iterations"])
    base = local.ctypes.data
    local_descs = [(base + i * size, size, 0) for i in range(window)]
    remote_descs = [(remote_address, size, 0)] * window
    local_side = agent.prep_xfer_dlist("NIXL_INIT_AGENT", local_descs, "DRAM")
    remote_side = agent.prep_xfer_dlist(owner_name, remote_descs, "DRAM")
    handles = []
    try:
        # Latency: one descriptor, one request, posted again and again;
        # then the same with a notification on each READ.
        one = agent.make_prepped_xfer("READ", local_side, [0], remote_side, [0])
        handles.append(one)
        samples = latency_samples(agent, one, latency_iterations)
        noticed = agent.make_prepped_xfer("READ", local_side, [0], remote_side, [0], b"done")
        handles.append(noticed)
        notice_samples = latency_samples(agent, noticed, latency_iterations)

        rounds = max(1, bandwidth_iterations // window)
        moved = size * window * rounds

        # Bandwidth, NIXL's batched form: the window as one request.
        indices = list(range(window))
        batch = agent.make_prepped_xfer("READ", local_side, indices, remote_side, indices)
        handles.append(batch)
        batch_seconds = seconds_of_rounds(agent, batch, rounds)

        # The batched form with a notification on each request.
        noticed_batch = agent.make_prepped_xfer(
            "READ", local_side, indices, remote_side, indices, b"done"
        )
        handles.append(noticed_batch)
        noticed_batch_seconds = seconds_of_rounds(agent, noticed_batch, rounds)

        # Bandwidth, perftest's shape: `window` one-descriptor requests in flight.
        singles = [
            agent.make_prepped_xfer("READ", local_side, [i], remote_side, [i])
            for i in range(window)
        ]
        handles.extend(singles)
        started = time.perf_counter()
        remaining = [rounds] * window
        in_flight = set()
        for i, handle in enumerate(singles):
            if post(agent, handle) == "DONE":
                remaining[i] -= 1
            else:
                in_flight.add(i)
        while in_flight or any(remaining):
            for i, handle in enumerate(singles):
                if i in in_flight:
                    state = agent.check_xfer_state(handle)
                    if state == "PROC":
                        continue
                    if state != "DONE":
                        raise RuntimeError(f"NIXL READ failed ({state})")
                    in_flight.discard(i)
                    remaining[i] -= 1
                if remaining[i] > 0 and i not in in_flight:
                    if post(agent, handle) == "DONE":
                        remaining[i] -= 1
                    else:
                        in_flight.add(i)
        singles_seconds = time.perf_counter() - started

        # WRITE into the owner's buffer: one descriptor, one request,
        # posted again and again; then the window as one request.
        write_one = agent.make_prepped_xfer("WRITE", local_side, [0], remote_side, [0])
        handles.append(write_one)
        write_samples = latency_samples(agent, write_one, latency_iterations)
        write_batch = agent.make_prepped_xfer("WRITE", local_side, indices, remote_side, indices)
        handles.append(write_batch)
        write_batch_seconds = seconds_of_rounds(agent, write_batch, rounds)

        mib = moved / (1 << 20)
        return {
            "kind": "row",
            "size": size,
            "window": window,
            "latency_iterations": latency_iterations,
            "bandwidth_iterations": rounds * window,
            "latency_p50_us": percentile(samples, 0.5) / 1000.0,
            "latency_p99_us": percentile(samples, 0.99) / 1000.0,
            "bandwidth_mib_s": mib / batch_seconds,
            "request_window_mib_s": mib / singles_seconds,
            "notice_latency_p50_us": percentile(notice_samples, 0.5) / 1000.0,
            "notice_bandwidth_mib_s": mib / noticed_batch_seconds,
            "write_latency_p50_us": percentile(write_samples, 0.5) / 1000.0,
            "write_bandwidth_mib_s": mib / write_batch_seconds,
        }
    finally:
        for handle in handles:
            handle.release()
        agent.release_dlist_handle(local_side)
        agent.release_dlist_handle(remote_side)


def run_reader():
    plan = json.load(sys.stdin)
    specs = plan["sizes"]
    if not specs:
        raise ValueError("the plan names no sizes")
    largest = max(spec["size"] for spec in specs)
    owner = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "owner", str(largest)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        offer = json.loads(owner.stdout.readline() or "null")
        if not offer:
            raise RuntimeError("the NIXL owner exited before offering its buffer")
        agent = make_agent("rdmareg-bench-nixl-reader")
        owner_name = agent.add_remote_agent(bytes.fromhex(offer["metadata"]))
        largest_window = max(max(1, spec["window"]) for spec in specs)
        local = np.zeros(largest * largest_window, dtype=np.uint8)
        registered = agent.register_memory([(local.ctypes.data, local.nbytes, 0, "")], "DRAM")
        send_line(
            RESULTS,
            {
                "kind": "info",
                "module": NIXL_MODULE,
                "ucx_tls": os.environ.get("UCX_TLS", ""),
                "pid_owner": owner.pid,
            },
        )
        # A fast benchmark of the wrong bytes is worthless: check them once.
        check = agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(local.ctypes.data, largest, 0)], "DRAM")
        source = agent.prep_xfer_dlist(owner_name, [(offer["address"], largest, 0)], "DRAM")
        handle = agent.make_prepped_xfer("READ", check, [0], source, [0])
        post(agent, handle)
        wait_done(agent, handle)
        handle.release()
        agent.release_dlist_handle(check)
        agent.release_dlist_handle(source)
        if not np.array_equal(local[:largest], pattern(largest)):
            raise RuntimeError("NIXL READ returned bytes that differ from the owner's")
        for spec in specs:
            send_line(RESULTS, measure(agent, owner_name, offer["address"], local, spec))
        agent.deregister_memory(registered)
        agent.remove_remote_agent(owner_name)
    finally:
        owner.stdin.close()
        try:
            owner.wait(timeout=30)
        except subprocess.TimeoutExpired:
            owner.kill()
            owner.wait()
    if owner.returncode != 0:
        raise RuntimeError(f"the NIXL owner exited with {owner.returncode}")
    return 0


def main(argv):
    # Results go to the original stdout only; anything else that writes to
    # fd 1 (NIXL's and UCX's own logs) is sent to stderr.
    global RESULTS
    RESULTS = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    if len(argv) >= 2 and argv[1] == "owner":
        return run_owner(int(argv[2]))
    if len(argv) >= 2 and argv[1] not in ("reader",):
        print(f"usage: {argv[0]} [reader | owner SIZE]", file=sys.stderr)
        return 2
    return run_reader()


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv))
    except Exception as error:  # one line for the bench to show
        print(f"nixl_peer: {error}", file=sys.stderr)
        sys.exit(1)
